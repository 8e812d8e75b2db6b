"""Qwen2 and Qwen3: Llama's network with two changes each.

- Qwen2 adds a bias to the q, k and v projections (never to o_proj).
- Qwen3 has no biases but RMS-normalizes each head's q and k over head_dim before RoPE (`q_norm`,
  `k_norm`), and its head_dim is set on its own rather than hidden_size / num_heads.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ferry.config import ModelConfig
from ferry.layers.norm import RMSNorm
from ferry.layers.rotary import apply_rotary_qk
from ferry.models.llama import LlamaAttention, LlamaForCausalLM, Rope


def _qwen_sliding_window(hf_config: dict[str, Any]) -> int | None:
    # Qwen configs always carry a `sliding_window` value, but it only applies when switched on.
    return hf_config.get("sliding_window") if hf_config.get("use_sliding_window") else None


class Qwen2ForCausalLM(LlamaForCausalLM):
    def make_attention(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return LlamaAttention(config, layer_idx, qkv_bias=True, o_bias=False)

    @staticmethod
    def sliding_window(hf_config: dict[str, Any]) -> int | None:
        return _qwen_sliding_window(hf_config)


class Qwen3Attention(LlamaAttention):
    """Llama attention plus an RMSNorm over each head's q and k, shared by all heads."""

    def __init__(self, config: ModelConfig, layer_idx: int, bias: bool) -> None:
        super().__init__(config, layer_idx, qkv_bias=bias, o_bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps=config.hf_config["rms_norm_eps"])
        self.k_norm = RMSNorm(self.head_dim, eps=config.hf_config["rms_norm_eps"])

    def rotate(self, q: torch.Tensor, k: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary_qk(q, k, rope, self.q_norm, self.k_norm)


class Qwen3ForCausalLM(LlamaForCausalLM):
    def make_attention(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return Qwen3Attention(config, layer_idx, bias=config.hf_config.get("attention_bias", False))

    @staticmethod
    def sliding_window(hf_config: dict[str, Any]) -> int | None:
        return _qwen_sliding_window(hf_config)
