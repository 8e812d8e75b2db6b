"""Host data to the device without waiting for the device.

A copy from pageable host memory to a CUDA device (what `torch.tensor(values, device="cuda")` does)
waits until the device has finished the work queued before it. In a step loop that launches step
k+1 while step k still runs (asynchronous scheduling) that wait undoes the overlap, so small
per-step tensors go through pinned memory and an asynchronous copy instead; torch's pinned-memory
cache keeps the host buffer alive until the copy has run.
"""

from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`values` (a list, a numpy array or a CPU tensor) as a tensor of `dtype` on `device`."""
    host = torch.as_tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
