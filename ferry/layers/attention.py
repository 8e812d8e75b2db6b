"""The attention layer: owns no weights, only hands q/k/v and its layer's KV cache to the backend."""

from __future__ import annotations

import torch
from torch import nn

from ferry.attention.backend import ForwardContext


class Attention(nn.Module):
    """Causal attention of this step's queries over each request's cached context.

    `layer_idx` picks this layer's KV cache from `ctx.kv_caches`; which kernel runs is the
    backend's business, so model code stays the same on every device.

    `k_scale` and `v_scale` (one per KV head) are what an FP8 KV cache's values are multiplied by:
    ones, unless the checkpoint calibrated them (`self_attn.k_scale`, as vLLM and llm-compressor
    write them; the loader finds them there). A 16-bit cache ignores them.
    """

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int, sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.sliding_window = sliding_window  # a query sees the last this many keys (itself included); None: all
        self.softcap: float | None = None  # scores soft-capped to (-softcap, softcap) before the softmax (Gemma 2)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.layer_idx = layer_idx
        self.scale = head_dim**-0.5
        # Buffers, not parameters: they are not weights (the weight count leaves them out), but the
        # loader fills them from the checkpoint when it has them (loader.kv_scale_targets).
        self.register_buffer("k_scale", torch.ones(num_kv_heads, dtype=torch.float32))
        self.register_buffer("v_scale", torch.ones(num_kv_heads, dtype=torch.float32))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """q: (num_tokens, num_heads, head_dim); k, v: (num_tokens, num_kv_heads, head_dim).
        Returns (num_tokens, num_heads * head_dim), ready for o_proj."""
        kv_cache = ctx.kv_caches[self.layer_idx]
        out = ctx.backend.forward(q, k, v, kv_cache, ctx.attn_metadata, self.scale, (self.k_scale, self.v_scale),
                                  self.sliding_window, self.softcap)
        return out.flatten(1, 2)  # (num_tokens, num_heads * head_dim)
