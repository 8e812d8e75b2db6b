"""From token ids to what users see: text, stop strings, logprobs, and the n completions of a request
folded back into one `RequestOutput`.

A request with n > 1 runs as n independent sequences in the scheduler (ids "0_<id>", "1_<id>", ...),
each with its own detokenizer; this module gathers them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ferry.core.outputs import Logprobs, RequestUpdate
from ferry.core.request import FinishReason
from ferry.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from ferry.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from ferry.engine.detokenizer import IncrementalDetokenizer
    from ferry.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class _Completion:
    """One of a request's n sequences."""

    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0  # how much a DELTA output has already handed out
    sent_chars: int = 0

    def visible_text(self) -> str:
        """Text safe to show now. While a stop string may still be forming at the end of the text,
        its possible beginning is held back, so that a stream never shows text it must retract."""
        if self.finish_reason is not None or not self.params.stop or self.params.include_stop_str_in_output:
            return self.text
        hold = max(len(s) for s in self.params.stop) - 1
        return self.text[: max(0, len(self.text) - hold)]


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[_Completion]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    prompt_logprobs_sent: bool = False  # DELTA: handed out once, when complete
    num_cached_tokens: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None  # when the first of its sequences was first scheduled
    first_token_time: float | None = None

    @property
    def finished(self) -> bool:
        for c in self.completions:
            if c.finish_reason is None:
                return False
        return True


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestState] = {}
        self._children: dict[str, tuple[_RequestState, _Completion]] = {}

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams
    ) -> list[str]:
        """Track a request; returns the ids of its n sequences for the scheduler."""
        completions = [
            _Completion(i, params, self._detokenizer(prompt_token_ids, params)) for i in range(params.n)
        ]
        state = _RequestState(request_id, prompt, prompt_token_ids, params, completions)
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]  # the first prompt token has no logprob
        self._requests[request_id] = state
        child_ids = [child_request_id(request_id, i, params.n) for i in range(params.n)]
        for child_id, completion in zip(child_ids, completions):
            self._children[child_id] = (state, completion)
        return child_ids

    def _detokenizer(self, prompt_token_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        from ferry.engine.detokenizer import IncrementalDetokenizer

        return IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request; returns its sequences' ids, for the scheduler to abort."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return []
        child_ids = [child_request_id(request_id, c.index, state.params.n) for c in state.completions]
        for child_id in child_ids:
            self._children.pop(child_id, None)
        return child_ids

    def mark_scheduled(self, request_ids: list[str], now: float) -> None:
        """Sequences the scheduler admitted at `now` (for the first time, or again after a
        preemption): the first one ends its request's queue time."""
        for request_id in request_ids:
            entry = self._children.get(request_id)
            if entry is not None and entry[0].first_scheduled_time is None:
                entry[0].first_scheduled_time = now

    def ids_in_use(self, request_id: str, n: int) -> list[str]:
        """Of the ids a request and its n sequences would take, those already taken."""
        ids = {request_id, *(child_request_id(request_id, i, n) for i in range(n))}
        return [i for i in ids if i in self._requests or i in self._children]

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    def process(self, updates: list[RequestUpdate]) -> tuple[list[RequestOutput], list[str], list[str]]:
        """Apply one step's updates. Returns the outputs to hand out, the sequence ids that a
        stop string has finished, and those of requests that failed here (detokenizing, stop
        strings, logprobs: an exception fails its request alone, see `fail`). The scheduler still
        holds the KV blocks of both."""
        touched: dict[str, _RequestState] = {}
        stopped: list[str] = []
        failed: dict[str, str] = {}  # request id -> why
        for update in updates:
            entry = self._children.get(update.request_id)
            if entry is None:
                continue  # aborted
            state, completion = entry
            touched[state.request_id] = state
            try:
                state.num_cached_tokens = update.num_cached_tokens
                if update.prompt_logprobs is not None and completion.index == 0:
                    self._add_prompt_logprobs(state, *update.prompt_logprobs)
                if self._add_tokens(completion, update):
                    stopped.append(update.request_id)
            except Exception as error:
                logger.exception("internal error in the output of request %s: failing it", state.request_id)
                failed.setdefault(state.request_id, _why(error))
            if completion.finish_reason is not None:
                del self._children[update.request_id]
        now = time.monotonic()
        outputs = []
        for state in touched.values():
            if state.request_id in failed:
                continue
            if state.first_token_time is None and any(c.token_ids for c in state.completions):
                state.first_token_time = now
            finished = state.finished
            try:
                output = self._make_output(state, finished)
            except Exception as error:
                logger.exception("internal error in the output of request %s: failing it", state.request_id)
                failed[state.request_id] = _why(error)
                continue
            if output is not None:
                outputs.append(output)
            if finished:
                del self._requests[state.request_id]
        failed_ids: list[str] = []
        for request_id, why in failed.items():
            output, child_ids = self.fail(request_id, why)
            outputs.append(output)
            failed_ids += child_ids
        stopped = [i for i in stopped if i not in failed_ids]
        return outputs, stopped, failed_ids

    def fail(self, request_id: str, why: str) -> tuple[RequestOutput, list[str]]:
        """End a request with an error: its final output (finish_reason "error", `error` = why) and
        its sequences' ids, for the scheduler to finish. Works on whatever state the request is in."""
        state = self._requests.get(request_id)
        params = state.params if state is not None else None
        child_ids = self.abort_request(request_id)
        n = params.n if params is not None else 1
        output = RequestOutput(
            request_id, state.prompt if state else None, state.prompt_token_ids if state else [],
            [CompletionOutput(i, "", [], None, None, str(FinishReason.ERROR)) for i in range(n)], True,
            error=why, metrics=self._metrics(state) if state is not None else {},
        )
        return output, child_ids

    def parent_id(self, child_id: str) -> str | None:
        """The request a sequence belongs to (None once it has finished)."""
        entry = self._children.get(child_id)
        return entry[0].request_id if entry is not None else None

    def _add_tokens(self, completion: _Completion, update: RequestUpdate) -> bool:
        """Append new tokens and their text; True when a stop string ended a running completion.
        Several tokens (accepted proposals) are checked for stop strings one by one, and the tokens
        after the one that completes a stop string are dropped."""
        token_ids = update.new_token_ids
        if len(token_ids) < 2 or not completion.params.stop:
            return self._add_run(completion, update)
        last = len(token_ids) - 1
        for k, token_id in enumerate(token_ids):
            one = RequestUpdate(
                update.request_id, [token_id], update.finish_reason if k == last else None,
                update.stop_reason if k == last else None,
                update.logprobs[k:k + 1] if update.logprobs is not None else None,
            )
            if self._add_run(completion, one):
                return True
        return False

    def _add_run(self, completion: _Completion, update: RequestUpdate) -> bool:
        params = completion.params
        old_len = len(completion.text)
        reason = update.finish_reason
        token_ids = update.new_token_ids
        completion.token_ids += token_ids
        detokenizer = completion.detokenizer
        if detokenizer is not None:
            # A stop token (EOS or one of stop_token_ids) ends the text before itself, as in vLLM.
            if reason is FinishReason.STOP and not isinstance(update.stop_reason, str):
                if not params.include_stop_str_in_output:
                    token_ids = token_ids[:-1]
            for token_id in token_ids:
                completion.text += detokenizer.push(token_id)
            if reason is not None:
                completion.text += detokenizer.finish()  # an incomplete last character
        if update.logprobs is not None and params.logprobs is not None:
            self._add_logprobs(completion, update.logprobs)
        completion.finish_reason = reason
        completion.stop_reason = update.stop_reason
        if not params.stop or len(completion.text) == old_len:
            return False
        if reason is None:
            return self._check_stop_strings(completion, old_len)
        if reason is FinishReason.LENGTH:
            # The token that reached max_tokens completed a stop string: the stop string wins. The
            # scheduler has already finished this sequence, so there is nothing to tell it.
            self._check_stop_strings(completion, old_len)
        return False

    @staticmethod
    def _check_stop_strings(completion: _Completion, old_len: int) -> bool:
        params = completion.params
        if len(completion.token_ids) < params.min_tokens:
            return False
        text = completion.text
        best: tuple[int, str] | None = None
        for stop in params.stop:
            # Only a match that reaches into this step's new text can be new.
            idx = text.find(stop, max(0, old_len - len(stop) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return False
        idx, stop = best
        completion.text = text[: idx + len(stop)] if params.include_stop_str_in_output else text[:idx]
        completion.finish_reason = FinishReason.STOP
        completion.stop_reason = stop
        return True

    def _add_logprobs(self, completion: _Completion, logprobs: list[Logprobs]) -> None:
        if completion.logprobs is None:
            completion.logprobs = []
            completion.cumulative_logprob = 0.0
        for lp in logprobs:
            completion.logprobs.append(self._position_logprobs(lp))
            completion.cumulative_logprob += lp.logprob

    def _add_prompt_logprobs(self, state: _RequestState, start: int, logprobs: list[Logprobs]) -> None:
        # Entry p of the list scores prompt token p + 1; a chunk recomputed after a preemption
        # repeats positions we already hold.
        have = len(state.prompt_logprobs) - 1
        for offset, lp in enumerate(logprobs):
            if start + offset == have:
                state.prompt_logprobs.append(self._position_logprobs(lp))
                have += 1

    def _position_logprobs(self, lp: Logprobs) -> PositionLogprobs:
        decode = self._decode_token
        out = {lp.token_id: Logprob(lp.logprob, lp.rank, decode(lp.token_id))}
        for rank, (token_id, logprob) in enumerate(lp.top, start=1):
            if token_id not in out:
                out[token_id] = Logprob(logprob, rank, decode(token_id))
        return out

    def _decode_token(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _make_output(self, state: _RequestState, finished: bool) -> RequestOutput | None:
        kind = state.params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        make = self._delta if kind is RequestOutputKind.DELTA else self._cumulative
        # Positional arguments: this runs for every request in every step.
        return RequestOutput(
            state.request_id, state.prompt, state.prompt_token_ids, [make(c) for c in state.completions],
            finished, self._prompt_logprobs_for(state, kind), state.num_cached_tokens,
            self._metrics(state) if finished else {},
        )

    @staticmethod
    def _prompt_logprobs_for(state: _RequestState, kind: RequestOutputKind) -> list[PositionLogprobs | None] | None:
        """All of them in every CUMULATIVE or FINAL_ONLY output; in DELTA outputs, once, as soon as
        every prompt position has its entry (chunked prefill fills them over several steps)."""
        logprobs = state.prompt_logprobs
        if kind is not RequestOutputKind.DELTA or logprobs is None:
            return logprobs
        if state.prompt_logprobs_sent or len(logprobs) < len(state.prompt_token_ids):
            return None
        state.prompt_logprobs_sent = True
        return logprobs

    @staticmethod
    def _cumulative(c: _Completion) -> CompletionOutput:
        return CompletionOutput(
            c.index, c.visible_text(), list(c.token_ids), c.cumulative_logprob,
            list(c.logprobs) if c.logprobs is not None else None,
            str(c.finish_reason) if c.finish_reason else None, c.stop_reason,
        )

    @staticmethod
    def _delta(c: _Completion) -> CompletionOutput:
        text = c.visible_text() if c.params.stop else c.text
        sent_chars, sent_tokens = c.sent_chars, c.sent_tokens
        c.sent_chars, c.sent_tokens = len(text), len(c.token_ids)
        return CompletionOutput(
            c.index, text[sent_chars:], c.token_ids[sent_tokens:], c.cumulative_logprob,
            c.logprobs[sent_tokens:] if c.logprobs is not None else None,
            c.finish_reason.value if c.finish_reason is not None else None, c.stop_reason,
        )

    @staticmethod
    def _metrics(state: _RequestState) -> dict[str, float]:
        metrics = {"arrival_time": state.arrival_time}
        if state.first_scheduled_time is not None:
            metrics["first_scheduled_time"] = state.first_scheduled_time
        if state.first_token_time is not None:
            metrics["first_token_time"] = state.first_token_time
        return metrics


def _why(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"
