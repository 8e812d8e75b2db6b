"""One streamed request to an OpenAI-compatible server, timed as its user feels it.

    sent ─────────► token chunk ──► token chunk ──► ... ──► token chunk ──► usage ──► [DONE]
    |──── ttft ─────|── itl[0] ───|── itl[1] ─── ... ─────|
    |─────────────────────── latency (end to end) ───────|

These are vLLM's definitions: a time is taken when a whole server-sent event has arrived; TTFT ends
at the first chunk that carries a token, every later token chunk adds one inter-token gap (a
server that sends several tokens in one chunk shows one gap for them), and the end-to-end latency
ends at the last token chunk. Two kinds of chunk carry no token and are not timed: the usage chunk
(no choices), and a chat stream's opening `{"role": "assistant", "content": ""}` delta, which
ferry and OpenAI send before the first token is sampled, so timing it would make TTFT the time to
the response headers. A trailing chunk with no text that only sets finish_reason is not a token
either. Each request sends `ignore_eos` and `max_tokens` so that its output length is fixed, and
asks for usage (`stream_options.include_usage`) to read the number of tokens generated.

A request fails, without raising, on an HTTP error status, an error event inside the stream, a
connection that breaks, a stream that ends without `[DONE]` or without any token, or when it takes
longer than the timeout in all.
"""

from __future__ import annotations

import asyncio
import enum
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from ferry.bench.sse import SseParser

Message = dict[str, str]
RequestPrompt = str | tuple[int, ...] | tuple[Message, ...]  # text or ids (completions), messages (chat)


class Api(enum.Enum):
    COMPLETIONS = "completions"
    CHAT = "chat"

    @classmethod
    def of_endpoint(cls, endpoint: str) -> Api:
        if endpoint.rstrip("/").endswith("chat/completions"):
            return cls.CHAT
        if endpoint.rstrip("/").endswith("completions"):
            return cls.COMPLETIONS
        raise ValueError(f"endpoint {endpoint!r} is neither .../completions nor .../chat/completions")


@dataclass(frozen=True)
class RequestInput:
    prompt: RequestPrompt
    prompt_len: int  # the client's count; the server's usage.prompt_tokens replaces it when given
    output_len: int  # sent as max_tokens


@dataclass(frozen=True)
class Target:
    """Where requests go and what each one asks for besides its prompt."""

    base_url: str
    endpoint: str
    model: str
    api_key: str | None = None
    timeout_s: float = 600.0  # for the whole request, first byte to [DONE]
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)  # merged into every request's JSON

    @property
    def api(self) -> Api:
        return Api.of_endpoint(self.endpoint)

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + "/" + self.endpoint.lstrip("/")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def payload(self, request: RequestInput) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "stream": True, "stream_options": {"include_usage": True}}
        if self.api is Api.CHAT:
            body |= {"messages": list(request.prompt), "max_completion_tokens": request.output_len}
        else:
            prompt = request.prompt
            body |= {"prompt": list(prompt) if isinstance(prompt, tuple) else prompt, "max_tokens": request.output_len}
        if self.ignore_eos:
            body["ignore_eos"] = True  # a vLLM extension; servers that do not know it ignore it
        return body | self.extra_body


@dataclass(frozen=True)
class RequestOutcome:
    error: str | None  # None: it succeeded
    start_time: float  # when it was sent, in seconds after the run began
    ttft: float | None  # seconds; None when no token came
    itl: tuple[float, ...]  # seconds between consecutive token chunks
    latency: float | None  # seconds from sent to the last token chunk
    prompt_len: int
    output_tokens: int | None  # usage.completion_tokens; None when the server reported no usage
    num_token_chunks: int
    generated_text: str
    queue_time: float = 0.0  # seconds it waited for a --max-concurrency slot before it was sent

    @property
    def success(self) -> bool:
        return self.error is None


class StreamError(Exception):
    """The server said, or showed, that the request failed."""


@dataclass
class _Stream:
    """What has arrived of one response so far."""

    api: Api
    sent: float
    first: float | None = None
    last: float | None = None
    itl: list[float] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    done: bool = False

    def on_event(self, data: str, now: float) -> None:
        if data.strip() == "[DONE]":
            self.done = True
            return
        chunk = json.loads(data)
        if not isinstance(chunk, dict):
            raise StreamError(f"unexpected event {data[:200]!r}")
        if "error" in chunk:
            raise StreamError(f"error event: {json.dumps(chunk['error'])[:300]}")
        if usage := chunk.get("usage"):
            self.prompt_tokens = usage.get("prompt_tokens", self.prompt_tokens)
            self.completion_tokens = usage.get("completion_tokens", self.completion_tokens)
        text = token_text(self.api, chunk)
        if text is None:
            return
        if self.first is None:
            self.first = now
        else:
            self.itl.append(now - self.last)
        self.last = now
        self.text.append(text)

    def problem(self) -> str | None:
        if self.first is None:
            return "the stream carried no token"
        if not self.done:
            return "the stream ended without [DONE]"
        return None

    def outcome(self, request: RequestInput, origin: float, error: str | None) -> RequestOutcome:
        return RequestOutcome(
            error=error,
            start_time=self.sent - origin,
            ttft=None if self.first is None else self.first - self.sent,
            itl=tuple(self.itl),
            latency=None if self.last is None else self.last - self.sent,
            prompt_len=request.prompt_len if self.prompt_tokens is None else self.prompt_tokens,
            output_tokens=self.completion_tokens,
            num_token_chunks=len(self.text),
            generated_text="".join(self.text),
        )


def token_text(api: Api, chunk: dict[str, Any]) -> str | None:
    """The text of a chunk that carries a token (maybe ""), or None for one that carries none."""
    choices = chunk.get("choices")
    if not choices:
        return None  # the usage chunk
    choice = choices[0]
    if api is Api.COMPLETIONS:
        text = choice.get("text")
    else:
        delta = choice.get("delta") or {}
        text = delta.get("content")
        if "role" in delta and not text:
            return None  # the chat stream's opening delta
    if not text and choice.get("finish_reason") is not None:
        return None  # a bare end marker after the last token
    return text or ""


async def send_request(
    session: aiohttp.ClientSession, target: Target, request: RequestInput, origin: float,
) -> RequestOutcome:
    """Send one streaming request and time it; never raises for a failed request."""
    stream = _Stream(target.api, sent=time.perf_counter())
    try:
        async with asyncio.timeout(target.timeout_s):
            body = target.payload(request)
            async with session.post(target.url, json=body, headers=target.headers) as response:
                if response.status != 200:
                    reply = await response.read()
                    raise StreamError(f"HTTP {response.status}: {reply[:300].decode(errors='replace')}")
                parser = SseParser()
                async for piece in response.content.iter_any():
                    for data in parser.feed(piece):
                        stream.on_event(data, time.perf_counter())
                for data in parser.finish():
                    stream.on_event(data, time.perf_counter())
        error = stream.problem()
    except TimeoutError:
        error = f"timed out after {target.timeout_s:g} s"
    except StreamError as e:
        error = str(e)
    except Exception as e:  # a broken connection, bad JSON: the run goes on, the request counts as failed
        error = f"{type(e).__name__}: {e}"
    return stream.outcome(request, origin, error)
