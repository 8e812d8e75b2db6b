"""POST /v1/chat/completions: messages through the chat template, a stream of
`chat.completion.chunk`s out.

Each of the n choices opens with a `{"role": "assistant", "content": ""}` delta, then content
deltas; its last chunk carries its finish_reason. `chunks` is the one code path: streaming sends
its chunks as events, and the plain reply is `fold_chat(chunks)`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

from ferry.metrics.latency import RequestClock
from ferry.outputs import CompletionOutput
from ferry.sampling_params import SamplingParams
from ferry.server.errors import bad_request
from ferry.server.logprobs import chat_logprobs
from ferry.server.preprocess import EnginePrompt, chat_prompt, check_context, check_fan_out, check_model, sampling_params
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
    num_engine_requests = 1  # the engine runs the n choices as one request


class ChatServing(Serving[ChatPlan, ChatCompletionResponse]):
    @staticmethod
    async def fold(chunks: AsyncIterator) -> ChatCompletionResponse:
        return await fold_chat(chunks)

    def plan(self, request: ChatCompletionRequest, arrival_time: float) -> ChatPlan:
        """Render and check the request against the model and the server's limits; raises ApiError."""
        check_model(request.model, self.config)
        if request.top_logprobs is not None and not request.logprobs:
            raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
        check_fan_out(1, request.n, self.config)
        prompt = chat_prompt(
            request.messages, self.engine, request.add_generation_prompt, request.tools, request.chat_template_kwargs,
        )
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        check_context(len(prompt.token_ids), max_tokens, self.engine, "messages")
        top_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = sampling_params(request, self.config, self.engine, max_tokens, top_logprobs)
        return ChatPlan(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.config.served_model_name, prompt, params,
                        top_logprobs, request.cache_salt, arrival_time)

    async def chunks(self, plan: ChatPlan, include_usage: bool) -> AsyncIterator[ChatCompletionChunk | TextDelta]:
        """The stream: a role chunk per choice, content chunks (TextDelta, the same JSON written
        faster, where the choice has no logprobs), then (include_usage) a usage chunk."""
        choices = [_Choice(i, plan.top_logprobs) for i in range(plan.params.n)]
        for choice in choices:
            yield self._chunk(plan, choice.opening())
        clock = RequestClock(plan.arrival_time)
        head = stream_head(plan.request_id, plan.created, plan.model, chat=True)
        cached_tokens = 0
        try:
            stream = self.engine.generate(
                plan.request_id, plan.prompt.token_ids, plan.params, plan.prompt.text, plan.cache_salt,
            )
            async with aclosing(stream) as outputs:
                async for output in outputs:
                    self.metrics.observe(clock.update(output, time.monotonic()))
                    cached_tokens = output.num_cached_tokens
                    for completion in output.outputs:
                        delta = choices[completion.index].update(completion, self._decode_one, head)
                        if isinstance(delta, TextDelta):
                            yield delta
                        elif delta is not None:
                            yield self._chunk(plan, delta)
        finally:
            self.metrics.finished([c.finish_reason or "abort" for c in choices])
        if include_usage:
            usage = self.usage(len(plan.prompt.token_ids), sum(c.num_tokens for c in choices), cached_tokens)
            yield ChatCompletionChunk(id=plan.request_id, created=plan.created, model=plan.model, choices=[],
                                      usage=usage)

    @staticmethod
    def _chunk(plan: ChatPlan, choice: ChatCompletionStreamChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=plan.request_id, created=plan.created, model=plan.model, choices=[choice])

    def _decode_one(self, token_id: int) -> str:
        return self.decode([token_id])


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
        self, completion: CompletionOutput, decode: Callable[[int], str], head: bytes,
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
        content = chat_logprobs(completion.token_ids, completion.logprobs or [], self.top_logprobs, decode)
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
    usage = None
    folded: dict[int, _Folded] = {}
    async with aclosing(chunks):
        async for chunk in chunks:
            if isinstance(chunk, TextDelta):
                chunk_choices = [chunk.choice()]
            else:
                head = head or chunk
                usage = chunk.usage or usage
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
    return ChatCompletionResponse(id=head.id, created=head.created, model=head.model, choices=choices, usage=usage)


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

