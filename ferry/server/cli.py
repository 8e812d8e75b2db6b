"""`ferry serve`: the OpenAI-compatible server (`python -m ferry serve` works the same)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ferry import __version__
from ferry.engine_args import add_engine_args, engine_config
from ferry.server.config import ServerConfig

DEFAULT_MODEL_NAME = "ferry-default"


def add_serve_command(subparsers) -> None:
    serve_parser = subparsers.add_parser(
        "serve", help="start the OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible HTTP API. vLLM's `vllm serve` lines work as they are.",
    )
    serve_parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                              help="model folder, as vLLM takes it (the same as --model; default: the bundled model)")
    serve_parser.add_argument("--version", action="version", version=f"ferry {__version__}")
    add_engine_args(serve_parser)
    add_server_args(serve_parser)
    serve_parser.set_defaults(func=serve, command_parser=serve_parser)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    defaults = ServerConfig(served_model_name="")
    http = parser.add_argument_group("server")
    http.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: beyond this machine)")
    http.add_argument("--port", type=int, default=8000, help="port to listen on")
    http.add_argument("--api-key", default=os.environ.get("FERRY_API_KEY"),
                      help="require 'Authorization: Bearer KEY' (default: $FERRY_API_KEY; none: no auth)")
    http.add_argument("--served-model-name", default=None,
                      help=f"the model's name in the API (default: the model as given, or {DEFAULT_MODEL_NAME!r})")
    http.add_argument("--chat-template", default=None,
                      help="a chat template to use instead of the model's: a file, or the template itself")
    http.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate")
    http.add_argument("--ssl-keyfile", default=None, help="the certificate's private key")
    http.add_argument("--allowed-origins", nargs="*", default=list(defaults.allowed_origins),
                      help="web origins allowed to call the API from a browser (CORS), e.g. "
                           "https://app.example.com, or '*' for any; none by default")
    limits = parser.add_argument_group("limits and failures")
    limits.add_argument("--max-pending-requests", type=int, default=defaults.max_pending_requests,
                        help="requests in flight before new ones get 429 (a hard cap; see --max-queue-wait)")
    limits.add_argument("--max-queue-wait", type=float, default=defaults.max_queue_wait_s,
                        help="seconds of work in flight (at the rate the server finishes requests) before new "
                             "requests get 429, with Retry-After saying when the queue will have drained")
    limits.add_argument("--body-timeout", type=float, default=defaults.body_timeout_s,
                        help="seconds a client has to send a request body before it gets 408")
    limits.add_argument("--max-fan-out", type=int, default=defaults.max_fan_out,
                        help="most completions (prompts times n) one request may ask for")
    limits.add_argument("--max-stop-strings", type=int, default=defaults.max_stop_strings,
                        help="most stop strings one request may give")
    limits.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes,
                        help="largest request body (413 past it)")
    limits.add_argument("--engine-restarts", type=int, default=5,
                        help="failed engine starts in a row before a server whose engine died gives up and "
                             "exits non-zero (0: never restart)")
    limits.add_argument("--drain-timeout", type=float, default=defaults.drain_timeout_s,
                        help="seconds in-flight requests get to finish after SIGTERM")
    logs = parser.add_argument_group("logs and traces")
    logs.add_argument("--trace-dir", default=None,
                      help="trace every request: Chrome trace files (open them in ui.perfetto.dev) go to this "
                           "folder, and the most recent are served at GET /v1/traces")
    logs.add_argument("--engine-threads", type=int, default=None,
                      help="torch threads of the engine process (default on CPU: all cores but one)")
    logs.add_argument("--log-level", "--uvicorn-log-level", default="info",
                      choices=["critical", "error", "warning", "info", "debug", "trace"],
                      help="the HTTP server's log level (--uvicorn-log-level is vLLM's name)")
    logs.add_argument("--no-access-log", action="store_true", help="do not log every HTTP request")
    logs.add_argument("--disable-log-requests", action="store_true",
                      help="accepted, no effect: ferry never logs what requests say")
    logs.add_argument("--disable-log-stats", action="store_true",
                      help="accepted, no effect: ferry logs no periodic stats (see /metrics)")
    tools = parser.add_argument_group("tool calling")
    tools.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="serve tool_choice 'auto' (the default where a request gives tools): the output is "
                            "read for tool calls with --tool-call-parser")
    tools.add_argument("--tool-call-parser", default=None,
                       help="the format the model writes tool calls in: " + ", ".join(_tool_parser_names()))


def _tool_parser_names() -> list[str]:
    from ferry.tools import TOOL_PARSERS

    return sorted(TOOL_PARSERS)


def chat_template_source(value: str | None) -> str | None:
    """--chat-template as vLLM takes it: a file's path, or the template in one line."""
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template {value}: cannot read it ({e})") from None
    if "{" not in value:
        raise ValueError(f"--chat-template {value}: no such file, and not a template either")
    return value


def serve(args: argparse.Namespace) -> int:
    """Check the options and build the engine's config (so a bad option or config.json fails here,
    before the port is taken or a process spawned), take the port, then start the engine behind a
    server that already answers (/health is 503 until the model is loaded). Exits 1 when no engine
    will start."""
    import uvicorn

    from ferry.engine.async_engine import AsyncEngine, RestartPolicy
    from ferry.server.app import build_app
    from ferry.server.http_protocol import JsonErrorsH11Protocol
    from ferry.server.shutdown import DrainingServer

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"the model is given twice: {args.model_tag} and --model {args.model}")
        args.model = args.model_tag
    if args.tokenizer is not None and not (Path(args.tokenizer) / "tokenizer.json").is_file():
        raise FileNotFoundError(f"--tokenizer {args.tokenizer}: no tokenizer.json in that folder")
    engine_cfg = engine_config(args)  # reads the model's config.json
    chat_template = chat_template_source(args.chat_template)
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
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
    )
    if args.engine_restarts < 0:
        raise ValueError(f"--engine-restarts must be >= 0, got {args.engine_restarts}")
    restart = RestartPolicy(max_attempts=args.engine_restarts) if args.engine_restarts > 0 else None
    trace = config.trace_dir is not None
    failure: list[str] = []

    def give_up(reason: str) -> None:
        failure.append(reason)
        server.should_exit = True

    app = build_app(config, lambda: AsyncEngine.start(engine_cfg, threads=args.engine_threads, trace=trace,
                                                      restart=restart, on_give_up=give_up,
                                                      chat_template=chat_template), on_fatal=give_up)
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
