"""Activations to FP8 in one kernel: a scale per token (or per token and group of columns), then
every value divided by it.

Before an FP8 GEMM each row x of the activations becomes e4m3 values and one float32 scale,

    s = max(max|x|, 1e-12) / 448        q = e4m3(clamp(x / s, -448, 448))

(quantization/fp8.py's `quantize_activations`, which this kernel matches bit for bit). In torch
that is six kernels (abs, amax, clamp, divide, clamp, cast), each a launch and a pass over x; here
one program takes a row (or a group of it), finds its largest magnitude in a first pass and writes
the quantized values in a second (the row is a few KB, still in cache). With a static scale the
first pass is skipped. Block-scaled weights (128 x 128) take activations scaled per token and 128
columns, so that each K tile of the product has one scale per row on either side.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferry.kernels.pdl import let_next_kernel_start, pdl_launch, wait_for_previous_kernel
from ferry.quantization import e4m3
from ferry.quantization.e4m3 import FP8

# The format's constants, as kernels may read them.
FP8_MAX = tl.constexpr(e4m3.FP8_MAX)
MIN_SCALE = tl.constexpr(e4m3.MIN_SCALE)


@triton.jit
def fp8_scale(amax):
    """A row's (or group's) scale from its largest magnitude (float32)."""
    # div_rn: IEEE division, rounded as torch rounds it (`/` compiles to a faster, inexact one).
    return tl.math.div_rn(tl.maximum(amax, MIN_SCALE), FP8_MAX)


@triton.jit
def to_fp8(x, scale):
    """x / scale clamped to e4m3's range (float32; the store rounds to nearest). A NaN stays NaN,
    as in torch (tl.clamp by default would make it 448)."""
    return tl.clamp(tl.math.div_rn(x, tl.broadcast_to(scale, x.shape)), -FP8_MAX, FP8_MAX,
                    propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, scale_ptr, static_scale_ptr, k, stride_x, stride_q, stride_scale,
    GROUP: tl.constexpr,  # columns a scale covers: k rounded up (a scale per row), or the group
    STATIC: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    let_next_kernel_start(PDL)
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0)
    group = tl.program_id(1)
    x_row = x_ptr + row * stride_x
    start = group * GROUP
    end = tl.minimum(start + GROUP, k)
    if STATIC:
        scale = tl.maximum(tl.load(static_scale_ptr).to(tl.float32), MIN_SCALE)
    else:
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(start, end, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_row + cols, mask=cols < end, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = fp8_scale(tl.max(amax, axis=0))
    tl.store(scale_ptr + row * stride_scale + group, scale)
    for k0 in range(start, end, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + cols, mask=cols < end, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * stride_q + cols, to_fp8(x, scale), mask=cols < end)


def fp8_rows_like(x: torch.Tensor, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (rows, columns) e4m3 values and (rows, 1) float32 scales, on x's device."""
    rows = x.shape[0]
    return (torch.empty((rows, columns), dtype=FP8, device=x.device),
            torch.empty((rows, 1), dtype=torch.float32, device=x.device))


def quantize_rows_fp8(
    x: torch.Tensor, static_scale: torch.Tensor | None = None, group: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) 16- or 32-bit -> (M, K) float8 e4m3 and float32 scales: (M, 1), one per row; with
    static_scale (one element), every row's scale is it; with group, (M, ceil(K / group)), one per
    row and group of columns."""
    m, k = x.shape
    assert x.stride(-1) == 1 and (static_scale is None or group is None)
    groups = 1 if group is None else -(-k // group)
    span = k if group is None else group
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    scale = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    block_k = min(4096, triton.next_power_of_2(span))
    _quantize_rows_kernel[(m, groups)](
        x, q, scale, static_scale if static_scale is not None else scale, k, x.stride(0), q.stride(0),
        scale.stride(0), GROUP=triton.next_power_of_2(k) if group is None else group,
        STATIC=static_scale is not None, BLOCK_K=block_k, num_warps=4 if block_k <= 2048 else 8,
        **pdl_launch(x.device),
    )
    return q, scale
