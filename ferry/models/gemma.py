"""Gemma 2 and Gemma 3 (text): Llama's attention and gated MLP with Gemma's changes, as
transformers defines them.

- Embeddings scaled by sqrt(hidden_size) (rounded to the activations' dtype first).
- RMSNorm scales by (1 + weight), in float32, and every block is wrapped in two of them: a norm
  before attention and one on its output before the residual add, and the same around the MLP.
- The MLP's gate goes through GELU (tanh approximation), not SiLU.
- Attention scaled by query_pre_attn_scalar ** -0.5 rather than head_dim ** -0.5, its scores
  soft-capped (cap * tanh(score / cap), attn_logit_softcapping), and every other layer local: a
  sliding window of `sliding_window` keys (`layer_types`), the others global. The global layers
  need every key, so no block is given back as the window slides (kv_cache_manager.py frees blocks
  only where every layer is windowed).
- The final logits soft-capped too (final_logit_softcapping).

Gemma 3 keeps all that (its configs turn both soft caps off) and adds an RMSNorm over each head of
q and k before RoPE; its local layers (five in six by default) rotate with their own RoPE base
(`rope_parameters["sliding_attention"]`, or `rope_local_base_freq` in older configs), the global
ones with theirs, possibly scaled.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ferry.attention.backend import ForwardContext
from ferry.config import ModelConfig
from ferry.layers.linear import Linear, MergedLinear
from ferry.layers.rotary import RotaryEmbedding, apply_rotary_qk, rope_parameters
from ferry.models.llama import LlamaAttention, Rope


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), computed in float32 and rounded once (weights start at zero)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


def layer_windows(hf: dict[str, Any]) -> list[int | None]:
    """Each layer's attention window: `sliding_window` where `layer_types` says sliding_attention
    (by default the even layers, 0, 2, ...), None where it says full_attention."""
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported (sliding_attention and full_attention are)")
    return [hf.get("sliding_window") if t == "sliding_attention" else None for t in types]


class Gemma2Attention(LlamaAttention):
    """Llama's attention with Gemma's scale, soft cap and (on local layers) window. Its input is
    normed by the decoder layer (Gemma's norm, not fused into qkv_proj)."""

    def __init__(self, config: ModelConfig, layer_idx: int, window: int | None) -> None:
        hf = config.hf_config
        bias = hf.get("attention_bias", False)
        super().__init__(config, layer_idx, qkv_bias=bias, o_bias=bias)
        self.qkv_proj.input_op = None
        self.attn.sliding_window = window
        self.attn.scale = hf.get("query_pre_attn_scalar", self.head_dim) ** -0.5
        self.attn.softcap = hf.get("attn_logit_softcapping")


class Gemma3Attention(Gemma2Attention):
    """Gemma 2's attention plus Gemma's RMSNorm over each head of q and k, before RoPE."""

    def __init__(self, config: ModelConfig, layer_idx: int, window: int | None) -> None:
        super().__init__(config, layer_idx, window)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.hf_config["rms_norm_eps"])
        self.k_norm = GemmaRMSNorm(self.head_dim, config.hf_config["rms_norm_eps"])

    def rotate(self, q: torch.Tensor, k: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary_qk(self.q_norm(q), self.k_norm(k), rope)


class GemmaMLP(nn.Module):
    """down_proj(gelu_tanh(gate_proj(x)) * up_proj(x)), gate and up in one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str) -> None:
        super().__init__()
        if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"hidden_activation {activation!r} is not supported; Gemma in ferry uses 'gelu_pytorch_tanh'")
        self.gate_up_proj = MergedLinear(hidden_size, {"gate_proj": intermediate_size, "up_proj": intermediate_size},
                                         bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma2DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, window: int | None, attention: type = Gemma2Attention) -> None:
        super().__init__()
        hf = config.hf_config
        h, eps = hf["hidden_size"], hf["rms_norm_eps"]
        self.window = window
        self.self_attn = attention(config, layer_idx, window)
        self.mlp = GemmaMLP(h, hf["intermediate_size"], hf.get("hidden_activation") or hf.get("hidden_act"))
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, x: torch.Tensor, rope: Rope, ctx: ForwardContext) -> torch.Tensor:
        attention = self.self_attn
        x = x + self.post_attention_layernorm(attention(attention.qkv_proj(self.input_layernorm(x)), rope, ctx))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma2Model(nn.Module):
    def __init__(self, config: ModelConfig, attention: type = Gemma2Attention) -> None:
        super().__init__()
        hf = config.hf_config
        self.embed_tokens = nn.Embedding(hf["vocab_size"], hf["hidden_size"])
        self.layers = nn.ModuleList(Gemma2DecoderLayer(config, i, w, attention) for i, w in enumerate(layer_windows(hf)))
        self.norm = GemmaRMSNorm(hf["hidden_size"], hf["rms_norm_eps"])
        local, global_ = layer_rope_parameters(hf)
        self.rotary_emb = RotaryEmbedding(config.head_dim, global_)
        # The local layers' RoPE, where it differs (Gemma 3).
        self.local_rotary_emb = RotaryEmbedding(config.head_dim, local) if local != global_ else None
        self.embed_scale = hf["hidden_size"] ** 0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)  # the scale rounded to the dtype, as transformers does
        rope = self.rotary_emb(positions)
        local = self.local_rotary_emb(positions) if self.local_rotary_emb is not None else rope
        for layer in self.layers:
            x = layer(x, local if layer.window is not None else rope, ctx)
        return self.norm(x)


def layer_rope_parameters(hf: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(local layers', global layers') RoPE settings: transformers 5 writes one dict per layer type
    in `rope_parameters`; older Gemma 3 configs give the global one as usual (rope_theta,
    rope_scaling) and the local base as `rope_local_base_freq`; Gemma 2 has one for both."""
    per_type = hf.get("rope_parameters") or {}
    if "full_attention" in per_type or "sliding_attention" in per_type:
        default = {"rope_type": "default"}
        global_ = rope_parameters({"rope_parameters": per_type.get("full_attention") or default})
        local = rope_parameters({"rope_parameters": per_type.get("sliding_attention") or default})
        return local, global_
    global_ = rope_parameters(hf)
    if "rope_local_base_freq" in hf:
        return {"rope_type": "default", "rope_theta": hf["rope_local_base_freq"]}, global_
    return global_, global_


class Gemma2ForCausalLM(nn.Module):
    attention = Gemma2Attention
    layer_windows = staticmethod(layer_windows)  # (ModelConfig.layer_windows)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hf = config.hf_config
        self.model = Gemma2Model(config, self.attention)
        self.lm_head = nn.Linear(hf["hidden_size"], hf["vocab_size"], bias=False)
        self.tie_word_embeddings = bool(hf.get("tie_word_embeddings", True))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.final_softcap = hf.get("final_logit_softcapping")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3's text model (config model_type gemma3_text)."""

    attention = Gemma3Attention
