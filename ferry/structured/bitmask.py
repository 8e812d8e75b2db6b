"""The allowed tokens of a step's rows as a bitmask, filled on the host and applied on the device.

One bit per token, 32 tokens an int32 word (llguidance's layout: bit b of word w is token 32w + b).
A row with no grammar is all ones. The host fills the mask while the device runs the step's
forward; the mask then goes to the device in one copy and bans every token whose bit is 0:

    word w of row r:  0b...1011  ->  tokens 32w+0, 32w+1, 32w+3 allowed, 32w+2 banned (-inf)
"""

from __future__ import annotations

import torch


def new_bitmask(num_rows: int, vocab_size: int, pin_memory: bool = False) -> torch.Tensor:
    """(num_rows, ceil(vocab / 32)) int32, every token allowed."""
    return torch.full((num_rows, -(-vocab_size // 32)), -1, dtype=torch.int32, pin_memory=pin_memory)


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits (R, V) with -inf where the bit of (row, token) is 0, in place; bitmask (R, ceil(V/32))
    on the logits' device. On CUDA one Triton kernel; elsewhere torch ops (the reference)."""
    if logits.device.type == "cuda":
        from ferry.kernels.bitmask import apply_bitmask_kernel

        apply_bitmask_kernel(logits, bitmask)
        return logits
    return apply_bitmask_reference_(logits, bitmask)


def apply_bitmask_reference_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[1]
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).flatten(1)[:, :vocab]  # (R, V) 0/1
    return logits.masked_fill_(allowed == 0, float("-inf"))
