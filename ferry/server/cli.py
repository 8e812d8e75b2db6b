"""`ferry serve`: the OpenAI-compatible server (`python -m ferry serve` works the same)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ferry.cli import add_engine_args, engine_kwargs, model_path
from ferry.server.config import ServerConfig

DEFAULT_MODEL_NAME = "ferry-default"


def add_serve_command(subparsers) -> None:
    serve_parser = subparsers.add_parser("serve", help="start the OpenAI-compatible HTTP server")
    add_engine_args(serve_parser)
    add_server_args(serve_parser)
    serve_parser.set_defaults(func=serve)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    defaults = ServerConfig(served_model_name="")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("FERRY_API_KEY"),
                        help="require 'Authorization: Bearer KEY' (default: $FERRY_API_KEY; none: no auth)")
    parser.add_argument("--served-model-name", default=None,
                        help=f"the model's name in the API (default: --model as given, or {DEFAULT_MODEL_NAME!r})")
    parser.add_argument("--ssl-certfile", default=None)
    parser.add_argument("--ssl-keyfile", default=None)
    parser.add_argument("--max-pending-requests", type=int, default=defaults.max_pending_requests,
                        help="requests in flight before new ones get 429 (a hard cap; see --max-queue-wait)")
    parser.add_argument("--max-queue-wait", type=float, default=defaults.max_queue_wait_s,
                        help="seconds of work in flight (at the rate the server finishes requests) before new "
                             "requests get 429, with Retry-After saying when they fit")
    parser.add_argument("--body-timeout", type=float, default=defaults.body_timeout_s,
                        help="seconds a client has to send a request body before it gets 408")
    parser.add_argument("--allowed-origins", nargs="*", default=list(defaults.allowed_origins),
                        help="web origins allowed to call the API from a browser (CORS), e.g. "
                             "https://app.example.com, or '*' for any; none by default")
    parser.add_argument("--engine-restarts", type=int, default=5,
                        help="failed engine starts in a row before a server whose engine died gives up and "
                             "exits non-zero (0: never restart)")
    parser.add_argument("--max-fan-out", type=int, default=defaults.max_fan_out,
                        help="most completions (prompts times n) one request may ask for")
    parser.add_argument("--max-stop-strings", type=int, default=defaults.max_stop_strings)
    parser.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes)
    parser.add_argument("--drain-timeout", type=float, default=defaults.drain_timeout_s,
                        help="seconds in-flight requests get to finish after SIGTERM")
    parser.add_argument("--trace-dir", default=None,
                        help="trace every request: Chrome trace files (open them in ui.perfetto.dev) go to this "
                             "folder, and the most recent are served at GET /v1/traces")
    parser.add_argument("--engine-threads", type=int, default=None,
                        help="torch threads of the engine process (default on CPU: all cores but one)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    parser.add_argument("--no-access-log", action="store_true", help="do not log every HTTP request")


def serve(args: argparse.Namespace) -> int:
    """Check the options, take the port, then start the engine behind a server that already answers
    (/health is 503 until the model is loaded). Exits 1 when no engine will start."""
    import uvicorn

    from ferry.engine.async_engine import AsyncEngine, RestartPolicy
    from ferry.server.app import build_app
    from ferry.server.http_protocol import JsonErrorsH11Protocol
    from ferry.server.shutdown import DrainingServer

    model = Path(model_path(args))
    if not (model / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in model folder {model}")
    config = ServerConfig(
        served_model_name=args.served_model_name or (args.model if args.model is not None else DEFAULT_MODEL_NAME),
        api_key=args.api_key or None,
        max_pending_requests=args.max_pending_requests,
        max_queue_wait_s=args.max_queue_wait,
        max_fan_out=args.max_fan_out,
        max_stop_strings=args.max_stop_strings,
        max_body_bytes=args.max_body_bytes,
        drain_timeout_s=args.drain_timeout,
        trace_dir=args.trace_dir,
        body_timeout_s=args.body_timeout,
        allowed_origins=tuple(args.allowed_origins),
    )
    if args.engine_restarts < 0:
        raise ValueError(f"--engine-restarts must be >= 0, got {args.engine_restarts}")
    restart = RestartPolicy(max_attempts=args.engine_restarts) if args.engine_restarts > 0 else None
    kwargs = engine_kwargs(args)
    trace = config.trace_dir is not None
    failure: list[str] = []

    def give_up(reason: str) -> None:
        failure.append(reason)
        server.should_exit = True

    app = build_app(config, lambda: AsyncEngine.start(model, kwargs, threads=args.engine_threads, trace=trace,
                                                      restart=restart, on_give_up=give_up), on_fatal=give_up)
    uvicorn_config = uvicorn.Config(
        app, host=args.host, port=args.port, ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile,
        log_level=args.log_level, access_log=not args.no_access_log, http=JsonErrorsH11Protocol,
        # After the drain, responses still open (aborted streams) get this long to close.
        timeout_graceful_shutdown=5,
    )
    server = DrainingServer(uvicorn_config, app.state.ferry.drain)
    # The port first: a busy one fails now, not after the model and the KV cache have loaded.
    sock = uvicorn_config.bind_socket()
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # Ctrl-C: uvicorn raises it again once the server has shut down
        return 130
    if failure:
        print(f"ferry serve: {failure[0]}", file=sys.stderr)
        return 1
    return 0
