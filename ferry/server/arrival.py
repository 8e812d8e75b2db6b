"""When a request reached the server: the moment its latencies (TTFT, E2E) count from.

ASGI middleware, outermost, so that the time the server spends on a request before its handler
runs (authentication, reading and validating the body, waiting for the event loop behind other
requests) counts too: a client feels all of it. Handlers read it with `arrival_time(request)`.
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send


class ArrivalTimeMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {})["arrival_time"] = time.monotonic()
        await self.app(scope, receive, send)


def arrival_time(request: Request) -> float:
    """time.monotonic() when the request arrived (now, if it came in past the middleware)."""
    stamped = getattr(request.state, "arrival_time", None)
    return stamped if stamped is not None else time.monotonic()
