"""The FP8 format ferry keeps weights, activations and the KV cache in: e4m3 (float8_e4m3fn), whose
largest number is 448, and the smallest scale a quantizer gives (an all-zero row keeps a usable
scale, and its zeros). Torch only: the torch code and the kernels read them from here."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
MIN_SCALE = 1e-12
