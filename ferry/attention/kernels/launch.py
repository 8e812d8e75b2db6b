"""Host-side helpers the kernel launchers share: facts about the device and the dtypes."""

from __future__ import annotations

import functools

import torch
import triton


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
