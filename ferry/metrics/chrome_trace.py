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
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from ferry.metrics.tracing import RequestTrace, TraceEvent

PID = 1
PROCESS_NAME = "ferry engine"


def chrome_trace(traces: Iterable[RequestTrace]) -> dict[str, Any]:
    """One trace file's JSON object with these requests' tracks."""
    events = [process_name_event()]
    for trace in traces:
        events.extend(trace_events(trace))
    return {"displayTimeUnit": "ms", "traceEvents": events}


def chrome_trace_json(traces: Iterable[RequestTrace]) -> bytes:
    return json.dumps(chrome_trace(traces), separators=(",", ":")).encode()


def process_name_event() -> dict[str, Any]:
    return {"ph": "M", "name": "process_name", "pid": PID, "tid": 0, "args": {"name": PROCESS_NAME}}


def trace_events(trace: RequestTrace) -> list[dict[str, Any]]:
    """One request's track: its name, then its events."""
    named = {"ph": "M", "name": "thread_name", "pid": PID, "tid": trace.track, "args": {"name": trace.request_id}}
    return [named] + [_event(e, trace.track) for e in trace.events]


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
