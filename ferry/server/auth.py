"""API keys: with `--api-key`, every route but /health (and /ping), /version and the dashboard's
static page needs `Authorization: Bearer <key>`.

It is ASGI middleware rather than a per-route dependency so that no route, present or future, can
forget it: the check runs before routing, and even an unknown path answers 401 without the key.
Keys are compared as SHA-256 digests with `hmac.compare_digest`, so the time taken says nothing
about how much of a guess was right, not even its length.
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from ferry.server.errors import ApiError, error_response

# /dashboard is its page alone, the same for everyone: it asks for the key and sends it with its
# requests for data (/dashboard/events), which need it as every other route does.
PUBLIC_PATHS = frozenset({"/health", "/ping", "/version", "/dashboard"})


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        if not api_key:
            raise ValueError("the API key must not be empty")
        self.app = app
        self._digest = _digest(api_key.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS and not self._authorized(scope):
            error = ApiError(401, "a valid API key is required: send it as 'Authorization: Bearer <key>'",
                             code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            await error_response(error)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        return hmac.compare_digest(_digest(token.strip()), self._digest)


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()
