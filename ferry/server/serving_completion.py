"""POST /v1/completions: prompts in, a stream of `text_completion` chunks out.

A request with P prompts and n completions each runs as P engine requests (the engine runs the n
together); choice i * n + j is completion j of prompt i, as in OpenAI's API. `chunks` is the one
code path: streaming sends its chunks as events, and the plain reply is `fold_completion(chunks)`.

Echo puts the prompt in front of each choice's first chunk (with the prompt's logprobs when
logprobs are asked for: what lm-eval's loglikelihood requests read). max_tokens=0 with echo
scores the prompt alone: the engine samples one token, which is not shown. A token's text_offset
is where it begins in the choice's text: an echoed text prompt's come from the tokenizer (the BOS it
adds has no text there: it begins at 0, with the first word), and each generated token's follows
the text of the tokens before it.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from functools import cached_property

from ferry.metrics.latency import RequestClock
from ferry.outputs import CompletionOutput, RequestOutput
from ferry.sampling_params import SamplingParams
from ferry.server.errors import bad_request
from ferry.server.logprobs import TokenNames, completion_logprobs, format_prompt_logprobs, text_offsets
from ferry.server.preprocess import (
    EnginePrompt, check_context, check_fan_out, check_model, completion_prompts, refuse_unsupported, sampling_params,
)
from ferry.server.protocol import (
    CompletionChoice, CompletionRequest, CompletionResponse, PromptLogprobs, TextDelta, stream_head,
)
from ferry.server.serving import Serving


@dataclass(frozen=True)
class CompletionPlan:
    """A validated request, ready to run."""

    request_id: str
    created: int
    model: str
    prompts: list[EnginePrompt]
    params: SamplingParams
    echo: bool
    logprobs: int | None
    score_only: bool  # max_tokens=0 with echo
    cache_salt: str | None
    arrival_time: float  # time.monotonic() when it reached the server: its latencies count from here
    return_prompt_logprobs: bool = False  # prompt_logprobs was asked for (not only echo's)
    tokens_as_ids: bool = False  # return_tokens_as_token_ids

    @property
    def num_engine_requests(self) -> int:
        return len(self.prompts)

    @cached_property
    def head(self) -> bytes:
        """The JSON of this request's chunks up to the choice's index (TextDelta)."""
        return stream_head(self.request_id, self.created, self.model)


class CompletionServing(Serving[CompletionPlan, CompletionResponse]):
    @staticmethod
    async def fold(chunks: AsyncIterator) -> CompletionResponse:
        return await fold_completion(chunks)

    def plan(self, request: CompletionRequest, arrival_time: float) -> CompletionPlan:
        """Check the request against the model and the server's limits; raises ApiError."""
        check_model(request.model, self.config)
        refuse_unsupported(request)
        # Text offsets of the echoed prompt come from the tokenizer, as it encodes the prompt.
        with_offsets = request.echo and request.logprobs is not None
        prompts = completion_prompts(request.prompt, self.engine, request.add_special_tokens, with_offsets)
        check_fan_out(len(prompts), request.n, self.config)
        score_only = request.max_tokens == 0
        if score_only and not request.echo:
            raise bad_request("max_tokens must be >= 1 (0 is allowed with echo=true, to score the prompt)", "max_tokens")
        max_tokens = 1 if score_only else request.max_tokens
        for prompt in prompts:
            check_context(len(prompt.token_ids), max_tokens, self.engine, "prompt")
        prompt_logprobs = request.prompt_logprobs
        if prompt_logprobs is None and request.echo:
            prompt_logprobs = request.logprobs
        params = sampling_params(request, self.config, self.engine, max_tokens, request.logprobs, prompt_logprobs)
        return CompletionPlan(
            f"cmpl-{uuid.uuid4().hex}", int(time.time()), self.config.served_model_name, prompts, params,
            request.echo, request.logprobs, score_only, request.cache_salt, arrival_time,
            request.prompt_logprobs is not None, request.return_tokens_as_token_ids,
        )

    async def chunks(
        self, plan: CompletionPlan, include_usage: bool, continuous_usage: bool = False,
    ) -> AsyncIterator[CompletionResponse | TextDelta]:
        """The stream: chunks of one choice each (TextDelta, the same JSON written faster, where the
        choice has no logprobs), then (include_usage) one usage chunk; with continuous_usage every
        chunk carries the usage so far."""
        n = plan.params.n
        names = TokenNames(self.decode_one, plan.tokens_as_ids)
        text_of = functools.partial(self.decode_one, skip_special_tokens=plan.params.skip_special_tokens)
        choices = [_Choice(i * n + j, prompt, plan) for i, prompt in enumerate(plan.prompts) for j in range(n)]
        streams = [
            self.engine.generate(f"{plan.request_id}-{i}", p.token_ids, plan.params, p.text, plan.cache_salt)
            for i, p in enumerate(plan.prompts)
        ]
        clocks = [RequestClock(plan.arrival_time) for _ in plan.prompts]
        cached_tokens = [0] * len(plan.prompts)
        num_prompt_tokens = sum(len(p.token_ids) for p in plan.prompts)

        def usage():
            return self.usage(num_prompt_tokens, sum(c.num_tokens for c in choices), sum(cached_tokens))

        try:
            async with aclosing(merge_streams(streams)) as outputs:
                async for prompt_index, output in outputs:
                    self.metrics.observe(clocks[prompt_index].update(output, time.monotonic()))
                    cached_tokens[prompt_index] = output.num_cached_tokens
                    for completion in output.outputs:
                        choice = choices[prompt_index * n + completion.index].update(
                            output, completion, names, self.decode, text_of)
                        if isinstance(choice, TextDelta):
                            choice.usage = usage() if continuous_usage else None
                            yield choice
                        elif choice is not None:
                            yield CompletionResponse(id=plan.request_id, created=plan.created, model=plan.model,
                                                     choices=[choice], usage=usage() if continuous_usage else None)
        finally:
            self.metrics.finished([c.finish_reason or "abort" for c in choices])
        if include_usage:
            yield CompletionResponse(id=plan.request_id, created=plan.created, model=plan.model, choices=[],
                                     usage=usage())


@dataclass
class _Choice:
    """What one choice has sent so far."""

    index: int
    prompt: EnginePrompt
    plan: CompletionPlan
    echoed: bool = False
    prompt_logprobs_sent: bool = False
    finish_reason: str | None = None
    next_offset: int = 0  # the text_offset of the next token
    num_tokens: int = 0

    def update(
        self, output: RequestOutput, completion: CompletionOutput, names: TokenNames,
        decode: Callable[[list[int]], str], text_of: Callable[[int], str],
    ) -> CompletionChoice | TextDelta | None:
        """The chunk for this delta of the choice (a TextDelta without logprobs), or None when there
        is nothing to send. `decode`: the text of token ids, for an echoed prompt of ids; `text_of`:
        a generated token's text in the reply (special tokens skipped as the request says)."""
        if self.finish_reason is not None:
            return None  # finished earlier; later outputs of the request still list it
        text, token_ids, positions = completion.text, completion.token_ids, completion.logprobs or []
        if self.plan.score_only:
            text, token_ids, positions = "", [], []
        head_text, head_ids, head_positions, head_offsets = self._echo(output, completion.finished, decode, names)
        prompt_logprobs = self._prompt_logprobs(output, names.decode)
        self.num_tokens += len(token_ids)
        self.finish_reason = completion.finish_reason
        if not (head_text or head_ids or text or token_ids or completion.finished or prompt_logprobs):
            return None
        stop_reason = completion.stop_reason if completion.finished else None
        if self.plan.logprobs is None and prompt_logprobs is None:
            return TextDelta(self.plan.head, self.index, head_text + text, completion.finish_reason, stop_reason)
        logprobs = None
        if self.plan.logprobs is not None:
            self.next_offset += len(head_text)  # the generated text follows the echoed prompt's
            offsets, self.next_offset = text_offsets(token_ids, self.next_offset, text_of)
            logprobs = completion_logprobs(head_ids + token_ids, head_positions + positions, head_offsets + offsets,
                                           names)
        return CompletionChoice(
            index=self.index, text=head_text + text, logprobs=logprobs, finish_reason=completion.finish_reason,
            stop_reason=stop_reason, prompt_logprobs=prompt_logprobs,
        )

    def _echo(
        self, output: RequestOutput, finished: bool, decode: Callable[[list[int]], str], names: TokenNames,
    ) -> tuple[str, list[int], list, list[int]]:
        """The prompt, once, at the front of the choice; with logprobs, once they have arrived. Its
        text, token ids, logprobs and text offsets (a text prompt's come from the tokenizer)."""
        plan = self.plan
        if not plan.echo or self.echoed:
            return "", [], [], []
        if plan.params.prompt_logprobs is not None and output.prompt_logprobs is None and not finished:
            return "", [], [], []
        self.echoed = True
        ids, text, offsets = self.prompt.token_ids, self.prompt.text, self.prompt.text_offsets
        if text is None:  # token ids: the text they decode to, special tokens written out
            text = decode(ids)
        if offsets is None:
            offsets, _ = text_offsets(ids, 0, names.decode)
        positions = output.prompt_logprobs if output.prompt_logprobs is not None else [None] * len(ids)
        return text, list(ids), list(positions), list(offsets)

    def _prompt_logprobs(self, output: RequestOutput, decode) -> PromptLogprobs | None:
        """vLLM's prompt_logprobs, once, with the first chunk after they arrive (when asked for)."""
        if not self.plan.return_prompt_logprobs or self.prompt_logprobs_sent or output.prompt_logprobs is None:
            return None
        self.prompt_logprobs_sent = True
        return format_prompt_logprobs(output.prompt_logprobs, decode)


async def merge_streams(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index of the stream, output) from several engine streams as their outputs arrive. Closing
    the merged stream closes all of them (aborting their requests)."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as stream:
            async for output in stream:
                yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async with aclosing(stream):
                async for output in stream:
                    queue.put_nowait((index, output))
            queue.put_nowait((index, None))
        except Exception as e:
            queue.put_nowait((index, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def fold_completion(chunks: AsyncIterator[CompletionResponse | TextDelta]) -> CompletionResponse:
    """The non-streaming reply: every chunk of the stream folded into one (consumes the chunks)."""
    head: CompletionResponse | None = None
    choices: dict[int, CompletionChoice] = {}
    async with aclosing(chunks):
        async for chunk in chunks:
            if isinstance(chunk, TextDelta):
                chunk_choices = [chunk.choice()]
            else:  # a pydantic chunk (with logprobs, or the usage chunk, always last, always there)
                head = head or chunk
                head.usage = chunk.usage or head.usage
                chunk_choices = chunk.choices
            for choice in chunk_choices:
                if choice.index in choices:
                    _fold_choice(choices[choice.index], choice)
                else:
                    choices[choice.index] = choice
    assert head is not None, "a completion stream always ends with its usage chunk"
    return CompletionResponse(id=head.id, created=head.created, model=head.model,
                              choices=[choices[i] for i in sorted(choices)], usage=head.usage)


def _fold_choice(into: CompletionChoice, chunk: CompletionChoice) -> None:
    into.text += chunk.text
    into.prompt_logprobs = into.prompt_logprobs or chunk.prompt_logprobs
    into.finish_reason = chunk.finish_reason or into.finish_reason
    into.stop_reason = chunk.stop_reason if chunk.stop_reason is not None else into.stop_reason
    if into.logprobs is not None and chunk.logprobs is not None:
        into.logprobs.tokens += chunk.logprobs.tokens
        into.logprobs.token_logprobs += chunk.logprobs.token_logprobs
        into.logprobs.top_logprobs += chunk.logprobs.top_logprobs
        into.logprobs.text_offset += chunk.logprobs.text_offset

