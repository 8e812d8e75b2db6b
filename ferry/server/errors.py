"""Errors as OpenAI sends them: an HTTP status and `{"error": {"message", "type", "param", "code"}}`.

Every failure a client can cause is an `ApiError` raised where it is found and turned into its
response by one handler, so no handler builds error bodies itself and nothing a client sends can
surface as a 500.
"""

from __future__ import annotations

import json
import logging

from fastapi import Request
from fastapi.responses import JSONResponse

logger = logging.getLogger("ferry.server")

# OpenAI's `type` for each status it uses.
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        error_type = _TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": error_type, "param": self.param, "code": self.code}}

    def sse_event(self) -> bytes:
        """The error as a server-sent event, for a stream that has already begun."""
        return f"data: {json.dumps(self.body())}\n\n".encode()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def handle_unexpected(request: Request, error: Exception) -> JSONResponse:
    # A bug: log it with its traceback, tell the client no more than that it was ours.
    logger.exception("internal error: unhandled exception on %s %s", request.method, request.url.path)
    return error_response(ApiError(500, "internal server error", code="internal_error"))


async def handle_http_exception(request: Request, error) -> JSONResponse:
    """Starlette's own errors (404 no such route, 405 wrong method) in OpenAI's shape."""
    headers = getattr(error, "headers", None)
    return error_response(ApiError(error.status_code, str(error.detail), headers=headers))
