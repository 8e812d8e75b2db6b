"""Paged decode attention: a fixed number of query tokens per request (one for decode, a few for a
speculative verify step), attending to the whole cached context.

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

Several query tokens (query_len Q > 1, a speculative verify). Each request brings its last Q
tokens, whose K/V are already cached: token j sits at position prefix + j, prefix = seq_len - Q,
and sees keys 0 .. prefix + j. A program's tile holds all Q tokens of the GROUP heads, token-major,
so each K/V tile read serves all of them and a 5-token verify reads the same bytes as a decode:

    Q = 2, GROUP = 4:   row   0 1 2 3 | 4 5 6 7 | 8 ... 15
                        token 0 0 0 0 | 1 1 1 1 | padding        row r: token r // GROUP,
                        head  g*G + 0 1 2 3 | 0 1 2 3 |          head kv_head * GROUP + r % GROUP

The first shared_len = prefix + 1 keys are seen by every token and need no causal mask; only the
Q - 1 keys after them, in the context's last tile or two, are masked per row (key <= row's
position). Splits cut the shared keys, and the split that ends them also takes those Q - 1 keys:

    keys:      [ split 0      | split 1      | split 2   ][Q-1 ]   split_len from shared_len
                                                 ^ last split: up to seq_len, its last tiles masked

So every non-empty split starts at a key that every row sees: no row of a split is empty, every
partial lse is finite, and all Q tokens of a request merge the same splits. At Q = 1,
shared_len = seq_len and this is the one-token formula; the extra code is behind constexpr
branches, so a one-token launch compiles as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ferry.attention.kernels.launch import block_d, dot_precision, kv_scale_args, num_multiprocessors, widens_query
from ferry.attention.kernels.paged_tiles import (
    LOG2_E, fp8_query, kv_scales, load_kv_tile, online_softmax_step, soft_cap,
)
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


# Over an FP8 cache a tile of 128 keys is as many bytes as 64 in bf16, and with few programs (a
# small batch, its contexts split) the larger tile keeps more bytes in flight per program. With
# many programs each SM runs several, and smaller ones (64 keys, 2 warps) do better: on an H200,
# Qwen3-0.6B's heads at batch 32 and context 4096 took 101 us against 128, at batch 1 and context
# 32k 65 against 49 (`python -m ferry.bench.kernel_check` times both).
FP8_DECODE_CONFIG = DecodeConfig(block_n=128, num_warps=4, num_stages=3)
FP8_MANY_PROGRAMS_CONFIG = DecodeConfig(block_n=64, num_warps=2, num_stages=3)
# Requests x KV heads from which FP8_MANY_PROGRAMS_CONFIG serves (Llama's 8 KV heads: batch 16).
FP8_MANY_PROGRAMS = 128


def default_config(num_reqs: int, num_kv_heads: int, fp8_kv: bool, query_len: int = 1) -> DecodeConfig:
    """Stage 1's launch parameters for a batch, from host-side sizes only (fixed in a CUDA graph
    captured for that batch size). A verify step's taller tiles keep the 4-warp configuration."""
    if not fp8_kv:
        return DecodeConfig()
    many = num_reqs * num_kv_heads >= FP8_MANY_PROGRAMS and query_len == 1
    return FP8_MANY_PROGRAMS_CONFIG if many else FP8_DECODE_CONFIG


@triton.jit
def _split_len(shared_len, num_splits, BLOCK_N: tl.constexpr):
    """Tokens per split: ceil(shared_len / num_splits) rounded up to a whole number of tiles, where
    shared_len = seq_len - query_len + 1 counts the keys that every query token sees. Split s covers
    [s * len, min((s + 1) * len, shared_len)), the split that reaches shared_len up to seq_len;
    trailing splits of a short context may be empty. Both stages must agree on this formula."""
    return tl.cdiv(tl.cdiv(shared_len, num_splits), BLOCK_N) * BLOCK_N


@triton.jit
def _row_ptrs(request_ptr, tok, heads, stride_tok, stride_head, QUERY_LEN: tl.constexpr):
    """(BLOCK_H,) pointers to each tile row's (query token, head) in a (num_tokens, num_heads, ...)
    tensor, from request_ptr, its request's first token."""
    ptrs = request_ptr + heads * stride_head
    if QUERY_LEN > 1:
        ptrs += tok * stride_tok
    return ptrs


@triton.jit
def _first_key(seq_len, window, WINDOW: tl.constexpr):
    """The first key a one-token query at position seq_len - 1 sees: 0, or with a sliding window
    the first of its last `window` keys. Splits cut the keys from there on; both stages must agree."""
    if WINDOW:
        return tl.maximum(seq_len - window, 0)
    return 0


@triton.jit(do_not_specialize=["num_splits", "stride_table_req"])
def _decode_split_kernel(
    q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, lse_ptr,
    k_scale_ptr, v_scale_ptr,  # an FP8 cache's (num_kv_heads,) scales
    scale_log2,  # softmax scale * log2(e)
    num_splits,  # a runtime value: it follows the longest context, and each constexpr value compiles anew
    stride_q_tok, stride_q_head,
    stride_cache_kv, stride_cache_block, stride_cache_tok, stride_cache_head,
    stride_table_req,
    stride_out_tok, stride_out_head, stride_out_split,
    stride_lse_tok, stride_lse_head,
    window,  # with WINDOW (one query token a request only): the query sees its last `window` keys
    softcap_log2,  # with SOFTCAP: scores soft-capped at this (in log2 units)
    QUERY_LEN: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FP8_KV: tl.constexpr, WIDEN_Q: tl.constexpr, PDL: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    let_next_kernel_start(PDL)
    wait_for_previous_kernel(PDL)  # before the early return of an empty split too (pdl.py)
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + req)
    shared_len = seq_len - (QUERY_LEN - 1)  # keys 0 .. prefix, seen by every query token
    first_key = _first_key(seq_len, window, WINDOW)
    split_len = _split_len(shared_len - first_key, num_splits, BLOCK_N)
    start = first_key + split * split_len
    if start >= shared_len:  # an empty trailing split: stage 2 skips it by the same formula
        return
    end = tl.minimum(start + split_len, shared_len)
    if QUERY_LEN > 1:
        end = tl.where(end == shared_len, seq_len, end)  # the last split also takes the masked keys

    # Row r holds query token r // GROUP of this request and query head kv_head * GROUP + r % GROUP.
    rows = tl.arange(0, BLOCK_H)
    tok = rows // GROUP  # (BLOCK_H,), used only when QUERY_LEN > 1 (at 1 every real row is token 0)
    row_mask = rows < QUERY_LEN * GROUP
    heads = kv_head * GROUP + (rows % GROUP if QUERY_LEN > 1 else rows)  # (BLOCK_H,) query heads
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q_mask = row_mask[:, None] & dim_mask[None, :]
    q_rows = _row_ptrs(q_ptr + req * QUERY_LEN * stride_q_tok, tok, heads, stride_q_tok, stride_q_head, QUERY_LEN)
    q = tl.load(q_rows[:, None] + dims[None, :], mask=q_mask, other=0.0)
    q = fp8_query(q, WIDEN_Q)
    k_scale, v_scale = kv_scales(k_scale_ptr, v_scale_ptr, kv_head, FP8_KV)
    scale_log2 = scale_log2 * k_scale

    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    # -inf is safe: `start < shared_len`, so the first tile holds a key that every row sees (padding
    # rows too, whose q is 0), and every row gets a finite score there.
    row_max = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    table_row = block_tables_ptr + req * stride_table_req
    # Keys [start, unmasked_end): no causal mask. At QUERY_LEN 1 that is the whole split, whose
    # last tile may run past the context (`in_bounds`); above 1, whole tiles of shared keys only.
    unmasked_end = end if QUERY_LEN == 1 else tl.minimum(end, shared_len // BLOCK_N * BLOCK_N)
    for tile_start in range(start, unmasked_end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        in_bounds = pos < end
        k, v = load_kv_tile(
            cache_ptr, table_row, pos, in_bounds, kv_head, dims, dim_mask,
            stride_cache_kv, stride_cache_block, stride_cache_tok, stride_cache_head, q, PAGE_SIZE,
        )
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # (BLOCK_H, BLOCK_N)
        if SOFTCAP:
            scores = soft_cap(scores, softcap_log2)
        scores = tl.where(in_bounds[None, :], scores, float("-inf"))
        acc, row_sum, row_max = online_softmax_step(acc, row_sum, row_max, scores, v, DOT_PRECISION)
    if QUERY_LEN > 1:
        # Keys [unmasked_end, end), non-empty in the last split only: each row sees keys <= its position.
        row_pos = shared_len - 1 + tok  # (BLOCK_H,)
        for tile_start in range(tl.maximum(start, unmasked_end), end, BLOCK_N):
            pos = tile_start + tl.arange(0, BLOCK_N)
            k, v = load_kv_tile(
                cache_ptr, table_row, pos, pos < end, kv_head, dims, dim_mask,
                stride_cache_kv, stride_cache_block, stride_cache_tok, stride_cache_head, q, PAGE_SIZE,
            )
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
            if SOFTCAP:
                scores = soft_cap(scores, softcap_log2)
            visible = pos[None, :] <= row_pos[:, None]  # also keeps pos < seq_len for real rows
            scores = tl.where(visible, scores, float("-inf"))
            acc, row_sum, row_max = online_softmax_step(acc, row_sum, row_max, scores, v, DOT_PRECISION)

    out = acc / row_sum[:, None] * v_scale
    out_request = out_ptr + req * QUERY_LEN * stride_out_tok + split * stride_out_split
    out_rows = _row_ptrs(out_request, tok, heads, stride_out_tok, stride_out_head, QUERY_LEN)
    tl.store(out_rows[:, None] + dims[None, :], out, mask=q_mask)  # cast to the output's dtype on store
    lse = row_max + tl.log2(row_sum)
    lse_request = lse_ptr + req * QUERY_LEN * stride_lse_tok
    lse_rows = _row_ptrs(lse_request, tok, heads, stride_lse_tok, stride_lse_head, QUERY_LEN)
    tl.store(lse_rows + split, lse, mask=row_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    partial_ptr, lse_ptr, seq_lens_ptr, out_ptr, num_splits,
    stride_part_tok, stride_part_head, stride_part_split,
    stride_lse_tok, stride_lse_head,
    stride_out_tok, stride_out_head,
    window,
    QUERY_LEN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,  # BLOCK_S: num_splits rounded up to a power of two
    PDL: tl.constexpr, WINDOW: tl.constexpr,
):
    let_next_kernel_start(PDL)
    wait_for_previous_kernel(PDL)
    token = tl.program_id(0)  # flat query token: request token // QUERY_LEN
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + token // QUERY_LEN)
    shared_len = seq_len - (QUERY_LEN - 1)
    keys = shared_len - _first_key(seq_len, window, WINDOW)  # the keys the splits cut
    splits = tl.arange(0, BLOCK_S)
    # Empty splits wrote nothing; their rows of the buffers are garbage and must not be read.
    valid = (splits < num_splits) & (splits * _split_len(keys, num_splits, BLOCK_N) < keys)
    lse = tl.load(lse_ptr + token * stride_lse_tok + head * stride_lse_head + splits, mask=valid, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, axis=0))  # (BLOCK_S,), 0 for empty splits; split 0 is never empty
    dims = tl.arange(0, BLOCK_D)
    mask = valid[:, None] & (dims < HEAD_DIM)[None, :]
    part_ptrs = partial_ptr + token * stride_part_tok + head * stride_part_head + splits[:, None] * stride_part_split
    partial = tl.load(part_ptrs + dims[None, :], mask=mask, other=0.0)  # (BLOCK_S, BLOCK_D) fp32
    out = tl.sum(weight[:, None] * partial, axis=0) / tl.sum(weight, axis=0)
    tl.store(out_ptr + token * stride_out_tok + head * stride_out_head + dims, out, mask=dims < HEAD_DIM)


def decode_attention(
    q: torch.Tensor,  # (num_reqs * query_len, num_heads, head_dim): request r's tokens in rows r*Q .. r*Q+Q-1
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
    block_tables: torch.Tensor,  # (num_reqs, max_blocks) int32
    seq_lens: torch.Tensor,  # (num_reqs,) int32, each >= query_len, the query tokens included
    scale: float,
    out: torch.Tensor,  # like q, written
    num_splits: int,
    config: DecodeConfig | None = None,  # None: default_config's
    query_len: int = 1,  # Q: query tokens per request, the last Q of its context (a constexpr)
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # an FP8 cache's, (num_kv_heads,) each
    sliding_window: int | None = None,  # one query token a request: it sees only its last this many keys
    softcap: float | None = None,  # scores become softcap * tanh(score / softcap)
) -> None:
    """out[r*Q + j] = softmax(q[r*Q + j] k^T * scale) v over the first seq_lens[r] - Q + j + 1 cached
    tokens of request r: each of its Q tokens sees the keys up to its own position (with a sliding
    window, at query_len 1, the last sliding_window of them)."""
    num_tokens, num_heads, head_dim = q.shape
    num_reqs = num_tokens // query_len
    _, _, page_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    assert num_reqs * query_len == num_tokens, "every request brings query_len tokens"
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and kv_cache.stride(-1) == 1
    assert sliding_window is None or query_len == 1, "a windowed step of several tokens a request runs the varlen kernel"
    if num_splits == 1:
        partial = out[:, :, None, :]  # (num_tokens, num_heads, 1, head_dim): stage 1 writes the result
    else:
        partial = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=q.device)
    fp8_kv, k_scale, v_scale = kv_scale_args(kv_cache, kv_scales, lse)
    config = config or default_config(num_reqs, num_kv_heads, fp8_kv, query_len)
    _decode_split_kernel[(num_reqs, num_kv_heads, num_splits)](
        q, kv_cache, block_tables, seq_lens, partial, lse,
        k_scale, v_scale,
        scale * LOG2_E, num_splits,
        q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        partial.stride(0), partial.stride(1), partial.stride(2),
        lse.stride(0), lse.stride(1),
        sliding_window or 0, (softcap or 1.0) * LOG2_E,
        QUERY_LEN=query_len, GROUP=group, BLOCK_H=max(_MIN_DOT_ROWS, triton.next_power_of_2(query_len * group)),
        HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim),
        PAGE_SIZE=page_size, BLOCK_N=config.block_n,
        DOT_PRECISION=dot_precision(q.dtype), FP8_KV=fp8_kv, WIDEN_Q=widens_query(q.dtype, fp8_kv),
        WINDOW=sliding_window is not None, SOFTCAP=softcap is not None,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_launch(q.device),
    )
    if num_splits == 1:
        return
    _decode_merge_kernel[(num_tokens, num_heads)](
        partial, lse, seq_lens, out, num_splits,
        partial.stride(0), partial.stride(1), partial.stride(2),
        lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        sliding_window or 0,
        QUERY_LEN=query_len, HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim),
        BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_N=config.block_n, WINDOW=sliding_window is not None,
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

