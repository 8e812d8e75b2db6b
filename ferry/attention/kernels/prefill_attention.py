"""Varlen causal attention over the paged cache: prefill, chunked prefill after a cached prefix,
and decode rows, all in one launch.

Request i brings query_len = qsl[i+1] - qsl[i] tokens, which are the last query_len of its seq_len
cached tokens (they were stored just before). Query token t (0-based in the chunk) sits at context
position prefix + t, prefix = seq_len - query_len, and sees keys 0 .. prefix + t.

Tiles. A program owns BLOCK_Q = BLOCK_M // GROUP consecutive query tokens of one request and the
GROUP query heads of one KV head, packed into the rows of a (BLOCK_M, head_dim) query tile,
token-major:

    row r  ->  token first_tok + r // GROUP,  query head kv_head * GROUP + r % GROUP

so each K/V tile read from the cache serves every query head that shares it, and a decode row
(query_len 1) still fills GROUP rows of the tile. The program walks the keys in tiles of BLOCK_N,
keeping an online softmax per row. Keys below prefix + first_tok are visible to every row and need
no causal mask; only the last few tiles, along the diagonal, do:

    keys:   0 ............................ prefix+first_tok ...... prefix+last_tok
            [ full tiles: no mask          |  diagonal tiles: mask key <= row's position ]

Grid. Programs are numbered over all requests at once: request i's tiles start at
qsl[i] // BLOCK_Q + i, a formula that needs only qsl[i] and leaves each request at least
ceil(query_len / BLOCK_Q) tiles (at most one spare, which exits at once). A program finds its
request by binary search over those starts, so the grid is num_tokens // BLOCK_Q + num_reqs,
known on the host without reading any device tensor:

    a 5-token prefill chunk, then 3 decode rows; BLOCK_Q = 4
    qsl:           0   5   6   7   8
    tile starts:   0   2   3   4          (qsl[i] // 4 + i)
    grid: 8 // 4 + 4 = 6 programs   0 1 | 2 | 3 | 4 5    (program 5 is request 3's spare: it exits)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ferry.attention.kernels.launch import block_d, dot_precision, kv_scale_args, widens_query
from ferry.attention.kernels.paged_tiles import (
    LOG2_E, fp8_query, kv_scales, load_kv_tile, online_softmax_step, soft_cap,
)


@dataclass(frozen=True)
class PrefillConfig:
    """Launch parameters: a tile of block_m query rows walks the keys block_n at a time.

    128 x 64 with 8 warps is the flash-attention tile shape that fits Hopper's registers at
    head_dim 128 (the fp32 accumulator is 128 x 128 x 4 = 64 KB, 64 registers a thread; two
    warpgroups each issue wgmma on 64 rows). Measured on an H200 (docs/benchmarks.md), 64 x 64 with
    4 warps (one warpgroup, the same 64 registers a thread) was faster at every prompt length from
    64 to 4096 tokens, for Qwen3-0.6B's heads and Llama-3.1-8B's: twice the programs fill the
    multiprocessors sooner, and a short prompt's 8 tiles a KV head become 16. So 64 x 64 is the
    default up to head_dim 128 (`default_config`); beyond, 64 rows of 4 warps would hold twice the
    registers, and 128 x 64 over 8 warps stays. With num_stages 3 the pipeliner keeps two K/V tiles
    in flight (cp.async). In fp32 (exact "ieee" dots, done on FMA units) these tiles spill: that
    path is for checking, not speed.
    """

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3


def default_config(head_dim: int, group: int = 1) -> PrefillConfig:
    """64 x 64 up to head_dim 128 where 64 rows hold a token's `group` query heads; else 128 x 64."""
    return PrefillConfig(64, 64, 4, 3) if head_dim <= 128 and group <= 64 else PrefillConfig()


@triton.jit
def _find_request(query_start_loc_ptr, tile, num_reqs, BLOCK_Q: tl.constexpr):
    """The request owning program `tile`: the last i with qsl[i] // BLOCK_Q + i <= tile."""
    lo = 0
    hi = num_reqs  # invariant: the answer is in [lo - 1, hi)
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(start <= tile, mid + 1, lo)
        hi = tl.where(start <= tile, hi, mid)
    return lo - 1


@triton.jit(do_not_specialize=["num_reqs", "stride_table_req"])
def _prefill_kernel(
    q_ptr, cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr,
    k_scale_ptr, v_scale_ptr,  # an FP8 cache's (num_kv_heads,) scales
    scale_log2, num_reqs,
    stride_q_tok, stride_q_head,
    stride_cache_kv, stride_cache_block, stride_cache_tok, stride_cache_head,
    stride_table_req,
    stride_out_tok, stride_out_head,
    window,  # with WINDOW: a query at position p sees keys p - window + 1 .. p
    softcap_log2,  # with SOFTCAP: scores soft-capped at this (in log2 units: the cap times log2(e))
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FP8_KV: tl.constexpr, WIDEN_Q: tl.constexpr, WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = _find_request(query_start_loc_ptr, tile, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    first_tok = (tile - (q_start // BLOCK_Q + req)) * BLOCK_Q
    if first_tok >= query_len:  # the spare tile of a request
        return
    seq_len = tl.load(seq_lens_ptr + req)
    prefix = seq_len - query_len

    rows = tl.arange(0, BLOCK_M)
    tok = first_tok + rows // GROUP  # (BLOCK_M,) token of each row, within the chunk
    heads = kv_head * GROUP + rows % GROUP
    # When GROUP does not divide BLOCK_M the last rows would spill into the next tile's token.
    row_mask = (rows < BLOCK_Q * GROUP) & (tok < query_len)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    io_mask = row_mask[:, None] & dim_mask[None, :]
    q_rows = (q_start + tok) * stride_q_tok + heads * stride_q_head
    q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=io_mask, other=0.0)
    row_pos = prefix + tok  # context position of each row's query token; it sees keys <= row_pos
    q = fp8_query(q, WIDEN_Q)
    k_scale, v_scale = kv_scales(k_scale_ptr, v_scale_ptr, kv_head, FP8_KV)
    scale_log2 = scale_log2 * k_scale

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    # -inf is safe without a window: the first tile (full or diagonal) starts at a key <= prefix +
    # first_tok, which every row sees, so every row's maximum is finite after it. With a window a
    # later row may see nothing of the first tiles, so the maximum starts finite instead: a tile
    # that a row sees nothing of then adds 2**(-inf) = 0 for it, and the first key it sees sets it.
    row_max = tl.full([BLOCK_M], -1e30 if WINDOW else float("-inf"), dtype=tl.float32)
    table_row = block_tables_ptr + req * stride_table_req

    # Keys [first, full_end): whole tiles below the first row's position, visible to every row
    # (first = 0), or, with a window, from the tile of the first row's first key on, each key masked
    # per row by its window.
    first = 0
    if WINDOW:
        first = tl.maximum(prefix + first_tok - window + 1, 0) // BLOCK_N * BLOCK_N
    full_end = (prefix + first_tok + 1) // BLOCK_N * BLOCK_N
    # Keys [full_end, kv_end): the diagonal, masked per row; kv_end is one past the last row's position.
    kv_end = prefix + tl.minimum(first_tok + BLOCK_Q, query_len)
    for tile_start in range(first, full_end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        k, v = load_kv_tile(
            cache_ptr, table_row, pos, pos < full_end, kv_head, dims, dim_mask,
            stride_cache_kv, stride_cache_block, stride_cache_tok, stride_cache_head, q, PAGE_SIZE,
        )
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # (BLOCK_M, BLOCK_N)
        if SOFTCAP:
            scores = soft_cap(scores, softcap_log2)
        if WINDOW:
            scores = tl.where(pos[None, :] > row_pos[:, None] - window, scores, float("-inf"))
        acc, row_sum, row_max = online_softmax_step(acc, row_sum, row_max, scores, v, DOT_PRECISION)
    for tile_start in range(tl.maximum(full_end, first), kv_end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        k, v = load_kv_tile(
            cache_ptr, table_row, pos, pos < kv_end, kv_head, dims, dim_mask,
            stride_cache_kv, stride_cache_block, stride_cache_tok, stride_cache_head, q, PAGE_SIZE,
        )
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        if SOFTCAP:
            scores = soft_cap(scores, softcap_log2)
        visible = pos[None, :] <= row_pos[:, None]  # also keeps pos < seq_len: row_pos < seq_len
        if WINDOW:
            visible &= pos[None, :] > row_pos[:, None] - window
        scores = tl.where(visible, scores, float("-inf"))
        acc, row_sum, row_max = online_softmax_step(acc, row_sum, row_max, scores, v, DOT_PRECISION)

    out = acc / row_sum[:, None] * v_scale
    out_rows = (q_start + tok) * stride_out_tok + heads * stride_out_head
    tl.store(out_ptr + out_rows[:, None] + dims[None, :], out, mask=io_mask)


def prefill_attention(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
    block_tables: torch.Tensor,  # (num_reqs, max_blocks) int32
    query_start_loc: torch.Tensor,  # (num_reqs + 1,) int32
    seq_lens: torch.Tensor,  # (num_reqs,) int32
    num_real_tokens: int,  # query_start_loc[-1], from the host
    scale: float,
    out: torch.Tensor,  # (num_tokens, num_heads, head_dim); rows of requests written, others untouched
    config: PrefillConfig | None = None,  # None: default_config(head_dim, group)
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # an FP8 cache's, (num_kv_heads,) each
    sliding_window: int | None = None,  # a query sees only the last this many keys, itself included
    softcap: float | None = None,  # scores become softcap * tanh(score / softcap)
) -> None:
    """Causal attention of every request's query rows over its cached context (prefix + chunk)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    _, _, page_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    num_reqs = seq_lens.shape[0]
    config = config or default_config(head_dim, group)
    assert config.block_m >= group, "a query tile must hold at least one token's heads"
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and kv_cache.stride(-1) == 1
    block_q = config.block_m // group
    num_tiles = num_real_tokens // block_q + num_reqs
    fp8_kv, k_scale, v_scale = kv_scale_args(kv_cache, kv_scales, seq_lens)
    _prefill_kernel[(num_tiles, num_kv_heads)](
        q, kv_cache, block_tables, query_start_loc, seq_lens, out,
        k_scale, v_scale,
        scale * LOG2_E, num_reqs,
        q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        sliding_window or 0, (softcap or 1.0) * LOG2_E,
        GROUP=group, BLOCK_M=config.block_m, BLOCK_Q=block_q,
        HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim),
        PAGE_SIZE=page_size, BLOCK_N=config.block_n,
        DOT_PRECISION=dot_precision(q.dtype), FP8_KV=fp8_kv, WIDEN_Q=widens_query(q.dtype, fp8_kv),
        WINDOW=sliding_window is not None, SOFTCAP=softcap is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
