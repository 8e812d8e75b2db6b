"""The server's side of the dashboard: the engine's sampled views, kept and fanned out to browsers.

    AsyncEngine.view_sink ─► DashboardFeed.add(view) ─► recent steps, queue, counters, block map
    GET /dashboard/events ─► DashboardFeed.events() ─► an SSE event every TICK_S with what is new

The engine samples only while someone watches: the first browser's stream asks it to
(`AsyncEngine.watch(True)`), the last one's end tells it to stop. Each browser gets the steps it
has not seen yet, the latest queue and counters, the block map when a new one came, and every
HISTOGRAM_EVERY ticks the server's TTFT, ITL and end-to-end histograms (server/metrics.py).
A browser that falls behind skips steps rather than queueing them: its cursor jumps to the
oldest step still kept.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections import deque
from importlib import resources
from collections.abc import AsyncIterator, Callable
from typing import Any

from prometheus_client import CollectorRegistry

TICK_S = 0.25
HISTOGRAM_EVERY = 4  # ticks
MAX_WATCHERS = 32  # browsers streaming at once; more get a 429 (each costs the server a little work a tick)
KEPT_STEPS = 1200  # a minute of described steps at 20 a second
KEPT_VIEWS = 600  # queue samples: a minute at 10 a second
HISTOGRAMS = {
    "ttft": "ferry:time_to_first_token_seconds",
    "itl": "ferry:inter_token_latency_seconds",
    "e2e": "ferry:e2e_request_latency_seconds",
}


# Scripts and styles inline, data from this server only, and nothing from anywhere else.
DASHBOARD_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                 "connect-src 'self'; img-src data:")


@functools.cache
def dashboard_page() -> bytes:
    """static/index.html: the whole dashboard, one file, no build step."""
    return resources.files("ferry.dashboard").joinpath("static/index.html").read_bytes()


class DashboardFeed:
    def __init__(self, registry: CollectorRegistry, watch: Callable[[bool], None], tick_s: float = TICK_S) -> None:
        self.registry = registry
        self._watch = watch  # asks the engine to sample itself, or to stop
        self.tick_s = tick_s
        self._steps: deque[tuple[int, list]] = deque(maxlen=KEPT_STEPS)  # (sequence number, step)
        self._queue: deque[list[float]] = deque(maxlen=KEPT_VIEWS)  # [time, running, waiting]
        self._next_step = 0
        self._latest: dict[str, Any] = {}  # the last view's gauges and counters
        self._map: dict[str, Any] | None = None
        self._map_version = 0
        self.num_watchers = 0

    def add(self, view: dict[str, Any]) -> None:
        """A view from the engine (dashboard/watch.py)."""
        for step in view.get("steps", ()):
            self._steps.append((self._next_step, step))
            self._next_step += 1
        self._queue.append([view["time"], view["running"], view["waiting"]])
        self._latest = {k: v for k, v in view.items() if k not in ("steps", "map", "requests")}
        if "map" in view:
            self._map = {"map": view["map"], "requests": view["requests"]}
            self._map_version += 1

    async def events(self) -> AsyncIterator[bytes]:
        """One browser's stream: SSE `data:` events, the first at once."""
        self._subscribe(+1)
        step_cursor, map_version, tick = 0, 0, 0
        try:
            while True:
                event: dict[str, Any] = {"gauges": self._latest}
                oldest = self._steps[0][0] if self._steps else self._next_step
                step_cursor = max(step_cursor, oldest)
                event["steps"] = [s for n, s in self._steps if n >= step_cursor]
                step_cursor = self._next_step
                if tick == 0:
                    event["queue"] = list(self._queue)  # the history, once
                elif self._queue:
                    event["queue"] = [self._queue[-1]]
                if self._map is not None and map_version != self._map_version:
                    map_version = self._map_version
                    event.update(self._map)
                if tick % HISTOGRAM_EVERY == 0:
                    event["histograms"] = self.histograms()
                tick += 1
                yield f"data: {json.dumps(event, separators=(',', ':'))}\n\n".encode()
                await asyncio.sleep(self.tick_s)
        finally:
            self._subscribe(-1)

    def _subscribe(self, delta: int) -> None:
        before = self.num_watchers
        self.num_watchers += delta
        if (before == 0) != (self.num_watchers == 0):
            self._watch(self.num_watchers > 0)

    def histograms(self) -> dict[str, dict[str, list[float | None]]]:
        """Each latency histogram as bucket upper bounds (None: the last, unbounded) and the count in
        each bucket (not cumulative)."""
        wanted = {name: key for key, name in HISTOGRAMS.items()}
        out: dict[str, dict[str, list[float | None]]] = {}
        for family in self.registry.collect():
            key = wanted.get(family.name)
            if key is None:
                continue
            bounds, cumulative = [], []
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    le = float(sample.labels["le"])
                    bounds.append(le if le != float("inf") else None)  # (JSON has no infinity)
                    cumulative.append(sample.value)
            counts = [c - p for c, p in zip(cumulative, [0.0, *cumulative[:-1]])]
            out[key] = {"le": bounds, "count": counts}
        return out
