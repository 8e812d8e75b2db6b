"""RMSNorm, the only normalization Llama-family models use."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), over the last dimension.

    The statistics are taken in float32 and the result is cast back before the weight is applied,
    exactly as Hugging Face's LlamaRMSNorm does, so half-precision outputs round the same way.

    Given a residual, the norm is of x + residual and both are returned: (normed, x + residual),
    the sum being the next residual. On CUDA one fused kernel (fused.py) does the add and the norm,
    updating `residual` in place.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.is_cuda and x.dim() == 2:
            from ferry.layers import fused

            out = fused.rms_norm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # the same arithmetic in one op (few ops matter on a CPU)
            return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)
