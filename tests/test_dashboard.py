"""The live dashboard: the engine's sampler (dashboard/watch.py), the server's feed (feed.py), the
routes and their key, and the page itself in headless Chromium against a server under load."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import threading
import time

import pytest

from ferry import LLM, SamplingParams
from ferry.bench.roofline import Hardware
from ferry.dashboard import watch as watch_module
from ferry.dashboard.feed import DASHBOARD_CSP, DashboardFeed
from ferry.dashboard.watch import CACHED, FREE, SHARED, EngineWatch, block_map, expand, watch_engine
from ferry.core.outputs import ScheduledRequest, SchedulerOutput
from ferry.engine.messages import EngineStats, EngineView, Watch, decode, encode
from ferry.server.metrics import ServerMetrics
from test_server import API_KEY, ServerProcess, make_tiny_served_model

httpx = pytest.importorskip("httpx")

CPU = Hardware(1e11, 1e10, "test")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_seqs=4, num_kv_blocks=64)


def run_steps(engine, on_step, n: int) -> None:
    engine.step_listener = on_step
    try:
        for _ in range(n):
            engine.step()
    finally:
        engine.step_listener = None


def add(engine, request_id: str, prompt: list[int], max_tokens: int) -> None:
    engine.add_request(request_id, {"prompt_token_ids": prompt}, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_a_watch_describes_sampled_steps_with_their_bound(llm):
    engine = llm.engine
    clock = Clock()
    watch = watch_engine(engine, CPU)
    watch.clock = clock
    add(engine, "a", list(range(5, 45)), 4)
    add(engine, "b", list(range(100, 120)), 4)
    seen = []

    def on_step(output, start, end):
        seen.append(output)
        watch.on_step(output, start, end)

    run_steps(engine, on_step, 3)
    first = seen[0]
    view = watch.take()
    assert view["num_steps"] == len(seen) == 3
    # Steps less than STEP_INTERVAL_S apart are counted, not described: on this machine 3 steps
    # take far less than 3 intervals, but the first is always described.
    assert 1 <= len(view["steps"]) <= 3
    start, seconds, prefills, prefill_tokens, decodes, tokens, bound = view["steps"][0]
    assert (prefills, prefill_tokens, decodes) == (2, 60, 0) and tokens == first.num_scheduled_tokens == 60
    assert seconds > 0 and bound > 0
    assert view["running"] == 2 and view["waiting"] == 0 and view["kv_blocks"] == 64
    assert watch.take() is None  # within VIEW_INTERVAL_S of the last
    assert watch.take(force=True) is not None
    clock.now += 1.0
    assert watch.take()["steps"] == []  # described steps go out once
    while engine.has_unfinished_requests():
        engine.step()


def test_only_one_step_per_interval_is_described(llm):
    watch = EngineWatch(llm.engine, lambda output: 0.001)
    decode = ScheduledRequest("c", [7], start_pos=30, new_block_ids=[], sample=True)
    output = SchedulerOutput([decode], num_scheduled_tokens=1)
    for start in (0.0, 0.01, 0.02, 0.06, 0.07, 0.2):
        watch.on_step(output, start, start + 0.001)
    steps = watch.take(force=True)["steps"]
    assert [s[0] for s in steps] == [0.0, 0.06, 0.2]
    assert steps[0][2:6] == [0, 0, 1, 1]  # no prefill chunk, one decode, one token


def test_the_block_map_shows_owners_sharing_and_the_prefix_cache():
    llm = LLM(max_num_seqs=4, num_kv_blocks=40, block_size=16)
    engine = llm.engine
    shared_prefix = list(range(100, 164))  # 4 full blocks
    add(engine, "first", shared_prefix + [7, 8], 40)
    engine.step()
    engine.step()
    add(engine, "second", shared_prefix + [9], 40)  # finds the 4 blocks in the prefix cache
    engine.step()
    engine.step()
    view = block_map(engine.scheduler)
    cells, fill = expand(view["map"]["runs"])
    assert view["map"]["blocks_per_cell"] == 1 and len(cells) == view["map"]["num_cells"] == 40
    kv = engine.scheduler.kv_cache
    first, second = kv.block_ids("first"), kv.block_ids("second")
    assert first[:4] == second[:4]
    names = [r[0] for r in view["requests"]]
    assert sorted(names) == ["first", "second"]
    for block in first[:4]:
        assert cells[block] == SHARED and fill[block] == 100
    for request, blocks in (("first", first), ("second", second)):
        for block in blocks[4:]:
            assert cells[block] == names.index(request)
    assert cells.count(FREE) == 40 - len(set(first) | set(second))
    engine.abort_request("first")
    engine.abort_request("second")
    view = block_map(engine.scheduler)
    # Freed, but their full blocks stay findable: cached, and empty.
    cells, fill = expand(view["map"]["runs"])
    assert view["requests"] == [] and cells.count(CACHED) >= 4 and all(f == 0 for f in fill)


def test_a_large_pool_is_shrunk_to_at_most_map_cells():
    llm = LLM(max_num_seqs=2, num_kv_blocks=5000)
    add(llm.engine, "x", list(range(5, 60)), 2)
    llm.engine.step()
    view = block_map(llm.engine.scheduler)
    cells, _ = expand(view["map"]["runs"])
    assert len(cells) == view["map"]["num_cells"] <= watch_module.MAP_CELLS
    assert view["map"]["blocks_per_cell"] == 2 and cells[0] == 0  # its first block, in use
    assert len(view["map"]["runs"]) < 10  # one request's blocks, then the free rest: a few runs


def test_watch_and_view_messages_cross_the_wire():
    assert decode(encode(Watch(True))[4:]) == Watch(True)
    view = {"time": 1.5, "steps": [[1.0, 0.01, 1, 20, 3, 23, 0.002]], "running": 3}
    assert decode(encode(EngineView(view))[4:]) == EngineView(view)
    with pytest.raises(ValueError):
        decode(b'["Watch", "yes"]')
    with pytest.raises(ValueError):
        decode(b'["EngineView", [1, 2]]')


def test_the_feed_watches_while_someone_reads_and_skips_what_a_slow_reader_missed():
    metrics = ServerMetrics("m", EngineStats)
    asked = []
    feed = DashboardFeed(metrics.registry, asked.append, tick_s=0.001)
    metrics.time_to_first_token.observe(0.03)
    metrics.time_to_first_token.observe(5000.0)

    async def read_two():
        events = feed.events()
        first = json.loads((await events.__anext__())[6:])
        assert asked == [True]
        for i in range(2000):  # more than the feed keeps
            feed.add({"time": float(i), "running": 1, "waiting": 0, "steps": [[float(i), 0.01, 0, 0, 1, 1, 0.001]]})
        feed.add({"time": 2000.0, "running": 2, "waiting": 5, "steps": [],
                  "map": {"blocks_per_cell": 1, "num_cells": 2, "runs": [[0, 100, 1], [-1, 0, 1]]}, "requests": [["r", 3, 1]]})
        second = json.loads((await events.__anext__())[6:])
        await events.aclose()
        return first, second

    first, second = asyncio.run(read_two())
    assert asked == [True, False]
    ttft = first["histograms"]["ttft"]
    assert sum(ttft["count"]) == 2 and ttft["le"][-1] is None and ttft["count"][-1] == 1  # 5000 s: past every bound
    assert first["steps"] == [] and "map" not in first
    assert len(second["steps"]) == 1200 and second["steps"][-1][0] == 1999.0  # the oldest dropped
    assert second["gauges"]["waiting"] == 5 and second["map"]["runs"] == [[0, 100, 1], [-1, 0, 1]] and second["requests"][0][0] == "r"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_served_model(tmp_path_factory.mktemp("tiny-served-model"))
    proc = ServerProcess(model, tmp_path_factory.mktemp("logs") / "server.log", "--api-key", API_KEY,
                         "--served-model-name", "tiny", "--max-num-seqs", "4")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def load(server, stop: threading.Event, num_clients: int = 3) -> list[threading.Thread]:
    """Clients that send completions until `stop` is set."""
    def client():
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
            while not stop.is_set():
                body = {"model": "tiny", "prompt": "a dashboard shows", "max_tokens": 48, "ignore_eos": True}
                assert c.post("/v1/completions", json=body).status_code == 200

    threads = [threading.Thread(target=client, daemon=True) for _ in range(num_clients)]
    for t in threads:
        t.start()
    return threads


def test_the_page_is_static_and_its_data_needs_the_key(server):
    page = httpx.get(server.url + "/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.headers["content-security-policy"] == DASHBOARD_CSP
    assert "http://" not in page.text and "https://" not in page.text  # nothing from elsewhere
    refused = httpx.get(server.url + "/dashboard/events")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"


def test_the_events_carry_the_engine_under_load(server):
    stop = threading.Event()
    threads = load(server, stop)
    events = []
    try:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        with httpx.stream("GET", server.url + "/dashboard/events", headers=headers, timeout=30) as response:
            assert response.status_code == 200
            deadline = time.monotonic() + 20
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                if time.monotonic() > deadline or (sum(len(e["steps"]) for e in events) >= 5
                                                   and any(e.get("requests") for e in events)
                                                   and any(e["gauges"].get("running", 0) for e in events)):
                    break
    finally:
        stop.set()
        for t in threads:
            t.join()
    steps = [s for e in events for s in e["steps"]]
    assert len(steps) >= 5, events[-1]
    assert all(s[1] > 0 and s[6] > 0 and 0 <= s[3] <= s[5] for s in steps)
    assert max(e["gauges"].get("running", 0) for e in events) >= 1
    # A map taken while requests run (one a second: the first may come at an idle moment).
    mapped = next(e for e in events if e.get("requests"))
    assert any(state >= 0 for state, _, _ in mapped["map"]["runs"])


def find_chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


def test_a_browser_sees_live_panels(server, tmp_path):
    """Bar: headless Chromium on /dashboard under load: it asks for the key, then its panels fill
    with live data; it loads nothing from another origin. The screenshot is kept in tmp_path."""
    sync_api = pytest.importorskip("playwright.sync_api")
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("no Chromium on this machine (.ci/run installs it)")
    stop = threading.Event()
    threads = load(server, stop)
    elsewhere = []
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on("request", lambda r: None if r.url.startswith(server.url) else elsewhere.append(r.url))
            page.goto(server.url + "/dashboard")
            page.wait_for_selector("#key-form.shown", timeout=15_000)
            assert page.inner_text("#status") == "API key needed" and page.get_attribute("body", "data-updates") == "0"
            page.fill("#key", API_KEY)
            page.click("button[type=submit]")
            deadline = time.monotonic() + 30
            # (Polled from here: the page's CSP forbids the string evaluation wait_for_function uses.)
            # The block map comes once a second, and names the requests running then.
            while time.monotonic() < deadline and not (
                    int(page.get_attribute("body", "data-steps") or 0) >= 10 and page.inner_text("#running") != "–"
                    and "tokens)" in page.inner_text("#kv-legend")):
                time.sleep(0.2)
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
            assert page.inner_text("#status") == "live"
            assert int(page.get_attribute("body", "data-steps")) >= 10
            assert page.inner_text("#achieved").endswith("%")
            assert "tokens)" in page.inner_text("#kv-legend")  # a request named on the block map
            assert page.inner_text("#kv-usage").endswith("%")
            browser.close()
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert elsewhere == []
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000


def test_the_cost_benchmark_runs_both_sides(tmp_path):
    from ferry.bench import dashboard_cost

    out = tmp_path / "cost.json"
    dashboard_cost.main(["--rounds", "2", "--num-prompts", "4", "--concurrency", "2", "--input-len", "8",
                         "--output-len", "8", "--json", str(out), "--", "--max-num-seqs", "4"])
    result = json.loads(out.read_text())
    unwatched, watched = result["rounds"]
    assert not unwatched["watched"] and watched["watched"] and watched["events"] >= 1
    assert result["ratio"] == pytest.approx(watched["output_tok_s"] / unwatched["output_tok_s"])


def test_watchers_past_the_limit_get_a_429(server):
    from ferry.dashboard.feed import MAX_WATCHERS

    headers = {"Authorization": f"Bearer {API_KEY}"}
    lines = []  # each stream's line iterator, kept: a dropped one closes its stream
    with contextlib.ExitStack() as stack:
        for _ in range(MAX_WATCHERS):
            response = stack.enter_context(httpx.stream("GET", server.url + "/dashboard/events", headers=headers,
                                                        timeout=30))
            assert response.status_code == 200
            lines.append(response.iter_lines())
            next(lines[-1])  # its stream has begun: it counts
        refused = httpx.get(server.url + "/dashboard/events", headers=headers, timeout=30)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "too_many_watchers"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the closed streams end at their next tick
        with httpx.stream("GET", server.url + "/dashboard/events", headers=headers, timeout=30) as response:
            if response.status_code == 200:
                break
        time.sleep(0.2)
    assert response.status_code == 200
