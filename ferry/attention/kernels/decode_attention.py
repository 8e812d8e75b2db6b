"""Paged decode attention: one query token per request, attending to its whole cached context.

Decode is memory-bound: every step reads each request's K and V once, and does 2 FLOPs per
element per query head. Two things keep it at the memory's speed.

Grouped-query heads share one read. A program owns one KV head of one request and all GROUP query
heads that read it, as the rows of a (BLOCK_H, head_dim) query tile; the scores of a K tile are then
one small matrix product (tl.dot needs at least 16 rows, so BLOCK_H >= 16 and spare rows are zero):

    q tile (BLOCK_H, D)      K tile^T (D, BLOCK_N)       scores (BLOCK_H, BLOCK_N)
    [ head g*G + 0 ]                                      [ ........ ]
    [ head g*G + 1 ]    x    [ k_0 k_1 ... k_N-1 ]   =    [ ........ ]
    [ ...  G rows  ]                                      [ ........ ]
    [ 0 (padding)  ]                                      [ ignored  ]

Split-K ("flash-decoding") fills the GPU when there are few programs. With batch 1 and 8 KV heads
there are only 8 programs for 132 multiprocessors, so the context is cut into num_splits ranges,
each a program that writes a partial result; a second kernel merges them:

    context:   [ split 0      | split 1      | split 2   ]      each a multiple of BLOCK_N tokens
    stage 1:     o_0, lse_0     o_1, lse_1     o_2, lse_2       o_s = softmax over split s @ V
    stage 2:   o = sum_s 2**(lse_s - lse_max) * o_s / sum_s 2**(lse_s - lse_max)

With one split, stage 1 writes the final output directly and stage 2 is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ferry.attention.kernels.launch import block_d, dot_precision, num_multiprocessors
from ferry.attention.kernels.paged_tiles import LOG2_E, load_kv_tile, online_softmax_step
from ferry.kernels.pdl import let_next_kernel_start, pdl_launch, wait_for_previous_kernel

# tl.dot needs at least 16 rows per operand.
_MIN_DOT_ROWS = 16
# A split should cover enough tokens that its fixed costs (loading q, writing a partial row,
# merging it) stay small next to streaming its K/V: 256 tokens of K and V are 128 KB per KV head
# at head_dim 128 in bf16, against 2 * 128 * 4 bytes of partial output per query head.
_MIN_TOKENS_PER_SPLIT = 256
# The merge kernel holds every split of one head in registers (64 x head_dim fp32 at most), and
# 64 splits already give batch-1 Llama-3.1-8B (8 KV heads) 512 programs, about 4 per SM.
_MAX_SPLITS = 64


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of stage 1 (leads for Hopper, to be confirmed by ferry.bench.kernel_check).

    block_n 64: a K plus V tile is 2 * 64 * 128 * 2 = 32 KB at head_dim 128 in bf16. With
    num_stages 3 the software pipeliner puts the block-table lookup, the cp.async copy of K and V
    into shared memory and the math in three stages, so the next tile's K/V are in flight while
    this one is used. Compiled for sm_90 this takes 105 registers and 38 KB of shared memory per
    program, no spills: four programs fit one multiprocessor, about 128 KB of loads in flight per
    SM, well above the ~40 KB that 4.8 TB/s times ~1 us of latency asks of each of 132 SMs.
    num_warps 4: the math is tiny (16 x 64 scores per tile), and 128 threads loading 16-byte
    vectors cover a 64 x 128 bf16 tile in 8 instructions each.
    """

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def _split_len(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """Tokens per split of a context of seq_len tokens: ceil(seq_len / num_splits) rounded up to a
    whole number of tiles. Split s covers [s * len, min((s + 1) * len, seq_len)); trailing splits
    of a short context may be empty. Both stages must agree on this formula."""
    return tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N


@triton.jit(do_not_specialize=["num_splits", "stride_table_req"])
def _decode_split_kernel(
    q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, lse_ptr,
    scale_log2,  # softmax scale * log2(e)
    num_splits,  # a runtime value: it follows the longest context, and each constexpr value compiles anew
    stride_q_req, stride_q_head,
    stride_cache_kv, stride_cache_block, stride_cache_tok, stride_cache_head,
    stride_table_req,
    stride_out_req, stride_out_head, stride_out_split,
    stride_lse_req, stride_lse_head,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    let_next_kernel_start(PDL)
    wait_for_previous_kernel(PDL)  # before the early return of an empty split too (pdl.py)
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + req)
    split_len = _split_len(seq_len, num_splits, BLOCK_N)
    start = split * split_len
    if start >= seq_len:  # an empty trailing split: stage 2 skips it by the same formula
        return
    end = tl.minimum(start + split_len, seq_len)

    rows = tl.arange(0, BLOCK_H)
    row_mask = rows < GROUP
    heads = kv_head * GROUP + rows  # (BLOCK_H,) query heads of this KV head
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q_mask = row_mask[:, None] & dim_mask[None, :]
    q = tl.load(q_ptr + req * stride_q_req + heads[:, None] * stride_q_head + dims[None, :], mask=q_mask, other=0.0)

    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    # -inf is safe: `start < seq_len`, so the first tile holds a real key and every row (padding
    # rows too, whose q is 0) gets a finite score there.
    row_max = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    table_row = block_tables_ptr + req * stride_table_req
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        in_bounds = pos < end
        k, v = load_kv_tile(
            cache_ptr, table_row, pos, in_bounds, kv_head, dims, dim_mask,
            stride_cache_kv, stride_cache_block, stride_cache_tok, stride_cache_head, PAGE_SIZE,
        )
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # (BLOCK_H, BLOCK_N)
        scores = tl.where(in_bounds[None, :], scores, float("-inf"))
        acc, row_sum, row_max = online_softmax_step(acc, row_sum, row_max, scores, v, DOT_PRECISION)

    out = acc / row_sum[:, None]
    out_ptrs = out_ptr + req * stride_out_req + split * stride_out_split + heads[:, None] * stride_out_head + dims[None, :]
    tl.store(out_ptrs, out, mask=q_mask)  # cast to the output's dtype on store
    lse = row_max + tl.log2(row_sum)
    tl.store(lse_ptr + req * stride_lse_req + heads * stride_lse_head + split, lse, mask=row_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    partial_ptr, lse_ptr, seq_lens_ptr, out_ptr, num_splits,
    stride_part_req, stride_part_head, stride_part_split,
    stride_lse_req, stride_lse_head,
    stride_out_req, stride_out_head,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,  # BLOCK_S: num_splits rounded up to a power of two
    PDL: tl.constexpr,
):
    let_next_kernel_start(PDL)
    wait_for_previous_kernel(PDL)
    req = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + req)
    splits = tl.arange(0, BLOCK_S)
    # Empty splits wrote nothing; their rows of the buffers are garbage and must not be read.
    valid = (splits < num_splits) & (splits * _split_len(seq_len, num_splits, BLOCK_N) < seq_len)
    lse = tl.load(lse_ptr + req * stride_lse_req + head * stride_lse_head + splits, mask=valid, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, axis=0))  # (BLOCK_S,), 0 for empty splits; split 0 is never empty
    dims = tl.arange(0, BLOCK_D)
    mask = valid[:, None] & (dims < HEAD_DIM)[None, :]
    part_ptrs = partial_ptr + req * stride_part_req + head * stride_part_head + splits[:, None] * stride_part_split
    partial = tl.load(part_ptrs + dims[None, :], mask=mask, other=0.0)  # (BLOCK_S, BLOCK_D) fp32
    out = tl.sum(weight[:, None] * partial, axis=0) / tl.sum(weight, axis=0)
    tl.store(out_ptr + req * stride_out_req + head * stride_out_head + dims, out, mask=dims < HEAD_DIM)


def decode_attention(
    q: torch.Tensor,  # (num_reqs, num_heads, head_dim): one query token per request
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
    block_tables: torch.Tensor,  # (num_reqs, max_blocks) int32
    seq_lens: torch.Tensor,  # (num_reqs,) int32, each >= 1, the query token included
    scale: float,
    out: torch.Tensor,  # (num_reqs, num_heads, head_dim), written
    num_splits: int,
    config: DecodeConfig = DecodeConfig(),
) -> None:
    """out[i] = softmax(q[i] k^T * scale) v over the first seq_lens[i] cached tokens of request i."""
    num_reqs, num_heads, head_dim = q.shape
    _, _, page_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and kv_cache.stride(-1) == 1
    if num_splits == 1:
        partial = out[:, :, None, :]  # (num_reqs, num_heads, 1, head_dim): stage 1 writes the result
    else:
        partial = torch.empty(num_reqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(num_reqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(num_reqs, num_kv_heads, num_splits)](
        q, kv_cache, block_tables, seq_lens, partial, lse,
        scale * LOG2_E, num_splits,
        q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        partial.stride(0), partial.stride(1), partial.stride(2),
        lse.stride(0), lse.stride(1),
        GROUP=group, BLOCK_H=max(_MIN_DOT_ROWS, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim),
        PAGE_SIZE=page_size, BLOCK_N=config.block_n,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_launch(q.device),
    )
    if num_splits == 1:
        return
    _decode_merge_kernel[(num_reqs, num_heads)](
        partial, lse, seq_lens, out, num_splits,
        partial.stride(0), partial.stride(1), partial.stride(2),
        lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim),
        BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_N=config.block_n,
        # One (BLOCK_S, head_dim) fp32 tile per program; 4 warps hold 64 splits x 128 dims at 64
        # values per thread (1 warp needed 181 registers for 33 splits).
        num_warps=4, **pdl_launch(q.device),
    )


def choose_num_splits(num_reqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """How many ranges to cut each context into, from host-side sizes only (no device sync).

    Enough programs to give every multiprocessor two (one running while the other waits on
    memory), but no split shorter than _MIN_TOKENS_PER_SPLIT. Under CUDA graphs the split count is
    fixed at capture: pass the split count of the longest context the graph will serve.
    """
    programs = num_reqs * num_kv_heads
    wanted = -(-2 * num_multiprocessors(device) // programs)
    longest_useful = -(-max_seq_len // _MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, longest_useful, _MAX_SPLITS))

