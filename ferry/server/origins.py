"""Which web pages may call the API: none by default.

A browser sends a page's cross-site "simple" requests (a text/plain or form POST) without asking
first, so a page anywhere could make a visitor's browser use a server on their machine. Two lines
stop that: POST bodies must be declared JSON (parse_body answers 415 otherwise), which a page cannot
do without a CORS preflight; and a request whose Origin is another site's is refused with 403
before it reaches a route, unless `--allowed-origins` names that origin ("*": any), in which case
Starlette's CORS middleware answers the preflights and adds the headers. A request from the
server's own origin, and a request without an Origin (curl, SDKs), are never refused here.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from ferry.server.errors import ApiError, error_response


def add_origin_policy(app: FastAPI, allowed_origins: tuple[str, ...]) -> None:
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["Retry-After"])
    app.add_middleware(OriginCheckMiddleware, allowed_origins=allowed_origins)


class OriginCheckMiddleware:
    def __init__(self, app: ASGIApp, allowed_origins: tuple[str, ...]) -> None:
        self.app = app
        self._any = "*" in allowed_origins
        self._allowed = frozenset(o.rstrip("/").lower() for o in allowed_origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self._any:
            headers = dict(scope["headers"])
            origin = headers.get(b"origin")
            if origin is not None and not self._allows(origin.decode("latin-1"), headers.get(b"host", b"")):
                error = ApiError(403, "requests from this web origin are not allowed (see --allowed-origins)",
                                 code="origin_not_allowed")
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _allows(self, origin: str, host: bytes) -> bool:
        origin = origin.rstrip("/").lower()
        if origin in self._allowed:
            return True
        return urlsplit(origin).netloc == host.decode("latin-1").lower()  # the server's own pages
