"""The two pieces the paged attention kernels share: a K/V tile read through a block table, and one
step of the online softmax. Both are `@triton.jit` helpers, inlined into the kernels that call them.

Reading a tile of BLOCK_N consecutive key positions of one request and one KV head:

    key position p  ->  block = block_table[p // PAGE_SIZE], offset = p % PAGE_SIZE
    K row at  cache + block * stride_block + offset * stride_tok + kv_head * stride_head + [0, head_dim)
    V row at  the same + stride_kv

    block_table row:  [ 7 | 2 | 9 | ... ]       PAGE_SIZE = 4, BLOCK_N = 8
    positions:          0 1 2 3 4 5 6 7
    blocks read:        7 7 7 7 2 2 2 2

Each K row is head_dim contiguous elements (256 bytes for head_dim 128 in bf16), so the load is
coalesced along head_dim whatever the page size; BLOCK_N need not match the page size, because
every row looks its block up separately (rows of one page hit the same table entry, which the
cache serves).

An FP8 cache's tiles are widened to the query's dtype as they load, for the tensor cores, and a
16-bit query is first made float16 (`fp8_query`): e4m3 widens to float16 in one instruction per
two values, to bfloat16 only through float32, and on an H200 that conversion, not the halved
bytes, set the speed (decode over an FP8 cache ran 10% slower than over bf16 when widened to
bf16; kernel_check times both). float16 holds e4m3 exactly and the query and probabilities with
more mantissa than bf16; a query past float16's 65504 is clamped. Where the widening happens
matters as much. Left to itself, Triton keeps a tile in e4m3 through shared memory and widens it in
the tensor-core operand's registers: right for K, whose operand rows run along head_dim as the cache
does, but V is the second operand of P @ V, read down its key column, and 8-bit values have no
transposing shared-memory load (ldmatrix.trans moves 16-bit ones), so V came back one byte per
load (128 ld.shared.b8 per thread per 128-key tile at head_dim 128). V is therefore widened as it
arrives, in the load's own layout, by one PTX instruction per two values that the compiler cannot
move (`_widen_e4m3`), and reaches the tensor cores as float16 through the transposing load, as a
16-bit cache's V does. The scales are the kernels'
business: K's multiplies the scores (folded into the softmax scale), V's the output, once, at the
end (the softmax-weighted sum is linear in V).

Scores are kept in log2 units (scaled by softmax_scale * log2(e)) so the exponentials are `exp2`,
one hardware instruction; the log-sum-exp a kernel reports is in the same units.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

LOG2_E = 1.4426950408889634  # softmax(x) = 2 ** (x * log2(e)) / sum(...)
# Triton's interpreter (CPU tensors) runs no inline PTX; it reads the variable when kernels are
# defined, as this module does.
_PTX = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


@triton.jit
def load_kv_tile(
    cache_ptr, block_table_ptr,  # block_table_ptr: this request's row of the block table
    pos, in_bounds,  # (BLOCK_N,) key positions, and which of them exist
    kv_head, dims, dim_mask,  # dims: (BLOCK_D,) arange; dim_mask: dims < head_dim
    stride_kv, stride_block, stride_tok, stride_head,
    q,  # the query tile: K and V come in its dtype
    PAGE_SIZE: tl.constexpr,
):
    """K and V at key positions `pos`, each (BLOCK_N, BLOCK_D) in q's dtype; positions out of
    bounds read as 0."""
    block = tl.load(block_table_ptr + pos // PAGE_SIZE, mask=in_bounds, other=0).to(tl.int64)
    row = block * stride_block + (pos % PAGE_SIZE) * stride_tok + kv_head * stride_head  # (BLOCK_N,) int64
    ptrs = cache_ptr + row[:, None] + dims[None, :]
    mask = in_bounds[:, None] & dim_mask[None, :]
    k = tl.load(ptrs, mask=mask, other=0.0)
    v = tl.load(ptrs + stride_kv, mask=mask, other=0.0)
    if _PTX and v.dtype == tl.float8e4nv and q.dtype == tl.float16:
        v = _widen_e4m3(v)
    return k.to(q.dtype), v.to(q.dtype)


@triton.jit
def _widen_e4m3(x):
    """e4m3 to float16, exactly, where x is (in registers, in its load layout): four bytes in one
    register become two float16x2 registers. Not pure, so that Triton keeps it here rather than
    hoisting the tensor-core layout change above it (module docstring)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4,
    )


@triton.jit
def soft_cap(scores, cap):
    """cap * tanh(scores / cap) (Gemma 2's attention soft cap; scores and cap in the same units, here
    log2 ones): tanh(x) = 1 - 2 / (e^(2x) + 1), e^(2x) by exp2. Saturates to +-cap, never NaN."""
    e = tl.exp2(scores * (2.8853900817779268 / cap))  # 2 * log2(e): a compiled kernel reads no globals
    return cap * (1.0 - 2.0 / (e + 1.0))


@triton.jit
def fp8_query(q, WIDEN_Q: tl.constexpr):
    """The query tile in the dtype the K/V tiles widen to: float16 for a 16-bit query over an FP8
    cache (WIDEN_Q, from launch.widens_query); as it is otherwise (float32 stays, for exact checks)."""
    if WIDEN_Q:
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0, propagate_nan=tl.PropagateNan.ALL).to(tl.float16)
    return q


@triton.jit
def kv_scales(k_scale_ptr, v_scale_ptr, kv_head, FP8_KV: tl.constexpr):
    """An FP8 cache's K and V scales of one KV head; 1 and 1 for a 16-bit cache."""
    if FP8_KV:
        return tl.load(k_scale_ptr + kv_head), tl.load(v_scale_ptr + kv_head)
    return 1.0, 1.0


@triton.jit
def online_softmax_step(acc, row_sum, row_max, scores, v, DOT_PRECISION: tl.constexpr):
    """Fold one tile into the running softmax-weighted sum of values.

    acc (M, D) fp32: sum of 2**(s - row_max) * v so far; row_sum (M,): sum of 2**(s - row_max);
    row_max (M,): largest score so far; scores (M, N) fp32 in log2 units, -inf where masked;
    v (N, D). When the maximum grows, the old sums are rescaled by 2**(old_max - new_max).
    Callers guarantee every row meets a finite score in its first tile, so row_max is finite
    from then on and no -inf - (-inf) = NaN arises.
    """
    new_max = tl.maximum(row_max, tl.max(scores, axis=1))
    alpha = tl.exp2(row_max - new_max)
    p = tl.exp2(scores - new_max[:, None])  # (M, N)
    row_sum = row_sum * alpha + tl.sum(p, axis=1)
    # p goes to the values' dtype for the tensor cores (as flash attention does); the products
    # are still summed in fp32.
    acc = tl.dot(p.to(v.dtype), v, acc=acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, row_sum, new_max

