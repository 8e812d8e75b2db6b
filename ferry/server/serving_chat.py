"""POST /v1/chat/completions: messages through the chat template, a stream of
`chat.completion.chunk`s out.

Each of the n choices opens with a `{"role": "assistant", "content": ""}` delta, then content
deltas; its last chunk carries its finish_reason. Prompt logprobs (vLLM's prompt_logprobs) come in a
chunk of their own, with no choices, as soon as they arrive. `chunks` is the one code path: streaming sends
its chunks as events, and the plain reply is `fold_chat(chunks)`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from ferry.metrics.latency import RequestClock
from ferry.outputs import CompletionOutput
from ferry.sampling_params import SamplingParams
from ferry.server.errors import bad_request
from ferry.server.logprobs import TokenNames, chat_logprobs, format_prompt_logprobs
from ferry.server.preprocess import (
    EnginePrompt, chat_prompt, check_context, check_fan_out, check_model, refuse_unsupported, sampling_params,
)
from ferry.server.protocol import (
    ChatChoiceLogprobs, ChatCompletionChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
    ChatCompletionStreamChoice, ChatMessageOut, DeltaMessage, TextDelta,
    stream_head,
)
from ferry.server.serving import Serving


@dataclass(frozen=True)
class ChatPlan:
    """A validated request, ready to run."""

    request_id: str
    created: int
    model: str
    prompt: EnginePrompt
    params: SamplingParams
    top_logprobs: int | None  # None: no logprobs
    cache_salt: str | None
    arrival_time: float  # time.monotonic() when it reached the server: its latencies count from here
    tokens_as_ids: bool = False  # return_tokens_as_token_ids
    num_engine_requests = 1  # the engine runs the n choices as one request


class ChatServing(Serving[ChatPlan, ChatCompletionResponse]):
    @staticmethod
    async def fold(chunks: AsyncIterator) -> ChatCompletionResponse:
        return await fold_chat(chunks)

    def plan(self, request: ChatCompletionRequest, arrival_time: float) -> ChatPlan:
        """Render and check the request against the model and the server's limits; raises ApiError."""
        check_model(request.model, self.config)
        refuse_unsupported(request)
        if request.top_logprobs is not None and not request.logprobs:
            raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
        check_fan_out(1, request.n, self.config)
        prompt = chat_prompt(
            request.messages, self.engine, request.add_generation_prompt, request.tools, request.chat_template_kwargs,
        )
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        check_context(len(prompt.token_ids), max_tokens, self.engine, "messages")
        top_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = sampling_params(request, self.config, self.engine, max_tokens, top_logprobs, request.prompt_logprobs)
        return ChatPlan(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.config.served_model_name, prompt, params,
                        top_logprobs, request.cache_salt, arrival_time, request.return_tokens_as_token_ids)

    async def chunks(
        self, plan: ChatPlan, include_usage: bool, continuous_usage: bool = False,
    ) -> AsyncIterator[ChatCompletionChunk | TextDelta]:
        """The stream: a role chunk per choice, content chunks (TextDelta, the same JSON written
        faster, where the choice has no logprobs), then (include_usage) a usage chunk; with
        continuous_usage every chunk carries the usage so far."""
        names = TokenNames(self.decode_one, plan.tokens_as_ids)
        choices = [_Choice(i, plan.top_logprobs) for i in range(plan.params.n)]
        cached_tokens = 0

        def usage():
            return self.usage(len(plan.prompt.token_ids), sum(c.num_tokens for c in choices), cached_tokens)

        def chunk(choice: ChatCompletionStreamChoice | None = None, prompt_logprobs=None) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=plan.request_id, created=plan.created, model=plan.model,
                                       choices=[] if choice is None else [choice],
                                       usage=usage() if continuous_usage else None, prompt_logprobs=prompt_logprobs)

        for choice in choices:
            yield chunk(choice.opening())
        clock = RequestClock(plan.arrival_time)
        head = stream_head(plan.request_id, plan.created, plan.model, chat=True)
        prompt_logprobs_sent = plan.params.prompt_logprobs is None
        try:
            stream = self.engine.generate(
                plan.request_id, plan.prompt.token_ids, plan.params, plan.prompt.text, plan.cache_salt,
            )
            async with aclosing(stream) as outputs:
                async for output in outputs:
                    self.metrics.observe(clock.update(output, time.monotonic()))
                    cached_tokens = output.num_cached_tokens
                    if not prompt_logprobs_sent and output.prompt_logprobs is not None:
                        prompt_logprobs_sent = True
                        yield chunk(prompt_logprobs=format_prompt_logprobs(output.prompt_logprobs, self.decode_one))
                    for completion in output.outputs:
                        delta = choices[completion.index].update(completion, names, head)
                        if isinstance(delta, TextDelta):
                            delta.usage = usage() if continuous_usage else None
                            yield delta
                        elif delta is not None:
                            yield chunk(delta)
        finally:
            self.metrics.finished([c.finish_reason or "abort" for c in choices])
        if include_usage:
            yield ChatCompletionChunk(id=plan.request_id, created=plan.created, model=plan.model, choices=[],
                                      usage=usage())


@dataclass
class _Choice:
    """What one choice has sent so far."""

    index: int
    top_logprobs: int | None
    finish_reason: str | None = None
    num_tokens: int = 0

    def opening(self) -> ChatCompletionStreamChoice:
        return ChatCompletionStreamChoice(
            index=self.index, delta=DeltaMessage(role="assistant", content=""), logprobs=None, finish_reason=None,
        )

    def update(
        self, completion: CompletionOutput, names: TokenNames, head: bytes,
    ) -> ChatCompletionStreamChoice | TextDelta | None:
        """The chunk for this delta of the choice (a TextDelta without logprobs), or None when there
        is nothing to send."""
        if self.finish_reason is not None:
            return None  # finished earlier; later outputs of the request still list it
        self.num_tokens += len(completion.token_ids)
        self.finish_reason = completion.finish_reason
        if not (completion.text or completion.token_ids or completion.finished):
            return None
        stop_reason = completion.stop_reason if completion.finished else None
        if self.top_logprobs is None:
            return TextDelta(head, self.index, completion.text, completion.finish_reason, stop_reason, chat=True)
        content = chat_logprobs(completion.token_ids, completion.logprobs or [], self.top_logprobs, names)
        logprobs = ChatChoiceLogprobs(content=content)
        return ChatCompletionStreamChoice(
            index=self.index, delta=DeltaMessage(content=completion.text or None), logprobs=logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=stop_reason,
        )


@dataclass
class _Folded:
    role: str = "assistant"
    content: list[str] = field(default_factory=list)
    logprobs: list | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


async def fold_chat(chunks: AsyncIterator[ChatCompletionChunk | TextDelta]) -> ChatCompletionResponse:
    """The non-streaming reply: every chunk of the stream folded into one."""
    head: ChatCompletionChunk | None = None
    usage = prompt_logprobs = None
    folded: dict[int, _Folded] = {}
    async with aclosing(chunks):
        async for chunk in chunks:
            if isinstance(chunk, TextDelta):
                chunk_choices = [chunk.choice()]
            else:
                head = head or chunk
                usage = chunk.usage or usage
                prompt_logprobs = chunk.prompt_logprobs or prompt_logprobs
                chunk_choices = chunk.choices
            for choice in chunk_choices:
                _fold_choice(folded.setdefault(choice.index, _Folded()), choice)
    assert head is not None, "a chat stream always begins with its role chunks"
    choices = [
        ChatCompletionChoice(
            index=i, message=ChatMessageOut(role=f.role, content="".join(f.content)),
            logprobs=None if f.logprobs is None else ChatChoiceLogprobs(content=f.logprobs),
            finish_reason=f.finish_reason, stop_reason=f.stop_reason,
        )
        for i, f in sorted(folded.items())
    ]
    return ChatCompletionResponse(id=head.id, created=head.created, model=head.model, choices=choices, usage=usage,
                                  prompt_logprobs=prompt_logprobs)


def _fold_choice(into: _Folded, chunk: ChatCompletionStreamChoice) -> None:
    if chunk.delta.role is not None:
        into.role = chunk.delta.role
    if chunk.delta.content:
        into.content.append(chunk.delta.content)
    if chunk.logprobs is not None:
        if into.logprobs is None:
            into.logprobs = []
        into.logprobs.extend(chunk.logprobs.content or [])
    into.finish_reason = chunk.finish_reason or into.finish_reason
    into.stop_reason = chunk.stop_reason if chunk.stop_reason is not None else into.stop_reason

