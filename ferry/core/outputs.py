"""The seam between the scheduler and the model runner: plain data, one message each way per step.

    Scheduler.schedule() ──SchedulerOutput──► ModelRunner.execute()
    Scheduler.update_from_output() ◄──ModelRunnerOutput──┘

The runner keeps its own per-request state (block table, sampling generator) keyed by request id, so
a step tells it only what changed: the tokens to compute, blocks added since the last step, and which
requests are gone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ferry.core.request import FinishReason
from ferry.sampling_params import SamplingParams


@dataclass(slots=True)
class ScheduledRequest:
    request_id: str
    # The tokens to compute this step (a prefill chunk, or one decode token). None for a token the
    # step still running sampled (asynchronous scheduling): the runner takes its id from that
    # step's sampled tokens on the device.
    token_ids: list[int | None]
    start_pos: int  # position of token_ids[0]: the request's num_computed_tokens before this step
    new_block_ids: list[int]  # blocks appended to its block table since the runner last saw it
    sample: bool  # this step reaches the end of its known tokens, so a next token is sampled
    # Only for a request the runner has no state for (new, or resumed after preemption): its block
    # table starts over from new_block_ids, and sampling needs its params and prompt.
    new: bool = False
    sampling_params: SamplingParams | None = None
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None  # tokens generated before a preemption
    eos_token_ids: tuple[int, ...] = ()  # banned, with stop_token_ids, until min_tokens are out
    # Rows of this chunk whose next-token logprobs the client asked for (prompt logprobs).
    prompt_logprobs: bool = False


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: int
    # Requests the runner should forget: finished, aborted or preempted since the last step.
    finished_request_ids: set[str] = field(default_factory=set)
    # (source, destination) KV blocks to copy before the forward: a fully cached prompt's last
    # block, which its request must own to recompute its last token (see core/kv_cache_manager.py).
    copy_blocks: list[tuple[int, int]] = field(default_factory=list)
    # Requests this step's schedule() preempted (also in finished_request_ids, for the runner); they
    # wait again, to be recomputed. Nothing in a step needs them: they are there to be observed.
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class Logprobs:
    """Logprobs of one position: the chosen token's and the top-k alternatives'."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]]  # (token_id, logprob), most likely first


@dataclass
class ModelRunnerOutput:
    # One entry per scheduled request with sample=True, in scheduling order.
    sampled_request_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: list[Logprobs | None] | None = None
    # request id -> (first position, logprobs of the prompt tokens this step's chunk covered);
    # the entry for position p is the logprob of prompt token p + 1.
    prompt_logprobs: dict[str, tuple[int, list[Logprobs]]] = field(default_factory=dict)


@dataclass(slots=True)
class RequestUpdate:
    """What one step did to one request, as the engine's output side needs it."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    logprobs: Logprobs | None = None
    prompt_logprobs: tuple[int, list[Logprobs]] | None = None
    num_cached_tokens: int = 0


class OwedTokens:
    """Tokens still in flight (asynchronous scheduling) for requests that have ended on this side of
    the seam. Their ids may be taken by new requests before the tokens arrive; `take` says which
    arriving tokens are such leftovers, to be dropped."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}

    def add(self, request_id: str, n: int) -> None:
        if n:
            self._counts[request_id] = self._counts.get(request_id, 0) + n

    def take(self, request_id: str) -> bool:
        """True (and one fewer owed) when a token of `request_id` is a leftover."""
        n = self._counts.get(request_id)
        if n is None:
            return False
        if n == 1:
            del self._counts[request_id]
        else:
            self._counts[request_id] = n - 1
        return True

    def __bool__(self) -> bool:
        return bool(self._counts)

