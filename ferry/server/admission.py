"""Who gets in: requests in flight bounded by the wait they mean (429 past it) and none while
draining (503).

The engine would queue any number of requests, but every queued one holds a client, memory, and
time it will wait anyway; refusing early with Retry-After lets clients and load balancers go
elsewhere. The bound is a time, not a count: the server measures how fast it finishes requests
while it has work (`DrainRate`), and the expected wait of a new request is the time the requests
ahead of it take to drain at that rate. A request is admitted while that wait stays within
`max_queue_wait_s` (and the count within `max_pending`, a hard cap that also holds before any rate
is known); a refused one is told, in Retry-After, the queue's expected drain time. The rate is taken
over the last 256 completions, so that requests finishing in waves (a batch admitted together ends
together) do not swing admission between all and nothing. Each admitted request holds a `Ticket`
until its reply is complete.
"""

from __future__ import annotations

import math
import time
from collections import deque

from ferry.server.errors import ApiError


class DrainRate:
    """Engine requests finished per second of busy time (time with requests in flight), over the
    last `window` completions: idle time does not count, so a quiet server is not taken for a slow
    one."""

    def __init__(self, window: int = 256, min_samples: int = 8) -> None:
        self._busy_s = 0.0  # busy time so far
        self._since: float | None = None  # when the current busy period began (None: idle)
        self._marks: deque[tuple[float, int]] = deque(maxlen=window)  # (busy time, count) per release
        self._min_samples = min_samples

    def busy(self, now: float, pending: int) -> None:
        """Call before `pending` changes: accounts the busy time up to now."""
        if self._since is not None:
            self._busy_s += now - self._since
        self._since = now if pending > 0 else None

    def finished(self, count: int) -> None:
        self._marks.append((self._busy_s, count))

    def per_second(self) -> float | None:
        """None until enough requests have finished to tell."""
        if len(self._marks) < self._min_samples:
            return None
        elapsed = self._marks[-1][0] - self._marks[0][0]
        done = sum(count for _, count in list(self._marks)[1:])
        return done / elapsed if elapsed > 0 else None


class Admission:
    def __init__(self, max_pending: int, max_queue_wait_s: float = math.inf) -> None:
        self.max_pending = max_pending
        self.max_queue_wait_s = max_queue_wait_s
        self.pending = 0
        self.rate = DrainRate()
        self._drain_deadline: float | None = None

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None

    def start_draining(self, timeout_s: float) -> None:
        self._drain_deadline = time.monotonic() + timeout_s

    def expected_wait_s(self, extra: int = 0) -> float | None:
        """How long the requests in flight (and `extra` more) take to drain at the measured rate."""
        rate = self.rate.per_second()
        return None if rate is None else (self.pending + extra) / rate

    def admit(self, count: int) -> Ticket:
        """A ticket for `count` engine requests, or ApiError 503 (draining) / 429 (full)."""
        if self._drain_deadline is not None:
            retry = max(1, math.ceil(self._drain_deadline - time.monotonic()))
            raise ApiError(503, "the server is shutting down", code="server_shutting_down",
                           headers={"Retry-After": str(retry)})
        rate = self.rate.per_second()
        over_count = self.pending + count > self.max_pending
        over_wait = self.pending > 0 and rate is not None and (self.pending + count) / rate > self.max_queue_wait_s
        if over_count or over_wait:
            raise self._full(count, rate, over_count)
        self.rate.busy(time.monotonic(), self.pending + count)
        self.pending += count
        return Ticket(self, count)

    def _full(self, count: int, rate: float | None, over_count: bool) -> ApiError:
        # The queue's expected drain time: by Little's law also the time a request admitted now
        # would spend in the server, so a client that comes back then finds room for itself.
        retry_s = 1.0 if rate is None else max(1.0, self.pending / rate)
        wait = f"about {self.pending / rate:.0f} s of work" if rate is not None else "work"
        limit = f"its limit of {self.max_pending} requests in flight" if over_count else \
            f"its queue limit of {self.max_queue_wait_s:g} s"
        return ApiError(429, f"the server is at {limit} ({self.pending} in flight, {wait}); retry later",
                        code="queue_full", headers={"Retry-After": str(math.ceil(retry_s))})

    def release(self, count: int) -> None:
        self.rate.busy(time.monotonic(), self.pending - count)
        self.pending -= count
        self.rate.finished(count)


class Ticket:
    """Released once, by `release()` or on leaving a `with` block."""

    def __init__(self, admission: Admission, count: int) -> None:
        self._admission = admission
        self._count = count

    def release(self) -> None:
        if self._count:
            self._admission.release(self._count)
        self._count = 0

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
