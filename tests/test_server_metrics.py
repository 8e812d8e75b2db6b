"""The server's latency histograms and request traces, end to end: a real `python -m ferry serve`
with the tiny model (see test_server.py), streaming clients that time what they receive, and
`--trace-dir` with a KV cache small enough to force preemptions."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import pytest

from test_server import API_KEY, ServerProcess, make_tiny_served_model, metric_values
from test_tracing import validate

httpx = pytest.importorskip("httpx")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

HISTOGRAMS = ("ferry:time_to_first_token_seconds", "ferry:inter_token_latency_seconds",
              "ferry:e2e_request_latency_seconds", "ferry:request_queue_time_seconds")
NUM_REQUESTS = 8
MAX_TOKENS = 96
STAGGER_S = 0.01  # between the requests of a burst: the client sends one at a time anyway


@pytest.fixture(scope="module")
def traced_server(tmp_path_factory):
    model = make_tiny_served_model(tmp_path_factory.mktemp("tiny-served-model"))
    trace_dir = tmp_path_factory.mktemp("traces")
    # 4 running at a time, so that half of the requests queue; 24 blocks of 16 tokens do not hold 4
    # requests of ~50 + 96 tokens, so that running ones are preempted.
    proc = ServerProcess(
        model, tmp_path_factory.mktemp("logs") / "server.log", "--api-key", API_KEY, "--served-model-name", "tiny",
        "--max-num-seqs", "4", "--num-kv-blocks", "24", "--trace-dir", str(trace_dir),
    )
    try:
        yield proc.wait_ready(), trace_dir
    finally:
        proc.stop()


@pytest.fixture()
def http(traced_server):
    server, _ = traced_server
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c


@dataclass
class ClientTiming:
    """What a streaming client sees of one request, in seconds of time.monotonic()."""

    sent: float
    token_chunks: list[float] = field(default_factory=list)  # when each chunk (one or more tokens) came

    @property
    def ttft(self) -> float:
        return self.token_chunks[0] - self.sent

    @property
    def e2e(self) -> float:
        return self.token_chunks[-1] - self.sent

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.token_chunks, self.token_chunks[1:])]


async def stream_completion(client, prompt: str, delay_s: float) -> ClientTiming:
    await asyncio.sleep(delay_s)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True}
    timing = ClientTiming(time.monotonic())
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            # Every chunk carries a token: its text may be empty, while a character's bytes gather.
            if line.startswith("data: {"):
                timing.token_chunks.append(time.monotonic())
    return timing


async def scrape(client) -> dict[str, float]:
    text = (await client.get("/metrics")).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def measure_burst(url: str, prompts: list[str]) -> tuple[dict[str, float], list[ClientTiming], dict[str, float]]:
    """The metrics before and after the prompts run at once, and what their clients saw. A
    burst of one-token requests first opens the connections, so that the clients' clocks do not
    count connecting, which the server cannot see."""
    async def run():
        headers = {"Authorization": f"Bearer {API_KEY}"}
        limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60, limits=limits) as client:
            one_token = {"model": "tiny", "prompt": "Hi", "max_tokens": 1}
            await asyncio.gather(*(client.post("/v1/completions", json=one_token) for _ in prompts))
            before = await scrape(client)
            timings = await asyncio.gather(
                *(stream_completion(client, p, i * STAGGER_S) for i, p in enumerate(prompts))
            )
            return before, timings, await scrape(client)

    return asyncio.run(run())


def histogram(values: dict[str, float], before: dict[str, float], name: str) -> tuple[float, float]:
    """(count, sum) of a histogram since `before`."""
    return (values[f"{name}_count"] - before.get(f"{name}_count", 0.0),
            values[f"{name}_sum"] - before.get(f"{name}_sum", 0.0))


def test_server_histograms_agree_with_the_client(traced_server, http):
    server, _ = traced_server
    prompts = [f"Request {i}: once upon a time, in a land far away," for i in range(NUM_REQUESTS)]
    before, timings, after = measure_burst(server.url, prompts)
    for name in HISTOGRAMS:
        assert f"{name}_count" in before

    for name in ("ferry:time_to_first_token_seconds", "ferry:e2e_request_latency_seconds",
                 "ferry:request_queue_time_seconds"):
        assert histogram(after, before, name)[0] == NUM_REQUESTS, name
    generated = after["ferry:generation_tokens_total"] - before["ferry:generation_tokens_total"]
    assert generated == NUM_REQUESTS * MAX_TOKENS
    assert after["ferry:prompt_tokens_total"] > before["ferry:prompt_tokens_total"]

    def agree(server_mean: float, client_mean: float, what: str) -> None:
        assert abs(server_mean - client_mean) <= 0.1 * client_mean, (what, server_mean, client_mean)

    count, total = histogram(after, before, "ferry:time_to_first_token_seconds")
    agree(total / count, sum(t.ttft for t in timings) / NUM_REQUESTS, "TTFT")
    count, total = histogram(after, before, "ferry:e2e_request_latency_seconds")
    agree(total / count, sum(t.e2e for t in timings) / NUM_REQUESTS, "E2E")
    # One gap per chunk after the first: a token each, unless the server fell behind and merged some.
    count, total = histogram(after, before, "ferry:inter_token_latency_seconds")
    client_gaps = [g for t in timings for g in t.gaps]
    assert count == len(client_gaps) <= NUM_REQUESTS * (MAX_TOKENS - 1)
    agree(total / count, sum(client_gaps) / len(client_gaps), "ITL")
    # Half of them waited for a running slot (max-num-seqs 4): the engine saw them queue.
    count, total = histogram(after, before, "ferry:request_queue_time_seconds")
    assert total > 0


def test_traces_show_every_preemption(traced_server, http):
    server, trace_dir = traced_server
    prompts = [f"Preempt {i}: the quick brown fox jumps over the lazy dog" for i in range(NUM_REQUESTS)]
    measure_burst(server.url, prompts)
    values = metric_values(http)
    preemptions = values["ferry:num_preemptions_total"]
    assert preemptions > 0, "the KV cache was meant to be too small for 4 requests"
    # Every request this server has finished (these, and any other test's before them).
    num_requests = values["ferry:e2e_request_latency_seconds_count"]

    response = http.get("/v1/traces")
    assert response.status_code == 200
    trace = response.json()
    validate(trace)
    # The endpoint keeps every request of this server so far, so it saw every preemption.
    events = trace["traceEvents"]
    assert sum(e["name"] == "preempted" for e in events) == preemptions
    finished = [e for e in events if e["name"] == "finished"]
    assert len(finished) == num_requests and all(e["args"]["reason"] == "length" for e in finished)
    assert sum(e["args"]["output_tokens"] for e in finished) == values["ferry:generation_tokens_total"]

    one = events[1]["args"]["name"]  # the first request's track, by its engine request id
    narrowed = http.get("/v1/traces", params={"request_id": one}).json()["traceEvents"]
    assert {e["args"]["name"] for e in narrowed if e["name"] == "thread_name"} == {one}
    assert httpx.get(server.url + "/v1/traces").status_code == 401

    # The files: flushed every second, each one a whole trace.
    deadline = time.monotonic() + 10
    while True:
        files = sorted(trace_dir.glob("ferry-trace-*.json"))
        on_disk = [e for f in files for e in json.loads(f.read_text())["traceEvents"]]
        if sum(e["name"] == "finished" for e in on_disk) == num_requests:
            break
        assert time.monotonic() < deadline, "the traces did not reach the disk"
        time.sleep(0.2)
    for f in files:
        validate(json.loads(f.read_text()))
    assert sum(e["name"] == "preempted" for e in on_disk) == preemptions


def test_traces_route_without_tracing():
    pytest.importorskip("fastapi")
    from starlette.testclient import TestClient

    from ferry.server.app import build_app
    from ferry.server.config import ServerConfig

    async def never():
        raise AssertionError("no engine is needed")

    response = TestClient(build_app(ServerConfig(served_model_name="tiny"), never)).get("/v1/traces")
    assert response.status_code == 404 and response.json()["error"]["code"] == "tracing_off"


def test_arrival_is_stamped_before_the_handler():
    pytest.importorskip("fastapi")
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from ferry.server.arrival import ArrivalTimeMiddleware, arrival_time

    async def handler(request):
        return JSONResponse({"arrival": arrival_time(request), "handled": time.monotonic()})

    app = Starlette(routes=[Route("/", handler)])
    app.add_middleware(ArrivalTimeMiddleware)
    before = time.monotonic()
    reply = TestClient(app).get("/").json()
    assert before <= reply["arrival"] <= reply["handled"]
