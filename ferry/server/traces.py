"""Request traces in the server (`ferry serve --trace-dir DIR`): the engine traces every request and
sends each finished request's trace with its step's outputs; here they are kept and written.

    engine process ─ StepOutputs.traces, .steps ─► AsyncEngine.trace_sink ─► TraceLog.add, .add_steps
        ├─► the most recent `keep` requests, in memory    GET /v1/traces[?request_id=...]
        └─► TraceWriter: rolling files in DIR, flushed every `flush_interval_s`

Open a file or the endpoint's reply in https://ui.perfetto.dev: each request is a track of its
own, showing its time in the queue, its prefill chunks, its decode runs, its preemptions and how it
finished (see metrics/tracing.py).
"""

from __future__ import annotations

import asyncio
from collections import deque
from pathlib import Path

from ferry.metrics.chrome_trace import chrome_trace_json
from ferry.metrics.trace_writer import TraceWriter
from ferry.metrics.tracing import RequestTrace, StepTrace


class TraceLog:
    def __init__(self, directory: Path, keep: int = 1000, keep_steps: int = 100_000,
                 flush_interval_s: float = 1.0) -> None:
        self.writer = TraceWriter(directory)
        self.flush_interval_s = flush_interval_s
        self._recent: deque[RequestTrace] = deque(maxlen=keep)
        self._steps: deque[StepTrace] = deque(maxlen=keep_steps)

    def add(self, traces: list[RequestTrace]) -> None:
        for trace in traces:
            self._recent.append(trace)
            self.writer.add(trace)

    def add_steps(self, steps: list[StepTrace]) -> None:
        for step in steps:
            self._steps.append(step)
            self.writer.add_step(step)

    def recent_json(self, request_id: str | None = None) -> bytes:
        """The kept traces as one Chrome trace, with the engine steps they span; with `request_id`,
        only the tracks whose engine request id contains it (an API id such as `cmpl-...` finds all
        of its prompts and choices)."""
        traces = list(self._recent) if request_id is None else [t for t in self._recent if request_id in t.request_id]
        spans = [(e.start, e.start + (e.duration or 0.0)) for t in traces for e in t.events]
        if not spans:
            return chrome_trace_json(traces)
        first, last = min(s for s, _ in spans), max(e for _, e in spans)
        return chrome_trace_json(traces, [s for s in self._steps if first <= s.start <= last])

    async def flush_periodically(self) -> None:
        """Write what has finished, every flush_interval_s, until cancelled."""
        while True:
            await asyncio.sleep(self.flush_interval_s)
            self.writer.flush()
