"""Fused Triton kernels for the small ops between the matmuls: RMSNorm (with the residual add),
RoPE on q and k (with Qwen3's per-head q/k norm), and SiLU-and-mul.

Each op, written in torch, is several elementwise kernels: RMSNorm alone is a cast, a square, a
mean, an rsqrt, two multiplies and a cast back. At decode batch sizes those kernels move a few
kilobytes each and cost their launch, a microsecond or two apiece even inside a CUDA graph, so a
28-layer model spends more time on them than on its weights. One kernel per op reads its inputs
once and writes its outputs once:

    per layer, torch:   add, norm (6), qkv, q/k norm (12), rope (2 x 6), attention, o, add, norm (6), gate_up, silu, mul, down
    per layer, fused:   add+norm,      qkv, q/k norm + rope (1),         attention, o, add+norm,      gate_up, silu*mul, down

The layers call these only on CUDA tensors; elsewhere they keep their torch code, which follows
Hugging Face's rounding exactly (tests/test_fused_ops.py holds the kernels to it, within bf16
tolerances). Each launches with programmatic dependent launch where the device has it
(kernels/pdl.py), loading its weights while the kernel before it finishes. Rounding here: sums and statistics in float32, results cast to the activations'
dtype where Hugging Face casts them (the residual sum, the normalized value before the weight).

Before an FP8 GEMM, the norm and SiLU-and-mul can write their output quantized instead (`*_fp8`:
e4m3 values and a scale per row, the numbers kernels/fp8_quant.py would make of their 16-bit
output), so the activations' quantization costs no kernel of its own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferry.kernels.fp8_quant import FP8, fp8_rows_like, fp8_scale, to_fp8
from ferry.kernels.pdl import let_next_kernel_start, pdl_launch, wait_for_previous_kernel


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, scale_ptr,
    stride_x, stride_residual, stride_out,
    n, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, OUT_FP8: tl.constexpr, PDL: tl.constexpr,
):
    """One row: with a residual, residual <- x + residual (rounded to the dtype), then
    out <- weight * dtype(s / sqrt(mean(s^2) + eps)) for s the (new) residual, or x without one."""
    let_next_kernel_start(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    wait_for_previous_kernel(PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r_ptrs = residual_ptr + row * stride_residual + cols
        x = (x.to(tl.float32) + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(r_ptrs, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=0) / n + eps)
    normed = (x32 * inv_rms).to(x.dtype).to(tl.float32)
    y = normed * w
    if OUT_FP8:  # the 16-bit output, as the unfused norm would write it, quantized
        y = y.to(x.dtype).to(tl.float32)
        scale = fp8_scale(tl.max(tl.where(mask, tl.abs(y), 0.0), axis=0))
        tl.store(scale_ptr + row, scale)
        y = to_fp8(y, scale)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dimension of x (rows, n). With `residual` (rows, n, contiguous rows),
    first residual += x in place, and the norm is of that sum (vLLM's fused_add_rms_norm)."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_rms_norm(x, weight, eps, residual, out, out)
    return out


def rms_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm's output quantized per row, in the same kernel: (rows, n) e4m3 and (rows, 1) scales."""
    q, scale = fp8_rows_like(x, x.shape[1])
    _launch_rms_norm(x, weight, eps, residual, q, scale)
    return q, scale


def _launch_rms_norm(x, weight, eps, residual, out, scale) -> None:
    rows, n = x.shape
    assert x.stride(-1) == 1 and (residual is None or residual.stride(-1) == 1)
    if rows == 0:
        return
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out, scale,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        n, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, OUT_FP8=out.dtype == FP8,
        num_warps=max(1, min(16, block // 256)), **pdl_launch(x.device),
    )


@triton.jit
def _norm_rotate_heads(
    ptr, stride_head, num_heads, weight_ptr, cos, sin, half, eps,
    HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Normalize (optionally) and rotate, in place, the num_heads heads of one token at ptr, a
    (BLOCK_H, half) tile; cos, sin: (BLOCK_HALF,) fp32."""
    heads = tl.arange(0, BLOCK_H)
    mask = (heads[:, None] < num_heads) & (half[None, :] < HEAD_DIM // 2)
    first = ptr + heads[:, None] * stride_head + half[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HEAD_DIM // 2, mask=mask, other=0.0)
    dtype = x1.dtype
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    if HAS_NORM:
        inv_rms = tl.rsqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / HEAD_DIM + eps)[:, None]
        w1 = tl.load(weight_ptr + half, mask=half < HEAD_DIM // 2, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(weight_ptr + HEAD_DIM // 2 + half, mask=half < HEAD_DIM // 2, other=0.0).to(tl.float32)[None, :]
        a = ((a * inv_rms).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        b = ((b * inv_rms).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    c, s = cos[None, :], sin[None, :]
    tl.store(first, (a * c - b * s).to(dtype), mask=mask)
    tl.store(first + HEAD_DIM // 2, (b * c + a * s).to(dtype), mask=mask)


@triton.jit
def _rotary_qk_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, q_weight_ptr, k_weight_ptr,
    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_rope_tok,
    eps,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, PDL: tl.constexpr,
):
    """Program (token, 0) rotates the token's q heads, (token, 1) its k heads: a program per head
    would be tens of thousands of one-warp programs for a prompt, which the GPU schedules slower
    than they run."""
    let_next_kernel_start(PDL)
    wait_for_previous_kernel(PDL)
    tok = tl.program_id(0)
    half = tl.arange(0, BLOCK_HALF)
    mask = half < HEAD_DIM // 2
    # Both halves of a head rotate by the same angles: read the first half of the (cos, sin) rows,
    # cast to the activations' dtype as Hugging Face casts them.
    dtype = q_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + tok * stride_rope_tok + half, mask=mask, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(sin_ptr + tok * stride_rope_tok + half, mask=mask, other=0.0).to(dtype).to(tl.float32)
    if tl.program_id(1) == 0:
        _norm_rotate_heads(q_ptr + tok * stride_q_tok, stride_q_head, NUM_Q_HEADS, q_weight_ptr, cos, sin, half,
                           eps, HEAD_DIM, HAS_NORM, BLOCK_H)
    else:
        _norm_rotate_heads(k_ptr + tok * stride_k_tok, stride_k_head, NUM_KV_HEADS, k_weight_ptr, cos, sin, half,
                           eps, HEAD_DIM, HAS_NORM, BLOCK_H)


def rotary_qk_(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim), each head contiguous; rotated in place
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim), likewise
    cos: torch.Tensor,  # (num_tokens, head_dim) float32, both halves equal
    sin: torch.Tensor,
    q_weight: torch.Tensor | None = None,  # (head_dim,): RMS-normalize each q head first (Qwen3)
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> None:
    """RoPE (rotate_half layout) on q and k in one launch, after an optional per-head RMSNorm."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_tokens == 0:
        return
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos.stride() == sin.stride() and cos.stride(-1) == 1
    assert head_dim % 2 == 0
    has_norm = q_weight is not None
    block_h, block_half = triton.next_power_of_2(num_heads), triton.next_power_of_2(head_dim // 2)
    _rotary_qk_kernel[(num_tokens, 2)](
        q, k, cos, sin, q_weight if has_norm else q, k_weight if has_norm else k,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        eps,
        NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HAS_NORM=has_norm,
        BLOCK_H=block_h, BLOCK_HALF=block_half, num_warps=max(1, min(8, block_h * block_half // 256)),
        **pdl_launch(q.device),
    )


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, d, BLOCK: tl.constexpr, PDL: tl.constexpr):
    let_next_kernel_start(PDL)
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    # silu rounded to the dtype first, as torch's F.silu(gate) * up rounds it.
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(gate.dtype), mask=mask)


@triton.jit
def _silu_and_mul_fp8_kernel(
    x_ptr, q_ptr, scale_ptr, stride_x, stride_q, d, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """One row, in two passes over it: the largest magnitude of silu(gate) * up (rounded to the
    dtype, as silu_and_mul writes it), then the values divided by the row's scale."""
    let_next_kernel_start(PDL)
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for c0 in range(0, d, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(_silu_mul_tile(x_ptr + row * stride_x, cols, d)))
    scale = fp8_scale(tl.max(amax, axis=0))
    tl.store(scale_ptr + row, scale)
    for c0 in range(0, d, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        y = _silu_mul_tile(x_ptr + row * stride_x, cols, d)
        tl.store(q_ptr + row * stride_q + cols, to_fp8(y, scale), mask=cols < d)


@triton.jit
def _silu_mul_tile(x_row, cols, d):
    """silu(gate) * up at `cols` of one row, rounded to the dtype and back to float32 (0 past d)."""
    mask = cols < d
    gate = tl.load(x_row + cols, mask=mask, other=0.0)
    up = tl.load(x_row + d + cols, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    return (act * up).to(gate.dtype).to(tl.float32)


def silu_and_mul_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu_and_mul's output quantized per row, in one kernel: (rows, d) e4m3 and (rows, 1) scales."""
    rows, two_d = x.shape
    d = two_d // 2
    assert x.stride(-1) == 1
    q, scale = fp8_rows_like(x, d)
    if rows == 0:
        return q, scale
    block = min(2048, triton.next_power_of_2(d))
    _silu_and_mul_fp8_kernel[(rows,)](x, q, scale, x.stride(0), q.stride(0), d, BLOCK=block, num_warps=8,
                                      **pdl_launch(x.device))
    return q, scale


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """(rows, 2d) with gate then up -> silu(gate) * up, (rows, d)."""
    rows, two_d = x.shape
    d = two_d // 2
    assert x.stride(-1) == 1
    out = torch.empty((rows, d), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block = min(1024, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(rows, triton.cdiv(d, block))](x, out, x.stride(0), out.stride(0), d, BLOCK=block,
                                                         num_warps=4, **pdl_launch(x.device))
    return out
