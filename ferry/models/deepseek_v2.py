"""DeepSeek-V2 and V2-Lite: multi-head latent attention (MLA) and a mixture of experts with shared
experts, in Llama's decoder layers.

MLA caches a latent, not keys and values. Each token's hidden state is projected to c, of
kv_lora_rank numbers (RMS-normed), and to one RoPE key k_pe of qk_rope_head_dim that every head
shares; the cache holds only [c, k_pe], 576 numbers a token a layer for V2-Lite where its 16 heads
of keys and values would take 16 x (192 + 128) = 5,120. Head h's key and value are expanded from c
by kv_b_proj's rows for that head, W_UK[h] and W_UV[h]:

    k_h = [W_UK[h] c, k_pe]      v_h = W_UV[h] c

so a score and an output can be computed on the latent itself (the "absorbed" form):

    q_h . k_h = (W_UK[h]^T q_nope_h) . c + q_pe_h . k_pe  =  [W_UK[h]^T q_nope_h, q_pe_h] . [c, k_pe]
    o_h       = W_UV[h] (sum_j p_j c_j)

That is multi-query attention: num_heads queries of width kv_lora_rank + qk_rope_head_dim over one
KV head of the same width, [c, k_pe], whose values are the keys themselves (of the weighted sum of
[c, k_pe], the first kv_lora_rank numbers are the sum of c; the rest are dropped). ferry's attention
backends run it as they run any GQA layer, with one KV head, and the model config's cache shape says
so (`ModelConfig.num_kv_heads`, `head_dim`). The latent is stored once: the cache's V half is a
view of its K half (attention/kv_cache.py, `kv_cache_halves`).

RoPE here rotates adjacent pairs (x[2i], x[2i+1]), not the two halves of the head as Llama's does,
with YaRN's frequencies and, through the softmax scale, its attention factor squared
(`mscale_all_dim`), as transformers computes them.

The experts: a softmax router in float32 whose k largest weights are kept as they are (or, where
norm_topk_prob, renormalized) and multiplied by routed_scaling_factor, optionally limited to the
topk_group best groups of experts first (`group_limited_greedy`, DeepSeek-V2's); beside them,
n_shared_experts experts' worth of one SiLU-gated MLP that every token goes through, added unscaled.
The first first_k_dense_replace layers (and those off moe_layer_freq) keep a dense MLP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ferry.attention.backend import ForwardContext
from ferry.config import ModelConfig
from ferry.layers.attention import Attention
from ferry.layers.linear import Linear, MergedLinear
from ferry.layers.moe import QWEN_EXPERT_NAMES, FusedMoE, Routing, SparseMoeBlock, TopKRouter
from ferry.layers.norm import RMSNorm
from ferry.layers.rotary import (
    inverse_frequencies,
    rope_parameters,
    yarn_attention_factor,
    yarn_mscale,
)
from ferry.models.llama import LlamaForCausalLM, LlamaMLP

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each (num_tokens, qk_rope_head_dim / 2)


class PairRotaryEmbedding(nn.Module):
    """positions -> (cos, sin) of each adjacent pair's angle, times the YaRN attention factor."""

    def __init__(self, rope_dim: int, params: dict) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(rope_dim, params), persistent=False)
        self.attention_factor = yarn_attention_factor(params)

    def forward(self, positions: torch.Tensor) -> Rope:
        angles = positions[:, None].float() * self.inv_freq  # (T, rope_dim / 2)
        return torch.cos(angles) * self.attention_factor, torch.sin(angles) * self.attention_factor


def rotate_pairs(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """x (T, heads, rope_dim): each pair (a, b) -> (a cos - b sin, a sin + b cos), in float32."""
    cos, sin = (t[:, None, :] for t in rope)
    a, b = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2).to(x.dtype)


class MlaAttention(nn.Module):
    """Multi-head latent attention, absorbed: (num_tokens, hidden) -> (num_tokens, hidden)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        hf = config.hf_config
        hidden = hf["hidden_size"]
        self.num_heads = config.num_heads
        self.nope_dim, self.rope_dim = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"]
        self.v_dim, self.kv_rank = hf["v_head_dim"], hf["kv_lora_rank"]
        q_rank = hf.get("q_lora_rank")
        q_size = self.num_heads * (self.nope_dim + self.rope_dim)
        # Both first projections read the normed hidden state: one matmul, the norm inside it.
        first = {"q_proj": q_size} if q_rank is None else {"q_a_proj": q_rank}
        self.qkv_proj = MergedLinear(hidden, {**first, "kv_a_proj_with_mqa": self.kv_rank + self.rope_dim}, bias=False)
        self.qkv_proj.input_op = "rms_norm"
        if q_rank is not None:
            self.q_a_layernorm = RMSNorm(q_rank, eps=1e-6)
            self.q_b_proj = Linear(q_rank, q_size, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, eps=1e-6)
        # Read as W_UK and W_UV per head, never run as a layer: a plain parameter.
        self.kv_b_proj = nn.Linear(self.kv_rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = Linear(self.num_heads * self.v_dim, hidden, bias=False)
        self.attn = Attention(self.num_heads, 1, self.kv_rank + self.rope_dim, layer_idx)
        # YaRN's temperature of mscale_all_dim scales the softmax, squared (as DeepSeek's own code does).
        params = rope_parameters(hf)
        yarn = params["rope_type"] == "yarn"
        mscale = yarn_mscale(params["factor"], params.get("mscale_all_dim") or 0.0) if yarn else 1.0
        self.attn.scale = (self.nope_dim + self.rope_dim) ** -0.5 * mscale * mscale

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK (heads, nope_dim, kv_rank) and W_UV (heads, v_dim, kv_rank): views of kv_b_proj."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_rank)
        return w[:, :self.nope_dim], w[:, self.nope_dim:]

    def forward(self, qkv: torch.Tensor, rope: Rope, ctx: ForwardContext) -> torch.Tensor:
        n = qkv.shape[0]
        q, latent = self.qkv_proj.split(qkv)
        if hasattr(self, "q_b_proj"):
            q = self.q_b_proj(self.q_a_layernorm(q.contiguous()))
        q = q.view(n, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        c, k_pe = latent.split([self.kv_rank, self.rope_dim], dim=-1)
        c = self.kv_a_layernorm(c.contiguous())
        w_uk, w_uv = self.absorbed_weights()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # (T, heads, kv_rank)
        q = torch.cat((q_latent, rotate_pairs(q_pe, rope)), dim=-1)  # (T, heads, kv_rank + rope_dim)
        kv = torch.cat((c, rotate_pairs(k_pe[:, None, :], rope)[:, 0]), dim=-1)[:, None, :]  # (T, 1, same)
        out = self.attn(q, kv, kv, ctx).view(n, self.num_heads, -1)[..., :self.kv_rank]
        out = torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # (T, heads, v_dim)
        return self.o_proj(out.reshape(n, self.num_heads * self.v_dim))


class DeepseekRouter(TopKRouter):
    """Router logits and softmax in float32; greedy or group-limited top k, renormalized where
    norm_topk_prob (and k > 1) as DeepSeek's code does, scaled by routed_scaling_factor otherwise.
    (transformers ignores norm_topk_prob; every published V2 has it false, where the two agree.)"""

    def __init__(self, hidden_size: int, config: ModelConfig) -> None:
        super().__init__(hidden_size, config.moe)
        hf = config.hf_config
        self.method = hf.get("topk_method", "greedy")
        self.num_groups, self.topk_groups = hf.get("n_group") or 1, hf.get("topk_group") or 1
        self.scaling = hf.get("routed_scaling_factor", 1.0)

    def forward(self, x: torch.Tensor) -> Routing:
        probs = torch.softmax(F.linear(x.float(), self.weight.float()), dim=-1)  # (T, E)
        if self.method == "group_limited_greedy":
            groups = probs.unflatten(-1, (self.num_groups, -1))  # (T, G, E / G)
            best = groups.amax(-1).topk(self.topk_groups, dim=-1).indices
            keep = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter_(1, best, True)
            probs = (groups * keep[..., None]).flatten(-2)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.top_k > 1 and self.norm_topk_prob:  # DeepSeek's own rule: renormalized, or else scaled
            return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20), ids
        return weights * self.scaling, ids


class DeepseekMoeBlock(SparseMoeBlock):
    """The routed experts plus the shared ones, which every token goes through: (T, H) -> (T, H)."""

    def __init__(self, gate: TopKRouter, experts: FusedMoE, shared_experts: LlamaMLP) -> None:
        super().__init__(gate, experts)
        self.shared_experts = shared_experts
        self.shared_experts.gate_up_proj.input_op = None  # (it reads the normed stream: no norm of its own)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.shared_experts(self.shared_experts.gate_up_proj(x))


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig) -> None:
        hf = config.hf_config
        if hf.get("hidden_act", "silu") != "silu" or hf.get("scoring_func", "softmax") != "softmax":
            raise ValueError(f"{config.architecture} with hidden_act {hf.get('hidden_act')!r} and scoring_func "
                             f"{hf.get('scoring_func')!r} is not supported; ferry runs 'silu' and 'softmax'")
        if hf.get("attention_bias", False):  # (q_proj would have none beside kv_a_proj's: no published model)
            raise ValueError(f"{config.architecture} with attention_bias is not supported")
        if hf.get("topk_method", "greedy") not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"topk_method {hf['topk_method']!r} is not supported; ferry supports 'greedy' and "
                             "'group_limited_greedy'")
        super().__init__(config)
        self.model.rotary_emb = PairRotaryEmbedding(hf["qk_rope_head_dim"], rope_parameters(hf))

    def make_attention(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return MlaAttention(config, layer_idx)

    def make_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        hf = config.hf_config
        if config.moe is None or layer_idx not in config.moe.sparse_layers:
            return LlamaMLP(hf["hidden_size"], hf["intermediate_size"], bias=False)
        hidden, moe = hf["hidden_size"], config.moe
        gate, experts = DeepseekRouter(hidden, config), FusedMoE(hidden, moe, QWEN_EXPERT_NAMES)
        if not moe.shared_expert_intermediate_size:
            return SparseMoeBlock(gate, experts)
        return DeepseekMoeBlock(gate, experts, LlamaMLP(hidden, moe.shared_expert_intermediate_size, bias=False))

