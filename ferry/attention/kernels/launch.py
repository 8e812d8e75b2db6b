"""Host-side helpers the kernel launchers share: facts about the device and the dtypes."""

from __future__ import annotations

import functools

import torch
import triton

from ferry.quantization.e4m3 import FP8


@functools.lru_cache(maxsize=None)
def num_multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (132 on an H100/H200 SXM). Under the interpreter
    (CPU tensors) programs run one after another, so 1: splitting work finer only adds programs."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs would be multiplied in TF32 by default (10-bit mantissa); ask for full fp32 so an
    fp32 model gets fp32 attention. Other dtypes go to the tensor cores as they are."""
    return "ieee" if dtype == torch.float32 else "tf32"


def block_d(head_dim: int) -> int:
    """Tiles need power-of-two sides; head dims like 80 or 96 are padded and masked."""
    return triton.next_power_of_2(head_dim)


def floor_power_of_2(n: int) -> int:
    """The largest power of two <= n, for n >= 1."""
    return 1 << (n.bit_length() - 1)


def kv_scale_args(
    kv_cache: torch.Tensor, kv_scales: tuple[torch.Tensor, torch.Tensor] | None, unread: torch.Tensor,
) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """(whether the cache is FP8, K's scales, V's scales) as a kernel takes them: a 16-bit cache
    passes `unread`, any tensor, for the two pointers its kernel never reads."""
    fp8 = kv_cache.dtype == FP8
    assert kv_scales is not None or not fp8, "an FP8 cache needs its scales"
    return (True, *kv_scales) if fp8 else (False, unread, unread)


def widens_query(q_dtype: torch.dtype, fp8_kv: bool) -> bool:
    """Whether paged_tiles.fp8_query makes the query float16 (the kernels' WIDEN_Q)."""
    return fp8_kv and q_dtype != torch.float32
