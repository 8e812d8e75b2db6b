"""Llama, and Mistral which is the same network: pre-norm decoder layers of GQA attention with
RoPE and a SiLU-gated MLP. Qwen2 and Qwen3 (qwen.py) reuse these classes with small changes, and
the mixtures of experts (mixtral.py, qwen_moe.py) replace the MLP (`make_mlp`).

Tokens arrive flat, many requests concatenated: (num_tokens,) ids and positions, and the
ForwardContext says which request each token belongs to and where its KV cache lives.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ferry.attention.backend import ForwardContext
from ferry.config import ModelConfig
from ferry.layers.activation import SiluAndMul
from ferry.layers.attention import Attention
from ferry.layers.linear import Linear, MergedLinear
from ferry.layers.norm import RMSNorm
from ferry.layers.rotary import RotaryEmbedding, apply_rotary_qk, rope_parameters

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each (num_tokens, head_dim)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        hidden_size = config.hf_config["hidden_size"]
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        sizes = {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size}
        self.qkv_proj = MergedLinear(hidden_size, sizes, bias=qkv_bias)
        self.qkv_proj.input_op = "rms_norm"  # the decoder layer opens the block with forward_rms_norm
        self.o_proj = Linear(q_size, hidden_size, bias=o_bias)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, layer_idx)

    def split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv_proj's output -> q (num_tokens, num_heads, head_dim), k and v (num_tokens, num_kv_heads, head_dim)."""
        q, k, v = self.qkv_proj.split(qkv)
        n = qkv.shape[0]
        q = q.view(n, self.num_heads, self.head_dim)  # (num_tokens, num_heads, head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)  # (num_tokens, num_kv_heads, head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)  # (num_tokens, num_kv_heads, head_dim)
        return q, k, v

    def rotate(self, q: torch.Tensor, k: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary_qk(q, k, rope)

    def forward(self, qkv: torch.Tensor, rope: Rope, ctx: ForwardContext) -> torch.Tensor:
        """From qkv_proj's output, which the decoder layer computes together with the norm before it
        (Linear.forward_rms_norm): (num_tokens, q_size + 2 * kv_size) -> (num_tokens, hidden)."""
        q, k, v = self.split_heads(qkv)
        q, k = self.rotate(q, k, rope)
        return self.o_proj(self.attn(q, k, v, ctx))


class LlamaMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)), with gate and up in one matmul; the decoder layer
    computes gate_up_proj together with the norm before it, and the MLP takes over from there."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        sizes = {"gate_proj": intermediate_size, "up_proj": intermediate_size}
        self.gate_up_proj = MergedLinear(hidden_size, sizes, bias=bias)
        self.gate_up_proj.input_op = "rms_norm"
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.down_proj.input_op = "silu_and_mul"
        self.act_fn = SiluAndMul()

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """From gate_up_proj's output: (num_tokens, 2 * intermediate) -> (num_tokens, hidden)."""
        return self.down_proj.forward_silu_and_mul(gate_up, self.act_fn)

    def forward_rms_norm(
        self, h: torch.Tensor, residual: torch.Tensor, norm: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(gate_up_proj(norm(h + residual))), h + residual): the decoder layer's entry to its
        feed-forward block, the norm inside gate_up_proj where its GEMV serves the batch."""
        gate_up, residual = self.gate_up_proj.forward_rms_norm(h, residual, norm)
        return self(gate_up), residual


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        hf = config.hf_config
        self.self_attn = self_attn
        self.mlp = mlp  # a LlamaMLP, or a mixture of experts (layers/moe.py): either has forward_rms_norm
        self.input_layernorm = RMSNorm(hf["hidden_size"], eps=hf["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(hf["hidden_size"], eps=hf["rms_norm_eps"])

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is carried apart from each block's output, so that the add joins the
        next norm: (block output, residual) in, the same out; the stream is their sum. The first
        layer gets the embeddings as x and no residual."""
        # Each norm runs inside the projection that follows it where that projection's GEMV serves
        # the batch (Linear.forward_rms_norm); otherwise as its own kernel, then the projection.
        qkv, residual = self.self_attn.qkv_proj.forward_rms_norm(x, residual, self.input_layernorm)
        h = self.self_attn(qkv, rope, ctx)
        return self.mlp.forward_rms_norm(h, residual, self.post_attention_layernorm)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, layers: list[LlamaDecoderLayer]) -> None:
        super().__init__()
        hf = config.hf_config
        self.embed_tokens = nn.Embedding(hf["vocab_size"], hf["hidden_size"])
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hf["hidden_size"], eps=hf["rms_norm_eps"])
        self.rotary_emb = RotaryEmbedding(config.head_dim, rope_parameters(hf))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # (num_tokens, hidden)
        rope = self.rotary_emb(positions)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, rope, ctx)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    """The model runner's entry point: `forward` to hidden states, `compute_logits` on the rows it
    samples from (usually one per request), so the vocab-sized matmul runs only where needed."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hf = config.hf_config
        _check_supported(config, None if self.implements_sliding_window else self.sliding_window(hf))
        layers = [LlamaDecoderLayer(config, self.make_attention(config, i), self.make_mlp(config, i))
                  for i in range(config.num_layers)]
        self.model = LlamaModel(config, layers)
        self.lm_head = nn.Linear(hf["hidden_size"], hf["vocab_size"], bias=False)
        self.tie_word_embeddings = bool(hf.get("tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_attention(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        bias = config.hf_config.get("attention_bias", False)
        return LlamaAttention(config, layer_idx, qkv_bias=bias, o_bias=bias)

    def make_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        hf = config.hf_config
        return LlamaMLP(hf["hidden_size"], hf["intermediate_size"], bias=hf.get("mlp_bias", False))

    # Whether the class masks attention by its config's window (and frees the blocks that leave it);
    # a model with a window it does not implement is refused where the window would cut anything.
    implements_sliding_window = False

    @staticmethod
    def sliding_window(hf_config: dict[str, Any]) -> int | None:
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions: (num_tokens,) -> hidden states (num_tokens, hidden_size)."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(n, hidden_size) -> (n, vocab_size) float32."""
        return self.lm_head(hidden).float()


class MistralForCausalLM(LlamaForCausalLM):
    """Llama's network; Mistral 7B v0.1 adds a sliding attention window: each query sees its last
    `sliding_window` keys, in every layer, and the KV blocks that leave it are given back
    (core/kv_cache_manager.py)."""

    implements_sliding_window = True

    @staticmethod
    def sliding_window(hf_config: dict[str, Any]) -> int | None:
        return hf_config.get("sliding_window")

    def make_attention(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        attention = super().make_attention(config, layer_idx)
        attention.attn.sliding_window = config.sliding_window
        return attention


def _check_supported(config: ModelConfig, sliding_window: int | None) -> None:
    act = config.hf_config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported; Llama-family models in ferry use 'silu'")
    # A query attends to at most max_model_len keys (itself included), so a window at least that
    # wide never masks anything and full causal attention is exact.
    if sliding_window is not None and sliding_window < config.max_model_len:
        raise ValueError(
            f"{config.architecture} uses sliding-window attention (window {sliding_window}), which ferry "
            f"does not implement; set max_model_len <= {sliding_window} (now {config.max_model_len})"
        )
