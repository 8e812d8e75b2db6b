"""Who gets in: a bounded number of requests in flight (429 past it) and none while draining (503).

The engine would queue any number of requests, but every queued one holds a client, memory, and
time it will wait anyway; refusing early with Retry-After lets clients and load balancers go
elsewhere. Each admitted request holds a `Ticket` until its reply is complete.
"""

from __future__ import annotations

import math
import time

from ferry.server.errors import ApiError


class Admission:
    def __init__(self, max_pending: int) -> None:
        self.max_pending = max_pending
        self.pending = 0
        self._drain_deadline: float | None = None

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None

    def start_draining(self, timeout_s: float) -> None:
        self._drain_deadline = time.monotonic() + timeout_s

    def admit(self, count: int) -> Ticket:
        """A ticket for `count` engine requests, or ApiError 503 (draining) / 429 (full)."""
        if self._drain_deadline is not None:
            retry = max(1, math.ceil(self._drain_deadline - time.monotonic()))
            raise ApiError(503, "the server is shutting down", code="server_shutting_down",
                           headers={"Retry-After": str(retry)})
        if self.pending + count > self.max_pending:
            raise ApiError(
                429, f"the server is at its limit of {self.max_pending} requests in flight; retry later",
                code="queue_full", headers={"Retry-After": "1"},
            )
        self.pending += count
        return Ticket(self, count)


class Ticket:
    """Released once, by `release()` or on leaving a `with` block."""

    def __init__(self, admission: Admission, count: int) -> None:
        self._admission = admission
        self._count = count

    def release(self) -> None:
        self._admission.pending -= self._count
        self._count = 0

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
