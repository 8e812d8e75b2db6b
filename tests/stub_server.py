"""A tiny OpenAI-compatible streaming server with known, injected delays, to test the load generator.

    python tests/stub_server.py --port PORT

Every request must stream. A chat stream opens with a role chunk at once (as OpenAI and ferry do);
then, for both endpoints, token k (k = 0 .. n-1) goes out at arrival + ttft + k * itl: fixed
deadlines, so that the overshoot of one sleep does not add up over the stream. n is the request's
max_tokens (max_completion_tokens for chat), else the configured output_len. A usage chunk follows
when stream_options.include_usage asks for it (and usage is on), then [DONE]. prompt_tokens is the
length of a token-id prompt, or the number of whitespace-separated words of a text one.

Each connection has its own thread, which sleeps until each deadline and writes the chunk itself:
an asyncio server's timers wake up to a millisecond late (epoll counts whole milliseconds) and
its streams wait for one another, which would put more jitter into the gaps than a 5% test allows.

POST /stub/config with any of ttft_ms, itl_ms, output_len, fail_every, disconnect_every,
truncate_every, usage sets them and clears the log. Counting arrivals from 1: request k gets
HTTP 500 when fail_every divides k; otherwise, when disconnect_every divides k, its connection
breaks after two tokens; otherwise, when truncate_every divides k, its body ends properly after
two tokens, but without [DONE].
GET /stub/log: per request, its arrival time and the times it wrote each token (time.perf_counter),
endpoint, the requests in flight on arrival (itself included), what it asked for and what usage it
was given; and max_in_flight.
A request is in flight from its arrival until its last event is written.
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

DEFAULTS = {
    "ttft_ms": 200.0, "itl_ms": 20.0, "output_len": 16, "fail_every": 0, "disconnect_every": 0, "truncate_every": 0,
    "usage": True,
}


class Stub:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.config = dict(DEFAULTS)
        self.log: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0

    def arrive(self, entry: dict) -> tuple[int, dict]:
        with self.lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.log.append(entry | {"in_flight": self.in_flight})
            return len(self.log), self.config

    def leave(self) -> None:
        with self.lock:
            self.in_flight -= 1

    def reset(self, config: dict) -> None:
        with self.lock:
            self.config = DEFAULTS | config
            self.log, self.max_in_flight = [], 0


STUB = Stub()


def prompt_tokens(body: dict) -> int:
    if "messages" in body:
        return sum(len(str(m.get("content", "")).split()) for m in body["messages"])
    prompt = body.get("prompt", "")
    return len(prompt) if isinstance(prompt, list) else len(str(prompt).split())


def event(payload: dict | str) -> bytes:
    return b"data: " + (payload if isinstance(payload, str) else json.dumps(payload)).encode() + b"\n\n"


def role_chunk() -> dict:
    choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
    return {"object": "chat.completion.chunk", "choices": [choice]}


def token_chunk(chat: bool, k: int, last: bool) -> dict:
    finish = "length" if last else None
    if chat:
        return {"object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {"content": f" t{k}"}, "finish_reason": finish}]}
    return {"object": "text_completion", "choices": [{"index": 0, "text": f" t{k}", "finish_reason": finish}]}


def sleep_until(deadline: float) -> None:
    time.sleep(max(0.0, deadline - time.perf_counter()))


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, chunked streams
    disable_nagle_algorithm = True  # else small chunks wait for the client's (delayed) ACK and bunch up

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self.reply(200, {"object": "list", "data": [{"id": "stub-model", "object": "model", "owned_by": "stub"}]})
        elif self.path == "/stub/log":
            with STUB.lock:
                self.reply(200, {"requests": list(STUB.log), "max_in_flight": STUB.max_in_flight})
        else:
            self.reply(404, {"error": {"message": "not found"}})

    def do_POST(self) -> None:
        arrival = time.perf_counter()
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path == "/stub/config":
            STUB.reset(body)
            self.reply(200, STUB.config)
        elif self.path in ("/v1/completions", "/v1/chat/completions"):
            self.complete(body, arrival, chat=self.path == "/v1/chat/completions")
        else:
            self.reply(404, {"error": {"message": "not found"}})

    def reply(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def complete(self, body: dict, arrival: float, chat: bool) -> None:
        entry = {
            "arrival": arrival, "endpoint": self.path, "max_tokens": body.get("max_tokens"),
            "max_completion_tokens": body.get("max_completion_tokens"), "ignore_eos": body.get("ignore_eos"),
            "model": body.get("model"), "prompt_tokens": prompt_tokens(body), "messages": body.get("messages"),
            "prompt_is_ids": isinstance(body.get("prompt"), list),
        }
        number, config = STUB.arrive(entry)
        left = False

        def leave() -> None:
            nonlocal left
            if not left:
                left = True
                STUB.leave()

        try:
            if config["fail_every"] and number % config["fail_every"] == 0:
                self.reply(500, {"error": {"message": "injected failure", "type": "server_error"}})
                return
            self.stream(body, arrival, chat, number, config, entry["prompt_tokens"], leave)
        finally:
            leave()

    def stream(self, body: dict, arrival: float, chat: bool, number: int, config: dict, prompt_len: int,
               leave) -> None:
        n = body.get("max_completion_tokens") or body.get("max_tokens") or config["output_len"]
        breaks = config["disconnect_every"] and number % config["disconnect_every"] == 0
        truncated = config["truncate_every"] and number % config["truncate_every"] == 0
        sent = STUB.log[number - 1].setdefault("token_times", [])
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if chat:
            self.chunk(event(role_chunk()))
        for k in range(n):
            sleep_until(arrival + (config["ttft_ms"] + k * config["itl_ms"]) / 1000)
            if breaks and k == 2:
                self.connection.shutdown(socket.SHUT_RDWR)  # mid-stream, without the closing chunk
                self.close_connection = True
                return
            if truncated and k == 2:
                self.chunk(b"", last=True)
                return
            self.chunk(event(token_chunk(chat, k, last=k == n - 1)))
            sent.append(time.perf_counter())
        if config["usage"] and (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n}
            self.chunk(event({"object": "chunk", "choices": [], "usage": usage}))
        leave()  # before the last event: a client that reacts to [DONE] finds the slot free
        self.chunk(event("[DONE]"), last=True)

    def chunk(self, data: bytes, last: bool = False) -> None:
        piece = b"%x\r\n%s\r\n" % (len(data), data) if data else b""
        self.wfile.write(piece + (b"0\r\n\r\n" if last else b""))
        self.wfile.flush()


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # the listen backlog: a burst of new connections must not be dropped


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    Server(("127.0.0.1", parser.parse_args().port), Handler).serve_forever()
