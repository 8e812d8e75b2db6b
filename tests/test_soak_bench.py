"""`ferry bench soak`: its pure parts (outcome accounting, RSS trend, Retry-After ratios), the
classification of every outcome against a scripted aiohttp server, and a short soak of a real
`ferry serve` on the tiny model."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

import pytest

aiohttp = pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

from aiohttp import web  # noqa: E402

from ferry.bench import soak  # noqa: E402
from ferry.bench.cli import add_bench_command  # noqa: E402
from ferry.bench.openai_stream import RequestInput, Target  # noqa: E402
from ferry.bench.soak import (  # noqa: E402
    OK, REJECTED_429, Ledger, LoadSettings, Planned, Record, RssSample,
)


def record(outcome: str, sent_at: float = 0.0, latency: float = 1.0, retry_after: str | None = None) -> Record:
    return Record(outcome, sent_at, latency, streamed=False, retry_after=retry_after)


# ---- accounting ----


def test_every_request_has_exactly_one_outcome_or_the_ledger_says_so():
    ledger = Ledger()
    ids = [ledger.open() for _ in range(3)]
    assert ledger.in_flight == 3
    ledger.close(ids[0], record(OK))
    ledger.close(ids[2], record(REJECTED_429, retry_after="2"))
    accounting = ledger.accounting()
    assert (accounting.sent, accounting.outcomes, accounting.without_outcome) == (3, 2, 1)
    assert not accounting.exactly_one and ledger.in_flight == 1

    ledger.close(ids[1], record("cancelled"))
    assert ledger.accounting().exactly_one and ledger.in_flight == 0
    assert ledger.counts() == {OK: 1, REJECTED_429: 1, "cancelled": 1}

    ledger.close(ids[1], record(OK))  # a second outcome for one request
    accounting = ledger.accounting()
    assert accounting.recorded_twice == 1 and accounting.outcomes == 4 and not accounting.exactly_one
    assert ledger.counts()["cancelled"] == 1  # the first outcome stands


def test_a_request_whose_send_breaks_stays_without_an_outcome(monkeypatch):
    async def broken(*args):
        raise RuntimeError("a bug of the client")

    monkeypatch.setattr(soak, "send", broken)
    ledger = Ledger()
    assert asyncio.run(soak.tracked(None, None, None, ledger, 0.0)) is None
    assert ledger.accounting().without_outcome == 1 and not ledger.accounting().exactly_one


def test_outcome_order_and_the_5xx_rule():
    counts = soak.outcome_counts([record("error_502"), record("cancelled"), record(OK), record("error_404"),
                                  record(OK), record("rejected_503")])
    assert list(counts) == [OK, "rejected_503", "cancelled", "error_404", "error_502"] and counts[OK] == 2
    assert soak.refusal(429) == REJECTED_429 and soak.refusal(503) == "rejected_503"
    assert soak.refusal(500) == "error_500" and soak.refusal(400) == "error_400"
    assert [soak.is_bad_5xx(o) for o in ("error_500", "error_504", "rejected_503", "error_404", OK)] == \
        [True, True, False, False, False]


def _checks(*outcomes: str, gauges_zero: bool = True) -> soak.Checks:
    ledger = Ledger()
    for outcome in outcomes:
        ledger.close(ledger.open(), record(outcome, retry_after="1"))
    truth = soak.retry_after_truth(ledger.done())
    gauges = soak.GaugesAfter({}, gauges_zero, 0.0)
    return soak.checks([ledger], truth, gauges, rss=None, max_rss_slope=10.0, rss_sampled=False)


def test_checks():
    assert _checks(OK, REJECTED_429, "rejected_503", "cancelled", "timeout").passed
    assert not _checks(OK, "error_500").no_5xx_but_503
    assert not _checks(OK, "stream_error").no_stream_errors
    assert not _checks(OK, "incomplete").no_stream_errors
    assert not _checks(OK, gauges_zero=False).passed
    assert _checks(OK).rss_flat is None


# ---- capacity and arrivals ----


def test_completion_rate_counts_ok_requests_ended_in_the_last_three_quarters():
    records = [record(OK, sent_at=0.0, latency=1.0),  # ended in the first quarter of 8 s: left out
               record(OK, sent_at=1.0, latency=2.0), record(OK, sent_at=5.0, latency=3.0),
               record(OK, sent_at=7.0, latency=2.0),  # ended after the phase: left out
               record(REJECTED_429, sent_at=3.0, latency=0.1)]
    assert soak.completion_rate(records, 8.0) == pytest.approx(2 / 6)


def _load(**fields) -> LoadSettings:
    defaults = dict(rate=50.0, duration_s=20.0, cancel_fraction=0.25, cancel_delay_max_s=2.0, stream_fraction=0.5,
                    max_outstanding=100, max_requests=100_000, seed=1)
    return LoadSettings(**(defaults | fields))


def test_arrivals_are_poisson_within_the_duration_and_bounded_in_count():
    offsets = soak.arrival_offsets(_load())
    assert offsets.max() < 20.0 and abs(len(offsets) - 1000) < 5 * 1000 ** 0.5
    gaps = offsets[1:] - offsets[:-1]
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.1) and gaps.std() == pytest.approx(1 / 50, rel=0.15)
    assert len(soak.arrival_offsets(_load(max_requests=30))) == 30


def test_plan_mixes_streams_and_cancels_at_the_asked_fractions():
    import random

    rng, load = random.Random(0), _load()
    plans = [soak.plan(RequestInput("x", 1, 1), rng, load) for _ in range(4000)]
    assert sum(p.streamed for p in plans) / 4000 == pytest.approx(0.5, abs=0.03)
    delays = [p.cancel_after_s for p in plans if p.cancel_after_s is not None]
    assert len(delays) / 4000 == pytest.approx(0.25, abs=0.03) and 0 <= min(delays) and max(delays) <= 2.0


# ---- RSS ----


def test_rss_trend_is_the_least_squares_slope_after_warm_up():
    # 1 GiB, growing 3 MiB a minute after a warm-up jump at 50 s, plus alternating noise of 1 MiB.
    mib = soak.MIB
    samples = [RssSample(t, 100 * mib, 924 * mib + (t >= 50) * (200 * mib + int(3 * mib * (t - 50) / 60))
                         + (t // 5 % 2) * mib) for t in range(0, 600, 5)]
    trend = soak.rss_trend(samples, start_s=60, end_s=595)
    assert trend.slope_mib_per_10min == pytest.approx(30, abs=0.5) and trend.samples == 108
    assert trend.warm_mib == pytest.approx(samples[12].total_bytes / mib)
    assert trend.end_mib == pytest.approx(samples[-1].total_bytes / mib)
    assert soak.rss_trend(samples, 0, 595).slope_mib_per_10min > 40  # the warm-up jump, when not left out
    assert soak.rss_trend(samples[:1], 0, 595) is None


def test_rss_counts_the_descendants():
    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(64 << 20); time.sleep(30)"])
    try:
        deadline = time.monotonic() + 10
        while (sample := soak.rss_sample(os.getpid(), 0.0)).children_bytes < 60 * soak.MIB:
            assert time.monotonic() < deadline, sample
            time.sleep(0.05)
        assert child.pid in soak.descendants(os.getpid())
        assert sample.server_bytes == pytest.approx(soak.vm_rss_bytes(os.getpid()), rel=0.2)
    finally:
        child.kill()
        child.wait()
    assert soak.vm_rss_bytes(child.pid) is None and soak.rss_sample(child.pid, 0.0) is None


# ---- Retry-After truth ----


def test_retry_after_ratio_is_against_the_ok_requests_sent_within_a_second():
    records = [
        record(OK, sent_at=10.0, latency=2.0), record(OK, sent_at=10.9, latency=4.0),
        record(OK, sent_at=11.2, latency=9.0),  # too late for the 429 at 10.1
        record("cancelled", sent_at=10.2, latency=50.0),  # not ok: no measure of the wait
        record(REJECTED_429, sent_at=10.1, retry_after="6"),  # neighbours 2 and 4: wait 3, ratio 2
        record(REJECTED_429, sent_at=11.5, retry_after="3"),  # neighbours 4 and 9: wait 6.5
        record(REJECTED_429, sent_at=30.0, retry_after="3"),  # no neighbour: skipped
        record(REJECTED_429, sent_at=10.0, retry_after=None),  # no header: skipped, and invalid
        record(REJECTED_429, sent_at=10.0, retry_after="Wed, 21 Oct 2015 07:28:00 GMT"),  # invalid
    ]
    assert soak.retry_after_ratios(records) == pytest.approx([2.0, 3 / 6.5])
    truth = soak.retry_after_truth(records)
    assert (truth.rejections, truth.invalid, truth.compared) == (5, 2, 2)
    assert truth.within_2x == 0.5  # 2.0 is inside, 0.46 is not
    assert truth.median == pytest.approx((2.0 + 3 / 6.5) / 2)
    assert soak.retry_after_truth([record(OK)]).median is None
    assert soak.retry_after_seconds("0") == 0 and soak.retry_after_seconds(" 12 ") == 12
    assert soak.retry_after_seconds("1.5") is None


# ---- parsing ----


def test_stream_events_and_replies():
    assert soak.stream_event("[DONE]") and not soak.stream_event('{"choices": [{"text": "a"}]}')
    with pytest.raises(soak.StreamError):
        soak.stream_event('{"error": {"message": "boom"}}')
    with pytest.raises(ValueError):
        soak.stream_event("{not json")
    assert soak.reply_outcome(b'{"choices": [{"text": "a", "finish_reason": "length"}]}') == OK
    assert soak.reply_outcome(b'{"choices": [{"text": "a", "finish_reason": null}]}') == "incomplete"
    assert soak.reply_outcome(b'{"error": {"message": "boom"}}') == "incomplete"


def test_gauges_are_read_from_prometheus_text():
    text = ("# TYPE ferry:num_requests_running gauge\nferry:num_requests_running 2.0\n"
            "# TYPE ferry:num_requests_waiting gauge\nferry:num_requests_waiting 0.0\n"
            "# TYPE ferry:kv_cache_usage_perc gauge\nferry:kv_cache_usage_perc 0.25\n"
            "# TYPE ferry:prompt_tokens counter\nferry:prompt_tokens_total 7.0\n")
    assert soak.parse_gauges(text) == {"ferry:num_requests_running": 2.0, "ferry:num_requests_waiting": 0.0,
                                       "ferry:kv_cache_usage_perc": 0.25}


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000", "http://example.com", "https://[2001:db8::1]/"])
def test_only_loopback_servers(url):
    with pytest.raises(ValueError, match="loopback"):
        soak.check_loopback(url)


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://localhost:1", "http://[::1]:8000",
                                 "http://127.1.2.3"])
def test_loopback_servers(url):
    soak.check_loopback(url)


@pytest.mark.parametrize("options", [
    ["--base-url", "http://192.168.1.2:8000"], ["--capacity", "inf"], ["--capacity", "0"], ["--overload", "-1"],
    ["--cancel-fraction", "1.5"], ["--max-outstanding", "0"], ["--server-pid", str(2 ** 22 + 1)],
])
def test_bad_options_are_refused(options):
    parser = argparse.ArgumentParser(prog="ferry")
    add_bench_command(parser.add_subparsers(dest="command", required=True))
    with pytest.raises(ValueError):
        soak.parse_options(parser.parse_args(["bench", "soak", *options]))


# ---- every outcome, from a scripted server ----


async def _scripted(request: web.Request) -> web.StreamResponse:
    """The prompt says what to do."""
    body = await request.json()
    what = body["prompt"]
    sse = {"Content-Type": "text/event-stream"}
    if what in ("429", "503", "500"):
        return web.json_response({"error": {"code": what}}, status=int(what), headers={"Retry-After": "3"})
    if what == "plain":
        assert body["stream"] is False and "stream_options" not in body
        return web.json_response({"choices": [{"text": "hi", "finish_reason": "length"}]})
    if what == "slow-plain":
        await asyncio.sleep(5)
    response = web.StreamResponse(headers=sse)
    await response.prepare(request)
    await response.write(b'data: {"choices": [{"text": "hi"}]}\n\n')
    if what == "error-event":
        await response.write(b'data: {"error": {"message": "boom"}}\n\n')
    elif what == "drop":
        request.transport.close()
        return response
    elif what == "slow-stream":
        await asyncio.sleep(5)
    if what != "no-done":
        await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


@pytest.mark.parametrize(("what", "streamed", "cancel_after", "timeout", "outcome"), [
    ("stream", True, None, 5, OK),
    ("plain", False, None, 5, OK),
    ("429", True, None, 5, REJECTED_429),
    ("503", False, None, 5, "rejected_503"),
    ("500", True, None, 5, "error_500"),
    ("error-event", True, None, 5, "stream_error"),
    ("no-done", True, None, 5, "incomplete"),
    ("drop", True, None, 5, "connection_error"),
    ("slow-plain", False, 0.2, 5, "cancelled"),  # before the reply
    ("slow-stream", True, 0.2, 5, "cancelled"),  # mid-stream
    ("slow-stream", True, 5, 0.2, "timeout"),
    ("stream", True, 3.0, 5, OK),  # done before its cancel was due
])
def test_each_outcome(what, streamed, cancel_after, timeout, outcome):
    async def run() -> Record:
        app = web.Application()
        app.router.add_post("/v1/completions", _scripted)
        runner = web.AppRunner(app, shutdown_timeout=0.1)  # the slow handlers are not waited for
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        target = Target(f"http://127.0.0.1:{port}", "/v1/completions", "m", timeout_s=timeout)
        try:
            async with aiohttp.ClientSession() as session:
                start = time.perf_counter()
                result = await soak.send(session, target, Planned(RequestInput(what, 1, 4), streamed, cancel_after),
                                         start)
                assert time.perf_counter() - start < 2, "a cancel or timeout was not prompt"
                return result
        finally:
            await runner.cleanup()

    result = asyncio.run(run())
    assert result.outcome == outcome and result.streamed == streamed and 0 <= result.sent_at < 0.5
    assert result.retry_after == ("3" if what in ("429", "503", "500") else None)


# ---- a real server, overloaded ----


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("fastapi")
    from test_server import ServerProcess, make_tiny_served_model

    model = make_tiny_served_model(tmp_path_factory.mktemp("soak-model"))
    # 4 sequences at a time and a queue of at most 2 s of work: 2.5x the capacity fills it in a few
    # seconds, after which most arrivals get 429.
    proc = ServerProcess(model, tmp_path_factory.mktemp("soak-logs") / "server.log",
                         "--max-num-seqs", "4", "--max-queue-wait", "2")
    try:
        yield proc.wait_ready(), model
    finally:
        proc.stop()


def test_a_short_soak_of_the_real_server(small_server, tmp_path, capsys):
    """~20 s at 2.5x capacity with 20% of requests cancelled within 1 s of being sent (an admitted
    request waits about 2 s): every request ends once, nothing fails on the server's side, the
    429s say when to come back, and the engine is idle afterwards."""
    srv, model = small_server
    result = tmp_path / "soak.json"
    parser = argparse.ArgumentParser(prog="ferry")
    add_bench_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args([
        "bench", "soak", "--base-url", srv.url, "--server-pid", str(srv.proc.pid), "--tokenizer", str(model),
        "--capacity-duration", "4", "--capacity-concurrency", "8", "--duration", "16", "--overload", "2.5",
        "--cancel-fraction", "0.2", "--cancel-delay-max", "1", "--rss-interval", "1", "--num-prompts", "50",
        "--gauge-timeout", "20", "--result-file", str(result),
    ])
    code = args.func(args)
    summary = json.loads(result.read_text())
    assert code == (0 if summary["passed"] else 1)
    assert "Soak Benchmark Result" in capsys.readouterr().out

    load, checks = summary["load"], summary["checks"]
    outcomes = load["outcomes"]
    assert load["sent"] == sum(outcomes.values()) == load["accounting"]["outcomes"] > 100
    assert checks["exactly_one_outcome"] and summary["capacity"]["accounting"]["without_outcome"] == 0
    assert checks["no_5xx_but_503"] and not any(o.startswith("error_5") for o in outcomes)
    assert checks["no_stream_errors"]
    assert outcomes[OK] > 0 and outcomes["cancelled"] > 0 and outcomes[REJECTED_429] > 0
    requests = summary["requests"]
    retry_afters = [ra for o, ra in zip(requests["outcome"], requests["retry_after"]) if o == REJECTED_429]
    assert all(ra is not None and ra.isdigit() and int(ra) >= 1 for ra in retry_afters)
    assert checks["retry_after_valid"] and summary["retry_after"]["compared"] > 0
    assert checks["gauges_zero_after"]
    assert all(summary["gauges_after"]["values"][name] == 0 for name in soak.GAUGES)
    samples = summary["rss"]["samples"]
    assert len(samples) >= 10 and all(child > 0 for _, _, child in samples)  # the engine's RSS is in
    assert summary["rss"]["trend"] is not None
