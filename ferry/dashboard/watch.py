"""What the dashboard shows of the engine, sampled in the engine's process.

While a browser watches (the server sends `Watch(True)`), the engine loop keeps an `EngineWatch`:

    each completed step ─► on_step: at most one step per STEP_INTERVAL_S is described
                                    (its prefill chunks, decodes, tokens, time, roofline bound)
    between steps       ─► take:    every VIEW_INTERVAL_S, the described steps, the queue, the KV
                                    pool's counts, and every MAP_INTERVAL_S a map of its blocks

Nothing is done for the steps between samples but a clock read, so the cost is bounded by the
rates, not by the step rate: a described step is one pass over its scheduled requests (the
roofline bound needs each one's context), and a block map is one pass over the pool, done in numpy
and shrunk to at most MAP_CELLS cells (a cell shows the state of its first block and how full it
is, in percent). Measured on a CPU: a described step of 8 requests about 8 us, a map of 10,922
blocks 0.35 ms, so well under a millisecond a second. Without a watcher the engine holds no
EngineWatch, and a step costs one `is None` test.

A map travels as runs of equal cells ([state, fill, count]), a few hundred numbers for a pool of
any size in the usual case. Block states in a map: FREE, CACHED (free, but its K/V still findable in the prefix cache), SHARED
(held by more than one request), or the index of its one owner among the running requests, in the
order the view's `requests` lists them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ferry.metrics.tracing import step_trace

if TYPE_CHECKING:
    from ferry.bench.roofline import Hardware
    from ferry.core.outputs import SchedulerOutput

STEP_INTERVAL_S = 0.05  # at most 20 steps a second described
VIEW_INTERVAL_S = 0.1  # a view at most 10 times a second
MAP_INTERVAL_S = 1.0  # the KV block map once a second
MAP_CELLS = 4096
MAX_REQUESTS = 64  # requests named in a view (the longest running first); the rest own "other"
FREE, CACHED, SHARED, OTHER = -1, -2, -3, -4


def watch_engine(engine, hardware: Hardware | None = None) -> EngineWatch:
    """An EngineWatch of `engine`, its steps' bounds on `hardware` (measured when not given: about
    a second on a GPU, a few on a CPU, once per process)."""
    from ferry.bench.roofline import schedule_bound

    return EngineWatch(engine, schedule_bound(engine.config, hardware))


class EngineWatch:
    def __init__(self, engine, bound: Callable[[SchedulerOutput], float], clock=time.monotonic) -> None:
        self.engine = engine
        self.bound = bound  # seconds: a scheduled step's roofline bound (bench/roofline.py)
        self.clock = clock
        self._steps: list[list[float]] = []
        self._last_step = self._last_view = self._last_map = float("-inf")
        self._num_steps = 0  # steps completed since watching began, described or not

    def on_step(self, output: SchedulerOutput, start: float, end: float) -> None:
        """A step completed: it ran from `start` to `end` (time.monotonic())."""
        self._num_steps += 1
        if start - self._last_step < STEP_INTERVAL_S:
            return
        self._last_step = start
        s = step_trace(output, start, end, self.bound)
        self._steps.append([round(s.start, 4), round(s.duration, 6), s.prefill_chunks, s.prefill_tokens, s.decodes,
                            s.tokens, round(s.bound, 6)])

    def take(self, force: bool = False) -> dict[str, Any] | None:
        """The view since the last one, or None when the last was under VIEW_INTERVAL_S ago (unless
        `force`: the engine is going idle, and its last state should be seen)."""
        now = self.clock()
        if now - self._last_view < VIEW_INTERVAL_S and not force:
            return None
        self._last_view = now
        scheduler = self.engine.scheduler
        kv = scheduler.kv_cache
        prefix = kv.prefix_cache
        view: dict[str, Any] = {
            "time": round(now, 4),
            "steps": self._steps,
            "num_steps": self._num_steps,
            "running": scheduler.num_running,
            "waiting": scheduler.num_waiting,
            "budget": scheduler.config.max_num_batched_tokens,
            "max_num_seqs": scheduler.config.max_num_seqs,
            "kv_blocks": kv.num_blocks,
            "kv_free_blocks": kv.pool.num_free_blocks,
            "block_size": kv.block_size,
            "preemptions": scheduler.num_preemptions,
            "prefix_queries": prefix.queries if prefix is not None else 0,
            "prefix_hits": prefix.hits if prefix is not None else 0,
        }
        self._steps = []
        if now - self._last_map >= MAP_INTERVAL_S:
            self._last_map = now
            view.update(block_map(scheduler))
        return view


def block_map(scheduler) -> dict[str, Any]:
    """The KV pool's blocks as at most MAP_CELLS cells, and the running requests the cells name."""
    kv = scheduler.kv_cache
    pool = kv.pool
    n = pool.num_blocks
    state = np.full(n, FREE, dtype=np.int32)
    if kv.prefix_cache is not None:
        cached = kv.prefix_cache.cached_blocks()
        if cached:
            state[np.fromiter(cached, dtype=np.int64, count=len(cached))] = CACHED
    running = sorted(scheduler.running, key=lambda r: -r.num_computed_tokens)
    requests = []
    for request in running:
        blocks = kv.held_block_ids(request.request_id)
        if not blocks:
            continue
        ids = np.asarray(blocks, dtype=np.int64)
        owner = len(requests) if len(requests) < MAX_REQUESTS else OTHER
        if owner != OTHER:
            requests.append([request.request_id, request.num_computed_tokens, len(blocks)])
        taken = state[ids] >= 0  # already owned by a request listed before: shared
        state[ids[taken]] = SHARED
        state[ids[~taken]] = owner
    refs = np.asarray(pool.ref_counts, dtype=np.int32)
    state[refs > 1] = SHARED
    in_use = refs > 0
    per_cell = -(-n // MAP_CELLS)
    starts = np.arange(0, n, per_cell)
    cells = state[starts]
    fill = np.round(np.add.reduceat(in_use, starts) / np.diff(np.append(starts, n)) * 100).astype(np.int64)
    # Runs of equal cells, [state, fill, count]: a pool is mostly long runs (free, or one request's).
    bounds = np.concatenate(([0], np.flatnonzero((cells[1:] != cells[:-1]) | (fill[1:] != fill[:-1])) + 1,
                             [len(cells)]))
    runs = np.stack([cells[bounds[:-1]], fill[bounds[:-1]], np.diff(bounds)], axis=1)
    return {"map": {"blocks_per_cell": per_cell, "num_cells": len(cells), "runs": runs.tolist()},
            "requests": requests}


def expand(runs: list[list[int]]) -> tuple[list[int], list[int]]:
    """A map's runs as one state and one fill (percent) per cell."""
    cells = [state for state, _, count in runs for _ in range(count)]
    fill = [f for _, f, count in runs for _ in range(count)]
    return cells, fill
