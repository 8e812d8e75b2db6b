"""The server's settings: who may call it, what it will accept, how it shuts down."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str
    api_key: str | None = None  # None: no authentication
    # Requests admitted and not finished (each prompt of a list counts once; n does not multiply,
    # the engine runs the n completions of a prompt together). Past it: 429. A hard cap; the bound
    # that usually applies first is max_queue_wait_s.
    max_pending_requests: int = 1024
    # The queue is bounded by the wait it means: a request is refused (429) when the requests in
    # flight, at the rate the server has been finishing them, would take longer than this to drain.
    max_queue_wait_s: float = 30.0
    # n times the number of prompts in one request: the most sequences one call can start.
    max_fan_out: int = 128
    max_stop_strings: int = 16
    max_body_bytes: int = 32 << 20  # a body over this gets 413 (32 MiB: a few batches of long prompts)
    drain_timeout_s: float = 30.0  # SIGTERM: how long in-flight requests may take to finish
    trace_dir: str | None = None  # trace every request, write the traces here, serve them at /v1/traces
    body_timeout_s: float = 30.0  # a request body that has not arrived by then gets 408
    # Browser origins allowed to call the API (CORS); none by default, "*" for any.
    allowed_origins: tuple[str, ...] = ()
    # Tool calling: the parser (ferry.tools.TOOL_PARSERS) that reads calls out of free output, and
    # whether tool_choice "auto" (the default where tools are given) uses it. Without auto, a request's
    # tool_choice "auto" is a 400 and tools without a tool_choice are only shown to the model.
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False

    def __post_init__(self) -> None:
        for name in ("max_pending_requests", "max_fan_out", "max_stop_strings", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        from ferry.tools import TOOL_PARSERS

        known = ", ".join(sorted(TOOL_PARSERS))
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser {self.tool_call_parser!r} is not known: use one of {known}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser (one of {known})")
        for name in ("max_queue_wait_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

