"""Ban the tokens a grammar does not allow: out[r, t] = logits[r, t], or -inf where bit t % 32 of
word t // 32 of row r's bitmask is 0 (structured/bitmask.py has the layout). One program per row and
BLOCK tokens; it reads 4 bytes of mask per 32 logits. The result is a new tensor, so the logits
need no copy of their own before it (the sampler leaves its input as it was)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096


@triton.jit(do_not_specialize=["vocab", "stride_logits", "stride_mask"])
def _masked_logits(logits_ptr, mask_ptr, out_ptr, vocab, stride_logits, stride_mask, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = tokens < vocab
    words = tl.load(mask_ptr + row * stride_mask + tokens // 32, mask=in_vocab, other=-1)
    allowed = ((words >> (tokens % 32)) & 1) != 0
    logits = tl.load(logits_ptr + row * stride_logits + tokens, mask=in_vocab)
    tl.store(out_ptr + row * vocab + tokens, tl.where(allowed, logits, float("-inf")), mask=in_vocab)


def masked_logits_kernel(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits (R, V) float32, contiguous rows; bitmask (R, ceil(V / 32)) int32, on the same device
    -> (R, V) float32, a new tensor."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1 and bitmask.stride(1) == 1 and bitmask.shape[0] == rows
    out = torch.empty((rows, vocab), dtype=torch.float32, device=logits.device)
    _masked_logits[(rows, triton.cdiv(vocab, _BLOCK))](
        logits, bitmask, out, vocab, logits.stride(0), bitmask.stride(0), BLOCK=_BLOCK,
    )
    return out
