"""Allocating the paged KV cache: one tensor per layer, in the layout backend.py describes."""

from __future__ import annotations

import torch

from ferry.config import ModelConfig


def kv_cache_shape(model_config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """(2, num_blocks, block_size, num_kv_heads, head_dim): K and V of one layer."""
    return (2, num_blocks, block_size, model_config.num_kv_heads, model_config.head_dim)


def kv_cache_bytes_per_block(model_config: ModelConfig, block_size: int) -> int:
    """Bytes one block takes summed over all layers (K and V), in the model's dtype: the unit to
    divide a memory budget by to get num_blocks."""
    per_layer = 2 * block_size * model_config.num_kv_heads * model_config.head_dim
    return per_layer * model_config.num_layers * model_config.dtype_bytes


def allocate_kv_caches(
    model_config: ModelConfig, num_blocks: int, block_size: int, device: torch.device | str
) -> list[torch.Tensor]:
    """One zeroed cache tensor per layer. Zeros, not garbage: a kernel that reads a masked slot
    must not meet NaN bit patterns, which would survive multiplication by a zero weight."""
    shape = kv_cache_shape(model_config, num_blocks, block_size)
    return [torch.zeros(shape, dtype=getattr(torch, model_config.dtype), device=device) for _ in range(model_config.num_layers)]
