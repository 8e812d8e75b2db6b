"""`ferry doctor`: its formulas against figures worked out by hand on the Qwen3-0.6B and Llama-3.1-8B
shapes, the GPU table, and the command end to end on CPU (its --check measuring the bundled model)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from ferry.bench.roofline import Hardware
from ferry.cli import main
from ferry.config import EngineConfig
from ferry.doctor import calibration
from ferry.doctor.calibration import Calibration
from ferry.doctor.gpus import GPUS, find_gpu, gpu_named_like
from ferry.doctor.predict import (
    Deployment, Machine, compute_bound_batch, concurrency, itl, kv_bytes_per_token, kv_capacity, prefill_chunks,
    step_time, tokens_per_verify_step, ttft, weights_memory,
)

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
QWEN, LLAMA = BENCHMARKS / "qwen3-0.6b", BENCHMARKS / "llama-3.1-8b"
H200 = find_gpu("H200")
H200_MACHINE = Machine(H200.hardware(), calibration.DATASHEET_GPU, H200.memory_bytes, H200.link_gbps * 1e9)
# The roofline itself: every ceiling reached, nothing beside it.
ROOFLINE = Calibration(compute=1.0, fp8_compute=1.0, weight_bandwidth=1.0, kv_bandwidth=1.0, kv_ramp_s=0.0,
                       kernel_s=0.0, eager_layer_s=0.0, eager_token_s=0.0, source="the roofline")


def deployment(path: Path, machine: Machine = H200_MACHINE, **options) -> Deployment:
    return Deployment(EngineConfig.create(path, device="cuda", load_format="dummy", **options), machine)


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    try:
        code = main(["doctor", *argv])
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out + captured.err


# ---- memory, by hand ----


def test_qwen3_weights_and_kv_per_token_by_hand():
    linear = 28 * (1024 * 2048 + 2 * 1024 * 1024 + 2048 * 1024 + 3 * 1024 * 3072)  # q, k, v, o; gate, up, down
    others = 151936 * 1024 + 28 * (2 * 1024 + 2 * 128) + 1024  # the tied embedding, the norms
    assert (linear, others) == (440_401_920, 155_648_000)
    assert weights_memory(deployment(QWEN)).value == 2 * (linear + others)
    assert weights_memory(deployment(QWEN, quantization="fp8")).value == linear + 2 * others  # linears a byte each
    assert kv_bytes_per_token(deployment(QWEN)).value == 2 * 28 * 8 * 128 * 2 == 114_688
    assert kv_bytes_per_token(deployment(QWEN, kv_cache_dtype="fp8")).value == 114_688 / 2


def test_llama_3_1_8b_weights_and_kv_per_token_by_hand():
    linear = 32 * (4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096 + 3 * 4096 * 14336)
    others = 2 * 128256 * 4096 + 32 * 2 * 4096 + 4096  # embedding and LM head apart, the norms
    assert weights_memory(deployment(LLAMA)).value == 2 * (linear + others) == 16_060_522_496
    assert weights_memory(deployment(LLAMA, quantization="fp8")).value == linear + 2 * others == 9_081_200_640
    assert kv_bytes_per_token(deployment(LLAMA)).value == 2 * 32 * 8 * 128 * 2 == 131_072
    assert kv_bytes_per_token(deployment(LLAMA, kv_cache_dtype="fp8")).value == 65_536
    two_gpus = Deployment(deployment(LLAMA).config, H200_MACHINE, tensor_parallel=2)
    assert weights_memory(two_gpus).value == 16_060_522_496 / 2 and kv_bytes_per_token(two_gpus).value == 65_536


def test_kv_capacity_is_the_memory_left_in_blocks_capped_by_what_requests_can_use():
    d = deployment(QWEN)  # max_model_len 40,960: the memory, not the requests, is the limit
    budget = 141 * 2**30 * 0.9 - 2 * 596_049_920 - 1.7 * 2**30
    blocks = int(budget // (114_688 * 16))
    assert kv_capacity(d).value == blocks * 16
    assert concurrency(d, 1000).value == 256  # max_num_seqs: far fewer than the blocks hold
    assert concurrency(d, 1000).terms.startswith(f"min({blocks:,} blocks // 63 blocks a request")
    # 256 running requests at 4096 tokens can use 256 blocks each, one request 256: the engine allocates no more.
    assert kv_capacity(deployment(QWEN, max_model_len=4096)).value == 256 * 256 * 16 < blocks * 16
    assert kv_capacity(deployment(QWEN, max_model_len=4096, max_num_seqs=1)).value == 4096
    # An FP8 cache holds twice the tokens in the same bytes.
    assert kv_capacity(deployment(QWEN, kv_cache_dtype="fp8")).value // 2 == pytest.approx(blocks * 16, abs=16)


def test_a_cpu_kv_cache_is_ferrys_fixed_pool():
    from ferry.assets import default_model_path

    config = EngineConfig.create(default_model_path(), device="cpu")
    d = Deployment(config, Machine(Hardware(1e11, 1e10, "cpu"), calibration.CPU, None))
    per_block = 2 * 6 * 2 * 64 * 4 * 16  # float32 on a CPU
    assert kv_capacity(d).value == (config.cache.cpu_kv_cache_bytes // per_block) * 16


# ---- speed, by hand ----


def test_decode_step_is_the_slower_ceiling_plus_kernels():
    c = Calibration(compute=0.5, fp8_compute=0.25, weight_bandwidth=0.8, kv_bandwidth=0.6, kv_ramp_s=20e-6,
                    kernel_s=2e-6, eager_layer_s=1e-3, eager_token_s=1e-5, source="")
    machine = Machine(Hardware(1000e12, 5e12, "test"), c, 100 * 2**30)
    d = deployment(LLAMA, machine)
    context, batch = 1000, 4
    linear, vocab_h = 6_979_321_856, 128256 * 4096
    matmul_flops = batch * (2 * linear + 2 * vocab_h)
    attention_flops = batch * 4 * 32 * 32 * 128 * (context + 1)
    weights = 2 * (linear + vocab_h + 32 * 2 * 4096 + 4096 + batch * 4096)  # the LM head whole, `batch` embedding rows
    kv = batch * 131_072 * (context + 1)
    read = kv / 3e12 + min(kv / 3e12, 32 * 20e-6)  # a short read costs itself again
    # The linears and attention are separate kernels: each bound by its own work, the two added.
    expected = max(matmul_flops / 500e12, weights / 4e12) + max(attention_flops / 500e12, read) + (8 * 32 + 6) * 2e-6
    assert itl(d, batch, context).value == pytest.approx(expected)
    assert weights / 4e12 > matmul_flops / 500e12  # memory-bound at batch 4
    # At batch 256 the linears are bound by their FLOPs, and attention's KV read comes on top.
    big = 256
    matmul_s = big * (2 * linear + 2 * vocab_h) / 500e12
    kv = big * 131_072 * (context + 1)
    read = kv / 3e12 + min(kv / 3e12, 32 * 20e-6)
    assert matmul_s > 2 * (linear + vocab_h) / 4e12
    # Above 8 rows the linears are cuBLAS's and the norms and SiLU-and-mul kernels of their own: 10 a layer.
    assert itl(d, big, context).value == pytest.approx(matmul_s + read + (10 * 32 + 6) * 2e-6, rel=1e-3)
    long = 256 * 131_072 * (4096 + 1)  # a long read: its bytes and 20 us a layer
    assert itl(d, 256, 4096).terms.count(f"min({long / 3e12 * 1e3:.2f} ms, 32 layers x 20 us = 0.640 ms)") == 1
    # Past the largest graph (max_num_seqs here) a step is launched eagerly: the host's 32 layers x 1 ms
    # and 4 tokens x 10 us.
    eager = Deployment(EngineConfig.create(LLAMA, device="cuda", max_num_seqs=2), machine)
    assert itl(eager, batch, context).value == pytest.approx(max(expected, 32e-3 + 4e-5))


def test_compute_bound_batch_from_the_ratio_of_peak_to_bandwidth():
    peak, bandwidth = 989.5e12, 4.8e12
    d = deployment(QWEN, Machine(Hardware(peak, bandwidth, "roofline"), ROOFLINE, 141 * 2**30))
    weights = 2 * 596_049_920  # every weight, the tied embedding read once as the LM head
    flops = 2 * 440_401_920 + 2 * 151936 * 1024  # a token's linears and LM head
    for context in (0, 16):
        per_flops = flops + 4 * 28 * 16 * 128 * (context + 1)
        per_kv = 114_688 * (context + 1)
        expected = (weights / bandwidth) / (per_flops / peak - per_kv / bandwidth)
        assert compute_bound_batch(d, context).value == math.ceil(expected)
    # With next to no KV (the new token's), the crossover is peak / bandwidth (206 FLOP a byte) x the weights'
    # bytes per FLOP of a token (2 B a weight, 2 FLOP a weight: 1), 2% above it for that token's K and V.
    assert weights / flops == pytest.approx(1.0, rel=1e-3)
    assert compute_bound_batch(d, 0).value == pytest.approx(peak / bandwidth, rel=0.03)
    # At 512 tokens a request's KV reads outlast its FLOPs (2 FLOP a byte of KV): never compute-bound.
    assert compute_bound_batch(d, 512).value == math.inf


def test_prefill_is_cut_into_steps_as_the_budget_allows():
    assert prefill_chunks(10, 3, 16) == [([(10, 10), (6, 6)], 1), ([(4, 10), (10, 10)], 2)]
    assert prefill_chunks(32000, 1, 16384) == [([(16384, 16384)], 0), ([(15616, 32000)], 1)]


def test_ttft_of_a_short_prompt_is_the_host_and_of_a_long_one_the_gpu():
    qwen = ttft(deployment(QWEN), 512)
    host = calibration.DATASHEET_GPU
    assert qwen.value == pytest.approx(28 * host.eager_layer_s + 512 * host.eager_token_s)  # the GPU waits for the host
    llama = ttft(deployment(LLAMA, max_model_len=65536), 32000)
    assert llama.terms.startswith("2 steps' terms summed")  # 16,384 + 15,616 tokens
    flops = 2 * 6_979_321_856 * 32000 + 4 * 32 * 32 * 128 * (32000 * 32001 // 2) + 2 * 128256 * 4096
    assert llama.value == pytest.approx(flops / (989.5e12 * calibration.DATASHEET_GPU.compute), rel=0.03)


def test_ttft_from_a_prefill_graph_is_the_device_and_the_host_around_the_replay():
    eager = ttft(deployment(QWEN), 512)
    graphs = ttft(deployment(QWEN, max_prefill_graph_tokens=512), 512)
    c = calibration.DATASHEET_GPU
    kernels = 10 * 28 + 6
    host = c.replay_host_s + kernels * c.graph_launch_kernel_s  # nothing before a first token to overlap it
    assert f"{kernels} kernels launched" in graphs.terms and "max(host" not in graphs.terms
    device = graphs.value - host
    assert device == pytest.approx(step_time(deployment(QWEN), [(512, 512)], 1).seconds)
    assert graphs.value < eager.value / 3
    longer = ttft(deployment(QWEN, max_prefill_graph_tokens=256), 512)  # 512 tokens: no graph holds them
    assert longer.value == eager.value


def test_the_doctors_row_count_of_the_small_batch_path_is_the_gemvs():
    pytest.importorskip("triton")
    from ferry.layers import gemv

    assert calibration.GEMV_MAX_ROWS == gemv.MAX_ROWS


def test_tokens_per_verify_step():
    assert tokens_per_verify_step(4, 0.7) == pytest.approx(1 + 0.7 + 0.7**2 + 0.7**3 + 0.7**4)
    assert tokens_per_verify_step(3, 0.0) == 1


# ---- the GPU table ----


def test_the_gpu_table():
    assert {g.name for g in GPUS} >= {"H100-SXM", "H100-PCIe", "H200", "A100-80GB-SXM", "A100-40GB", "L40S",
                                       "RTX-4090", "B200"}
    assert find_gpu("h100 sxm") is find_gpu("H100_SXM") is find_gpu("H100-SXM")
    h200 = H200.hardware()
    assert (h200.peak_flops, h200.fp8_peak_flops, h200.bandwidth_bytes_per_s) == (989.5e12, 1979e12, 4.8e12)
    assert find_gpu("A100-40GB").hardware().fp8_peak_flops is None
    with pytest.raises(ValueError, match="unknown GPU 'V100'.*H100-SXM, H100-PCIe, H200"):
        find_gpu("V100")
    assert gpu_named_like("NVIDIA H200") is H200
    assert gpu_named_like("NVIDIA H100 80GB HBM3").name == "H100-SXM"
    assert gpu_named_like("NVIDIA H100 PCIe").name == "H100-PCIe"
    assert gpu_named_like("Tesla T4") is None


# ---- the command ----


def test_doctor_on_a_named_gpu(capsys, tmp_path):
    out = tmp_path / "doctor.json"
    code, text = run_cli(capsys, str(QWEN), "--gpu", "H200", "--batch-sizes", "1", "64", "--json", str(out))
    assert code == 0, text
    assert "KV cache per token = 2 x 28 layers x 8 KV heads x 128 head dim x 2 B = 114,688 B" in text
    assert "ITL at batch 64, context 768 = max(" in text and "kernels x 2.3 us" in text
    for what_if in ("FP8 weights", "FP8 KV cache", "tensor parallel 2"):
        assert f"\n  {what_if} " in text
    r = json.loads(out.read_text())
    figures = {f["key"]: f for f in r["figures"]}
    assert figures["weights_bytes"]["value"] == 2 * 596_049_920
    assert figures["itl_s_batch_64"]["value"] > figures["itl_s_batch_1"]["value"] > 0
    what_if = r["what_if"]
    assert what_if["FP8 KV cache"]["KV tokens"]["value"] > 1.9 * what_if["as configured"]["KV tokens"]["value"]
    assert what_if["tensor parallel 2"]["weights"]["value"] == 596_049_920
    assert [f["key"] for f in r["speculative"]] == ["speculative_itl_s_batch_1", "speculative_itl_s_batch_64"]


def test_doctor_check_on_cpu(capsys, tmp_path):
    out = tmp_path / "doctor.json"
    code, text = run_cli(capsys, "--gpu", "cpu", "--check", "--prompt-len", "8", "--output-len", "3",
                         "--batch-sizes", "1", "2", "--check-requests", "2", "--check-iters", "1", "--check-steps", "2",
                         "--json", str(out))
    assert code == 0, text
    assert "predicted" in text and "measured" in text and "error" in text
    check = {row["quantity"]: row for row in json.loads(out.read_text())["check"]}
    assert list(check) == ["KV capacity", "throughput, 2 requests of 8 in / 3 out", "TTFT, one prompt of 8 tokens",
                           "ITL at batch 1, context 12", "ITL at batch 2, context 12"]
    # The CPU pool is sized as predicted, to the block.
    assert check["KV capacity"]["predicted"] == check["KV capacity"]["measured"] and check["KV capacity"]["error"] == 0
    for row in check.values():
        assert row["measured"] > 0
        assert row["error"] == pytest.approx((row["predicted"] - row["measured"]) / row["measured"])


@pytest.mark.parametrize("argv, message", [
    (["/no/such/model", "--gpu", "H200"], "no config.json in model folder /no/such/model"),
    (["--gpu", "H200", "--batch-sizes", "1", "0"], "--batch-sizes must be >= 1, got 0"),
    (["--gpu", "H200", "--context-len", "4096"], "--context-len is 4,096 tokens, more than max_model_len 2,048"),
    (["--gpu", "V100"], "unknown GPU 'V100': the table has H100-SXM"),
    (["--gpu", "H200", "--spec-acceptance", "1"], "--spec-acceptance must be in [0, 1)"),
    (["--gpu", "H200", "--batch-sizes", "x"], "invalid int value: 'x'"),
    (["--gpu", "cpu", "--check", "--check-iters", "0"], "--check-iters must be >= 1, got 0"),
])
def test_bad_input_is_a_clear_error_with_exit_code_2(capsys, argv, message):
    code, text = run_cli(capsys, *argv)
    assert code == 2 and message in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is measured by default")
def test_without_a_gpu_one_must_be_named(capsys):
    code, text = run_cli(capsys)
    assert code == 2 and "no CUDA device here: name a GPU with --gpu" in text
    code, text = run_cli(capsys, "--gpu", "H200", "--check")
    assert code == 2 and "--check measures this machine, which has no CUDA device" in text
