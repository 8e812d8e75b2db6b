"""A split-K matrix-vector kernel for the linear layers of small decode batches, used only where it
measures faster than cuBLAS on the device at hand.

At batch 1 a linear layer reads its whole weight to produce one row: pure bandwidth. cuBLAS picks
its kernel from heuristics, and for some shapes the pick is poor: on an H200, Qwen3-0.6B's o_proj
(2048 -> 1024, 4 MB in bf16) took 12.3 us, a third of the bandwidth. The kernel here gives each
program BLOCK_N output columns and one of SPLIT_K slices of the input dimension:

    y (M, N) = x (M, K) @ W^T       W: (N, K), rows contiguous, as nn.Linear stores it

    program (n, s): acc (16, BLOCK_N) += x[:, k-tile] @ W[n-block, k-tile]^T  for the k-tiles of slice s
                    then acc goes to y, or (SPLIT_K > 1) to float32 partials that one sum adds up:
                    not atomics, whose order would make the result differ from run to run

The M rows of x are padded to 16 (tl.dot's minimum), which costs nothing: the weights dominate the
bytes. Which configuration, if any, beats cuBLAS is measured at startup for every distinct layer
shape (`tune`), in a CUDA graph as decode runs it, and each layer remembers its choice.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ferry.attention.kernels.launch import dot_precision
from ferry.layers.linear import SMALL_BATCH_ROWS

logger = logging.getLogger(__name__)

MAX_ROWS = SMALL_BATCH_ROWS  # tuning times 1 and this many rows
_MIN_DOT_ROWS = 16


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4


# Few, because each compiles at startup: the winners over Qwen3-0.6B's and Llama-3.1-8B's layer shapes
# at one row on an H200, among block_n 16/32/64, block_k 128/256 and split_k 1/2/4.
CANDIDATES = (GemvConfig(32, 128, 1), GemvConfig(64, 128, 1), GemvConfig(64, 256, 1), GemvConfig(32, 128, 4))


@triton.jit(do_not_specialize=["m"])
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr,
    m, n, k, stride_xm, stride_wn, stride_ym,
    k_tiles,  # BLOCK_K tiles per split
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for i in range(k_tiles):
        ks = (pid_k * k_tiles + i) * BLOCK_K + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :], mask=(cols[:, None] < n) & (ks[None, :] < k),
                    other=0.0)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=(rows[:, None] < m) & (ks[None, :] < k),
                    other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
    if HAS_BIAS:
        if pid_k == 0:
            acc += tl.load(bias_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)[None, :]
    mask = (rows[:, None] < m) & (cols[None, :] < n)
    # y: (M, N), or (SPLIT_K, M, N) float32 partials with stride_ym * m between slices.
    y_ptrs = y_ptr + pid_k * stride_ym * m + rows[:, None] * stride_ym + cols[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: GemvConfig) -> torch.Tensor:
    """F.linear(x, weight, bias) for x of at most 16 rows."""
    m, k = x.shape
    n = weight.shape[0]
    assert m <= _MIN_DOT_ROWS and x.stride(-1) == 1 and weight.stride(-1) == 1
    split = config.split_k
    k_tiles = triton.cdiv(triton.cdiv(k, split), config.block_k)
    if split == 1:
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    else:
        y = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    _gemv_kernel[(triton.cdiv(n, config.block_n), split)](
        x, weight, bias if bias is not None else weight, y,
        m, n, k, x.stride(0), weight.stride(0), n, k_tiles,
        HAS_BIAS=bias is not None, BLOCK_M=_MIN_DOT_ROWS, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        SPLIT_K=split, DOT_PRECISION=dot_precision(x.dtype), num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return y if split == 1 else y.sum(0).to(x.dtype)


# The weight dtypes the kernel is for: 16-bit. (A float32 model would want full-precision products,
# and its tiles would need more shared memory than some GPUs have.)
DTYPES = (torch.bfloat16, torch.float16)

Timings = dict[tuple[int, GemvConfig | None], float]  # (rows, config or None for cuBLAS) -> seconds


def tune(weight: torch.Tensor, bias: torch.Tensor | None) -> GemvConfig | None:
    """The configuration this layer should use for small batches, or None for cuBLAS."""
    if weight.dtype not in DTYPES:
        return None
    return choose(measure(weight, bias))


# In decode a layer's weights come from memory, not from the L2 cache (50 MB on an H200): the other
# layers' weights pass through it in between. Timing calls cycle through copies of the weight
# that together outgrow the cache.
_COLD_BYTES = 128 << 20


def measure(weight: torch.Tensor, bias: torch.Tensor | None) -> Timings:
    """Seconds per call of cuBLAS and of every candidate, at 1 and MAX_ROWS rows, replayed from CUDA
    graphs; inf for a candidate that does not run here or computes something else."""
    copies = [weight] + [weight.clone() for _ in range(min(31, _COLD_BYTES // weight.nbytes))]
    times: Timings = {}
    for rows in (1, MAX_ROWS):
        x = torch.randn(rows, weight.shape[1], device=weight.device, dtype=weight.dtype)
        expected = torch.nn.functional.linear(x, weight, bias)
        times[rows, None] = _graph_time(lambda w: torch.nn.functional.linear(x, w, bias), copies)
        for config in CANDIDATES:
            times[rows, config] = float("inf")
            try:
                y = gemv(x, weight, bias, config)
                if torch.allclose(y.float(), expected.float(), atol=1e-2, rtol=1e-2):
                    times[rows, config] = _graph_time(lambda w: gemv(x, w, bias, config), copies)
            except Exception as e:  # e.g. Triton's OutOfResources: an optimization is never fatal
                logger.warning("GEMV %s does not run on this device: %s", config, e)
    return times


def choose(times: Timings, margin: float = 0.9) -> GemvConfig | None:
    """The fastest candidate at one row among those that take at most `margin` of cuBLAS's time
    there and no more than cuBLAS at MAX_ROWS rows; None when no candidate does."""
    fast = [c for c in CANDIDATES
            if times[1, c] <= margin * times[1, None] and times[MAX_ROWS, c] <= times[MAX_ROWS, None]]
    return min(fast, key=lambda c: times[1, c], default=None)


def _graph_time(fn, weights: list[torch.Tensor], calls: int = 32, replays: int = 10) -> float:
    """Seconds per call of fn(weight), replayed from a CUDA graph of `calls` calls that take the
    weights in turn (launch costs as decode graphs see them)."""
    for w in weights[:3]:
        fn(w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(weights[i % len(weights)])
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / (calls * replays)
