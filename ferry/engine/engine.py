"""The engine: one step = schedule, run the model, apply the results, turn tokens into outputs.

    add_request ─► tokenize, validate ─► Scheduler.add_request (n sequences)
    step():  Scheduler.schedule ─► ModelRunner.execute ─► Scheduler.update_from_output
             ─► OutputProcessor.process (text, stop strings) ─► RequestOutputs

The engine is single-threaded; the offline `LLM` drains it in a loop and the server runs it in a
loop of its own. With `async_scheduling`, a step schedules and launches the next batch before it
waits for the tokens of the one in flight, so the host's work (scheduling, input preparation,
output processing) runs while the device computes; outputs then come one step later:

    step k:   schedule + launch batch k ─► collect batch k-1 ─► update, outputs of k-1
                       (device: batch k-1, then k)

Requests with penalties need their last token on the host before they can be sampled again; while
one runs, steps do not overlap. Given a `RequestTracer`, it tells it what each step did to each
request (see metrics/tracing.py); without one, tracing costs nothing. A `step_listener` is told
each applied step's schedule and times (the dashboard's sampler: dashboard/watch.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ferry.config import EngineConfig
from ferry.core.kv_cache_manager import KVCacheManager
from ferry.core.outputs import SchedulerOutput
from ferry.core.request import FinishReason, Request
from ferry.core.scheduler import Scheduler
from ferry.engine.faults import is_device_fault
from ferry.engine.output_processor import OutputProcessor
from ferry.outputs import RequestOutput
from ferry.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ferry.executor.executor import Executor
    from ferry.executor.model_runner import LaunchedStep
    from ferry.metrics.tracing import RequestTracer
    from ferry.structured.grammar import Grammars
    from ferry.tokenizer import Tokenizer

# A prompt is text, or a dict (vLLM's form): {"prompt_token_ids": [...]} or {"prompt": "..."}, with
# an optional "cache_salt" that keeps its prefix-cache entries apart from other tenants'.
PromptType = str | dict[str, Any]

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self, config: EngineConfig, executor: Executor, tokenizer: Tokenizer | None, tracer: RequestTracer | None = None,
        grammars: Grammars | None = None,
    ) -> None:
        self.config = config
        self.grammars = grammars  # checks the grammars of structured-output requests
        self.executor = executor  # runs the model: executor/executor.py says what the engine needs of it
        self.tokenizer = tokenizer
        kv_cache = KVCacheManager(executor.num_kv_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
                                  config.model.sliding_window)
        self.scheduler = Scheduler(config.scheduler, kv_cache, executor.num_lookahead_slots)
        self.output_processor = OutputProcessor(tokenizer)
        self.tracer = tracer
        self.eos_token_ids = _eos_token_ids(config, tokenizer)
        # Asynchronous scheduling: the launched step whose results have not been applied yet.
        self._in_flight: _Launched | None = None
        # The steps scheduled and not yet applied (at most two): whose requests a failure ends.
        self._unapplied: list[SchedulerOutput] = []
        # Told of every step once applied: (its schedule, when it was scheduled, when it ended). The
        # dashboard's sampler sits here while a browser watches (dashboard/watch.py).
        self.step_listener: Callable[[SchedulerOutput, float, float], None] | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, tracer: RequestTracer | None = None) -> LLMEngine:
        from ferry.executor.model_runner import build_model_runner

        tokenizer, grammars = None, None
        tokenizer_json = config.model.tokenizer_dir / "tokenizer.json"
        if tokenizer_json.is_file():
            from ferry.structured.grammar import Grammars
            from ferry.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_pretrained(config.model.tokenizer_dir)
            grammars = Grammars(tokenizer_json, config.model.vocab_size, _eos_token_ids(config, tokenizer))
        return cls(config, build_model_runner(config, grammars=grammars), tokenizer, tracer, grammars)

    # ---- requests in ----

    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams, arrival_time: float | None = None
    ) -> None:
        """Validate and queue a request. Raises ValueError naming the problem; the engine is
        unchanged then."""
        text, token_ids = self._tokenize(prompt)
        # Token ids in the sampling params (logit_bias, allowed ids, bad words) within the
        # vocabulary: one out of it would fail the sampler, and on a GPU the process.
        params = params.for_model(self.config.model.vocab_size, self.tokenizer)
        self._validate(request_id, token_ids, params)
        cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        child_ids = self.output_processor.add_request(request_id, text, token_ids, params)
        try:
            for index, child_id in enumerate(child_ids):
                child_params = params if params.n == 1 else _child_params(params, index)
                self.scheduler.add_request(Request(
                    child_id, token_ids, child_params, self.config.model.max_model_len,
                    self.eos_token_ids, arrival_time, cache_salt,
                ))
        except Exception:
            self.abort_request(request_id)
            raise
        if self.tracer is not None:
            self.tracer.queued(child_ids, time.monotonic())

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer.json: give prompts as {'prompt_token_ids': [...]}")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" not in prompt and isinstance(prompt.get("prompt"), str):
            return self._tokenize(prompt["prompt"])
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            token_ids = prompt["prompt_token_ids"]
            if not isinstance(token_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
                raise ValueError("prompt_token_ids must be a list of integers")
            return prompt.get("prompt"), list(token_ids)
        raise ValueError(f"a prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")

    def _validate(self, request_id: str, token_ids: list[int], params: SamplingParams) -> None:
        model = self.config.model
        if not token_ids:
            raise ValueError("the prompt is empty")
        bad = next((t for t in token_ids if not 0 <= t < model.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is out of vocabulary (valid ids: 0 to {model.vocab_size - 1})")
        bad = next((t for t in params.stop_token_ids if t >= model.vocab_size), None)
        if bad is not None:
            raise ValueError(f"stop_token_ids: {bad} is out of vocabulary (size {model.vocab_size})")
        if len(token_ids) >= model.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, but max_model_len is {model.max_model_len}: "
                "it leaves no room for a single output token"
            )
        if params.structured_outputs is not None:
            if self.grammars is None:
                raise ValueError(f"{params.structured_outputs.source}: structured output needs the model's "
                                 "tokenizer (tokenizer.json)")
            self.grammars.check(params.structured_outputs)  # a GrammarError (ValueError) names the problem
        taken = self.output_processor.ids_in_use(request_id, params.n)
        if taken:
            raise ValueError(f"request id {request_id!r} is already in use (as {', '.join(sorted(taken))})")

    def abort_request(self, request_id: str) -> None:
        child_ids = self.output_processor.abort_request(request_id)
        self.scheduler.finish_requests(child_ids, FinishReason.ABORT)
        if self.tracer is not None:
            self.tracer.finished(child_ids, str(FinishReason.ABORT), time.monotonic())

    def shutdown(self) -> None:
        """Release the executor (device memory, workers); the engine serves nothing after it."""
        self.executor.shutdown()

    # ---- the step ----

    def has_unfinished_requests(self) -> bool:
        return (self.output_processor.num_unfinished_requests > 0 or self.scheduler.has_unfinished_requests()
                or self._in_flight is not None)

    def step(self) -> list[RequestOutput]:
        """One step's outputs. An exception inside it fails the requests of the steps it was running
        (finish_reason "error") and the engine goes on with the others; only a fault of the device
        itself (a CUDA error: nothing on it can be trusted any more) propagates."""
        try:
            return self._step()
        except Exception as error:
            if is_device_fault(error):
                raise
            return self._fail_unapplied(error)

    def _step(self) -> list[RequestOutput]:
        if not self.config.async_scheduling:
            return self._complete(self._launch())
        if self._in_flight is not None and not self._can_overlap():
            done, self._in_flight = self._in_flight, None
            return self._complete(done)
        launched = self._launch()
        done, self._in_flight = self._in_flight, launched
        # In a trace, the step in flight ends where the next one begins, so that steps never overlap.
        outputs = self._complete(done, launched.start) if done is not None else []
        if launched.scheduler_output.is_empty:  # nothing to overlap with: finish it now
            self._in_flight = None
            outputs += self._complete(launched)
        return outputs

    def _launch(self) -> _Launched:
        start = time.monotonic()
        scheduler_output = self.scheduler.schedule()
        self._unapplied.append(scheduler_output)
        # A request's queue time ends when it is first scheduled (new: admitted, or resumed).
        self.output_processor.mark_scheduled([s.request_id for s in scheduler_output.scheduled if s.new], start)
        return _Launched(scheduler_output, self.executor.launch(scheduler_output), start)

    def _complete(self, launched: _Launched, trace_end: float | None = None) -> list[RequestOutput]:
        runner_output = self.executor.collect(launched.step)
        updates = self.scheduler.update_from_output(launched.scheduler_output, runner_output)
        self._unapplied = [o for o in self._unapplied if o is not launched.scheduler_output]
        outputs, stopped, failed = self.output_processor.process(updates)
        if stopped:
            self.scheduler.finish_requests(stopped, FinishReason.STOP)
        if failed:
            self.scheduler.finish_requests(failed, FinishReason.ERROR)
        if self.tracer is not None or self.step_listener is not None:
            end = time.monotonic() if trace_end is None else trace_end
            if self.tracer is not None:
                self.tracer.step(launched.scheduler_output, updates, launched.start, end)
                self.tracer.finished(stopped, str(FinishReason.STOP), end)
                self.tracer.finished(failed, str(FinishReason.ERROR), end)
            if self.step_listener is not None:
                self.step_listener(launched.scheduler_output, launched.start, end)
        return outputs

    def _fail_unapplied(self, error: Exception) -> list[RequestOutput]:
        """After an exception in a step: fail every request of the steps scheduled and not yet
        applied (the one that raised, and the one in flight before it). Their tokens in flight will
        never arrive, so they are forgotten before the requests finish; what the others hold was
        applied by earlier steps and stays true."""
        logger.exception("internal error in a step: failing its requests and going on")
        why = f"the engine failed on this step ({type(error).__name__}: {error})"
        child_ids = {s.request_id for output in self._unapplied for s in output.scheduled}
        for output in self._unapplied:
            self.scheduler.abandon(output)
        self._unapplied.clear()
        self._in_flight = None
        outputs = []
        for request_id in sorted({p for c in child_ids if (p := self.output_processor.parent_id(c)) is not None}):
            output, children = self.output_processor.fail(request_id, why)
            outputs.append(output)
            child_ids.update(children)
        failed = sorted(child_ids)
        self.scheduler.finish_requests(failed, FinishReason.ERROR)
        if self.tracer is not None:
            self.tracer.finished(failed, str(FinishReason.ERROR), time.monotonic())
        return outputs

    def _can_overlap(self) -> bool:
        """Whether the next step may be scheduled before the one in flight is collected: not while a
        running request's penalties need its tokens on the host, nor when the executor proposes
        tokens (the next step verifies proposals that follow the tokens of this one). (A grammar's
        mask follows every token too, but only the sampling waits for it: see ModelRunner.)"""
        if self.executor.proposes_tokens:
            return False
        return not any(r.sampling_params.uses_penalties for r in self.scheduler.running)


@dataclass
class _Launched:
    scheduler_output: SchedulerOutput
    step: LaunchedStep  # the executor's handle
    start: float  # when it was scheduled


def _eos_token_ids(config: EngineConfig, tokenizer: Tokenizer | None) -> tuple[int, ...]:
    """The model's EOS ids (generation_config.json, config.json), else the tokenizer's."""
    if config.model.eos_token_ids:
        return config.model.eos_token_ids
    return (tokenizer.eos_token_id,) if tokenizer is not None and tokenizer.eos_token_id is not None else ()


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    # Each of the n sequences samples on its own stream; with a seed they stay reproducible, and in
    # the range of a 64-bit seed (2**64 - 1 plus an index wraps around).
    seed = None if params.seed is None else (params.seed + index) % 2**64
    return replace(params, n=1, seed=seed)

