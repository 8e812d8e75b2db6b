"""`ferry bench serve` against a stub server whose delays are known (tests/stub_server.py), plus
the arrival processes, SSE parsing, workloads and metric definitions on their own."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from ferry.assets import default_model_path
from ferry.bench.arrivals import ArrivalProcess
from ferry.bench.cli import add_bench_command
from ferry.bench.datasets import Lengths, PromptMaker, WorkloadConfig, load_tokenizer, make_workload
from ferry.bench.openai_stream import RequestOutcome
from ferry.bench.serve_metrics import Slo, compute_metrics, output_lengths
from ferry.bench.sse import SseParser

STUB = Path(__file__).parent / "stub_server.py"
TTFT_MS, ITL_MS, TOKENS = 200.0, 20.0, 16


# ---- the stub server ----


@pytest.fixture(scope="module")
def stub():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, str(STUB), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "the stub server did not start"
        try:
            httpx.get(url + "/v1/models", timeout=1, trust_env=False).raise_for_status()
            break
        except httpx.HTTPError:
            time.sleep(0.1)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def configure(url: str, **config) -> None:
    httpx.post(url + "/stub/config", json=config, trust_env=False).raise_for_status()


def stub_log(url: str) -> dict:
    return httpx.get(url + "/stub/log", trust_env=False).json()


def bench(url: str, tmp_path: Path, *options: str) -> tuple[int, dict]:
    """Run `ferry bench serve` as the CLI does, in this process; returns its exit code and JSON."""
    parser = argparse.ArgumentParser(prog="ferry")
    add_bench_command(parser.add_subparsers(dest="command", required=True))
    result = tmp_path / "result.json"
    args = parser.parse_args(["bench", "serve", "--base-url", url, "--disable-tqdm", "--save-result", str(result),
                              "--random-input-len", "16", *options])
    code = args.func(args)
    return code, json.loads(result.read_text())


def within(value: float, expected: float, tolerance: float = 0.05) -> bool:
    return abs(value - expected) <= tolerance * expected


# ---- against the stub ----


STATS = {"mean": np.mean, "median": np.median, "p90": lambda x: np.percentile(x, 90),
         "p99": lambda x: np.percentile(x, 99)}


def delays_injected(log: list[dict]) -> dict[str, np.ndarray]:
    """The delays as the stub really injected them, in ms, from the times it wrote each token."""
    ttft = np.array([e["token_times"][0] - e["arrival"] for e in log])
    e2el = np.array([e["token_times"][-1] - e["arrival"] for e in log])
    gaps = np.array([b - a for e in log for a, b in zip(e["token_times"], e["token_times"][1:])])
    tpot = np.array([(e["token_times"][-1] - e["token_times"][0]) / (len(e["token_times"]) - 1) for e in log])
    return {"ttft": ttft * 1000, "tpot": tpot * 1000, "itl": gaps * 1000, "e2el": e2el * 1000}


def misses(result: dict, log: list[dict]) -> list[tuple[str, float, float]]:
    """(key, reported, expected) for each figure more than 5% off: every mean, median, p90 and p99
    against the same statistic of the delays the stub really injected, and every mean and median
    against the nominal delays too."""
    nominal = {"ttft": TTFT_MS, "tpot": ITL_MS, "itl": ITL_MS, "e2el": TTFT_MS + (TOKENS - 1) * ITL_MS}
    injected = delays_injected(log)
    expected = [(f"{stat}_{metric}_ms", float(of(samples)))
                for metric, samples in injected.items() for stat, of in STATS.items()]
    expected += [(f"{stat}_{metric}_ms", value) for metric, value in nominal.items() for stat in ("mean", "median")]
    return [(key, result[key], value) for key, value in expected if not within(result[key], value)]


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_latencies_equal_the_injected_delays(stub, tmp_path, endpoint):
    """TTFT 200 ms, then a token every 20 ms, 16 tokens. Poisson arrivals spread the streams out,
    so that the client is not timing tokens that land at the same instant. The stub records when it
    really wrote each token: another busy process on a small machine now and then wakes its threads
    (and the client) a millisecond or two late, which moves a p99 of 20 ms gaps past 5%. So the
    tails are compared with what was injected in fact, and a run is tried up to five times (on a
    quiet machine the first passes); a wrong definition (a role chunk timed as a token, TPOT over
    n tokens instead of n - 1) misses in every run."""
    for _ in range(5):
        configure(stub, ttft_ms=TTFT_MS, itl_ms=ITL_MS)  # also clears its log
        code, r = bench(stub, tmp_path, "--endpoint", endpoint, "--num-prompts", "24", "--request-rate", "10",
                        "--random-output-len", str(TOKENS))
        assert code == 0 and r["completed"] == 24 and r["failed"] == 0
        assert r["output_lens"] == [TOKENS] * 24 and all(len(gaps) == TOKENS - 1 for gaps in r["itls"])
        log = stub_log(stub)["requests"]
        if not (missed := misses(r, log)):
            break
    assert not missed
    assert r["total_output_tokens"] == 24 * TOKENS
    assert all(e["ignore_eos"] is True and e["model"] == "stub-model" for e in log)
    assert all((e["max_completion_tokens"] if "chat" in endpoint else e["max_tokens"]) == TOKENS for e in log)
    assert r["total_input_tokens"] == sum(e["prompt_tokens"] for e in log)  # the server's usage wins


def test_max_concurrency_is_honoured(stub, tmp_path):
    configure(stub, ttft_ms=50, itl_ms=10)
    code, r = bench(stub, tmp_path, "--num-prompts", "8", "--max-concurrency", "2", "--random-output-len", "6")
    assert code == 0 and r["completed"] == 8
    assert stub_log(stub)["max_in_flight"] == 2
    assert r["max_concurrent_requests"] == 2
    assert r["duration"] >= 4 * 0.1  # 8 requests of 100 ms, two at a time
    assert max(r["queue_times"]) > 0.25  # the last ones waited for three rounds


def test_request_rate_is_honoured(stub, tmp_path):
    configure(stub, ttft_ms=10, itl_ms=5)
    n, rate, seed = 30, 20.0, 3
    code, r = bench(stub, tmp_path, "--num-prompts", str(n), "--request-rate", str(rate), "--seed", str(seed),
                    "--random-output-len", "4")
    assert code == 0 and r["completed"] == n
    planned = ArrivalProcess(rate).offsets(n, seed)
    sent = np.array(r["start_times"])
    assert np.all(sent >= planned - 1e-3) and np.all(sent - planned < 0.010)
    arrivals = np.array(sorted(e["arrival"] for e in stub_log(stub)["requests"]))
    assert np.all(np.abs((arrivals - arrivals[0]) - (planned - planned[0])) < 0.015)


def test_failed_requests_are_counted(stub, tmp_path):
    configure(stub, ttft_ms=20, itl_ms=5, fail_every=4, disconnect_every=5, truncate_every=7)
    code, r = bench(stub, tmp_path, "--num-prompts", "20", "--random-output-len", "8")
    # Arrivals 4, 8, 12, 16, 20 get HTTP 500; 5, 10, 15 lose their connection mid-stream; the
    # bodies of 7 and 14 end early, without [DONE].
    assert code == 0 and r["completed"] == 10 and r["failed"] == 10
    errors = [e for e in r["errors"] if e is not None]
    assert sum("HTTP 500" in e for e in errors) == 5 and len(errors) == 10
    assert sum("without [DONE]" in e for e in errors) == 2
    assert r["total_output_tokens"] == 10 * 8


def test_requests_time_out(stub, tmp_path):
    configure(stub, ttft_ms=5000)
    start = time.monotonic()
    code, r = bench(stub, tmp_path, "--num-prompts", "3", "--timeout", "0.3", "--random-output-len", "4")
    assert time.monotonic() - start < 3
    assert code == 1 and r["completed"] == 0 and r["failed"] == 3
    assert all("timed out" in e for e in r["errors"]) and r["mean_ttft_ms"] is None


def test_result_json_has_the_documented_fields(stub, tmp_path):
    configure(stub, ttft_ms=20, itl_ms=5)
    code, r = bench(stub, tmp_path, "--num-prompts", "5", "--random-output-len", "4", "--goodput", "ttft:1000",
                    "e2el:1")
    assert code == 0
    summary = ["duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
               "request_goodput", "output_throughput", "total_token_throughput", "max_concurrent_requests"]
    latencies = [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
                 for s in ("mean", "median", "std", "p90", "p99")]
    per_request = ["conversation_ids", "turn_indices", "input_lens", "expected_output_lens", "output_lens", "ttfts",
                   "tpots", "itls", "latencies", "start_times", "queue_times", "generated_texts", "errors"]
    settings = ["date", "base_url", "endpoint", "model", "dataset_name", "num_prompts", "request_rate", "burstiness",
                "max_concurrency", "seed", "tokenizer", "percentiles", "goodput_slos_ms"]
    assert not [k for k in summary + latencies + per_request + settings if k not in r]
    assert all(len(r[k]) == 5 for k in per_request)
    assert r["request_rate"] == "inf" and r["goodput_slos_ms"] == {"ttft": 1000.0, "e2el": 1.0}
    assert r["request_goodput"] == 0  # an end-to-end latency of 35 ms misses the 1 ms SLO
    assert r["request_throughput"] == pytest.approx(5 / r["duration"])


def test_token_id_prompts_and_output_counted_without_usage(stub, tmp_path):
    configure(stub, ttft_ms=10, itl_ms=5, usage=False)
    code, r = bench(stub, tmp_path, "--num-prompts", "3", "--random-input-len", "40", "--prompt-token-ids",
                    "--random-output-len", "6")
    assert code == 0
    assert all(e["prompt_is_ids"] and e["prompt_tokens"] == 40 for e in stub_log(stub)["requests"])
    assert r["input_lens"] == [40] * 3  # the client's count, since the server sent no usage
    maker = PromptMaker(load_tokenizer(default_model_path()))
    assert r["output_lens"] == [maker.count(text) for text in r["generated_texts"]]


def test_multi_turn_resends_the_history(stub, tmp_path):
    configure(stub, ttft_ms=20, itl_ms=5)
    code, r = bench(stub, tmp_path, "--endpoint", "/v1/chat/completions", "--dataset-name", "multi-turn",
                    "--num-prompts", "6", "--multi-turn-turns", "3", "--random-output-len", "3")
    assert code == 0 and r["completed"] == 6
    assert r["conversation_ids"] == [0, 0, 0, 1, 1, 1] and r["turn_indices"] == [0, 1, 2] * 2
    sent = stub_log(stub)["requests"]
    assert sorted(len(e["messages"]) for e in sent) == [1, 1, 3, 3, 5, 5]
    replies = {m["content"] for e in sent for m in e["messages"] if m["role"] == "assistant"}
    assert replies == {" t0 t1 t2"}
    for c in range(2):  # each turn is sent after the reply before it has ended
        turns = [i for i, cid in enumerate(r["conversation_ids"]) if cid == c]
        for a, b in zip(turns, turns[1:]):
            assert r["start_times"][b] >= r["start_times"][a] + r["latencies"][a]


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed")
def test_sweep_writes_plots(stub, tmp_path):
    configure(stub, ttft_ms=20, itl_ms=5)
    code, r = bench(stub, tmp_path, "--num-prompts", "6", "--random-output-len", "4", "--request-rate-sweep",
                    "40,inf", "--plot-dir", str(tmp_path / "plots"))
    assert code == 0 and [run["request_rate"] for run in r["sweep"]] == [40.0, "inf"]
    names = {p.name for p in (tmp_path / "plots").iterdir()}
    assert {"sweep_throughput.png", "sweep_latency.png", "rate-inf_latency_histograms.png",
            "rate-40_latency_cdfs.png"} <= names
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in (tmp_path / "plots").iterdir())


def test_an_unreachable_server_is_an_error_not_a_crash(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    out = subprocess.run([sys.executable, "-m", "ferry.bench.serve", "--base-url", f"http://127.0.0.1:{port}",
                          "--num-prompts", "2", "--random-input-len", "8"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "could not read the model name" in out.stderr and "Traceback" not in out.stderr


# ---- the parts ----


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_arrival_gaps_have_the_right_mean_and_spread(burstiness):
    rate, n = 8.0, 20000
    gaps = ArrivalProcess(rate, burstiness).intervals(n, seed=1)
    # Gamma(k, 1 / (rate k)): mean 1 / rate, squared coefficient of variation 1 / k.
    assert within(gaps.mean(), 1 / rate, 0.03)
    assert within(gaps.var() / gaps.mean() ** 2, 1 / burstiness, 0.06)
    if burstiness == 1.0:  # exponential: the empirical CDF stays near 1 - exp(-rate t)
        t = np.sort(gaps)
        assert np.max(np.abs(np.arange(1, n + 1) / n - (1 - np.exp(-rate * t)))) < 1.36 / math.sqrt(n) * 1.5


def test_arrivals_at_infinite_rate_or_burstiness():
    assert ArrivalProcess(math.inf).offsets(4, seed=0).tolist() == [0, 0, 0, 0]
    assert ArrivalProcess(4.0, math.inf).offsets(3, seed=0).tolist() == [0.25, 0.5, 0.75]
    with pytest.raises(ValueError):
        ArrivalProcess(0.0)


def test_sse_parser_splits_anywhere():
    stream = (b": ping\r\n\r\ndata: {\"a\": \"\xc3\xa9\xe2\x80\xa8\"}\r\n\r\n"
              b"event: x\ndata: line1\ndata: line2\n\ndata: [DONE]\n\n")
    parser, events = SseParser(), []
    for i in range(len(stream)):
        events += parser.feed(stream[i:i + 1])
    assert events == ['{"a": "\u00e9\u2028"}', "line1\nline2", "[DONE]"] and parser.finish() == []
    unterminated = SseParser()
    assert unterminated.feed(b"data: 1\n\ndata: [DONE]") == ["1"] and unterminated.finish() == ["[DONE]"]


@pytest.fixture(scope="module")
def maker():
    return PromptMaker(load_tokenizer(default_model_path()))


def test_random_prompts_have_the_asked_token_counts(maker):
    config = WorkloadConfig("random", 40, Lengths(100, 10, range_ratio=0.5), seed=2)
    turns = [c.turns[0] for c in make_workload(config, maker)]
    assert all(50 <= t.prompt_len <= 150 and 5 <= t.output_len <= 15 for t in turns)
    assert len({t.prompt_len for t in turns}) > 10
    assert all(maker.count(t.prompt) == t.prompt_len for t in turns)


def test_shared_prefix_groups(maker):
    config = WorkloadConfig("shared-prefix", 12, Lengths(20, 5), prefix_groups=3, prefix_len=64, token_ids=True)
    prompts = [c.turns[0].prompt for c in make_workload(config, maker)]
    prefixes = {p[:64] for p in prompts}
    assert len(prefixes) == 3 and all(len(p) == 84 for p in prompts)
    text = WorkloadConfig("shared-prefix", 6, Lengths(20, 5), prefix_groups=2, prefix_len=64)
    turns = [c.turns[0] for c in make_workload(text, maker)]
    assert all(abs(t.prompt_len - 84) <= 1 and maker.count(t.prompt) == t.prompt_len for t in turns)


def outcome(ttft: float, latency: float, output_tokens: int | None, text: str = "", chunks: int = 0,
            success: bool = True) -> RequestOutcome:
    return RequestOutcome(None if success else "x", 0.0, ttft, (), latency, 10, output_tokens, chunks, text)


def test_metric_definitions():
    outcomes = [outcome(0.1, 0.5, 5), outcome(0.2, 0.2, 1), outcome(0.3, 1.3, None, "a b", chunks=3),
                outcome(0.0, 0.0, None, success=False)]
    count = lambda text: len(text.split())  # noqa: E731
    assert output_lengths(outcomes, count) == [5, 1, 2, 0]
    assert output_lengths(outcomes, None) == [5, 1, 3, 0]
    m = compute_metrics(outcomes, 2.0, [50, 90], Slo.parse(["tpot:150"]), count)
    assert (m.completed, m.failed, m.total_input_tokens, m.total_output_tokens) == (3, 1, 30, 8)
    assert m.request_throughput == 1.5 and m.output_throughput == 4.0 and m.total_token_throughput == 19.0
    # TPOT: (0.5 - 0.1) / 4 = 100 ms and (1.3 - 0.3) / 1 = 1000 ms; the one-token request has none.
    assert m.tpot.mean == pytest.approx(550) and m.tpot.median == pytest.approx(550)
    assert dict(m.tpot.percentiles)[90] == pytest.approx(910)
    assert m.request_goodput == 1.0  # 100 ms and the one-token request (TPOT 0) meet 150 ms
    assert m.ttft.mean == pytest.approx(200) and m.ttft.std == pytest.approx(np.std([100, 200, 300]))
    with pytest.raises(ValueError):
        Slo.parse(["latency:10"])


def test_python_m_entry_point_shows_help():
    out = subprocess.run([sys.executable, "-m", "ferry.bench.serve", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "--request-rate-sweep" in out.stdout and "--goodput" in out.stdout
