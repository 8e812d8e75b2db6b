"""Which attention backend a device gets.

Triton on CUDA devices when Triton imports; torch's scaled_dot_product_attention, planned once a
step (sdpa_backend.py), everywhere else. A name overrides the choice (EngineConfig.attention_backend,
from FERRY_ATTENTION_BACKEND=torch|sdpa|triton): `torch` for the reference, one request at a time,
`triton` to run the kernels anyway (on a CPU that needs TRITON_INTERPRET=1). Backends are imported
only when chosen, so ferry runs where Triton is not installed.

Triton's tiles hold a head of up to MAX_TRITON_HEAD_DIM values (padded to a power of two); a wider
one, as multi-head latent attention's latent of 576 (models/deepseek_v2.py), gets sdpa by default.
"""

from __future__ import annotations

import importlib.util

import torch

from ferry.attention.backend import AttentionBackend
from ferry.config import ATTENTION_BACKENDS as BACKENDS


MAX_TRITON_HEAD_DIM = 256


def get_attention_backend(device: torch.device | str, name: str | None = None, head_dim: int = 128) -> AttentionBackend:
    name = name or default_backend_name(torch.device(device), head_dim)
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r}: choose one of {BACKENDS}")
    if name == "triton":
        from ferry.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    if name == "sdpa":
        from ferry.attention.sdpa_backend import SdpaAttentionBackend

        return SdpaAttentionBackend()
    from ferry.attention.torch_ref import TorchReferenceBackend

    return TorchReferenceBackend()


def default_backend_name(device: torch.device, head_dim: int = 128) -> str:
    if device.type == "cuda" and head_dim <= MAX_TRITON_HEAD_DIM and importlib.util.find_spec("triton") is not None:
        return "triton"
    return "sdpa"
