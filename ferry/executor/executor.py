"""What the engine needs of whatever runs the model: the seam between scheduling and execution.

    engine ── launch(SchedulerOutput) ──► executor      queue the step's forward and sampling; no wait
           ◄─ collect(step) ──────────── ModelRunnerOutput   wait for that step's tokens

An executor owns the model, its KV cache (`num_kv_blocks` blocks of the configured size, which the
engine's block pool hands out) and the sampler, on one device or on many. Between `launch` and
`collect` the host is free: with asynchronous scheduling the engine schedules and launches the next
step there, so an executor takes a second `launch` before the first step's `collect` (at most two
steps are outstanding, collected in order). `ModelRunner` (model_runner.py) is the in-process,
one-device executor; a multi-process or multi-GPU one provides the same members, and the
engine needs no change.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from ferry.core.outputs import ModelRunnerOutput, SchedulerOutput


@runtime_checkable
class Executor(Protocol):
    @property
    def num_kv_blocks(self) -> int:
        """KV cache blocks the executor allocated (on each device, for a sharded one)."""

    @property
    def proposes_tokens(self) -> bool:
        """Whether the next outputs may carry proposed next tokens (speculative decoding, unless it is
        off for the batch's size): then the engine collects each step before it schedules the next,
        which verifies them."""

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots past a sampling request's tokens that its proposals need (a draft model stores
        the K/V of its guesses there); the scheduler allocates them with the step."""

    def launch(self, scheduler_output: SchedulerOutput) -> Any:
        """Queue one step; return a handle for `collect`."""

    def collect(self, step: Any) -> ModelRunnerOutput:
        """Wait for a launched step and return its sampled tokens (and logprobs)."""

    def shutdown(self) -> None:
        """Release the devices' memory and any worker processes; no step runs after it."""
