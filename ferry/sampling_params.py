"""How one request wants its tokens chosen and when it wants generation to stop.

Field names and defaults follow vLLM's `SamplingParams`, so code written for vLLM works here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

# OpenAI allows at most 20 top logprobs; we allow the same.
MAX_LOGPROBS = 20


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries everything generated so far
    DELTA = 1  # every output carries only what is new since the last one (streaming)
    FINAL_ONLY = 2  # one output, when the request finishes (offline batch)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) means no top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # how many top logprobs to return besides the chosen token's
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def check(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        check(isinstance(self.n, int) and self.n >= 1, "n", "must be an integer >= 1")
        check(_is_number(self.temperature) and self.temperature >= 0, "temperature", "must be >= 0")
        check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "must be -1, 0 (disabled) or >= 1")
        check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        check(self.seed is None or isinstance(self.seed, int), "seed", "must be an integer")
        check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            "max_tokens", "must be an integer >= 1",
        )
        check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens}, max_tokens={self.max_tokens}"
            )
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids", "must be non-negative integers",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(
                value is None or (isinstance(value, int) and 0 <= value <= MAX_LOGPROBS),
                name, f"must be an integer in [0, {MAX_LOGPROBS}]",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            check(_is_number(getattr(self, name)) and -2 <= getattr(self, name) <= 2, name, "must be in [-2, 2]")
        check(
            _is_number(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty", "must be > 0",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
        )

    def clone(self, **changes) -> SamplingParams:
        return replace(self, **changes)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
