"""A matrix-vector kernel for the linear layers of small decode batches, used only where it measures
faster than cuBLAS on the device at hand.

At batch 1 a linear layer reads its whole weight to produce one row: pure bandwidth, and for the
small layers of a small model, launch latency too. cuBLAS picks its kernel from heuristics, and
for these shapes the pick is often poor: on an H200, Qwen3-0.6B's o_proj (2048 -> 1024, 4 MB in
bf16) took 12.7 us in cuBLAS, a tenth of the bandwidth; this kernel takes 3.2 us.

    y (M, N) = x (M, K) @ W^T       W: (N, K), rows contiguous, as nn.Linear stores it

    program n:  for each BLOCK_K tile of K:
                    w = W[BLOCK_N columns of y, tile]            one wide load, many bytes in flight
                    for each of the M rows:  acc[row] += sum over the tile of w * x[row, tile]

No tensor cores: at one row they would multiply mostly padding, and a GEMV has nothing to reuse.
What matters is keeping enough loads in flight to cover the memory latency on every multiprocessor:
many programs of a few output columns each (BLOCK_N 2 to 16), each loading a whole BLOCK_N x
BLOCK_K tile at once. No split over K either: each program owns its outputs, so there is no second
pass, no float atomics, and the result is the same from run to run.

From four rows on, that kernel runs out of arithmetic (its time grows with the rows), and a second
one (`_gemv_mma_kernel`) does the product on tensor cores, turned around: the weight's rows on the
MMA's wide side, the batch's few rows on its narrow one, padded to 16.

Which configuration, if any, beats cuBLAS is measured at startup for every distinct layer shape
(`tune`), in CUDA graphs as decode replays them, separately for each bucket of row counts
(ROW_BUCKETS): one row, a small decode batch, and a verify step's request with its proposals. At
four rows cuBLAS's tensor-core kernels often win back what they lose at one. Rows past the batch's
count in a block of rows are skipped, not computed and dropped: five rows cost five, not eight.
A layer fed by a small op is timed together with it, as the model runs it (`path_times`).

At decode batch sizes the small ops between the projections cost more in launches than in work,
and two of them can ride along with the GEMV's input loads (`_input_tile`), rounded as their own
kernels round (the activation wherever the GEMV serves a batch, the norm at one row):

    gate_up -> silu(gate) * up -> down_proj         down_proj's GEMV reads gate_up (silu_mul)
    x, residual -> add+RMSNorm -> qkv_proj           the GEMV sums, normalizes and writes the new
    x, residual -> add+RMSNorm -> gate_up_proj       residual (gemv_rms_norm)

So cuBLAS for Llama-3.1-8B's gate_up_proj (within 4% of this kernel alone) can still lose to the GEMV
once the norm's kernel is counted on cuBLAS's side.

FP8 weights (quantization/fp8.py, a scale per output row) are read as they are, a byte each, and
widened to float32 in registers; each output column is multiplied by its row's scale at the end,
and the activations stay 16-bit (weight-only FP8, as the one-row GEMV needs: half the bytes of a
16-bit weight, the bound of a batch-1 decode). For an FP8 layer the path the GEMV must beat is the
FP8 GEMM (`Fp8Linear.matmul`: the activations quantized, then cuBLASLt), not a 16-bit cuBLAS.

On Hopper the kernel launches with programmatic dependent launch (kernels/pdl.py): its
programs start while the kernel before it finishes, and load their first weight tile before
waiting for the input that kernel writes. The gap between two kernels, a microsecond or two of
idle bandwidth, is then spent streaming weights.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ferry.kernels.pdl import let_next_kernel_start, pdl_launch, wait_for_previous_kernel
from ferry.quantization.e4m3 import FP8

logger = logging.getLogger(__name__)

# Batches of up to MAX_ROWS rows may run the GEMV (Linear dispatches them here once tuned), in
# buckets of row counts, each timed at its largest (its worst case): one row (decode at batch 1), two
# to four (small decode batches), five to eight (a request verifying four proposals: five rows).
ROW_BUCKETS = (1, 4, 8)
MAX_ROWS = ROW_BUCKETS[-1]
# A GEMV path replaces cuBLAS only when it takes at most this fraction of cuBLAS's time. Replayed
# from CUDA graphs, 320 calls at a time, the timings repeat within about 1%: a 3% win is real,
# and at batch 1 a few percent on each of a large model's big layers add up to a tenth of a step.
WIN_MARGIN = 0.97


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int = 4
    # On tensor cores (_gemv_mma_kernel), with this many K tiles in flight: for two rows or more,
    # without the norm.
    tensor_cores: bool = False
    num_stages: int = 1

    def __str__(self) -> str:
        if self.tensor_cores:
            return f"MMA {self.block_n}x{self.block_k} ({self.num_warps} warps, {self.num_stages} stages)"
        return f"GEMV {self.block_n}x{self.block_k} ({self.num_warps} warps)"


# Few, because each compiles at startup: the fastest over Qwen3-0.6B's and Llama-3.1-8B's layer shapes
# on an H200, at one, four and eight rows (`python -m ferry.bench.gemv` times them all). 8 x 4096 with
# 8 warps: Llama-3.1-8B's gate_up over FP8 weights at one row, 28.7 us against 30.6 with the best of
# the others (docs/benchmarks.md, "Where the FP8 time goes").
CANDIDATES = (
    GemvConfig(2, 1024, 4), GemvConfig(2, 2048, 8), GemvConfig(4, 512, 4), GemvConfig(4, 1024, 4),
    GemvConfig(8, 2048, 8), GemvConfig(16, 1024, 8), GemvConfig(8, 4096, 8),
)
# For two rows or more, also the tensor-core kernel, its batch rows padded to MMA_ROWS.
MMA_ROWS = 16
FEW_ROW_CANDIDATES = (
    GemvConfig(16, 256, 4, True, 3), GemvConfig(32, 256, 4, True, 3), GemvConfig(32, 128, 4, True, 4),
    GemvConfig(64, 128, 4, True, 4), GemvConfig(16, 512, 4, True, 2),
)


def candidates(rows: int) -> tuple[GemvConfig, ...]:
    return CANDIDATES if rows == 1 else CANDIDATES + FEW_ROW_CANDIDATES


@triton.jit
def _input_tile(
    x_ptr, residual_ptr, residual_out_ptr, norm_ptr, r, ks, mask, k, stride_xm, stride_rm, inv_rms, owner,
    SILU_MUL: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    """Row r of the product's input over the K positions `ks`, in float32, rounded at each step as
    the separate kernels round it (layers/fused.py): x, or silu(gate) * up, or the RMSNorm of x
    (+ residual). With a residual, the program that owns it writes the new residual stream."""
    x = tl.load(x_ptr + r * stride_xm + ks, mask=mask, other=0.0)
    if SILU_MUL:  # x holds gate then up
        g = x.to(tl.float32)
        up = tl.load(x_ptr + r * stride_xm + k + ks, mask=mask, other=0.0).to(tl.float32)
        x = ((g / (1.0 + tl.exp(-g))).to(x.dtype).to(tl.float32) * up).to(x.dtype)
    if NORM:
        if HAS_RESIDUAL:
            s = x.to(tl.float32) + tl.load(residual_ptr + r * stride_rm + ks, mask=mask, other=0.0).to(tl.float32)
            x = s.to(x.dtype)
            if owner:
                tl.store(residual_out_ptr + r * stride_rm + ks, x, mask=mask)
        normed = (x.to(tl.float32) * inv_rms).to(x.dtype).to(tl.float32)
        x = (normed * tl.load(norm_ptr + ks, mask=ks < k, other=0.0).to(tl.float32)).to(x.dtype)
    return x.to(tl.float32)


@triton.jit
def _weight_tile_raw(w_ptr, cols, col_ok, k0, k, stride_wn, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """W[cols, k0 : k0 + BLOCK_K] in the weight's dtype, zero outside the matrix."""
    ks = k0 + tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + cols[:, None] * stride_wn + ks[None, :]
    if EVEN_K:  # a mask that is constant along K keeps the loads vectorized
        w = tl.load(w_ptrs, mask=col_ok[:, None], other=0.0)
    else:
        w = tl.load(w_ptrs, mask=col_ok[:, None] & (ks[None, :] < k), other=0.0)
    return w


@triton.jit
def _weight_tile(w_ptr, cols, col_ok, k0, k, stride_wn, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """W[cols, k0 : k0 + BLOCK_K] in float32, zero outside the matrix."""
    return _weight_tile_raw(w_ptr, cols, col_ok, k0, k, stride_wn, BLOCK_K, EVEN_K).to(tl.float32)


@triton.jit
def _accumulate(
    acc, w, k0, x_ptr, residual_ptr, residual_out_ptr, norm_ptr, m, k, stride_xm, stride_rm, inv_rms, owner,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SILU_MUL: tl.constexpr, NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """acc[row] += the weight tile w (BLOCK_N, BLOCK_K) at K offset k0 times each row's input there."""
    rows = tl.arange(0, BLOCK_M)
    ks = k0 + tl.arange(0, BLOCK_K)
    for r in tl.static_range(BLOCK_M):
        if r < m:  # the block's rows past the batch's are skipped
            x = _input_tile(
                x_ptr, residual_ptr, residual_out_ptr, norm_ptr, r, ks, ks < k, k, stride_xm, stride_rm,
                tl.sum(tl.where(rows == r, inv_rms, 0.0)), owner, SILU_MUL, NORM, HAS_RESIDUAL,
            )
            acc = tl.where(rows[:, None] == r, acc + tl.sum(w * x[None, :], axis=1)[None, :], acc)
    return acc


@triton.jit(do_not_specialize=["m"])
def _gemv_kernel(
    x_ptr, w_ptr, w_scale_ptr, bias_ptr, y_ptr, residual_ptr, residual_out_ptr, norm_ptr,
    m, n, k, stride_xm, stride_wn, stride_ym, stride_rm, eps,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, SILU_MUL: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    W_SCALE: tl.constexpr, PDL: tl.constexpr,
):
    let_next_kernel_start(PDL)
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    rows = tl.arange(0, BLOCK_M)
    # The first weight tile loads before the wait for the kernel that writes x (pdl.py): the
    # weights are constant, and their bytes are the whole cost.
    w = _weight_tile(w_ptr, cols, col_ok, 0, k, stride_wn, BLOCK_K, EVEN_K)
    wait_for_previous_kernel(PDL)
    inv_rms = tl.zeros([BLOCK_M], dtype=tl.float32)
    if NORM:  # a first pass over each row for its RMS (x is a few KB: it comes from cache)
        for r in tl.static_range(BLOCK_M):
            if r < m:
                sum_sq = 0.0
                for k0 in range(0, k, BLOCK_K):
                    ks = k0 + tl.arange(0, BLOCK_K)
                    mask = ks < k
                    x = tl.load(x_ptr + r * stride_xm + ks, mask=mask, other=0.0)
                    if HAS_RESIDUAL:
                        s = x.to(tl.float32) + tl.load(residual_ptr + r * stride_rm + ks, mask=mask, other=0.0).to(tl.float32)
                        x = s.to(x.dtype)
                    x = x.to(tl.float32)
                    sum_sq += tl.sum(x * x)
                inv_rms = tl.where(rows == r, tl.rsqrt(sum_sq / k + eps), inv_rms)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc = _accumulate(acc, w, 0, x_ptr, residual_ptr, residual_out_ptr, norm_ptr, m, k, stride_xm, stride_rm,
                      inv_rms, pid == 0, BLOCK_M, BLOCK_K, SILU_MUL, NORM, HAS_RESIDUAL)
    for k0 in range(BLOCK_K, k, BLOCK_K):
        w = _weight_tile(w_ptr, cols, col_ok, k0, k, stride_wn, BLOCK_K, EVEN_K)
        acc = _accumulate(acc, w, k0, x_ptr, residual_ptr, residual_out_ptr, norm_ptr, m, k, stride_xm, stride_rm,
                          inv_rms, pid == 0, BLOCK_M, BLOCK_K, SILU_MUL, NORM, HAS_RESIDUAL)
    if W_SCALE:  # FP8 weights: each output column times its weight row's scale
        acc *= tl.load(w_scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    mask = (rows[:, None] < m) & col_ok[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["m"])
def _gemv_mma_kernel(
    x_ptr, w_ptr, w_scale_ptr, bias_ptr, y_ptr, m, n, k, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, SILU_MUL: tl.constexpr, W_SCALE: tl.constexpr, PDL: tl.constexpr,
):
    """y = x @ W^T for a few rows on tensor cores, the product turned around so that the weight's
    rows take the MMA's wide side and the batch's rows its narrow one (padded to BLOCK_M = 16):

        program n:  acc (BLOCK_N, BLOCK_M) += W[BLOCK_N rows, K tile] @ x[:, K tile]^T
                    y[:, BLOCK_N columns] = acc^T

    The loop's loads are pipelined (num_stages tiles in flight), which keeps the weights streaming
    where the FMA kernel above runs out of arithmetic at four rows and more."""
    let_next_kernel_start(PDL)
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    rows = tl.arange(0, BLOCK_M)
    wait_for_previous_kernel(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        w = _weight_tile_raw(w_ptr, cols, col_ok, k0, k, stride_wn, BLOCK_K, EVEN_K)
        x_mask = (rows[None, :] < m) & (ks[:, None] < k)
        x_ptrs = x_ptr + rows[None, :] * stride_xm + ks[:, None]  # x^T: (BLOCK_K, BLOCK_M)
        xt = tl.load(x_ptrs, mask=x_mask, other=0.0)
        if SILU_MUL:  # x holds gate then up, rounded as the activation's own kernel rounds
            g = xt.to(tl.float32)
            up = tl.load(x_ptrs + k, mask=x_mask, other=0.0).to(tl.float32)
            xt = ((g / (1.0 + tl.exp(-g))).to(xt.dtype).to(tl.float32) * up).to(xt.dtype)
        if w.dtype == tl.float32:  # (tests: exact products, not TF32)
            acc = tl.dot(w, xt, acc, input_precision="ieee")
        elif W_SCALE:  # FP8 weights widened (exactly) to the activations' 16 bits
            acc = tl.dot(w.to(xt.dtype), xt, acc)
        else:
            acc = tl.dot(w, xt.to(w.dtype), acc)
    if W_SCALE:
        acc *= tl.load(w_scale_ptr + cols, mask=col_ok, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
    mask = (rows[None, :] < m) & col_ok[:, None]
    tl.store(y_ptr + rows[None, :] * stride_ym + cols[:, None], acc.to(y_ptr.dtype.element_ty), mask=mask)


def gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: GemvConfig, silu_mul: bool = False,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias) for x of a few rows (each compiles its own power-of-two row count).
    silu_mul: x is (m, 2k), gate then up, and the product is with silu(gate) * up: the MLP's
    activation done as the down projection loads its input, one kernel fewer per layer.
    weight_scale: an FP8 weight's (n,) float32 row scales (the weight stands for weight * scale)."""
    assert x.shape[1] == (2 * weight.shape[1] if silu_mul else weight.shape[1])
    return _launch(x, weight, bias, config, silu_mul=silu_mul, weight_scale=weight_scale)


def gemv_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
    bias: torch.Tensor | None, config: GemvConfig, weight_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(F.linear(rms_norm(x + residual), weight, bias), x + residual) in one kernel: the layer's
    norm done as its first projection loads its input. The new residual is a new tensor (every
    program reads the old one while the first writes the sum); without a residual it is x."""
    assert x.shape[1] == weight.shape[1] and (residual is None or residual.shape == x.shape)
    residual_out = None if residual is None else torch.empty_like(residual)
    y = _launch(x, weight, bias, config, residual=residual, residual_out=residual_out, norm=(norm_weight, eps),
                weight_scale=weight_scale)
    return y, (x if residual is None else residual_out)


def _launch(
    x, weight, bias, config, silu_mul=False, residual=None, residual_out=None, norm=None, weight_scale=None,
) -> torch.Tensor:
    m = x.shape[0]
    n, k = weight.shape
    assert (weight_scale is not None) == (weight.dtype == FP8), "FP8 weights, and only they, come with row scales"
    assert weight_scale is None or weight_scale.shape == (n,), "one scale per weight row"
    w_scale = weight_scale if weight_scale is not None else weight  # (unread without W_SCALE)
    assert k > 0 and x.stride(-1) == 1 and weight.stride(-1) == 1  # (the first weight tile is read unmasked)
    assert residual is None or (residual.stride(-1) == 1 and residual.stride(0) == residual_out.stride(0))
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if config.tensor_cores:
        assert norm is None and m <= MMA_ROWS, "the tensor-core GEMV takes no norm, and at most MMA_ROWS rows"
        _gemv_mma_kernel[(triton.cdiv(n, config.block_n),)](
            x, weight, w_scale, bias if bias is not None else weight, y, m, n, k, x.stride(0), weight.stride(0), n,
            HAS_BIAS=bias is not None, BLOCK_M=MMA_ROWS, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            EVEN_K=k % config.block_k == 0, SILU_MUL=silu_mul, W_SCALE=weight_scale is not None,
            num_warps=config.num_warps,
            num_stages=config.num_stages, **pdl_launch(x.device),
        )
        return y
    norm_weight, eps = norm if norm is not None else (weight, 0.0)
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, w_scale, bias if bias is not None else weight, y,
        residual if residual is not None else x, residual_out if residual_out is not None else x, norm_weight,
        m, n, k, x.stride(0), weight.stride(0), n, residual.stride(0) if residual is not None else 0, eps,
        HAS_BIAS=bias is not None, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, EVEN_K=k % config.block_k == 0, SILU_MUL=silu_mul, NORM=norm is not None,
        HAS_RESIDUAL=residual is not None, W_SCALE=weight_scale is not None, num_warps=config.num_warps,
        num_stages=1, **pdl_launch(x.device),
    )
    return y


# The weight dtypes the kernel is for: 16-bit and FP8 (with row scales). (A float32 layer is
# compute-heavier per byte, and cuBLAS serves it well.)
DTYPES = (torch.bfloat16, torch.float16, FP8)

Timings = dict[tuple[int, GemvConfig | None], float]  # (rows, config or None for cuBLAS) -> seconds


Buckets = tuple[tuple[int, GemvConfig | None], ...]  # (up to this many rows, config or None for cuBLAS)


@dataclass(frozen=True)
class LayerWeights:
    """A linear layer as the tuning sees it: its weight (16-bit, or FP8 with `weight_scale`, a scale
    per row), its bias, the activations' dtype, and the product the GEMV must beat: `matmul(x, w)`,
    cuBLAS by default, the FP8 GEMM for an FP8 layer; `matmul_quantized(qx, x_scale, w)`, that GEMM
    taking activations the op before it quantized (layers/fused.py's `*_fp8`), as the model runs it."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    weight_scale: torch.Tensor | None = None
    dtype: torch.dtype | None = None  # of the activations; None: the weight's
    matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    matmul_quantized: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    @property
    def x_dtype(self) -> torch.dtype:
        return self.dtype or self.weight.dtype

    def baseline(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, w) if self.matmul is not None else torch.nn.functional.linear(x, w, self.bias)

    def gemv(self, x: torch.Tensor, w: torch.Tensor, config: GemvConfig, silu_mul: bool = False) -> torch.Tensor:
        return gemv(x, w, self.bias, config, silu_mul=silu_mul, weight_scale=self.weight_scale)

    def gemv_rms_norm(self, x, residual, norm_weight, eps, w, config):
        return gemv_rms_norm(x, residual, norm_weight, eps, w, self.bias, config, self.weight_scale)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The product in float32 of the numbers the layer holds (an FP8 weight dequantized)."""
        w = self.weight.float()
        if self.weight_scale is not None:
            w = w * self.weight_scale.float()[:, None]
        return torch.nn.functional.linear(x.float(), w, None if self.bias is None else self.bias.float())


def tune(layer: LayerWeights, input_op: str | None = None) -> tuple[Buckets, bool]:
    """The configuration this layer should use for each bucket of ROW_BUCKETS (None: cuBLAS), and
    whether at one row its RMSNorm runs inside the GEMV. Each is the fastest way to run the layer
    together with the op that feeds it (`input_op`), as the model runs it: cuBLAS after the op's own
    kernel, or the GEMV after it, or the GEMV with the op inside (`path_times`)."""
    assert input_op in (None, "rms_norm", "silu_and_mul"), input_op
    if layer.weight.dtype not in DTYPES:
        return tuple((rows, None) for rows in ROW_BUCKETS), False
    copies = cold_copies(layer.weight)
    buckets, fuses_norm, low = [], False, 1
    for rows in ROW_BUCKETS:
        times = path_times(layer, input_op, rows, copies)
        config, inside = _fastest_that_agrees(layer, times, tuple(range(low, rows + 1)))
        buckets.append((rows, config))
        fuses_norm = fuses_norm or inside  # (only one row times the norm inside)
        low = rows + 1
    return tuple(buckets), fuses_norm


def _fastest_that_agrees(layer: LayerWeights, times: PathTimes, rows: tuple) -> tuple[GemvConfig | None, bool]:
    """fastest_path, among the paths whose variants compute what torch does at these row counts.
    Every variant a chosen configuration will run is built and checked here, where a failure only
    costs the optimization, not in the middle of a graph capture or a step."""
    times = dict(times)
    while True:
        config, inside = fastest_path(times)
        if config is None:
            return None, False
        if _variants_agree(layer, config, rows) and (not inside or _norm_fusion_agrees(layer, config)):
            return config, inside
        del times[config, inside]  # and try the next fastest


PathTimes = dict[tuple[GemvConfig | None, bool], float]  # (config or None for cuBLAS, op inside) -> s


def path_times(layer: LayerWeights, input_op: str | None, rows: int, copies: list[torch.Tensor]) -> PathTimes:
    """Seconds per call, replayed from CUDA graphs, of the layer with its input op at `rows` rows:
    (None, False) cuBLAS after the op's kernel (or the FP8 GEMM, fed by the op's kernel writing FP8
    where it can, as Linear runs it); (config, False) the GEMV after it,
    or with SiLU-and-mul inside (the only way a GEMV runs that op); (config, True) at one row, the
    GEMV with the RMSNorm inside. A candidate that fails to run is left out."""
    from ferry.layers.fused import rms_norm, rms_norm_fp8, silu_and_mul, silu_and_mul_fp8

    k, dtype, device = layer.weight.shape[1], layer.x_dtype, layer.weight.device
    x = torch.randn(rows, 2 * k if input_op == "silu_and_mul" else k, device=device, dtype=dtype)
    residual = torch.randn(rows, k, device=device, dtype=dtype)
    norm_weight = torch.ones(k, device=device, dtype=dtype)

    def op(x):
        if input_op == "rms_norm":
            return rms_norm(x, norm_weight, 1e-6, residual)
        return silu_and_mul(x) if input_op == "silu_and_mul" else x

    def op_then_baseline(w):
        if layer.matmul_quantized is not None and input_op == "rms_norm":
            return layer.matmul_quantized(*rms_norm_fp8(x, norm_weight, 1e-6, residual), w)
        if layer.matmul_quantized is not None and input_op == "silu_and_mul":
            return layer.matmul_quantized(*silu_and_mul_fp8(x), w)
        return layer.baseline(op(x), w)

    paths = {(None, False): op_then_baseline}
    for config in candidates(rows):
        if input_op == "silu_and_mul":
            paths[config, False] = lambda w, c=config: layer.gemv(x, w, c, silu_mul=True)
        else:
            paths[config, False] = lambda w, c=config: layer.gemv(op(x), w, c)
        if input_op == "rms_norm" and rows == 1:
            paths[config, True] = lambda w, c=config: layer.gemv_rms_norm(x, residual, norm_weight, 1e-6, w, c)
    times: PathTimes = {}
    for key, fn in paths.items():
        try:
            times[key] = _graph_time(fn, copies)
        except Exception as e:  # e.g. Triton's OutOfResources: an optimization is never fatal
            logger.warning("GEMV path %s does not run on this device: %s", key, e)
    return times


def fastest_path(times: PathTimes, margin: float = WIN_MARGIN) -> tuple[GemvConfig | None, bool]:
    """The fastest GEMV path if it takes at most `margin` of the cuBLAS path's time (a clear win,
    not noise), else cuBLAS: (config, op inside) or (None, False)."""
    gemv_paths = [key for key in times if key[0] is not None]
    if not gemv_paths or (None, False) not in times:
        return None, False
    best = min(gemv_paths, key=times.__getitem__)
    return best if times[best] <= margin * times[None, False] else (None, False)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2)


def _variants_agree(layer: LayerWeights, config: GemvConfig | None, rows: tuple) -> bool:
    """Whether the plain GEMV and its SiLU-and-mul input compute what torch does at these row counts
    (False also when one fails to build or run); True for no configuration."""
    if config is None:
        return True
    w = layer.weight
    try:
        for m in rows:
            x = torch.randn(m, 2 * w.shape[1], device=w.device, dtype=layer.x_dtype)
            gate, up = x.chunk(2, dim=-1)
            act = torch.nn.functional.silu(gate) * up
            expected = layer.reference(act)
            if not (_close(layer.gemv(act, w, config), expected) and _close(layer.gemv(x, w, config, True), expected)):
                logger.warning("GEMV %s disagrees with torch at %d rows: using cuBLAS", config, m)
                return False
    except Exception as e:
        logger.warning("GEMV %s does not run on this device: %s", config, e)
        return False
    return True


def _norm_fusion_agrees(layer: LayerWeights, config: GemvConfig) -> bool:
    """Whether the add+RMSNorm inside the GEMV computes what the norm then torch's linear does, with
    a residual and without (the first layer's)."""
    from ferry.layers.norm import RMSNorm

    w, dtype = layer.weight, layer.x_dtype
    k = w.shape[1]
    x, residual = (torch.randn(1, k, device=w.device, dtype=dtype) for _ in range(2))
    norm = RMSNorm(k, eps=1e-6).to(w.device, dtype)
    norm.weight.data = 1 + 0.1 * torch.randn(k, device=w.device, dtype=dtype)
    try:
        for r in (residual, None):
            s = x if r is None else (x.float() + r.float()).to(x.dtype)
            h = norm._norm(s)  # the torch code, Hugging Face's rounding
            y, new_residual = layer.gemv_rms_norm(x, r, norm.weight, norm.eps, w, config)
            if not (_close(y, layer.reference(h)) and torch.equal(new_residual, s)):
                logger.warning("GEMV %s with the RMSNorm inside disagrees with torch: not fused", config)
                return False
    except Exception as e:
        logger.warning("GEMV %s with the RMSNorm inside does not run on this device: %s", config, e)
        return False
    return True


# In decode a layer's weights come from memory, not from the L2 cache (50 MB on an H200): the other
# layers' weights pass through it in between. Timing calls cycle through copies of the weight
# that together outgrow the cache.
_COLD_BYTES = 128 << 20


def cold_copies(weight: torch.Tensor) -> list[torch.Tensor]:
    return [weight] + [weight.clone() for _ in range(min(31, _COLD_BYTES // weight.nbytes))]


def measure(weight: torch.Tensor, bias: torch.Tensor | None) -> Timings:
    """Seconds per call of cuBLAS and of every candidate, the plain layer at each bucket's largest row count,
    replayed from CUDA graphs; inf for a candidate that does not run here or computes something else
    (`python -m ferry.bench.gemv` prints them)."""
    copies = cold_copies(weight)
    times: Timings = {}
    for rows in ROW_BUCKETS:
        x = torch.randn(rows, weight.shape[1], device=weight.device, dtype=weight.dtype)
        expected = torch.nn.functional.linear(x, weight, bias)
        times[rows, None] = _graph_time(lambda w: torch.nn.functional.linear(x, w, bias), copies)
        for config in candidates(rows):
            times[rows, config] = float("inf")
            try:
                y = gemv(x, weight, bias, config)
                if torch.allclose(y.float(), expected.float(), atol=1e-2, rtol=1e-2):
                    times[rows, config] = _graph_time(lambda w: gemv(x, w, bias, config), copies)
            except Exception as e:  # e.g. Triton's OutOfResources: an optimization is never fatal
                logger.warning("GEMV %s does not run on this device: %s", config, e)
    return times


def choose(times: Timings, rows: int, margin: float = WIN_MARGIN) -> GemvConfig | None:
    """The fastest candidate at `rows` rows if it takes at most `margin` of cuBLAS's time there
    (a clear win, not noise); else None."""
    return fastest_path({(config, False): times[rows, config] for config in (None, *candidates(rows))
                         if (rows, config) in times}, margin)[0]


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
