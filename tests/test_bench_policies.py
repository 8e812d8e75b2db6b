"""`ferry bench policies`: the lab's accounting, checked by construction on a tiny trace of the
bundled model (not its timings): each gate hands requests over when its policy says, every request
gets all its tokens, the latencies are consistent, and the JSON and plots are written."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math

import pytest

from ferry.bench import policies
from ferry.bench.policies import Batches, Continuous
from ferry.cli import main

BATCH_SIZE = 3
ARGV = ["--num-prompts", "7", "--request-rate", "200", "--input-len", "4", "16", "--output-len", "1", "6",
        "--batch-size", str(BATCH_SIZE), "--batch-timeout", "0.02", "--ttft-slo", "200", "--itl-slo", "50",
        "--device", "cpu", "--threads", "1", "--no-quiet-gc"]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """The four policies over one trace, through `ferry bench policies`; (results, plot folder)."""
    out = tmp_path_factory.mktemp("policies")
    plot_dir = out / "plots" if importlib.util.find_spec("matplotlib") else None
    argv = ["bench", "policies", *ARGV, "--json", str(out / "lab.json")]
    assert main(argv + (["--plot-dir", str(plot_dir)] if plot_dir else [])) == 0
    return json.loads((out / "lab.json").read_text()), plot_dir


def trace() -> policies.Trace:
    parser = argparse.ArgumentParser()
    policies.add_args(parser)
    return policies.make_trace(parser.parse_args(ARGV), vocab_size=4096)


def by_name(results: dict) -> dict[str, dict]:
    return {p["policy"]: p for p in results["policies"]}


def test_every_policy_serves_every_token_of_the_trace(lab):
    results, _ = lab
    expected = trace().output_lens
    assert list(by_name(results)) == list(policies.POLICY_NAMES)
    assert results["trace"]["output_tokens"] == sum(expected)
    for p in results["policies"]:
        assert p["complete"] and p["output_tokens"] == sum(expected)
        assert [r["output_tokens"] for r in p["requests"]] == expected
        assert sorted(i for h in p["handovers"] for i in h["requests"]) == list(range(len(expected)))


def test_latencies_are_consistent(lab):
    results, _ = lab
    slo_ttft, slo_itl = results["ttft_slo_ms"] / 1000, results["itl_slo_ms"] / 1000
    for p in results["policies"]:
        for r in p["requests"]:
            assert r["arrival_s"] <= r["handed_over_s"] <= r["first_token_s"] <= r["finish_s"]
            assert 0 < r["ttft_s"] <= r["e2e_s"]
            assert len(r["itls_s"]) == r["output_tokens"] - 1 and all(gap >= 0 for gap in r["itls_s"])
            assert r["mean_itl_s"] == pytest.approx(sum(r["itls_s"]) / max(len(r["itls_s"]), 1))
            assert r["met_slo"] == (r["ttft_s"] <= slo_ttft and r["mean_itl_s"] <= slo_itl)
        assert p["makespan_s"] == pytest.approx(max(r["finish_s"] for r in p["requests"]))
        assert p["good_requests"] == sum(r["met_slo"] for r in p["requests"])
        assert p["goodput"] <= p["request_throughput"]
        assert p["output_throughput"] == pytest.approx(p["output_tokens"] / p["makespan_s"])
        assert p["ttft_ms"]["p50"] <= p["ttft_ms"]["p99"] and p["ttft_ms"]["mean"] <= p["e2e_ms"]["mean"]


@pytest.mark.parametrize("name", ["static", "dynamic"])
def test_a_batch_goes_to_the_engine_only_once_the_last_one_has_finished(lab, name):
    p = by_name(lab[0])[name]
    finish = [r["finish_s"] for r in p["requests"]]
    handovers = p["handovers"]
    for before, after in zip(handovers, handovers[1:]):
        assert max(finish[i] for i in before["requests"]) <= after["at_s"]
    assert all(1 <= len(h["requests"]) <= BATCH_SIZE for h in handovers)
    if name == "static":  # full batches, but the trace's last
        assert [len(h["requests"]) for h in handovers[:-1]] == [BATCH_SIZE] * (len(handovers) - 1)
    assert max(point["requests"] for point in p["timeline"]) <= BATCH_SIZE


def test_continuous_batching_hands_each_request_over_as_it_arrives(lab):
    for name in ("continuous", "continuous-no-chunked-prefill"):
        p = by_name(lab[0])[name]
        for h in p["handovers"]:
            assert all(p["requests"][i]["arrival_s"] <= h["at_s"] for i in h["requests"])
        # Handed over at the first look after arriving: before the end of the step running then.
        assert all(r["handed_over_s"] < r["first_token_s"] for r in p["requests"])


def test_without_chunked_prefill_a_step_prefills_or_decodes(lab):
    timeline = by_name(lab[0])["continuous-no-chunked-prefill"]["timeline"]
    assert any(point["prefilling"] for point in timeline)
    assert all(point["prefilling"] in (0, point["requests"]) for point in timeline)


def test_json_and_plots(lab):
    results, plot_dir = lab
    assert {"model", "device", "trace", "batch_size", "batch_timeout_s", "ttft_slo_ms", "itl_slo_ms",
            "policies"} <= set(results)
    for p in results["policies"]:
        assert {"policy", "makespan_s", "output_throughput", "request_throughput", "goodput", "ttft_ms", "itl_ms",
                "e2e_ms", "num_steps", "num_preemptions", "handovers", "timeline", "requests"} <= set(p)
        assert set(p["ttft_ms"]) == {"mean", "p50", "p99"} and set(p["itl_ms"]) == {"mean", "p99"}
    if plot_dir is None:
        pytest.skip("matplotlib is not installed")
    for name in ("throughput.png", "latency_cdfs.png", "batch_timeline.png"):
        assert (plot_dir / name).stat().st_size > 0


# ---- the gates alone ----

def test_static_batches_wait_for_a_full_batch_or_the_end_of_the_trace():
    static = Batches(4)
    assert static.release(3, oldest_wait=100.0, more_to_come=True, engine_busy=False) == 0
    assert static.release(6, oldest_wait=0.0, more_to_come=True, engine_busy=False) == 4
    assert static.release(6, oldest_wait=0.0, more_to_come=True, engine_busy=True) == 0
    assert static.release(3, oldest_wait=0.0, more_to_come=False, engine_busy=False) == 3
    assert static.timeout == math.inf


def test_dynamic_batches_start_short_once_the_oldest_has_waited():
    dynamic = Batches(4, timeout=0.5)
    assert dynamic.release(2, oldest_wait=0.4, more_to_come=True, engine_busy=False) == 0
    assert dynamic.release(2, oldest_wait=0.5, more_to_come=True, engine_busy=False) == 2
    assert dynamic.release(2, oldest_wait=0.9, more_to_come=True, engine_busy=True) == 0
    assert dynamic.release(5, oldest_wait=0.0, more_to_come=True, engine_busy=False) == 4


def test_continuous_hands_everything_over_at_once():
    assert Continuous().release(5, oldest_wait=0.0, more_to_come=True, engine_busy=True) == 5
