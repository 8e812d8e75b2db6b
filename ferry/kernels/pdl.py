"""Programmatic dependent launch (PDL): a kernel starts while the one before it finishes.

A decode step at batch 1 is hundreds of small kernels in a row, each waiting for the last one to
end before it launches: between any two, the GPU drains the first kernel's tail and ramps the next
one up, a microsecond or two of idle memory bandwidth each time. On Hopper and newer, a kernel
launched with PDL may start as soon as every program of the kernel before it has signalled
(`gdc_launch_dependents`); it then runs what does not depend on that kernel and waits
(`gdc_wait`) for the rest:

    kernel A   [programs ...................... tail]
    kernel B             [launch, load own weights | wait][reads A's output ...]
                                                   ^ A has finished and its writes are visible

The rules every kernel launched this way keeps:

- Before `gdc_wait` it reads only what no kernel of the step writes (weights), and writes nothing:
  the kernel before it, and the ones before that, may still be running.
- Every program calls `gdc_wait`, also one that has nothing to do: a kernel ends only after the one
  before it has ended, so waiting on the last kernel is waiting on all of them.

A kernel that is launched without PDL (cuBLAS, torch's own) simply starts after the kernel before
it ends, as usual. CUDA graphs record the dependencies as they are, so decode replays keep them.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


_enabled = True  # set once by the executor from EngineConfig.pdl (enable_pdl)


def enable_pdl(enabled: bool) -> None:
    """Whether this process's kernels may launch with PDL at all (EngineConfig.pdl; FERRY_PDL=0 off)."""
    global _enabled
    _enabled = enabled
    use_pdl.cache_clear()


@functools.lru_cache(maxsize=None)
def use_pdl(device: torch.device) -> bool:
    """Whether kernels on this device launch with PDL: CUDA devices of compute capability 9.0
    (Hopper) and newer, while enabled. Never under Triton's interpreter (CPU tensors)."""
    if device.type != "cuda" or not _enabled or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def pdl_launch(device: torch.device) -> dict[str, bool]:
    """A PDL kernel's launch arguments: its `PDL` constexpr and Triton's `launch_pdl`, which must agree."""
    pdl = use_pdl(device)
    return {"PDL": pdl, "launch_pdl": pdl}


@triton.jit
def let_next_kernel_start(PDL: tl.constexpr):
    """Tell the next kernel (launched with PDL) it may start; call it first thing."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """Wait until the kernel before this one has finished and its writes are visible; every program
    must call it before it reads what that kernel writes, or writes anything, or returns."""
    if PDL:
        gdc_wait()
