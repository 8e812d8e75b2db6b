"""The gated activation of Llama-family MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """silu(gate) * up, where the input is gate and up side by side: (..., 2 * d) -> (..., d).

    The MLP computes gate_proj and up_proj in one merged matmul; this splits the result again.
    On CUDA one fused kernel (fused.py) does it all.
    """

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.is_cuda and gate_up.dim() == 2:
            from ferry.layers import fused

            return fused.silu_and_mul(gate_up)  # one kernel instead of a split, a silu and a mul
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
