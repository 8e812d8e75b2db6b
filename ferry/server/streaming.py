"""One stream of chunks, two ways to deliver it: as server-sent events, or folded into one reply.

    chunks (serving_*.py) ─┬─► sse_events ─► EventStreamResponse      stream=true
                           └─► fold_* ─► until_disconnected ─► JSON    stream=false

Either way, a client that goes away cancels the work in progress, and cancelling it closes the
engine streams, which aborts the requests in the engine and frees their KV blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import TypeVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ferry.engine.async_engine import EngineDeadError, RequestAborted, RequestError, RequestRejected
from ferry.server.errors import ApiError, bad_request
from ferry.server.protocol import TextDelta

T = TypeVar("T")
DONE = b"data: [DONE]\n\n"


def api_error(error: Exception) -> ApiError | None:
    """The client-facing form of an engine error, or None for anything else (a bug)."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, RequestRejected):
        return bad_request(str(error))
    if isinstance(error, EngineDeadError):
        return ApiError(503, "the engine is not running", code="engine_dead")
    if isinstance(error, RequestAborted):
        return ApiError(503, f"the request was aborted: {error}", code="aborted")
    if isinstance(error, RequestError):
        return ApiError(500, f"the engine failed on this request and went on with the others: {error}",
                        code="engine_error")
    return None


async def sse_events(chunks: AsyncIterator[BaseModel | TextDelta], include_usage: bool) -> AsyncIterator[bytes]:
    """`data: {json}\\n\\n` per chunk, then `data: [DONE]`. Without include_usage the chunks carry no
    `usage` key at all; with it, `usage: null` until the final usage chunk (as OpenAI does). An
    error after the stream has begun becomes one `data: {"error": ...}` event."""
    exclude = None if include_usage else {"usage"}
    try:
        async with aclosing(chunks):
            async for chunk in chunks:
                body = chunk.json(include_usage) if isinstance(chunk, TextDelta) else \
                    chunk.model_dump_json(exclude=exclude).encode()
                yield b"data: " + body + b"\n\n"
    except Exception as e:
        error = api_error(e)
        if error is None:
            raise
        yield error.sse_event()
    yield DONE


class EventStreamResponse(StreamingResponse):
    """A text/event-stream response that always closes its event iterator (so the engine requests
    behind it end even if the stream never started) and then calls `on_close`."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._events.aclose()
            finally:
                self._on_close()


async def until_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Run `work`, unless the client disconnects first: then cancel it and return None."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # we are cancelled ourselves (shutdown): so is the work
        work_task.cancel()
        raise
    finally:
        watch_task.cancel()
    if work_task.done():
        return work_task.result()
    work_task.cancel()
    await asyncio.gather(work_task, return_exceptions=True)
    return None


async def _disconnected(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
