"""Request traces as Chrome trace-event JSON, the format Perfetto (ui.perfetto.dev) and
chrome://tracing open:

    {"displayTimeUnit": "ms", "traceEvents": [
      {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "ferry engine"}},
      {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "cmpl-5f...-0"}},
      {"ph": "X", "name": "prefill", "pid": 1, "tid": 7, "ts": 81234567, "dur": 2150, "args": {...}},
      {"ph": "i", "name": "preempted", "pid": 1, "tid": 7, "ts": 81236717, "s": "t", "args": {...}},
      ...]}

Every request is a thread of one process, so each has a track of its own, named by its id. "X" is
a complete event (a span: ts and dur), "i" an instant on its thread's track ("s": "t"), "M"
metadata. Times are whole microseconds of the engine's monotonic clock; a span's end is rounded
like a start, so spans that touch in the engine touch in the trace.

The engine's steps (tracing.StepTrace) are a track of their own, first ("engine steps", tid 0):
a span per step whose args give its batch, its measured and roofline milliseconds and the ratio.
Each prefill (or recompute) chunk of a request is linked to the step that computed it by a flow
arrow ("ph": "s" on the request's span, "f" on the step's, one id per pair), and decode runs name
their first and last step: click a chunk in Perfetto and follow the arrow to its step.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from ferry.metrics.tracing import PREFILL, RECOMPUTE, RequestTrace, StepTrace, TraceEvent

PID = 1
PROCESS_NAME = "ferry engine"
STEP_TRACK = 0  # the engine's steps: before every request's track


def chrome_trace(traces: Iterable[RequestTrace], steps: Iterable[StepTrace] = ()) -> dict[str, Any]:
    """One trace file's JSON object with these requests' tracks and these steps."""
    events = [process_name_event(), steps_track_event()]
    events.extend(step_event(s) for s in steps)
    for trace in traces:
        events.extend(trace_events(trace))
    return {"displayTimeUnit": "ms", "traceEvents": events}


def chrome_trace_json(traces: Iterable[RequestTrace], steps: Iterable[StepTrace] = ()) -> bytes:
    return json.dumps(chrome_trace(traces, steps), separators=(",", ":")).encode()


def process_name_event() -> dict[str, Any]:
    return {"ph": "M", "name": "process_name", "pid": PID, "tid": 0, "args": {"name": PROCESS_NAME}}


def steps_track_event() -> dict[str, Any]:
    return {"ph": "M", "name": "thread_name", "pid": PID, "tid": STEP_TRACK, "args": {"name": "engine steps"}}


def step_event(step: StepTrace) -> dict[str, Any]:
    """A step's span on the steps' track."""
    ts = _us(step.start)
    args: dict[str, Any] = {
        "step": step.step_id, "tokens": step.tokens, "prefill_chunks": step.prefill_chunks,
        "prefill_tokens": step.prefill_tokens, "decodes": step.decodes, "measured_ms": round(step.duration * 1e3, 4),
    }
    if step.bound is not None:
        args["roofline_ms"] = round(step.bound * 1e3, 4)
        if step.duration > 0:
            args["of_roofline"] = round(step.bound / step.duration, 4)
    return {"ph": "X", "name": f"step {step.step_id}", "pid": PID, "tid": STEP_TRACK, "ts": ts,
            "dur": _us(step.start + step.duration) - ts, "args": args}


def trace_events(trace: RequestTrace) -> list[dict[str, Any]]:
    """One request's track: its name, then its events, and an arrow from each chunk to its step."""
    named = {"ph": "M", "name": "thread_name", "pid": PID, "tid": trace.track, "args": {"name": trace.request_id}}
    events = [named]
    for e in trace.events:
        events.append(_event(e, trace.track))
        if e.name in (PREFILL, RECOMPUTE) and "step" in e.args:
            events.extend(_flow(e, trace.track))
    return events


def _flow(chunk: TraceEvent, tid: int) -> list[dict[str, Any]]:
    """An arrow from a chunk's span to its step's span, which share their start."""
    ts, flow_id = _us(chunk.start), f"{chunk.args['step']}/{tid}"
    common = {"name": "computed in", "cat": "step", "pid": PID, "ts": ts, "id": flow_id}
    return [{**common, "ph": "s", "tid": tid}, {**common, "ph": "f", "bp": "e", "tid": STEP_TRACK}]


def _event(event: TraceEvent, tid: int) -> dict[str, Any]:
    ts = _us(event.start)
    out: dict[str, Any] = {"name": event.name, "pid": PID, "tid": tid, "ts": ts}
    if event.duration is None:
        out.update(ph="i", s="t")
    else:
        out.update(ph="X", dur=_us(event.start + event.duration) - ts)
    out["args"] = event.args
    return out


def _us(seconds: float) -> int:
    return round(seconds * 1e6)
