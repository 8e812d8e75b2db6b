"""Ban the tokens a grammar does not allow: logits[r, t] = -inf where bit t % 32 of word t // 32 of
row r's bitmask is 0 (structured/bitmask.py has the layout). One program per row and BLOCK tokens;
it reads 4 bytes of mask per 32 logits and writes only the banned ones."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096


@triton.jit(do_not_specialize=["vocab", "stride_logits", "stride_mask"])
def _apply_bitmask(logits_ptr, mask_ptr, vocab, stride_logits, stride_mask, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = tokens < vocab
    words = tl.load(mask_ptr + row * stride_mask + tokens // 32, mask=in_vocab, other=-1)
    banned = ((words >> (tokens % 32)) & 1) == 0
    tl.store(logits_ptr + row * stride_logits + tokens, float("-inf"), mask=in_vocab & banned)


def apply_bitmask_kernel(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits (R, V) float, contiguous rows; bitmask (R, ceil(V / 32)) int32, on the same device."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1 and bitmask.stride(1) == 1 and bitmask.shape[0] == rows
    _apply_bitmask[(rows, triton.cdiv(vocab, _BLOCK))](
        logits, bitmask, vocab, logits.stride(0), bitmask.stride(0), BLOCK=_BLOCK,
    )
