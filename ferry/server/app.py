"""The HTTP app: the routes and the state they share.

    request ─► OriginCheck (403) ─► ApiKeyMiddleware (401) ─► route ─► parse_body (415, 413, 408, 400)
            ─► Serving.plan in a worker thread (validate, chat template, tokenize)
            ─► admit (429 / 503) ─► Serving.chunks ─┬─► sse_events            stream=true
                                                    └─► fold ─► one JSON      stream=false

The engine starts with the app (lifespan), in the background: the server answers at once, with
/health 503 until the engine is ready, and stops the engine when it stops. Routes reach the engine
only through `AsyncEngine` (which replaces a dead engine process by itself), and reach each other's
state only through `ServerState`.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ferry import __version__
from ferry.dashboard.feed import DASHBOARD_CSP, MAX_WATCHERS, DashboardFeed, dashboard_page
from ferry.engine.async_engine import AsyncEngine
from ferry.engine.messages import EngineStats
from ferry.gc_settings import quiet_gc
from ferry.server.admission import Admission
from ferry.server.arrival import ArrivalTimeMiddleware, arrival_time
from ferry.server.auth import ApiKeyMiddleware
from ferry.server.config import ServerConfig
from ferry.server.errors import ApiError, bad_request, error_response, handle_http_exception, handle_unexpected
from ferry.server.metrics import CONTENT_TYPE, ServerMetrics
from ferry.server.openapi import openapi_json
from ferry.server.origins import add_origin_policy
from ferry.server.preprocess import M, chat_prompt, check_model, check_text_length, check_token_ids, parse_body
from ferry.server.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList,
    SamplingFields, TokenizeRequest, TokenizeResponse,
)
from ferry.server.serving_chat import ChatServing
from ferry.server.serving_completion import CompletionServing
from ferry.server.streaming import EventStreamResponse, api_error, sse_events, until_disconnected
from ferry.server.traces import TraceLog

EngineStarter = Callable[[], Awaitable[AsyncEngine]]
logger = logging.getLogger("ferry.server")
GIL_SWITCH_INTERVAL_S = 0.001


class ServerState:
    """What the routes share: the engine, admission, metrics, traces, and the two serving paths."""

    def __init__(self, config: ServerConfig, on_fatal: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.admission = Admission(config.max_pending_requests, config.max_queue_wait_s)
        self.metrics = ServerMetrics(config.served_model_name,
                                     lambda: self.engine.stats if self.engine is not None else EngineStats(),
                                     lambda: self.engine.num_restarts if self.engine is not None else 0,
                                     lambda: self.engine is not None and self.engine.info.num_speculative_tokens > 0)
        self.traces = TraceLog(Path(config.trace_dir)) if config.trace_dir is not None else None
        self.dashboard = DashboardFeed(self.metrics.registry, self._watch)
        self.engine: AsyncEngine | None = None
        self.completions: CompletionServing | None = None
        self.chat: ChatServing | None = None
        self.started = int(time.time())
        self.on_fatal = on_fatal  # the server cannot go on (no engine will start): exit non-zero

    async def start(self, start_engine: EngineStarter) -> None:
        """Start the engine while the server already answers (/health is 503 until it is ready)."""
        try:
            engine = await start_engine()
        except Exception as error:
            logger.critical("the engine did not start: %s", error)
            if self.on_fatal is not None:
                self.on_fatal(f"the engine did not start: {error}")
            return
        self.attach(engine)
        quiet_gc()  # start-up is over: what lives now lives as long as the server
        # Planning threads (a chat template, a tokenizer call that holds the GIL) hand the GIL back to
        # the event loop every millisecond rather than every five: /health and the streams stay
        # responsive while templates render (python -m ferry.bench.health_probe --load chat).
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)

    def attach(self, engine: AsyncEngine) -> None:
        self.engine = engine
        if self.traces is not None:
            engine.trace_sink = self.traces.add
            engine.step_trace_sink = self.traces.add_steps
        engine.view_sink = self.dashboard.add
        if self.dashboard.num_watchers:
            engine.watch(True)
        self.completions = CompletionServing(engine, self.config, self.metrics)
        self.chat = ChatServing(engine, self.config, self.metrics)

    def _watch(self, on: bool) -> None:
        """The dashboard's first browser came, or its last one left."""
        if self.engine is not None:
            self.engine.watch(on)

    def ready_engine(self) -> AsyncEngine:
        """The engine, or ApiError 503 while it starts, restarts or is dead."""
        engine = self.engine
        if engine is not None and engine.is_alive:
            return engine
        if engine is None:
            raise ApiError(503, "the engine is starting", code="engine_starting", headers={"Retry-After": "5"})
        if engine.is_restarting:
            raise ApiError(503, "the engine is restarting after a failure", code="engine_restarting",
                           headers={"Retry-After": "5"})
        raise ApiError(503, "the engine is not running", code="engine_dead")

    async def respond(self, request: Request, kind: Literal["completions", "chat"], body: SamplingFields) -> Response:
        """Plan the request, admit its engine requests, then stream its chunks or send their fold.
        Planning (tokenization, the chat template) runs off the event loop: a long prompt or a slow
        template must not stall every other client."""
        self.ready_engine()
        serving = self.completions if kind == "completions" else self.chat
        plan = await asyncio.to_thread(serving.plan, body, arrival_time(request))
        self.ready_engine()
        ticket = self.admission.admit(plan.num_engine_requests)
        if body.stream:
            include_usage, continuous = body.stream_options.usage if body.stream_options is not None else (False, False)
            chunks = serving.chunks(plan, include_usage, continuous)
            return EventStreamResponse(sse_events(chunks, include_usage), ticket.release)
        with ticket:
            try:
                reply = await until_disconnected(request, serving.reply(plan))
            except Exception as e:
                error = api_error(e)
                if error is None:
                    raise
                raise error from None
        if reply is None:
            return Response(status_code=499)  # the client has gone; nobody reads this
        return Response(reply.model_dump_json(), media_type="application/json")

    async def drain(self) -> None:
        """Refuse new requests (503), give those in flight up to drain_timeout_s to finish, then
        abort the rest and give their handlers a moment to send their last event."""
        timeout = self.config.drain_timeout_s
        self.admission.start_draining(timeout)
        deadline = time.monotonic() + timeout
        while self.admission.pending and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.admission.pending and self.engine is not None:
            self.engine.abort_all("the server is shutting down")
            deadline = time.monotonic() + 2.0
            while self.admission.pending and time.monotonic() < deadline:
                await asyncio.sleep(0.05)


def build_app(
    config: ServerConfig, start_engine: EngineStarter, on_fatal: Callable[[str], None] | None = None,
) -> FastAPI:
    """The app; `start_engine` runs when the server starts (lifespan), in the background, and the
    engine stops with the server. `on_fatal(reason)` runs when no engine will start."""
    state = ServerState(config, on_fatal)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        starting = asyncio.create_task(state.start(start_engine))
        flusher = asyncio.create_task(state.traces.flush_periodically()) if state.traces is not None else None
        try:
            yield
        finally:
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            if state.engine is not None:
                await state.engine.shutdown()
            if flusher is not None:
                flusher.cancel()
                state.traces.writer.flush()

    # No redirects for trailing slashes (Starlette's would echo the Host header into Location).
    app = FastAPI(title="ferry", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None, redirect_slashes=False)
    app.state.ferry = state
    for path, method, endpoint in ROUTES:
        app.add_api_route(path, endpoint, methods=[method, "HEAD"] if method == "GET" else [method])
    app.add_api_route("/openapi.json", openapi_route, methods=["GET", "HEAD"])

    async def on_api_error(request: Request, error: ApiError) -> JSONResponse:
        state.metrics.rejected(error.status)
        return error_response(error)

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, handle_http_exception)
    app.add_exception_handler(Exception, handle_unexpected)
    if config.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    add_origin_policy(app, config.allowed_origins)
    app.add_middleware(ArrivalTimeMiddleware)  # the last added is the outermost
    return app


def _state(request: Request) -> ServerState:
    return request.app.state.ferry


async def health(request: Request) -> Response:
    state = _state(request)
    try:
        state.ready_engine()
    except ApiError as error:
        return error_response(error)
    if state.admission.draining:
        return error_response(ApiError(503, "the server is shutting down", code="server_shutting_down"))
    return Response(status_code=200)


async def version() -> dict:
    return {"version": __version__}


async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)


async def traces(request: Request) -> Response:
    """The most recent requests' traces, as Chrome trace JSON (`?request_id=` narrows them)."""
    log = _state(request).traces
    if log is None:
        raise ApiError(404, "tracing is off: start the server with --trace-dir DIR", code="tracing_off")
    return Response(log.recent_json(request.query_params.get("request_id")), media_type="application/json")


async def dashboard(request: Request) -> Response:
    """The dashboard's page: static, the same for everyone (its data comes from /dashboard/events,
    behind the API key). Its Content-Security-Policy lets it load nothing from another origin."""
    return Response(dashboard_page(), media_type="text/html", headers={"Content-Security-Policy": DASHBOARD_CSP})


async def dashboard_events(request: Request) -> Response:
    feed = _state(request).dashboard
    if feed.num_watchers >= MAX_WATCHERS:
        raise ApiError(429, f"{MAX_WATCHERS} dashboards are watching this server already", code="too_many_watchers",
                       headers={"Retry-After": "5"})
    return EventStreamResponse(feed.events(), lambda: None)


async def models(request: Request) -> Response:
    return Response(ModelList(data=[_model_card(_state(request))]).model_dump_json(), media_type="application/json")


async def model(request: Request) -> Response:
    """GET /v1/models/{model}: the model object, or 404 for a name this server does not serve."""
    state = _state(request)
    check_model(request.path_params["model"], state.config)
    return Response(_model_card(state).model_dump_json(), media_type="application/json")


def _model_card(state: ServerState) -> ModelCard:
    return ModelCard(id=state.config.served_model_name, created=state.started,
                     max_model_len=state.ready_engine().info.max_model_len)


async def _body(request: Request, model: type[M]) -> M:
    config = _state(request).config
    return await parse_body(request, model, config.max_body_bytes, config.body_timeout_s)


async def completions(request: Request) -> Response:
    return await _state(request).respond(request, "completions", await _body(request, CompletionRequest))


async def chat_completions(request: Request) -> Response:
    return await _state(request).respond(request, "chat", await _body(request, ChatCompletionRequest))


async def tokenize(request: Request) -> Response:
    state = _state(request)
    body = await _body(request, TokenizeRequest)
    check_model(body.model, state.config)
    engine = state.ready_engine()
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt and messages", "prompt")
    if body.messages is not None:
        token_ids = (await asyncio.to_thread(chat_prompt, body.messages, engine, body.add_generation_prompt)).token_ids
    elif engine.tokenizer is None:
        raise bad_request("this model has no tokenizer.json", "prompt")
    else:
        check_text_length(body.prompt, engine.tokenizer, engine, "prompt")
        token_ids = await asyncio.to_thread(engine.tokenizer.encode, body.prompt, body.add_special_tokens)
    reply = TokenizeResponse(count=len(token_ids), max_model_len=engine.info.max_model_len, tokens=token_ids)
    return Response(reply.model_dump_json(), media_type="application/json")


async def detokenize(request: Request) -> Response:
    state = _state(request)
    body = await _body(request, DetokenizeRequest)
    check_model(body.model, state.config)
    engine = state.ready_engine()
    if engine.tokenizer is None:
        raise bad_request("this model has no tokenizer.json", "tokens")
    check_token_ids(body.tokens, engine, "tokens")
    text = await asyncio.to_thread(engine.tokenizer.decode, body.tokens, False)
    return Response(DetokenizeResponse(prompt=text).model_dump_json(), media_type="application/json")


async def openapi_route(request: Request) -> Response:
    return Response(openapi_json(), media_type="application/json")


ROUTES = [
    ("/health", "GET", health),
    ("/ping", "GET", health),  # vLLM's and SageMaker's name for /health
    ("/ping", "POST", health),
    ("/version", "GET", version),
    ("/metrics", "GET", metrics),
    ("/v1/traces", "GET", traces),
    ("/dashboard", "GET", dashboard),
    ("/dashboard/events", "GET", dashboard_events),
    ("/v1/models", "GET", models),
    ("/v1/models/{model:path}", "GET", model),  # a served name may hold slashes ("org/model")
    ("/v1/completions", "POST", completions),
    ("/v1/chat/completions", "POST", chat_completions),
    ("/tokenize", "POST", tokenize),
    ("/detokenize", "POST", detokenize),
]
