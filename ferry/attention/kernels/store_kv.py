"""Write this step's keys and values into the paged KV cache (vLLM's `reshape_and_cache`).

A token's K (and V) is one row of `num_kv_heads * head_dim` contiguous elements, and so is its slot
in the cache, because the cache of a layer is laid out

    (2, num_blocks, block_size, num_kv_heads, head_dim)   contiguous
         slot = block * block_size + offset  ->  K row at block * stride(1) + offset * stride(2),
                                                 V row at the same offset + kv_cache.stride(0)

(A view of that shape over head-major storage works too: the strides place each head's part.)

so a program copies a (BLOCK_T tokens, row) tile of K and one of V, each row to its own slot.
Slot -1 marks a padding row (a fixed-size batch carries some): its row is masked out, never written.
An FP8 cache gets each value divided by its KV head's scale and clamped to e4m3's range first
(kernels/fp8_quant.py's `to_fp8`), as the reference (torch_ref.to_cache) does; the cast then
rounds to nearest.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferry.attention.kernels.launch import floor_power_of_2, kv_scale_args, num_multiprocessors
from ferry.kernels.fp8_quant import to_fp8
from ferry.kernels.pdl import let_next_kernel_start, pdl_launch, wait_for_previous_kernel

# One warp moves 32 lanes x 16 bytes = 512 bytes per vector instruction.
_BYTES_PER_WARP = 32 * 16
# Programs per multiprocessor before tokens are batched into one program: four give each SM work
# to overlap memory latency with; beyond that, more tokens per program amortize its fixed cost
# (the slot loads and address math). A decode batch therefore keeps one token per program.
_PROGRAMS_PER_SM = 4
_MAX_TOKENS_PER_PROGRAM = 16


@triton.jit(do_not_specialize=["num_tokens"])
def _store_kv_kernel(
    k_ptr, v_ptr, cache_ptr, slot_mapping_ptr, num_tokens,
    k_scale_ptr, v_scale_ptr,  # (num_kv_heads,) float32: read with an FP8 cache only
    stride_k_tok, stride_v_tok,
    stride_cache_kv,  # elements from the K half of the cache to the V half
    stride_cache_block, stride_cache_tok, stride_cache_head,
    ROW: tl.constexpr,  # num_kv_heads * head_dim
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_ROW: tl.constexpr,  # BLOCK_ROW: ROW rounded up to a power of two
    FP8: tl.constexpr, PDL: tl.constexpr,
):
    let_next_kernel_start(PDL)
    wait_for_previous_kernel(PDL)
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    # int64 slots: slot * ROW passes 2**31 in caches over 4 GB.
    slots = tl.load(slot_mapping_ptr + tokens, mask=tokens < num_tokens, other=-1)
    cols = tl.arange(0, BLOCK_ROW)  # contiguous on both sides: 16-byte vector loads and stores
    mask = (slots >= 0)[:, None] & (cols < ROW)[None, :]
    k = tl.load(k_ptr + tokens[:, None] * stride_k_tok + cols[None, :], mask=mask)
    v = tl.load(v_ptr + tokens[:, None] * stride_v_tok + cols[None, :], mask=mask)
    head = cols // HEAD_DIM
    # A slot's row: one contiguous run of ROW elements in the usual layout; a run of HEAD_DIM per
    # head where the cache's storage is head-major (kv_cache.py), its strides say which.
    row = (slots // PAGE_SIZE) * stride_cache_block + (slots % PAGE_SIZE) * stride_cache_tok
    dst = cache_ptr + row[:, None] + (head * stride_cache_head + cols % HEAD_DIM)[None, :]
    if FP8:
        k_scale = tl.load(k_scale_ptr + head, mask=cols < ROW, other=1.0)
        v_scale = tl.load(v_scale_ptr + head, mask=cols < ROW, other=1.0)
        k = to_fp8(k.to(tl.float32), k_scale[None, :])
        v = to_fp8(v.to(tl.float32), v_scale[None, :])
    # tl.store casts to the cache's dtype, as the reference's `.to(kv_cache.dtype)` does.
    tl.store(dst, k, mask=mask)
    tl.store(dst + stride_cache_kv, v, mask=mask)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Write k[t], v[t] at flat slot slot_mapping[t]; slot -1 is skipped.

    k, v: (num_tokens, num_kv_heads, head_dim), each token's heads contiguous (as views split out
    of a fused qkv projection are); kv_cache: contiguous (2, num_blocks, block_size, num_kv_heads,
    head_dim), or a view of it in that shape over other storage (each head's row contiguous);
    slot_mapping: (num_tokens,) int64; kv_scales: K's and V's (num_kv_heads,) float32
    scales, for an FP8 cache.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert kv_cache.stride(-1) == 1, "each head's row is contiguous"
    k, v = _rows_contiguous(k), _rows_contiguous(v)
    row = num_kv_heads * head_dim
    block_t = _tokens_per_program(num_tokens, k.device)
    tile_bytes = block_t * row * k.element_size()
    fp8, k_scale, v_scale = kv_scale_args(kv_cache, kv_scales, slot_mapping)
    _store_kv_kernel[(triton.cdiv(num_tokens, block_t),)](
        k, v, kv_cache, slot_mapping, num_tokens,
        k_scale, v_scale,
        k.stride(0), v.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        ROW=row, HEAD_DIM=head_dim, PAGE_SIZE=kv_cache.shape[2], BLOCK_T=block_t, BLOCK_ROW=triton.next_power_of_2(row), FP8=fp8,
        # One warp per 512 bytes of the tile: each lane moves one 16-byte vector per tensor.
        num_warps=max(1, min(8, tile_bytes // _BYTES_PER_WARP)), **pdl_launch(k.device),
    )


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """The kernel reads a token's (num_kv_heads, head_dim) as one contiguous row."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def _tokens_per_program(num_tokens: int, device: torch.device) -> int:
    per_program = num_tokens // (_PROGRAMS_PER_SM * num_multiprocessors(device))
    return min(_MAX_TOKENS_PER_PROGRAM, floor_power_of_2(max(1, per_program)))

