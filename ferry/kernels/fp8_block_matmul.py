"""The FP8 GEMM of block-scaled weights: Qwen3-FP8's and DeepSeek's 128 x 128 blocks.

A weight W (N, K) is e4m3 values Qw and a scale per (bn, bk) block, sw (N / bn, K / bk); the
activations come quantized per token and bk columns, Qx and sx (M, K / bk) (kernels/fp8_quant.py).
Within one K tile of bk columns every row of x and every row of W has a single scale, so the tile's
product is an FP8 matmul on the tensor cores, scaled once per output element:

    y[m, n] = sum over K tiles t of  (Qx[m, t] . Qw[n, t]) * sx[m, t] * sw[n // bn, t]

    program (i, j):  acc (BLOCK_M, BLOCK_N) = 0
                     for each K tile t:  acc += dot(Qx tile, Qw tile^T) * sx[rows, t][:, None]
                                                                  * sw[cols // bn, t][None, :]

BLOCK_K divides bk (one scale per tile and row); BLOCK_N need not match bn, since each column
looks its block's scale up. The reference is quantization/fp8.py's `fp8_linear_reference`: the
same numbers dequantized and multiplied in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fp8_block_matmul_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, bias_ptr, c_ptr,
    m, n, k, stride_am, stride_bn, stride_cm, stride_as, stride_bs,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < m, cols < n
    ks = tl.arange(0, BLOCK_K)
    weight_blocks = cols // GROUP_N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        kk = k0 + ks
        k_ok = kk < k
        a = tl.load(a_ptr + rows[:, None] * stride_am + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptr + cols[None, :] * stride_bn + kk[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        t = k0 // GROUP_K
        a_scale = tl.load(a_scale_ptr + rows * stride_as + t, mask=row_ok, other=0.0)
        b_scale = tl.load(b_scale_ptr + weight_blocks * stride_bs + t, mask=col_ok, other=0.0)
        acc += tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty), mask=mask)


def fp8_block_matmul(
    qx: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
    bias: torch.Tensor | None, block: tuple[int, int], out_dtype: torch.dtype,
) -> torch.Tensor:
    """(M, K) e4m3 with (M, K / bk) scales, times the (N, K) e4m3 weight with (N / bn, K / bk)
    block scales, transposed: (M, N) in out_dtype."""
    m, k = qx.shape
    n = weight.shape[0]
    bn, bk = block
    assert qx.stride(-1) == 1 and weight.stride(-1) == 1
    assert x_scale.shape == (m, -(-k // bk)) and weight_scale.shape == (-(-n // bn), -(-k // bk))
    out = torch.empty((m, n), dtype=out_dtype, device=qx.device)
    if m == 0:
        return out
    block_k = min(bk, 128)
    assert bk % block_k == 0, "a K tile must lie within one scale group"
    block_m = 64 if m <= 64 else 128  # (the FP8 tensor cores take 64 rows at a time)
    block_n = 128
    _fp8_block_matmul_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        qx, x_scale, weight, weight_scale, bias if bias is not None else weight_scale, out,
        m, n, k, qx.stride(0), weight.stride(0), out.stride(0), x_scale.stride(0), weight_scale.stride(0),
        GROUP_N=bn, GROUP_K=bk, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=8, num_stages=3,  # (4 warps spill at 64 rows: 255 registers for sm_90, `kernel_check --compile`)
    )
    return out
