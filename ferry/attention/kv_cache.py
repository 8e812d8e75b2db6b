"""Allocating the paged KV cache: one tensor per layer, in the layout backend.py describes, in the
model's dtype or, with kv_cache_dtype "fp8", in float8 e4m3: a byte a value, twice the tokens."""

from __future__ import annotations

import torch

from ferry.config import CacheConfig, ModelConfig, SchedulerConfig
from ferry.quantization.e4m3 import FP8


def kv_cache_shape(model_config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """(2, num_blocks, block_size, num_kv_heads, head_dim): K and V of one layer."""
    return (2, num_blocks, block_size, model_config.num_kv_heads, model_config.head_dim)


def kv_cache_halves(model_config: ModelConfig) -> int:
    """The halves a layer's cache stores: K and V, or one where the values are the keys (latent
    attention, models/deepseek_v2.py). Such a cache keeps the usual shape, its V half a view of its
    K half (stride 0 along the first dimension): every reader finds V where it looks, the kernels
    read it through the K half's addresses, and a write of V writes the same values again. Whatever
    writes both halves at once in one operation writes through `written_halves`."""
    return 1 if model_config.latent_attention else 2


def written_halves(kv_cache: torch.Tensor) -> torch.Tensor:
    """The cache without its aliased V half, where it has one: what a single write may target."""
    return kv_cache[:1] if kv_cache.stride(0) == 0 else kv_cache


def kv_cache_dtype(model_config: ModelConfig, cache_config: CacheConfig) -> torch.dtype:
    return FP8 if cache_config.fp8_kv else getattr(torch, model_config.dtype)


def kv_cache_bytes_per_block(model_config: ModelConfig, cache_config: CacheConfig) -> int:
    """Bytes one block takes summed over all layers (K and V), in the cache's dtype: the unit to
    divide a memory budget by to get num_blocks."""
    per_layer = kv_cache_halves(model_config) * cache_config.block_size * model_config.num_kv_heads * model_config.head_dim
    return per_layer * model_config.num_layers * cache_config.kv_itemsize(model_config)


def max_useful_blocks(scheduler_config: SchedulerConfig, block_size: int) -> int:
    """Blocks every running request at full length could use: more would be memory never used."""
    return scheduler_config.max_num_seqs * -(-scheduler_config.max_model_len // block_size)


def allocate_kv_caches(
    model_config: ModelConfig, cache_config: CacheConfig, num_blocks: int, device: torch.device | str,
) -> list[torch.Tensor]:
    """One zeroed cache tensor per layer. Zeros, not garbage: a kernel that reads a masked slot
    must not meet NaN bit patterns, which would survive multiplication by a zero weight."""
    shape = kv_cache_shape(model_config, num_blocks, cache_config.block_size)
    dtype = kv_cache_dtype(model_config, cache_config)
    halves = kv_cache_halves(model_config)
    return [torch.zeros((halves, *shape[1:]), dtype=dtype, device=device).expand(shape)
            for _ in range(model_config.num_layers)]
