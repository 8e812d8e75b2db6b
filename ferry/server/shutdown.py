"""SIGTERM drains: stop admitting, let in-flight requests finish (up to a timeout), then exit.

uvicorn's own SIGTERM handling closes the listening socket at once and then waits, without limit by
default, for the open responses. ferry keeps the socket open while it drains, so that new clients
get a 503 with Retry-After (and /health turns 503, taking the server out of a load balancer) rather
than a refused connection, and it bounds the wait. SIGINT (Ctrl-C), or a second signal, exits as
uvicorn does.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from types import FrameType

import uvicorn

logger = logging.getLogger("ferry.server")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self._drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and self._drain_task is None and not self.should_exit and self._loop is not None:
            # A signal handler runs between two bytecodes of the loop's thread: schedule, don't await.
            self._loop.call_soon_threadsafe(self._start_drain)
            return
        super().handle_exit(sig, frame)

    def _start_drain(self) -> None:
        if self._drain_task is None:
            logger.info("SIGTERM: draining in-flight requests")
            self._drain_task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain()
        finally:
            self.should_exit = True
