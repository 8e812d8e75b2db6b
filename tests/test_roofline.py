"""The roofline cost model against figures computed by hand, and the throughput and latency
benchmarks run end to end on CPU with the bundled model."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch

from ferry.assets import default_model_path
from ferry.bench import latency, throughput
from ferry.bench.roofline import (
    Hardware, ModelCost, RecordedStep, measure_hardware, paging_waste, percentile, step_bound, step_seconds,
)
from ferry.config import ModelConfig
from ferry.models.registry import get_model_class

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
H200 = Hardware(773e12, 4.27e12, "H200, as measured in the device notes")


def cost_of(path: Path, dtype: str = "bfloat16") -> ModelCost:
    return ModelCost.from_model_config(ModelConfig.from_pretrained(path, dtype, None, "dummy"))


# ---- weights ----


def test_qwen3_0_6b_weights_by_hand():
    h, q, kv, inter, layers, vocab, head_dim = 1024, 16 * 128, 8 * 128, 3072, 28, 151936, 128
    per_layer = (
        h * q + 2 * h * kv + q * h  # q, k, v, o projections, no biases
        + 3 * h * inter  # gate, up, down
        + 2 * h + 2 * head_dim  # two RMSNorms, q_norm and k_norm
    )
    assert per_layer == 15_730_944
    params = layers * per_layer + h + vocab * h  # + final norm + the embedding, tied: counted once
    cost = cost_of(BENCHMARKS / "qwen3-0.6b")
    assert cost.tied
    assert cost.num_params == params == 596_049_920
    assert cost.weight_bytes == 2 * params
    assert round(cost.weight_bytes / 1e9, 2) == 1.19


def test_llama_3_1_8b_weights_by_hand():
    h, q, kv, inter, layers, vocab = 4096, 4096, 1024, 14336, 32, 128256
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter + 2 * h
    params = layers * per_layer + h + 2 * vocab * h  # embedding and lm_head apart
    cost = cost_of(BENCHMARKS / "llama-3.1-8b")
    assert not cost.tied
    assert cost.num_params == params == 8_030_261_248
    assert round(cost.weight_bytes / 1e9, 2) == 16.06
    assert cost.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # K and V, every layer, bf16


def _tiny_config(tmp_path: Path, **changes) -> Path:
    config = json.loads((default_model_path() / "config.json").read_text())
    config.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("case", ["qwen3-0.6b", "llama-3.1-8b", "default", "qwen2", "llama_biases", "untied"])
def test_param_count_matches_the_model(case, tmp_path):
    """Every parameter ferry's model class builds is counted, biases and per-head norms included."""
    path = {
        "qwen3-0.6b": BENCHMARKS / "qwen3-0.6b",
        "llama-3.1-8b": BENCHMARKS / "llama-3.1-8b",
        "default": default_model_path(),
    }.get(case)
    if path is None:
        changes = {
            "qwen2": {"architectures": ["Qwen2ForCausalLM"]},  # q, k, v biases
            "llama_biases": {"attention_bias": True, "mlp_bias": True},
            "untied": {"tie_word_embeddings": False},
        }[case]
        path = _tiny_config(tmp_path, **changes)
    config = ModelConfig.from_pretrained(path, "bfloat16", 2048, "dummy")
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config)
    assert ModelCost.from_model_config(config).num_params == sum(p.numel() for p in model.parameters())


# ---- one step ----


# hidden 8, vocab 100, 2 layers of 2 query heads and 1 KV head of dim 4, 2-byte weights and KV.
TINY = ModelCost(hidden_size=8, vocab_size=100, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4,
                 linear_params=1000, norm_params=40, tied=False, weight_itemsize=2, kv_itemsize=2)
# A 3-token prompt prefilled whole, and a decode at position 4 (seq_len 5); both sample.
STEP = [(3, 3), (1, 5)]


def test_attention_flops_by_hand():
    # 4 queries after 2 cached tokens: 4 * 2 pairs with the cache + 1 + 2 + 3 + 4 causal ones.
    assert TINY.attention_flops(4, 6) == 4 * 2 * 2 * 4 * (8 + 10)
    assert TINY.attention_flops(1, 10) == 4 * 2 * 2 * 4 * 10  # a decode sees its whole context


def test_step_cost_by_hand():
    flops, nbytes, _ = TINY.step_cost(STEP, sampled_rows=2)
    # linears over 4 tokens + lm_head over 2 rows + attention over 6 + 5 (query, key) pairs
    assert flops == 2 * 1000 * 4 + 2 * 800 * 2 + 64 * 11
    kv = 2 * 2 * 1 * 4 * 2 * (3 + 5)  # per token: K and V in 2 layers; each request's whole context once
    # layers + norms + 4 embedding rows gathered + the whole lm_head
    assert nbytes == (1000 + 40 + 4 * 8 + 800) * 2 + kv


def test_tied_embedding_is_read_once():
    tied = ModelCost(**{**TINY.__dict__, "tied": True})
    kv = 2 * 2 * 1 * 4 * 2 * 8
    assert tied.step_cost(STEP, 2).bytes == (1000 + 40 + 800) * 2 + kv  # as the lm_head
    assert tied.step_cost(STEP, 0).bytes == (1000 + 40 + 4 * 8) * 2 + kv  # no logits: only gathered rows
    assert TINY.step_cost(STEP, 0).flops == tied.step_cost(STEP, 0).flops == 2 * 1000 * 4 + 64 * 11


def test_step_bound_is_the_larger_of_compute_and_memory():
    flops, nbytes, _ = TINY.step_cost(STEP, 2)
    compute_bound = Hardware(peak_flops=flops, bandwidth_bytes_per_s=nbytes * 10, name="slow matmul")
    memory_bound = Hardware(peak_flops=flops * 10, bandwidth_bytes_per_s=nbytes / 2, name="slow memory")
    assert step_bound(STEP, 2, TINY, compute_bound) == pytest.approx(1.0)
    assert step_bound(STEP, 2, TINY, memory_bound) == pytest.approx(2.0)
    assert step_bound([], 0, TINY, memory_bound) == 0.0


def test_batch_1_decode_bounds_on_the_h200():
    """A decode step reads every weight once; Llama's untied embedding table only at one row."""
    llama, qwen = cost_of(BENCHMARKS / "llama-3.1-8b"), cost_of(BENCHMARKS / "qwen3-0.6b")
    assert llama.weight_bytes / H200.bandwidth_bytes_per_s == pytest.approx(3.76e-3, abs=5e-6)
    embedding = 128256 * 4096 * 2
    expected = (llama.weight_bytes - embedding + 4096 * 2 + 1024 * llama.kv_bytes_per_token) / 4.27e12
    assert step_bound([(1, 1024)], 1, llama, H200) == pytest.approx(expected)
    assert step_bound([(1, 1)], 1, qwen, H200) == pytest.approx((1_192_099_840 + 114_688) / 4.27e12)


def test_long_prefill_is_compute_bound():
    llama = cost_of(BENCHMARKS / "llama-3.1-8b")
    flops, nbytes, _ = llama.step_cost([(8192, 8192)], 1)
    attention = 4 * 32 * 32 * 128 * (8192 * 8193 // 2)
    assert flops == 2 * 8192 * (8_030_261_248 - 2 * 128256 * 4096 - 65 * 4096) + 2 * 128256 * 4096 + attention
    assert step_bound([(8192, 8192)], 1, llama, H200) == pytest.approx(flops / 773e12)


# ---- helpers ----


def test_paging_waste_and_percentiles():
    steps = [RecordedStep([(1, 10)], 1, kv_slots=16, kv_tokens=12), RecordedStep([(1, 11)], 1, 32, 32)]
    assert paging_waste(steps) == pytest.approx((4 / 16 + 0) / 2)
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0], 90) == pytest.approx(1.9)


def test_measure_hardware_on_cpu():
    hw = measure_hardware("cpu")
    assert hw.peak_flops > 1e8 and hw.bandwidth_bytes_per_s > 1e8


# ---- the benchmarks, end to end ----


# Ceilings above what a CPU reaches (a 2-core one ran the throughput test's workload at 0.08 TFLOP/s),
# so that a run is always slower than its bound.
CEILINGS = ["--peak-tflops", "2", "--bandwidth-tbps", "0.5", "--device", "cpu"]


def test_throughput_end_to_end(tmp_path):
    out = tmp_path / "throughput.json"
    throughput.main(["--no-quiet-gc", "--num-prompts", "3", "--input-len", "5", "40", "--output-len", "4",
                     "--num-warmup-prompts", "1", "--json", str(out), *CEILINGS])
    r = json.loads(out.read_text())
    assert r["output_tokens"] == r["expected_output_tokens"] == 12
    assert r["num_steps"] == 4  # one step prefills all three prompts, three more decode
    assert r["num_prefill_steps"] == 1 and r["num_preemptions"] == 0
    assert 0 < r["bound_s"] < r["elapsed_s"] and r["achieved_fraction"] == pytest.approx(r["bound_s"] / r["elapsed_s"])
    assert 0 < r["kv_paging_waste"] < 1
    kinds = r["by_step_kind"]
    assert kinds["with prefill chunks"]["steps"] == 1 and kinds["decode only"]["steps"] == 3
    assert kinds["decode only"]["tokens"] == 9 and kinds["with prefill chunks"]["tokens"] == r["input_tokens"]
    # The steps' times tile the run from the first step's scheduling to its end.
    assert sum(k["seconds"] for k in kinds.values()) == pytest.approx(r["elapsed_s"], rel=0.05)
    assert sum(k["bound_s"] for k in kinds.values()) == pytest.approx(r["bound_s"])


def test_step_seconds_run_from_one_scheduling_to_the_next():
    steps = [RecordedStep([(1, 10)], 1, 16, 10, scheduled_at=t) for t in (1.0, 1.5, 3.0)]
    assert step_seconds(steps, end=3.25) == [0.5, 1.5, 0.25]


def test_full_batch_steps_are_those_in_which_every_request_decodes():
    b = 2
    steps = [
        RecordedStep([(8, 8)], 0, 16, 8, scheduled_at=0.0),  # request 0's prompt
        RecordedStep([(1, 9), (8, 8)], 1, 32, 17, scheduled_at=1.0),  # 0 decodes beside 1's prompt
        RecordedStep([(1, 10), (1, 9)], 2, 32, 19, scheduled_at=2.0),  # both decode: 0.5 s
        RecordedStep([(1, 11), (1, 10)], 2, 32, 21, scheduled_at=2.5),  # both decode: 1.5 s
        RecordedStep([(1, 11)], 1, 16, 11, scheduled_at=4.0),  # 1 alone
    ]
    assert latency.full_batch_steps(steps, end=5.0, batch=b) == (1.0, 10.0, 2)
    # The last step's time runs to the iteration's end, so it is never counted.
    assert latency.full_batch_steps(steps[:3], end=9.0, batch=b) is None


def test_latency_reports_the_full_batch_step_when_prompts_take_several_steps(tmp_path):
    out = tmp_path / "latency.json"
    latency.main(["--no-quiet-gc", "--batch-size", "4", "--input-len", "16", "--output-len", "6",
                  "--max-num-batched-tokens", "32", "--num-iters-warmup", "0", "--num-iters", "1",
                  "--json", str(out), *CEILINGS])
    r = json.loads(out.read_text())
    assert r["num_prefill_steps"] == 2
    full = r["full_batch_step_s"]
    # Step 1 prefills requests 0-1; step 2 decodes them beside 2's prompt and 14 tokens of 3's;
    # step 3 finishes 3's prompt. Steps 4 to 6 decode all four (contexts 19, 19, 18, 17 at step 4,
    # one more each step), and 0-1 end at step 6 with their 6th token.
    assert full["steps"] == 3 and full["p50"] > 0
    assert full["mean_context"] == pytest.approx((18.25 + 19.25 + 20.25) / 3)


@pytest.mark.parametrize("scheduling", [[], ["--async-scheduling"]], ids=["sync", "async"])
def test_latency_end_to_end(tmp_path, scheduling):
    out = tmp_path / "latency.json"
    latency.main(["--no-quiet-gc", "--input-len", "20", "--output-len", "5", "--num-iters-warmup", "1", "--num-iters", "2",
                  "--json", str(out), *CEILINGS, *scheduling])
    r = json.loads(out.read_text())
    assert len(r["ttft_s"]["all"]) == len(r["decode_s_per_token"]["all"]) == 2
    assert r["num_prefill_steps"] == 1
    cost = cost_of(default_model_path(), "float32")
    hw = Hardware(2e12, 0.5e12, "")
    assert r["ttft_bound_s"] == pytest.approx(step_bound([(20, 20)], 1, cost, hw))
    decode = sum(step_bound([(1, 20 + k)], 1, cost, hw) for k in range(1, 5)) / 4
    assert r["decode_bound_s_per_token"] == pytest.approx(decode)


def test_config_only_folder_runs_with_dummy_weights(tmp_path, capsys):
    shutil.copy(default_model_path() / "config.json", tmp_path / "config.json")
    latency.main(["--no-quiet-gc", "--config-dir", str(tmp_path), "--input-len", "8", "--output-len", "2",
                  "--num-iters-warmup", "0", "--num-iters", "1", *CEILINGS])
    assert "decode ms/token" in capsys.readouterr().out


def test_step_overhead_and_step_profile_run(capsys):
    from ferry.bench import step_overhead, step_profile

    step_overhead.main(["--requests", "4", "--prompt-len", "8", "--steps", "3"])
    assert "cpu total" in capsys.readouterr().out
    step_profile.main(["--no-quiet-gc", "--device", "cpu", "--batch-size", "2", "--input-len", "8", "--warmup-steps", "3",
                       "--steps", "2", "--profile-steps", "1", "--top", "3"])
    assert "step ms" in capsys.readouterr().out


def test_subcommands_register():
    from ferry.bench.cli import add_bench_command

    parser = argparse.ArgumentParser()
    add_bench_command(parser.add_subparsers())
    args = parser.parse_args(["bench", "throughput", "--input-len", "100", "1024", "--output-len", "512"])
    assert args.benchmark == "throughput" and args.input_len == [100, 1024]
    args = parser.parse_args(["bench", "latency", "--batch-size", "4"])
    assert args.benchmark == "latency" and args.max_num_seqs is None and args.device == "auto"


def test_fp8_weights_are_a_byte_and_their_matmuls_run_at_the_fp8_peak():
    """With --quantization fp8 the decoder layers' linear weights are one byte each (the embedding
    and norms stay bf16), and the linears' FLOPs meet the FP8 peak instead of the bf16 one."""
    path = BENCHMARKS / "llama-3.1-8b"
    bf16, fp8 = cost_of(path), ModelCost.from_model_config(
        ModelConfig.from_pretrained(path, "bfloat16", None, "dummy", quantization="fp8"))
    assert bf16.weight_bytes - fp8.weight_bytes == bf16.linear_params  # two bytes a weight -> one
    assert fp8.kv_bytes_per_token == bf16.kv_bytes_per_token
    decode = [(1, 1000)] * 64
    assert fp8.step_cost(decode, 64).bytes == bf16.step_cost(decode, 64).bytes - bf16.linear_params
    prefill = [(8192, 8192)]
    cost = fp8.step_cost(prefill, 1)
    assert cost.fp8_flops == 2 * fp8.linear_params * 8192 and bf16.step_cost(prefill, 1).fp8_flops == 0
    with_fp8 = Hardware(773e12, 4.27e12, "H200", fp8_peak_flops=1400e12)
    expected = (cost.flops - cost.fp8_flops) / 773e12 + cost.fp8_flops / 1400e12
    assert step_bound(prefill, 1, fp8, with_fp8) == pytest.approx(expected)
    assert step_bound(prefill, 1, fp8, H200) == pytest.approx(cost.flops / 773e12)  # no FP8 peak: the bf16 one
