"""Per-request traces: what the engine did to each request, step by step, as timed spans.

The engine tells a `RequestTracer` three things:

    add_request          ─► queued(id, now)                   the request's track opens
    step()               ─► step(scheduler_output, updates, start, end)
    stop string, abort   ─► finished(ids, reason, now)

and each request's track becomes, for example:

    ├─ queued ─┤├ prefill ┤├ prefill ┤├── decode ──┤   ├─ queued ─┤├ recompute ┤├─ decode ─┤
               ▲ scheduled                          ▲ preempted                             ▲ finished

Spans are (start, duration) in seconds of `time.monotonic()`, the engine's clock; a prefill chunk
spans the step that computed it. A run of decodes is one span, from its first step to its last,
rather than a span per step: a trace grows with what happened to the request (chunks,
preemptions), not with its length. A recompute is the prefill of a request resumed after a
preemption (its prompt and the output so far). When a request finishes, its `RequestTrace` goes to
the sink and the tracer forgets it, so its memory is bounded by the requests in flight.

Given a `step_sink`, the tracer also hands it each step as a `StepTrace`: its batch (prefill chunks,
decodes, tokens), its time and, given `bound`, its roofline bound (the least its FLOPs and bytes
allow: ferry/bench/roofline.py). Requests' spans name the steps they took part in (a chunk its
`step`, a decode run its `first_step` and `last_step`), so that a trace shows each request beside
the engine steps that served it (metrics/chrome_trace.py draws the links).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ferry.core.outputs import RequestUpdate, ScheduledRequest, SchedulerOutput

QUEUED = "queued"  # span: waiting for admission (first, or again after a preemption)
SCHEDULED = "scheduled"  # instant: the first admission
PREFILL = "prefill"  # span: one chunk of the prompt
RECOMPUTE = "recompute"  # span: one chunk of the tokens a preemption threw away
DECODE = "decode"  # span: a run of decode steps
PREEMPTED = "preempted"  # instant: its KV blocks were taken back
FINISHED = "finished"  # instant: why it ended

ArgValue = int | float | str


@dataclass(frozen=True)
class TraceEvent:
    """A span (duration set) or an instant (duration None) on a request's track."""

    name: str
    start: float  # seconds of time.monotonic()
    duration: float | None = None
    args: dict[str, ArgValue] = field(default_factory=dict)


@dataclass(frozen=True)
class RequestTrace:
    """One finished request's events, in the order they ended (an instant ends as it happens)."""

    request_id: str
    track: int  # a number of its own, in order of arrival: its thread id in a Chrome trace
    events: tuple[TraceEvent, ...]


@dataclass(frozen=True)
class StepTrace:
    """One engine step: what it computed, how long it took, and the least it could have taken."""

    step_id: int
    start: float  # seconds of time.monotonic()
    duration: float
    prefill_chunks: int  # requests that brought prompt (or recomputed) tokens
    prefill_tokens: int
    decodes: int  # requests that brought one new token (and any proposals to verify)
    tokens: int  # every token the step computed
    bound: float | None = None  # seconds: its roofline bound, when the tracer was given one


@dataclass
class _DecodeRun:
    start: float
    end: float
    first_step: int
    last_step: int
    steps: int = 1


@dataclass
class _Timeline:
    """A request in flight, as the tracer follows it."""

    track: int
    waiting_since: float | None
    events: list[TraceEvent] = field(default_factory=list)
    # Tokens it had at its last admission: chunks that start below this are (re)computing them,
    # chunks at or past it decode.
    known_tokens: int = 0
    cached_tokens: int = 0  # found in the prefix cache at its last admission
    computed_tokens: int = 0
    output_tokens: int = 0
    preemptions: int = 0
    decode_run: _DecodeRun | None = None


class RequestTracer:
    """Follows the scheduler's requests (ids as the scheduler knows them: one per sequence, so the n
    completions of a request are n tracks) and hands each finished one's trace to `sink`."""

    def __init__(
        self, sink: Callable[[RequestTrace], None], step_sink: Callable[[StepTrace], None] | None = None,
        bound: Callable[[SchedulerOutput], float] | None = None,
    ) -> None:
        self._sink = sink
        self._step_sink = step_sink
        self._bound = bound
        self._timelines: dict[str, _Timeline] = {}
        self._tracks = itertools.count(1)

    @property
    def num_in_flight(self) -> int:
        return len(self._timelines)

    def queued(self, request_ids: Iterable[str], now: float) -> None:
        for request_id in request_ids:
            self._timelines[request_id] = _Timeline(next(self._tracks), waiting_since=now)

    def step(self, output: SchedulerOutput, updates: list[RequestUpdate], start: float, end: float) -> None:
        """One step: scheduled (and preemptions made) at `start`, over at `end`: when its results
        were applied, or (asynchronous scheduling) when the next step was scheduled."""
        for request_id in output.preempted_request_ids:
            self._preempted(request_id, start)
        for item in output.scheduled:
            timeline = self._timelines.get(item.request_id)
            if timeline is not None:
                self._computed(timeline, item, start, end, output.step_id)
        if self._step_sink is not None and output.scheduled:
            self._step_sink(step_trace(output, start, end, self._bound))
        for update in updates:
            timeline = self._timelines.get(update.request_id)
            if timeline is None:
                continue
            timeline.output_tokens += len(update.new_token_ids)
            if update.finish_reason is not None:
                self._finish(update.request_id, str(update.finish_reason), end, update.stop_reason)

    def finished(self, request_ids: Iterable[str], reason: str, now: float) -> None:
        """Requests that ended outside a step's updates: stop strings, aborts."""
        for request_id in request_ids:
            if request_id in self._timelines:
                self._finish(request_id, reason, now)

    # ---- one request ----

    def _computed(self, timeline: _Timeline, item: ScheduledRequest, start: float, end: float, step: int) -> None:
        if item.new:
            self._admitted(timeline, item, start)
        if item.start_pos < timeline.known_tokens:
            name = PREFILL if timeline.preemptions == 0 else RECOMPUTE
            args = {"start": item.start_pos, "tokens": len(item.token_ids), "cached_tokens": timeline.cached_tokens,
                    "step": step}
            timeline.events.append(TraceEvent(name, start, end - start, args))
        elif timeline.decode_run is None:
            timeline.decode_run = _DecodeRun(start, end, step, step)
        else:
            timeline.decode_run.end = end
            timeline.decode_run.last_step = step
            timeline.decode_run.steps += 1
        timeline.computed_tokens = item.start_pos + len(item.token_ids)

    def _admitted(self, timeline: _Timeline, item: ScheduledRequest, now: float) -> None:
        self._end_wait(timeline, now)
        prompt_tokens = len(item.prompt_token_ids or ())
        # A new item's first chunk starts after the tokens its prefix-cache hit provides.
        timeline.cached_tokens = item.start_pos
        timeline.known_tokens = prompt_tokens + len(item.output_token_ids or ())
        if timeline.preemptions == 0:
            args = {"prompt_tokens": prompt_tokens, "cached_tokens": item.start_pos}
            timeline.events.append(TraceEvent(SCHEDULED, now, None, args))

    def _preempted(self, request_id: str, now: float) -> None:
        timeline = self._timelines.get(request_id)
        if timeline is None:
            return
        self._end_decode_run(timeline)
        timeline.preemptions += 1
        args = {"freed_tokens": timeline.computed_tokens, "preemptions": timeline.preemptions}
        timeline.events.append(TraceEvent(PREEMPTED, now, None, args))
        timeline.computed_tokens = 0
        timeline.waiting_since = now

    def _finish(self, request_id: str, reason: str, now: float, stop_reason: int | str | None = None) -> None:
        timeline = self._timelines.pop(request_id)
        self._end_decode_run(timeline)
        self._end_wait(timeline, now)  # aborted while waiting
        args: dict[str, ArgValue] = {
            "reason": reason, "output_tokens": timeline.output_tokens, "preemptions": timeline.preemptions,
        }
        if stop_reason is not None:
            args["stop_reason"] = stop_reason
        timeline.events.append(TraceEvent(FINISHED, now, None, args))
        self._sink(RequestTrace(request_id, timeline.track, tuple(timeline.events)))

    @staticmethod
    def _end_wait(timeline: _Timeline, now: float) -> None:
        if timeline.waiting_since is not None:
            timeline.events.append(TraceEvent(QUEUED, timeline.waiting_since, now - timeline.waiting_since))
            timeline.waiting_since = None

    @staticmethod
    def _end_decode_run(timeline: _Timeline) -> None:
        run = timeline.decode_run
        if run is not None:
            args = {"steps": run.steps, "first_step": run.first_step, "last_step": run.last_step}
            timeline.events.append(TraceEvent(DECODE, run.start, run.end - run.start, args))
            timeline.decode_run = None


def step_trace(
    output: SchedulerOutput, start: float, end: float, bound: Callable[[SchedulerOutput], float] | None = None,
) -> StepTrace:
    """A scheduled step as a StepTrace: it ran from `start` to `end`; `bound` gives its roofline bound."""
    prefills = [len(s.token_ids) for s in output.scheduled if not is_decode(s)]
    return StepTrace(
        output.step_id, start, end - start, len(prefills), sum(prefills), len(output.scheduled) - len(prefills),
        output.num_scheduled_tokens, bound(output) if bound is not None else None,
    )


def is_decode(item: ScheduledRequest) -> bool:
    """One new token to sample after (and any proposals to verify): not a chunk of a prompt."""
    return item.sample and len(item.token_ids) - item.num_draft_tokens == 1
