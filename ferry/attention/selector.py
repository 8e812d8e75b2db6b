"""Which attention backend a device gets.

Triton on CUDA devices when Triton imports; the torch reference everywhere else. The environment
variable FERRY_ATTENTION_BACKEND=torch|triton overrides the choice: `torch` to compare against the
reference on a GPU, `triton` to run the kernels anyway (on a CPU that needs TRITON_INTERPRET=1).
Backends are imported only when chosen, so ferry runs where Triton is not installed.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from ferry.attention.backend import AttentionBackend

ENV_VAR = "FERRY_ATTENTION_BACKEND"
BACKENDS = ("torch", "triton")


def get_attention_backend(device: torch.device | str) -> AttentionBackend:
    name = os.environ.get(ENV_VAR, "").strip().lower() or default_backend_name(torch.device(device))
    if name not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={name!r}: choose one of {BACKENDS}")
    if name == "triton":
        from ferry.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    from ferry.attention.torch_ref import TorchReferenceBackend

    return TorchReferenceBackend()


def default_backend_name(device: torch.device) -> str:
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        return "triton"
    return "torch"
