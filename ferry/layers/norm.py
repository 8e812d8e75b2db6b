"""RMSNorm, the only normalization Llama-family models use."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), over the last dimension.

    The statistics are taken in float32 and the result is cast back before the weight is applied,
    exactly as Hugging Face's LlamaRMSNorm does, so half-precision outputs round the same way.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)
