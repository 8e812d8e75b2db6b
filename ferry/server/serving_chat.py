"""POST /v1/chat/completions: messages through the chat template, a stream of
`chat.completion.chunk`s out.

Each of the n choices opens with a `{"role": "assistant", "content": ""}` delta, then content
deltas; its last chunk carries its finish_reason. Prompt logprobs (vLLM's prompt_logprobs) come in a
chunk of their own, with no choices, as soon as they arrive. `chunks` is the one code path: streaming sends
its chunks as events, and the plain reply is `fold_chat(chunks)`.

Tool calling (`tools`, `tool_choice`, `parallel_tool_calls`, as OpenAI and vLLM take them): "required"
and a named function constrain the output with a JSON schema (ferry.tools.choice); the text is held
back and sent at the end as whole calls. "auto" (with --enable-auto-tool-choice and
--tool-call-parser) reads the text through the parser's stream: content deltas and tool-call deltas
as they are found. "none" only shows the tools to the model. A choice with calls finishes with
"tool_calls"; the plain reply is the fold of the same deltas.
"""

from __future__ import annotations

import json
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
from ferry.structured.params import StructuredOutputsParams
from ferry.tools import (
    ContentDelta, ToolCallDelta, ToolCallStream, ToolChoiceError, ToolParser, call_deltas, get_tool_parser,
    tool_calls_from_constrained, tool_choice_schema, tool_functions,
)


@dataclass(frozen=True)
class ToolPlan:
    """How a request's output turns into tool calls."""

    tools: list[dict]
    tool_choice: str | dict  # "auto", "required" or a named function (never "none": then no ToolPlan)
    parser: ToolParser | None  # "auto": the server's --tool-call-parser; None: the output is constrained


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
    tools: ToolPlan | None = None  # None: the output is all content
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
        tool_plan, tool_structured = self.tool_plan(request)
        prompt = chat_prompt(
            request.messages, self.engine, request.add_generation_prompt, request.tools, request.chat_template_kwargs,
        )
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        check_context(len(prompt.token_ids), max_tokens, self.engine, "messages")
        top_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = sampling_params(request, self.config, self.engine, max_tokens, top_logprobs, request.prompt_logprobs,
                                tool_structured)
        return ChatPlan(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.config.served_model_name, prompt, params,
                        top_logprobs, request.cache_salt, arrival_time, request.return_tokens_as_token_ids, tool_plan)

    def tool_plan(self, request: ChatCompletionRequest) -> tuple[ToolPlan | None, StructuredOutputsParams | None]:
        """The request's tools and tool_choice, checked (400s name the field), as vLLM takes them: no
        tool_choice means "auto" where the server enables it, else "none"."""
        tools, choice = request.tools, request.tool_choice
        try:
            functions = tool_functions(tools)
        except ToolChoiceError as e:
            raise bad_request(str(e), "tools") from None
        if choice is not None and choice != "none" and not functions:
            raise bad_request(f"tool_choice {json.dumps(choice)} needs tools: the request gives none", "tool_choice")
        auto_enabled = self.config.enable_auto_tool_choice and self.config.tool_call_parser is not None
        if choice is None:
            choice = "auto" if functions and auto_enabled else "none"
        try:
            schema = tool_choice_schema(tools, choice, request.parallel_tool_calls)
        except ToolChoiceError as e:
            raise bad_request(str(e), "tool_choice") from None
        if schema is not None:
            structured = StructuredOutputsParams(json=json.dumps(schema), source="tool_choice")
            return ToolPlan(tools or [], choice, None), structured
        if choice != "auto" or not functions:
            return None, None
        if not auto_enabled:
            raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                              "tool_choice")
        return ToolPlan(tools or [], choice, get_tool_parser(self.config.tool_call_parser)), None

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
                        if plan.tools is not None:
                            for tool_chunk in choices[completion.index].tool_update(completion, names, plan.tools):
                                yield chunk(tool_chunk)
                            continue
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
    finish_reason: str | None = None  # the engine's (for the metrics)
    num_tokens: int = 0
    # Tool calling: the parser's stream ("auto"), or the text and logprobs held back (constrained).
    tool_stream: ToolCallStream | None = None
    held: list[str] = field(default_factory=list)
    held_logprobs: list = field(default_factory=list)
    called: bool = False  # a tool call was sent

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

    def tool_update(
        self, completion: CompletionOutput, names: TokenNames, tools: ToolPlan,
    ) -> list[ChatCompletionStreamChoice]:
        """update's counterpart for a request whose output may hold tool calls."""
        if self.finish_reason is not None:
            return []
        self.num_tokens += len(completion.token_ids)
        self.finish_reason = completion.finish_reason
        logprobs = None
        if self.top_logprobs is not None:
            logprobs = chat_logprobs(completion.token_ids, completion.logprobs or [], self.top_logprobs, names)
        stop_reason = completion.stop_reason if completion.finished else None
        if tools.parser is None:  # constrained: the calls once the output is whole
            self.held.append(completion.text)
            self.held_logprobs.extend(logprobs or [])
            if not completion.finished:
                return []
            text = "".join(self.held)
            try:
                calls = tool_calls_from_constrained(text, tools.tools, tools.tool_choice)
            except ValueError:  # cut short (max_tokens): the text as it is
                calls = []
            self.called = bool(calls)
            delta = DeltaMessage(tool_calls=[d.to_openai() for d in call_deltas(calls)]) if calls else \
                DeltaMessage(content=text or None)
            return [ChatCompletionStreamChoice(
                index=self.index, delta=delta,
                logprobs=None if self.top_logprobs is None else ChatChoiceLogprobs(content=self.held_logprobs),
                finish_reason="tool_calls" if calls else completion.finish_reason, stop_reason=stop_reason,
            )]
        if self.tool_stream is None:
            self.tool_stream = tools.parser.stream()
        deltas = self.tool_stream.feed(completion.text) if completion.text else []
        if completion.finished:
            deltas += self.tool_stream.finish()
        content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
        calls = [d.to_openai() for d in deltas if isinstance(d, ToolCallDelta)]
        self.called = self.called or bool(calls)
        if not (content or calls or logprobs or completion.finished):
            return []
        finish_reason = completion.finish_reason
        if completion.finished and self.called:
            finish_reason = "tool_calls"
        return [ChatCompletionStreamChoice(
            index=self.index, delta=DeltaMessage(content=content or None, tool_calls=calls or None),
            logprobs=None if logprobs is None else ChatChoiceLogprobs(content=logprobs),
            finish_reason=finish_reason, stop_reason=stop_reason,
        )]


@dataclass
class _Folded:
    role: str = "assistant"
    content: list[str] = field(default_factory=list)
    logprobs: list | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    tool_calls: dict[int, dict] = field(default_factory=dict)  # index -> the call so far, OpenAI's shape


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
            index=i, message=ChatMessageOut(role=f.role, content="".join(f.content) or None,
                                            tool_calls=[call for _, call in sorted(f.tool_calls.items())])
            if f.tool_calls else ChatMessageOut(role=f.role, content="".join(f.content)),
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
    for delta in chunk.delta.tool_calls or []:
        function = delta.get("function", {})
        call = into.tool_calls.get(delta["index"])
        if call is None:
            into.tool_calls[delta["index"]] = {
                "id": delta.get("id"), "type": "function",
                "function": {"name": function.get("name"), "arguments": function.get("arguments", "")},
            }
        else:
            call["function"]["arguments"] += function.get("arguments", "")
    if chunk.logprobs is not None:
        if into.logprobs is None:
            into.logprobs = []
        into.logprobs.extend(chunk.logprobs.content or [])
    into.finish_reason = chunk.finish_reason or into.finish_reason
    into.stop_reason = chunk.stop_reason if chunk.stop_reason is not None else into.stop_reason

