"""Fused mixture-of-experts: each token's top-k experts' MLPs, weighted and summed, as two grouped
GEMMs that read only the weights of the experts some token chose.

    out[t] = sum over j of  topk_weights[t, j] * W2[e] @ (silu(W13[e, :I] @ x[t]) * (W13[e, I:] @ x[t]))
             with e = topk_ids[t, j];  W13 (E, 2I, H) holds each expert's gate rows then its up rows

A token's k choices are k (token, expert) pairs, pair p = t * k + j. Grouped by expert, the pairs of
one expert are the rows of an ordinary GEMM against that expert's weights; with each group padded
to a multiple of BLOCK_M, every tile of BLOCK_M rows belongs to a single expert (`align_block_size`):

    topk_ids (T 3, k 2)     slots, pairs grouped by expert (BLOCK_M 4)    expert_ids (one a block)
    t0: [2, 0]   pairs 0 1     0.. 3   [1, 4, -, -]   expert 0's pairs     [0,
    t1: [2, 5]   pairs 2 3     4.. 7   [0, 2, 5, -]   expert 2's           2,
    t2: [0, 2]   pairs 4 5     8..11   [3, -, -, -]   expert 5's           5]
                               "-": the sentinel T * k, a padded slot;  num_tokens_post_padded = 12

    gate_up kernel, program (block b, BLOCK_N columns c of I):
        rows   = x[sorted_token_ids[b's slots] // k]                      (BLOCK_M, H), gathered
        gate   = rows @ W13[expert_ids[b], c]^T      up = rows @ W13[expert_ids[b], I + c]^T
        act[pairs, c] = silu(gate) * up                                   (T*k, I), x's dtype
    down kernel, program (block b, BLOCK_N columns c of H):
        y[pairs, c] = topk_weights[pairs] * act[pairs] @ W2[expert_ids[b], c]^T   (T*k, H) = (T, k, H)
    combine:  out[t] = sum over j of y[t, j]                              a sum over k, in float32

Both GEMMs keep their accumulators in float32 and fold the small ops into their epilogues: SiLU and
the product with up in the first (gate_up never reaches memory), the routing weight in the second.
The activation is rounded to x's dtype as it is stored, as Hugging Face's MoE layers round it.

The combine is a reduction over a (T, k, H) buffer rather than atomic adds into out: a token's k
pairs lie in k different experts' blocks, so one program cannot sum them, and float atomics would add
them in whatever order the programs finish, a different rounding from run to run. The buffer costs
T * k * H values of x's dtype and one more pass; with k = 1 the down kernel writes into out itself.

Alignment, on the device in two small kernels (pairs in chunks of _CHUNK, one program a chunk):

    count, program c:  chunk_counts[c, e] = pairs of chunk c that chose expert e
    place, program c:  count[e] = sum over all chunks,  before[e] = sum over the chunks before c
                       start[e] = exclusive cumsum over experts of round_up(count[e], BLOCK_M)
                       the r-th pair of chunk c that chose e  ->  slot start[e] + before[e] + r
                       program 0 also marks the padded slots, and writes expert_ids and
                       num_tokens_post_padded

Pairs keep their order within an expert, so the layout is the same from run to run. No host sync:
the grids and buffers are sized from host integers alone, for the most blocks the pairs can need,
max_blocks = (T*k + min(E, T*k) * (BLOCK_M - 1)) // BLOCK_M (every expert that was chosen wastes at
most BLOCK_M - 1 slots); the GEMMs' programs read num_tokens_post_padded on the device, and those
past it return before they load anything else. So the whole forward, the final sum over k included,
can be captured in a CUDA graph, and no kernel specializes on the pair count, which changes from
step to step (no step waits for a compilation).

Small batches. A decode step of batch 1 to 8 has a few pairs for each chosen expert, so its blocks
are mostly padding, and its cost is reading weights: each block is one chosen expert, and a block
never exists for an expert that no token chose. With BLOCK_M 16 (`choose_config`), as long as no
expert has more than 16 pairs (always at batch 16 or less: a token chooses an expert once), a step
reads each distinct chosen expert's W13 and W2 once, d * 3 * I * H values with d <= min(E, T*k)
the distinct experts chosen. For Qwen3-30B-A3B (H 2048, I 768, bf16) that is 9.4 MB an expert: at
batch 1 (8 experts) 75 MB a layer, 16 us at an H200's 4.8 TB/s. An expert with more pairs than
BLOCK_M has its weights read once per block of its pairs (mostly from L2, as its blocks run side
by side: the block index is the grid's fastest axis).

On Hopper the kernels launch with programmatic dependent launch (kernels/pdl.py), but each waits
before its first load: which weights a program reads depends on the alignment of the same step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ferry.kernels.pdl import let_next_kernel_start, pdl_launch, wait_for_previous_kernel

# Pairs an alignment program takes: a prefill chunk of 8192 tokens at top-8 is 64 programs, and each
# program sums the other chunks' counts (64 rows of E) before placing its own pairs.
_CHUNK = 1024
# Elements of an alignment tile's one-hot (pairs x experts) matrix: 128 pairs a tile at 128 experts.
_ONE_HOT_ELEMENTS = 16384
# Blocks whose expert program 0 finds at a time, against all the experts' slot ranges (32 x 256
# at 256 experts, which compiles without spills in 4 warps).
_BLOCKS_A_STEP = 32


@dataclass(frozen=True)
class MoeKernelConfig:
    """Launch parameters of both grouped GEMMs: tiles of block_m pairs (the alignment's padding
    unit) by block_n output columns, block_k of the reduction at a time, num_stages tiles in flight.

    Leads for Hopper, not measured yet: to be tuned on the GPU, by the pair count and also by
    the experts' shapes (I, H) and pairs per expert, which decide how much a weight tile is reused.
    One configuration serves both GEMMs; the first holds two accumulators (gate and up), and may
    want narrower tiles than the second.
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


# Decode: a few pairs an expert, so 16 rows (tl.dot's least) waste the least, and narrow column
# tiles give the step's few blocks enough programs to stream the weights from every multiprocessor
# (Qwen3-30B-A3B at batch 1: 8 blocks, 192 gate_up and 512 down programs). Compiled for sm_90 in
# bf16, gate_up takes 56 registers and 60 KB of shared memory, no spills: three programs an SM.
DECODE_CONFIG = MoeKernelConfig(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=4)
# Up to 1024 pairs (128 tokens at top-8): tens of pairs an expert.
SMALL_BATCH_CONFIG = MoeKernelConfig(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=4)
# Prefill: hundreds of pairs an expert; larger tiles reuse each weight tile over more rows. gate_up
# takes 118 registers and 120 KB of shared memory (one program an SM): a first thing to tune.
PREFILL_CONFIG = MoeKernelConfig(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)


def choose_config(num_pairs: int) -> MoeKernelConfig:
    """The launch parameters for T * k pairs (host-side: fixed in a CUDA graph of that batch)."""
    if num_pairs <= 64:
        return DECODE_CONFIG
    if num_pairs <= 1024:
        return SMALL_BATCH_CONFIG
    return PREFILL_CONFIG


class Alignment(NamedTuple):
    """The pairs grouped by expert, each group padded to whole blocks (module docstring's picture).
    Only the first num_tokens_post_padded slots and their blocks are written; the rest of both
    buffers (sized for the most blocks the pairs can need) is never read."""

    sorted_token_ids: torch.Tensor  # (max_blocks * block_m,) int32: pair t * k + j, or T * k: padding
    expert_ids: torch.Tensor  # (max_blocks,) int32: the expert of each block of block_m slots
    num_tokens_post_padded: torch.Tensor  # (1,) int32: the slots in use, a multiple of block_m


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most blocks num_pairs pairs can fill: at most min(E, pairs) experts are chosen, and each
    pads its group by at most block_m - 1 slots."""
    return (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m


@triton.jit
def _tile_one_hot(ids_ptr, t0, num_pairs, experts, TILE: tl.constexpr):
    """Pairs t0 .. t0 + TILE and their (TILE, BLOCK_E) int32 one-hot expert rows (zero past the pairs)."""
    pairs = t0 + tl.arange(0, TILE)
    chosen = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
    return pairs, (chosen[:, None] == experts[None, :]).to(tl.int32)


@triton.jit(do_not_specialize=["num_pairs"])
def _count_kernel(
    ids_ptr, chunk_counts_ptr, num_pairs,
    BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, TILE: tl.constexpr, PDL: tl.constexpr,
):
    let_next_kernel_start(PDL)
    chunk = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    wait_for_previous_kernel(PDL)  # the router writes topk_ids
    count = tl.zeros([BLOCK_E], dtype=tl.int32)
    for t0 in range(chunk * CHUNK, tl.minimum(chunk * CHUNK + CHUNK, num_pairs), TILE):
        _, one_hot = _tile_one_hot(ids_ptr, t0, num_pairs, experts, TILE)
        count += tl.sum(one_hot, axis=0)
    tl.store(chunk_counts_ptr + chunk * BLOCK_E + experts, count)


@triton.jit
def _mark_padding(sorted_ptr, start, count, padded, num_pairs, BLOCK_M: tl.constexpr):
    """The sentinel num_pairs in every expert's slots past its pairs: (BLOCK_E, BLOCK_M) at once,
    since an expert pads fewer than BLOCK_M slots."""
    j = tl.arange(0, BLOCK_M)
    slots = (start + count)[:, None] + j[None, :]
    sentinel = tl.full(slots.shape, num_pairs, dtype=tl.int32)
    tl.store(sorted_ptr + slots, sentinel, mask=j[None, :] < (padded - count)[:, None])


@triton.jit
def _write_block_experts(expert_ids_ptr, ends, num_padded, BLOCK_M: tl.constexpr, BLOCKS_A_STEP: tl.constexpr):
    """Each block's expert, the first whose slot range ends past the block's first slot (experts
    with no pairs have empty ranges and are never it)."""
    for b0 in range(0, num_padded // BLOCK_M, BLOCKS_A_STEP):
        blocks = b0 + tl.arange(0, BLOCKS_A_STEP)
        expert = tl.sum((ends[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + blocks, expert, mask=blocks * BLOCK_M < num_padded)


@triton.jit(do_not_specialize=["num_pairs", "num_chunks"])
def _place_kernel(
    ids_ptr, chunk_counts_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr, num_pairs, num_chunks,
    BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, TILE: tl.constexpr,
    BLOCKS_A_STEP: tl.constexpr, PDL: tl.constexpr,
):
    let_next_kernel_start(PDL)
    chunk = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    wait_for_previous_kernel(PDL)
    count = tl.zeros([BLOCK_E], dtype=tl.int32)
    before = tl.zeros([BLOCK_E], dtype=tl.int32)  # this expert's pairs in the chunks before this one
    for c in range(num_chunks):
        row = tl.load(chunk_counts_ptr + c * BLOCK_E + experts)
        count += row
        before += tl.where(c < chunk, row, 0)
    padded = tl.cdiv(count, BLOCK_M) * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    start = ends - padded
    next_slot = start + before  # each expert's slot for its next pair of this chunk
    for t0 in range(chunk * CHUNK, tl.minimum(chunk * CHUNK + CHUNK, num_pairs), TILE):
        pairs, one_hot = _tile_one_hot(ids_ptr, t0, num_pairs, experts, TILE)
        earlier = tl.cumsum(one_hot, axis=0) - one_hot  # the tile's earlier pairs of the same expert
        slots = tl.sum(one_hot * (earlier + next_slot[None, :]), axis=1)
        tl.store(sorted_ptr + slots, pairs, mask=pairs < num_pairs)
        next_slot += tl.sum(one_hot, axis=0)
    if chunk == 0:
        num_padded = tl.sum(padded, axis=0)
        _mark_padding(sorted_ptr, start, count, padded, num_pairs, BLOCK_M)
        _write_block_experts(expert_ids_ptr, ends, num_padded, BLOCK_M, BLOCKS_A_STEP)
        tl.store(num_padded_ptr, num_padded)


def align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """The (token, expert) pairs of topk_ids (T, k), ids in [0, num_experts), grouped by expert and
    padded to blocks of block_m slots, on the device and without a host sync."""
    ids = topk_ids.reshape(-1)
    num_pairs, device = ids.numel(), ids.device
    blocks = max_blocks(num_pairs, num_experts, block_m)
    block_e = triton.next_power_of_2(num_experts)
    tile = max(16, min(_CHUNK, _ONE_HOT_ELEMENTS // block_e))
    num_chunks = triton.cdiv(num_pairs, _CHUNK)
    chunk_counts = torch.empty((num_chunks, block_e), dtype=torch.int32, device=device)
    alignment = Alignment(
        torch.empty(blocks * block_m, dtype=torch.int32, device=device),
        torch.empty(blocks, dtype=torch.int32, device=device),
        torch.empty(1, dtype=torch.int32, device=device),
    )
    pdl = pdl_launch(device)
    _count_kernel[(num_chunks,)](ids, chunk_counts, num_pairs, BLOCK_E=block_e, CHUNK=_CHUNK, TILE=tile, **pdl)
    _place_kernel[(num_chunks,)](
        ids, chunk_counts, *alignment, num_pairs, num_chunks,
        BLOCK_E=block_e, BLOCK_M=block_m, CHUNK=_CHUNK, TILE=tile, BLOCKS_A_STEP=_BLOCKS_A_STEP, **pdl,
    )
    return alignment


@triton.jit
def _dot(a, b, acc):
    """acc + a @ b; float32 operands multiply exactly (IEEE), not in TF32."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _block_pairs(sorted_ptr, expert_ids_ptr, block, num_pairs, BLOCK_M: tl.constexpr):
    """A block's pairs (BLOCK_M,), which of its rows are pairs rather than padding, and its expert
    (int64: an expert's offset into the weights can pass 2**31 elements)."""
    pairs = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    return pairs, pairs < num_pairs, tl.load(expert_ids_ptr + block).to(tl.int64)


@triton.jit
def _weight_tile(w_ptr, rows, row_ok, ks, k, stride_row):
    """W[rows, ks]^T, (BLOCK_K, BLOCK_N) for tl.dot, zero outside the matrix."""
    mask = row_ok[None, :] & (ks[:, None] < k)
    return tl.load(w_ptr + rows[None, :] * stride_row + ks[:, None], mask=mask, other=0.0)


@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_kernel(
    x_ptr, w13_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr, act_ptr,
    num_pairs, top_k, hidden, inter, stride_x, stride_we, stride_wn, stride_act,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    let_next_kernel_start(PDL)
    block = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    wait_for_previous_kernel(PDL)
    if block * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs, pair_ok, expert = _block_pairs(sorted_ptr, expert_ids_ptr, block, num_pairs, BLOCK_M)
    rows_ptr = x_ptr + (pairs // top_k)[:, None] * stride_x  # each pair's token
    w_ptr = w13_ptr + expert * stride_we
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(rows_ptr + ks[None, :], mask=pair_ok[:, None] & (ks[None, :] < hidden), other=0.0)
        gate = _dot(a, _weight_tile(w_ptr, cols, col_ok, ks, hidden, stride_wn), gate)
        up = _dot(a, _weight_tile(w_ptr, inter + cols, col_ok, ks, hidden, stride_wn), up)
    act = gate / (1.0 + tl.exp(-gate)) * up
    mask = pair_ok[:, None] & col_ok[None, :]
    tl.store(act_ptr + pairs[:, None] * stride_act + cols[None, :], act.to(act_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(
    act_ptr, w2_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr, topk_weights_ptr, y_ptr,
    num_pairs, hidden, inter, stride_act, stride_we, stride_wn, stride_y,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    let_next_kernel_start(PDL)
    block = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    wait_for_previous_kernel(PDL)
    if block * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs, pair_ok, expert = _block_pairs(sorted_ptr, expert_ids_ptr, block, num_pairs, BLOCK_M)
    rows_ptr = act_ptr + pairs[:, None] * stride_act
    w_ptr = w2_ptr + expert * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(rows_ptr + ks[None, :], mask=pair_ok[:, None] & (ks[None, :] < inter), other=0.0)
        acc = _dot(a, _weight_tile(w_ptr, cols, col_ok, ks, inter, stride_wn), acc)
    acc *= tl.load(topk_weights_ptr + pairs, mask=pair_ok, other=0.0)[:, None]
    mask = pair_ok[:, None] & col_ok[None, :]
    tl.store(y_ptr + pairs[:, None] * stride_y + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


def _gate_up(x: torch.Tensor, w13: torch.Tensor, alignment: Alignment, top_k: int, config: MoeKernelConfig) -> torch.Tensor:
    """silu(gate) * up of every pair, (T * k, I) in x's dtype."""
    inter = w13.shape[1] // 2
    num_pairs = x.shape[0] * top_k
    act = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    grid = (alignment.expert_ids.numel(), triton.cdiv(inter, config.block_n))
    _gate_up_kernel[grid](
        x, w13, *alignment, act, num_pairs, top_k, x.shape[1], inter, x.stride(0), w13.stride(0), w13.stride(1),
        act.stride(0), BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_launch(x.device),
    )
    return act


def _down(
    act: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, alignment: Alignment, y: torch.Tensor,
    config: MoeKernelConfig,
) -> None:
    """y[pair] = the pair's routing weight times its down projection, y (T * k, H)."""
    hidden, inter = w2.shape[1], w2.shape[2]
    grid = (alignment.expert_ids.numel(), triton.cdiv(hidden, config.block_n))
    _down_kernel[grid](
        act, w2, *alignment, topk_weights.reshape(-1), y, act.shape[0], hidden, inter, act.stride(0),
        w2.stride(0), w2.stride(1), y.stride(0), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, num_warps=config.num_warps, num_stages=config.num_stages, **pdl_launch(act.device),
    )


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The MoE layer's experts for the tokens x (T, H): out (T, H) in x's dtype (module docstring).

    w13 (E, 2I, H) and w2 (E, H, I) in x's dtype, rows contiguous; topk_weights (T, k) float32;
    topk_ids (T, k) int32 or int64, in [0, E).
    """
    num_tokens, hidden = x.shape
    num_experts, top_k = w13.shape[0], topk_ids.shape[1]
    assert w13.shape[1:] == (2 * w2.shape[2], hidden) and w2.shape[:2] == (num_experts, hidden)
    assert x.dtype == w13.dtype == w2.dtype and topk_weights.dtype == torch.float32
    assert x.stride(1) == w13.stride(2) == w2.stride(2) == 1
    config = choose_config(num_tokens * top_k)
    alignment = align_block_size(topk_ids, num_experts, config.block_m)
    act = _gate_up(x, w13, alignment, top_k, config)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    y = out if top_k == 1 else torch.empty((num_tokens * top_k, hidden), dtype=x.dtype, device=x.device)
    _down(act, w2, topk_weights, alignment, y, config)
    if top_k > 1:  # (torch sums 16-bit values in float32 and rounds once)
        torch.sum(y.view(num_tokens, top_k, hidden), dim=1, out=out)
    return out


def fused_moe_reference(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
) -> torch.Tensor:
    """fused_moe in plain torch, expert by expert: products and sums in float32, the activation
    rounded to x's dtype as Hugging Face's MoE layers round it (reads topk_ids on the host)."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in topk_ids.unique().tolist():
        token, j = (topk_ids == expert).nonzero(as_tuple=True)
        gate_up = x[token].float() @ w13[expert].float().T  # (pairs, 2I)
        act = (torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(x.dtype)
        y = act.float() @ w2[expert].float().T * topk_weights[token, j, None]  # (pairs, H)
        out.index_add_(0, token, y)
    return out.to(x.dtype)
