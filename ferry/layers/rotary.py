"""Rotary position embedding (RoPE) in Hugging Face's layout, with the scalings Llama models use.

HF rotates the two halves of each head against each other (`rotate_half`), not adjacent pairs, so
checkpoints trained with HF code need exactly this layout:

    x = [x1 | x2]  (each head_dim / 2)   ->   [x1 * cos - x2 * sin | x2 * cos + x1 * sin]
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The RoPE settings of a config.json as one dict with `rope_type` and `rope_theta`.

    Two spellings exist: transformers >= 5 writes a single `rope_parameters` dict that includes
    rope_theta; older configs (most checkpoints on the Hub) write `rope_theta` next to an optional
    `rope_scaling` dict whose type key is `rope_type`, or `type` in the oldest ones.
    """
    params = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    params.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.pop("type", None) or "default"
    if params["rope_type"] == "yarn":  # (as transformers defaults them: the config's top level first)
        context = hf_config.get("max_position_embeddings")
        original = hf_config.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
        params["original_max_position_embeddings"] = original = original or context
        if params.get("factor") is None:
            params["factor"] = context / original
    if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type {params['rope_type']!r} is not supported; ferry supports {SUPPORTED_ROPE_TYPES}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    return params


def inverse_frequencies(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """(head_dim / 2,) float32: the angle per position of each rotated pair, after any scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (params["rope_theta"] ** exponents)
    if params["rope_type"] == "linear":
        # Position interpolation: position p is treated as p / factor.
        return inv_freq / params["factor"]
    if params["rope_type"] == "llama3":
        return _llama3_scaled(inv_freq, params)
    if params["rope_type"] == "yarn":
        return _yarn_scaled(inv_freq, head_dim, params)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's context extension: slow rotations (wavelength longer than the original context
    / low_freq_factor) are slowed down by `factor`, fast ones (shorter than original context /
    high_freq_factor) are kept, and the band between is blended linearly in 1 / wavelength."""
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return torch.where(in_band, blended, scaled)


def _yarn_scaled(inv_freq: torch.Tensor, head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """YaRN's context extension: a pair that turns fewer than beta_slow times over the original
    context is interpolated (slowed down by `factor`), one that turns more than beta_fast times is
    kept, and the pairs between are blended along a linear ramp over their index."""
    base, factor = params["rope_theta"], params["factor"]
    old_context = params["original_max_position_embeddings"]
    fast, slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def pair_of(rotations: float) -> float:  # the (fractional) pair index that turns `rotations` times
        return head_dim * math.log(old_context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_of(fast), pair_of(slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # 1: the pair keeps its frequency; 0: interpolated
    return inv_freq / factor * (1 - kept) + inv_freq * kept


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context `scale` times the original: 0.1 m ln(s) + 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(params: dict[str, Any]) -> float:
    """What cos and sin are multiplied by (1 but for YaRN): the config's attention_factor, else the
    ratio of mscale's temperature to mscale_all_dim's where both are given (DeepSeek's, which
    scales the softmax by mscale_all_dim's instead), else the temperature of `factor`."""
    if params["rope_type"] != "yarn":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor, mscale, all_dim = params["factor"], params.get("mscale"), params.get("mscale_all_dim")
    if mscale and all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim)
    return yarn_mscale(factor)


class RotaryEmbedding(nn.Module):
    """positions -> (cos, sin), computed once per forward and shared by every layer."""

    def __init__(self, head_dim: int, params: dict[str, Any]) -> None:
        super().__init__()
        # Not persistent: derived from the config, never read from or written to checkpoints.
        self.register_buffer("inv_freq", inverse_frequencies(head_dim, params), persistent=False)
        self.attention_factor = yarn_attention_factor(params)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # (num_tokens, head_dim / 2)
        angles = torch.cat((freqs, freqs), dim=-1)  # (num_tokens, head_dim): both halves rotate alike
        if self.attention_factor == 1.0:
            return angles.cos(), angles.sin()  # float32; cast to the activations' dtype when applied
        return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (num_tokens, num_heads, head_dim) by its tokens' angles; cos, sin: (num_tokens, head_dim).

    rotate_half(x) = [-x2 | x1] is x rolled by half a head with its first half negated, and the
    sign goes on sin instead: (-x2) * sin == x2 * (-sin) exactly, so this is HF's arithmetic in
    fewer ops (a CPU step is bound by its number of ops)."""
    if cos.dtype != x.dtype:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    cos = cos.unsqueeze(1)  # (num_tokens, 1, head_dim): same angle for every head
    sin = (sin * _half_signs(x.shape[-1], x.dtype, x.device)).unsqueeze(1)
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


@functools.cache
def _half_signs(head_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(head_dim,): -1 over the first half, 1 over the second."""
    signs = torch.ones(head_dim, dtype=dtype, device=device)
    signs[:head_dim // 2] = -1
    return signs


def apply_rotary_qk(
    q: torch.Tensor, k: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
    q_norm: nn.Module | None = None, k_norm: nn.Module | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q (num_tokens, num_heads, head_dim) and k (num_tokens, num_kv_heads, head_dim), after
    an optional RMSNorm of each head (Qwen3's q_norm and k_norm, RMSNorm modules over head_dim).
    On CUDA one fused kernel does all of it, in place on q and k."""
    cos, sin = rope
    if q.is_cuda:
        from ferry.layers import fused

        fused.rotary_qk_(q, k, cos, sin, *((q_norm.weight, k_norm.weight, q_norm.eps) if q_norm is not None else ()))
        return q, k
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    else:
        qk = _joint_view(q, k)
        if qk is not None:  # (on a CPU, where a step's time is its number of ops: one pass for both)
            qk = apply_rotary(qk, cos, sin)
            return qk[:, :q.shape[1]], qk[:, q.shape[1]:]
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def _joint_view(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q and k as one (num_tokens, num_heads + num_kv_heads, head_dim) view where k's heads follow q's
    in memory, as they do when both are split from one qkv projection's output; otherwise None."""
    num_tokens, num_heads, head_dim = q.shape
    if (k.shape[0] != num_tokens or k.shape[2] != head_dim or q.stride()[1:] != (head_dim, 1)
            or k.stride()[1:] != (head_dim, 1) or (num_tokens > 1 and k.stride(0) != q.stride(0)) or k.dtype != q.dtype
            or k.data_ptr() != q.data_ptr() + num_heads * head_dim * q.element_size()
            or k.untyped_storage().data_ptr() != q.untyped_storage().data_ptr()):
        return None
    return q.as_strided((num_tokens, num_heads + k.shape[1], head_dim), q.stride())
