"""The seam between the scheduler and the executor: plain data, one message each way per step.

    Scheduler.schedule() ──SchedulerOutput──► Executor.launch() ... collect()
    Scheduler.update_from_output() ◄──ModelRunnerOutput──┘

The executor keeps its own per-request state (block table, sampling generator) keyed by request id,
so a step tells it only what changed: the tokens to compute, blocks added since the last step, and
which requests are gone.

A row may carry proposed tokens after its last one (`num_draft_tokens`, speculative decoding): the
step computes all of them in one forward, samples a token after each position, and keeps the
proposals up to the first one that differs from what was sampled there, plus the token sampled
after the last kept one. So a step gives a request between 1 and 1 + num_draft_tokens tokens:

    token_ids:        [ last | d0  d1  d2  d3 ]          4 proposals
    sampled after:      s0     s1  s2  s3  s4
    s0 == d0, s1 == d1, s2 != d2  ->  new tokens d0 d1 s2   (2 proposals accepted)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ferry.core.request import FinishReason
from ferry.sampling_params import SamplingParams


@dataclass(slots=True)
class ScheduledRequest:
    request_id: str
    # The tokens to compute this step (a prefill chunk, or one decode token and maybe proposals
    # after it). None for a token the step still running sampled (asynchronous scheduling): the
    # runner takes its id from that step's sampled tokens on the device.
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
    # The last this many of token_ids are proposals to verify (see the module's docstring).
    num_draft_tokens: int = 0
    # Blocks taken off the end of its block table since the runner last saw it (freed after rejected
    # proposals), before new_block_ids are appended.
    num_dropped_blocks: int = 0


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
    # Numbers the scheduler's steps, so that it finds which requests a step samples for when its
    # output comes back (one or two steps later, with asynchronous scheduling).
    step_id: int = 0

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
    # One entry per scheduled request with sample=True, in scheduling order: the step's new tokens
    # of that request (one, or more where proposals were accepted).
    sampled_request_ids: list[str]
    sampled_token_ids: list[list[int]]
    # Per request, per new token (None where the request did not ask); None when nobody asked.
    logprobs: list[list[Logprobs] | None] | None = None
    # request id -> (first position, logprobs of the prompt tokens this step's chunk covered);
    # the entry for position p is the logprob of prompt token p + 1.
    prompt_logprobs: dict[str, tuple[int, list[Logprobs]]] = field(default_factory=dict)
    # Proposed next tokens per request (an executor with a proposer), to be verified by the next step.
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass(slots=True)
class RequestUpdate:
    """What one step did to one request, as the engine's output side needs it."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    logprobs: list[Logprobs] | None = None  # one per new token
    prompt_logprobs: tuple[int, list[Logprobs]] | None = None
    num_cached_tokens: int = 0
