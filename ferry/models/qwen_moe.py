"""Qwen2-MoE and Qwen3-MoE: Qwen2's and Qwen3's networks with a mixture of experts in place of the
MLP in the sparse layers (`ModelConfig.moe.sparse_layers`); the others keep a dense MLP.

- Both routers round the experts' weights to the activations' dtype before they scale the experts'
  outputs (Mixtral's keep float32), and renormalize them only where `norm_topk_prob`.
- Qwen2-MoE adds a shared expert that every token goes through, scaled per token by
  sigmoid(shared_expert_gate(x)), and has q/k/v biases unless config.json's `qkv_bias` says not.
"""

from __future__ import annotations

import torch
from torch import nn

from ferry.config import ModelConfig
from ferry.layers.moe import QWEN_EXPERT_NAMES, FusedMoE, Routing, SparseMoeBlock, TopKRouter
from ferry.models.llama import LlamaAttention, LlamaMLP
from ferry.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM


class QwenMoeRouter(TopKRouter):
    def forward(self, x: torch.Tensor) -> Routing:
        weights, ids = super().forward(x)
        # Rounded as transformers rounds them; still float32 tensors, as the fused kernel takes them.
        return weights.to(x.dtype).float(), ids


class Qwen2MoeSparseMoeBlock(SparseMoeBlock):
    """The routed experts plus the shared expert, gated per token: (T, H) -> (T, H)."""

    def __init__(self, gate: TopKRouter, experts: FusedMoE, shared_expert: LlamaMLP, hidden_size: int) -> None:
        super().__init__(gate, experts)
        self.shared_expert = shared_expert
        self.shared_expert.gate_up_proj.input_op = None  # (it reads the normed stream: no norm of its own)
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared_expert(self.shared_expert.gate_up_proj(x))  # (T, H)
        return super().forward(x) + torch.sigmoid(self.shared_expert_gate(x)) * shared


def _is_sparse(config: ModelConfig, layer_idx: int) -> bool:
    return config.moe is not None and layer_idx in config.moe.sparse_layers


def _routed_experts(config: ModelConfig) -> tuple[QwenMoeRouter, FusedMoE]:
    hidden, moe = config.hf_config["hidden_size"], config.moe
    return QwenMoeRouter(hidden, moe), FusedMoE(hidden, moe, QWEN_EXPERT_NAMES)


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    def make_attention(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return LlamaAttention(config, layer_idx, qkv_bias=config.hf_config.get("qkv_bias", True), o_bias=False)

    def make_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        if not _is_sparse(config, layer_idx):
            return super().make_mlp(config, layer_idx)
        hidden = config.hf_config["hidden_size"]
        shared_expert = LlamaMLP(hidden, config.moe.shared_expert_intermediate_size, bias=False)
        return Qwen2MoeSparseMoeBlock(*_routed_experts(config), shared_expert, hidden)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def make_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        if not _is_sparse(config, layer_idx):
            return super().make_mlp(config, layer_idx)
        return SparseMoeBlock(*_routed_experts(config))
