"""The constants of `ferry doctor`'s model, in one place, with where each comes from.

The roofline bound (bench/roofline.py) is what a step could take at best; ferry's steps take longer,
and by much more at small batches, where fixed costs per kernel weigh more than the bytes. A step
is predicted as

    device = max(matmul FLOPs / (peak x compute), weight bytes / (bandwidth x weight_bandwidth))
             + max(attention FLOPs / (peak x compute), KV read) + kernels x kernel_s
    KV read = t + min(t, layers x kv_ramp_s)    t = KV bytes / (bandwidth x kv_bandwidth)
    step   = max(device, host)    host = layers x eager_layer_s + tokens x eager_token_s for a step
                                  launched eagerly, else 0
    TTFT from a prefill graph = device + replay_host_s + kernels x graph_launch_kernel_s

Every figure below was fitted to ferry's own measurements on an H200 (docs/benchmarks.md and
docs/doctor.md, Qwen3-0.6B and Llama-3.1-8B shapes, dummy bf16 weights), against the ceilings that
`measure_hardware` found there.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ferry.doctor.gpus import find_gpu


@dataclass(frozen=True)
class Calibration:
    """What ferry's kernels reach of a machine's ceilings, and the costs no ceiling explains."""

    compute: float  # share of the peak FLOP/s that a prefill's (or a large batch's) matmuls reach
    fp8_compute: float  # share of the FP8 peak that FP8 linears reach (activations quantized first)
    weight_bandwidth: float  # share of the bandwidth at which a step streams the weights
    kv_bandwidth: float  # share of the bandwidth at which attention streams a long read of the KV cache
    kv_ramp_s: float  # a layer's attention costs its read again, up to this: splits, partial rows, the merge
    kernel_s: float  # device time of one kernel beyond its FLOPs and bytes: launch latency, ramp-up, tail
    eager_layer_s: float  # host time to launch one layer's kernels eagerly (no graph to replay)
    eager_token_s: float  # and the host's bookkeeping of each token of such a step (inputs, block hashes)
    source: str
    # A prefill replayed from a graph: the host's work around the replay, which nothing overlaps for a
    # first token (scheduling, the inputs, the LM head and sampling, the token handed back), and its
    # launch, by the graph's kernels. (A decode step's are overlapped by the step before it.)
    replay_host_s: float = 0.0
    graph_launch_kernel_s: float = 0.0


# Against measured ceilings (`--gpu measured` on a GPU), fitted on an H200 that measured 796 TFLOP/s
# of bf16 matmul, 1,451 in FP8 and 4.26 TB/s of copy bandwidth:
# - compute 0.65: Llama-3.1-8B prefill, 512 tokens 13.3 ms against a bound of 8.98 (0.68), 8,192 tokens
#   236.2 ms against 165.3 (0.70), 32,000 tokens 1,475 ms against 900 (0.61).
# - fp8_compute 0.45: Llama-3.1-8B with FP8 weights and KV cache, 3000 requests of 128 / 128 tokens,
#   compute-bound: 21,163 output tok/s, 1.32x bf16's 16,042 where the FP8 peak is 1.82x the bf16 one.
# - weight_bandwidth 1.0 and kernel_s 2.3 us: the two batch-1 decodes, Qwen3-0.6B 0.830 ms (1.25 GB
#   moved, 230 kernels) and Llama-3.1-8B 4.17 ms (15.1 GB, 262 kernels), solved together: the GEMVs
#   stream the weights at the copy bandwidth, and each kernel adds its fixed 2.3 us.
# - kv_bandwidth 1.0 and kv_ramp_s 20 us: decode steps of 32 requests at context 784 (Qwen3-0.6B 1.95 to
#   2.04 ms, Llama-3.1-8B 5.68 to 5.72), whose reads of about 0.1 GB a layer (24 us at the bandwidth) take
#   about twice that; Llama-3.1-8B at batch 1 and context 32k, 5.469 ms. Checked against steps of 256
#   requests all decoding at context 797 (docs/doctor.md): Qwen3-0.6B 7.84 ms (predicted 7.18), and
#   Llama-3.1-8B 16.98 ms (14.94), whose linears at 256 rows are bound by their FLOPs, not their bytes.
# - eager_layer_s 0.62 ms: a 512-token prompt's TTFT, launched kernel by kernel, is the host's time
#   while the GPU waits: Qwen3-0.6B 18.9 ms and Llama-3.1-8B 24.5 ms on one host, 19.8 to 24.8 and
#   19.7 to 21.3 in other runs (an earlier host's gave 12.1 and 13.3 ms).
# - eager_token_s 5 us: Qwen3-0.6B's offline throughput, whose runs spend about 1 s beside their decode
#   steps (the run's time less its decode steps at the latency benchmark's speed) on prefill chunks of
#   16,384 tokens that take the GPU 40 ms each: 256 requests of 100-1,024 tokens / 512, 1.05 s over
#   9 such steps; 1024 of 512 / 256, 3.2 s over 32.
# - replay_host_s 0.55 ms and graph_launch_kernel_s 1.5 us: Qwen3-0.6B's step of one 512-token
#   prompt replayed from a prefill graph under torch.profiler (docs/benchmarks.md): 2.91 ms, of which
#   the replay alone 1.92 and cudaGraphLaunch 0.44 ms for the graph's 288 kernels (that split from the
#   profiled steps, whose tracing may lengthen the launch; the 0.99 ms they sum to, without it).
MEASURED_GPU = Calibration(
    compute=0.65, fp8_compute=0.45, weight_bandwidth=1.0, kv_bandwidth=1.0, kv_ramp_s=20e-6, kernel_s=2.3e-6,
    eager_layer_s=0.62e-3, eager_token_s=5e-6, source="ferry on an H200 against its measured ceilings",
    replay_host_s=0.55e-3, graph_launch_kernel_s=1.5e-6,
)

# The ceilings measure_hardware found on those H200s: 794-800 TFLOP/s of bf16 matmul (1,451 in FP8),
# 4.25-4.27 TB/s of copy bandwidth. Against a datasheet's ceilings the same kernels reach that much
# less of them.
_H200_MEASURED = {"bf16_tflops": 796.0, "fp8_tflops": 1451.0, "bandwidth_tbps": 4.26}


def _against_datasheet(measured: Calibration) -> Calibration:
    h200, reached = find_gpu("H200"), _H200_MEASURED
    bandwidth = reached["bandwidth_tbps"] / h200.bandwidth_tbps
    return replace(
        measured, compute=measured.compute * reached["bf16_tflops"] / h200.bf16_tflops,
        fp8_compute=measured.fp8_compute * reached["fp8_tflops"] / h200.fp8_tflops,
        weight_bandwidth=measured.weight_bandwidth * bandwidth, kv_bandwidth=measured.kv_bandwidth * bandwidth,
        source="ferry on an H200 against its datasheet's ceilings",
    )


DATASHEET_GPU = _against_datasheet(MEASURED_GPU)

# A CPU runs every step eagerly on the cores that compute it, so its fixed cost is per op and the
# host term is in it (eager_layer_s 0). Fitted to the bundled model (float32) on a 2-core x86 machine
# against measure_hardware("cpu"), whose figures vary by 2x there from run to run.
CPU = Calibration(
    compute=0.5, fp8_compute=0.5, weight_bandwidth=1.0, kv_bandwidth=1.0, kv_ramp_s=0.0, kernel_s=60e-6,
    eager_layer_s=0.0, eager_token_s=0.0, source="ferry on a 2-core x86 CPU against its measured ceilings",
)

# An FP8 KV cache: the decode kernel widens e4m3 to 16 bits as it loads each tile and is bound by
# those instructions more than by its bytes: at batch 256 it took 1/1.39 of the bf16 kernel's time
# for half the bytes (docs/benchmarks.md, Qwen3-0.6B's heads at contexts 1024 and 4096), so it reads
# at 0.7 of the rate a 16-bit cache is read at.
FP8_KV_RATE = 0.7

# Kernels of a decode step (as the CUDA graph replays them): about 8 a layer (the fused add+RMSNorm,
# qkv_proj, q/k norm + RoPE, the K/V store, attention and its merge, o_proj, gate_up_proj, down_proj
# with SiLU-and-mul, some of them fused where startup tuning found it faster) and 6 outside the
# layers (embedding, final norm, LM head, sampling): Qwen3-0.6B's 28 layers make the 230 a profile counted.
# Above gemv.MAX_ROWS rows the linears are cuBLAS GEMMs, and the norms and SiLU-and-mul are kernels of
# their own: 10 a layer (a 512-token prefill of Qwen3-0.6B: 2 RMSNorms, 4 GEMMs, RoPE, the K/V store,
# attention, SiLU-and-mul).
KERNELS_PER_LAYER = 8
KERNELS_PER_LAYER_GEMM = 10
GEMV_MAX_ROWS = 8  # gemv.MAX_ROWS (a test holds them equal; the doctor runs without Triton)
KERNELS_OUTSIDE_LAYERS = 6

# What a GPU's memory holds beside the weights and the KV cache, inside gpu_memory_utilization: the
# CUDA context, cuBLAS workspaces, the allocator's cached blocks. On the H200 the Qwen3-0.6B pool of
# 72,298 blocks and the Llama-3.1-8B pool of about 900,000 tokens leave 1.5-1.7 GiB of the 90%
# unaccounted. (A prefill chunk's activations and the decode graphs come out of the remaining 10%.)
ALLOWANCE_BYTES = int(1.7 * 2**30)

# Tensor parallelism: two all-reduces of the hidden states a layer (after attention and after the
# MLP), each a fixed latency (NCCL's small-message all-reduce inside one NVLink node, order 8 us in
# nccl-tests) plus its bytes over the link: a ring moves 2 (n - 1) / n of the tensor each way.
ALL_REDUCES_PER_LAYER = 2
ALL_REDUCE_LATENCY_S = 8e-6
