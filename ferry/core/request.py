"""A request as the scheduler sees it: token ids, and how many of them the KV cache already holds.

There is no prefill phase and no decode phase. A request has `num_tokens` (prompt plus output so far)
and `num_computed_tokens` (tokens whose K/V are in the cache); each step computes some of the
difference. A fresh prompt has a large difference (prefill, maybe in chunks), a running request a
difference of one (decode), a preempted request is reset to zero (recompute).

With asynchronous scheduling the next step is scheduled while the last one still runs, so a request
may have a sampled token that is not known yet: `num_in_flight` counts those. The scheduler aims at
`num_tokens + num_in_flight`, and the runner takes an unknown token's id from the device.
"""

from __future__ import annotations

import enum
import time

from ferry.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # waiting again, its KV blocks given back
    FINISHED = enum.auto()


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens, the context length, or a KV cache too small to hold it
    ABORT = "abort"  # the client went away or asked to cancel
    ERROR = "error"  # the engine failed on this request (RequestOutput.error says how); others go on

    def __str__(self) -> str:
        return self.value


class Request:
    __slots__ = (
        "request_id", "prompt_token_ids", "sampling_params", "all_token_ids",
        "num_computed_tokens", "num_cached_tokens", "status", "finish_reason", "stop_reason",
        "max_tokens", "eos_token_ids", "arrival_time", "num_preemptions", "cache_salt", "block_hashes",
        "num_in_flight", "draft_token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        max_model_len: int,
        eos_token_ids: tuple[int, ...] = (),
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.all_token_ids = list(prompt_token_ids)  # the prompt, then the output: one list for both
        self.num_computed_tokens = 0
        self.num_in_flight = 0  # sampled tokens whose ids the host does not know yet
        self.draft_token_ids: list[int] = []  # proposed next tokens, for the next step to verify
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at admission
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        # The context length caps the output as surely as max_tokens does.
        room = max_model_len - len(prompt_token_ids)
        self.max_tokens = room if sampling_params.max_tokens is None else min(sampling_params.max_tokens, room)
        self.eos_token_ids = () if sampling_params.ignore_eos else eos_token_ids
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.num_preemptions = 0
        # Prefix caching: a salt keeps this request's cached blocks apart from other tenants', and
        # block_hashes[i] keys the i-th full block of all_token_ids (see core/prefix_cache.py).
        self.cache_salt = cache_salt
        self.block_hashes: list[bytes] = []

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_known_and_in_flight(self) -> int:
        return len(self.all_token_ids) + self.num_in_flight

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The tokens generated so far (a copy: the list is all_token_ids' tail)."""
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def check_stop(self) -> FinishReason | None:
        """Token-level stop conditions, checked after each new token. Stop strings need text, so the
        engine checks those after detokenizing."""
        n = self.num_output_tokens
        last = self.all_token_ids[-1]
        params = self.sampling_params
        if n >= params.min_tokens:
            if last in self.eos_token_ids:
                return FinishReason.STOP
            if last in params.stop_token_ids:
                self.stop_reason = last
                return FinishReason.STOP
        if n >= self.max_tokens:
            return FinishReason.LENGTH
        return None
