"""FP8 (e4m3) linear layers: half the bytes of a 16-bit weight, and matmuls on the FP8 tensor cores.

A weight W (N rows, K columns) is kept as float8 values Q and float32 scales s with W ~ Q * s, one
scale per output row, or one per block of (128, 128) as DeepSeek's and Qwen's FP8 checkpoints ship
them. An e4m3 number reaches +-448 with three mantissa bits, so each row (or block) is scaled to
put its largest magnitude at 448:

    s = max|W_row| / 448          Q = round_to_e4m3(W_row / s)

Activations are quantized the same way as they arrive, one scale per token (per token and 128
columns with block weights), or with a static scale the checkpoint gives. The product is then
`(Qx Qw^T) * sx * sw`: on CUDA `torch._scaled_mm` (cuBLASLt) multiplies the FP8 operands and
applies both scales in one kernel, and for block scales ferry's Triton GEMM does
(kernels/fp8_block_matmul.py); elsewhere, and for the layouts neither takes (16-bit activations,
static ones with block weights), the same numbers are dequantized and multiplied in float32
(`fp8_linear_reference`, the reference the kernels are held to).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ferry.quantization.config import Fp8Spec
from ferry.quantization.e4m3 import FP8, FP8_MAX, MIN_SCALE

logger = logging.getLogger(__name__)


# ---- quantizing and dequantizing ----


def scale_of(amax: torch.Tensor) -> torch.Tensor:
    """The float32 scale of values whose largest magnitude is amax: max(amax, MIN_SCALE) / 448,
    divided as IEEE divides, as the kernels do (fp8_quant.py). (On CUDA torch turns a division by a
    Python number into a multiplication by its reciprocal, which may differ in the last bit; and a
    bfloat16 input's quotient often falls exactly halfway between two e4m3 numbers, where that bit
    decides the rounding.)"""
    amax = amax.float().clamp(min=MIN_SCALE)
    return amax / torch.full_like(amax, FP8_MAX)


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) -> (N, K) float8 and (N,) float32 scales, one per row."""
    scale = scale_of(weight.abs().amax(dim=1))
    return _to_fp8(weight.float() / scale[:, None]), scale


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) -> (N, K) float8 and (ceil(N / bn), ceil(K / bk)) float32 scales, one per block (the
    blocks at the edges may be smaller)."""
    blocks = _blocked(weight.float(), block)  # (N/bn, bn, K/bk, bk), padded with zeros
    scale = scale_of(blocks.abs().amax(dim=(1, 3)))
    q = blocks / scale[:, None, :, None]
    n, k = weight.shape
    return _to_fp8(q.flatten(0, 1).flatten(1, 2)[:n, :k]), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None) -> torch.Tensor:
    """The float32 weight that `q` and its scales stand for."""
    if block is None:
        return q.float() * scale.float()[:, None]
    n, k = q.shape
    return q.float() * scale.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]


def quantize_activations(
    x: torch.Tensor, group: int | None = None, static_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) -> (M, K) float8 and float32 scales: (M, 1), one per token; (M, ceil(K / group)),
    one per token and `group` columns; or the static scale given, as (1, 1)."""
    if static_scale is not None:  # (a checkpoint's zero would divide by zero)
        scale = static_scale.float().reshape(1, 1).clamp(min=MIN_SCALE)
        return _to_fp8(x.float() / scale), scale
    if group is None:
        scale = scale_of(x.abs().amax(dim=1, keepdim=True))
        return _to_fp8(x.float() / scale), scale
    m, k = x.shape
    groups = F.pad(x.float(), (0, -k % group)).unflatten(1, (-1, group))  # (M, K/group, group)
    scale = scale_of(groups.abs().amax(dim=2))
    return _to_fp8((groups / scale[:, :, None]).flatten(1)[:, :k]), scale


def dequantize_activations(q: torch.Tensor, scale: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """The float32 activations that `q` and its scales (from quantize_activations, with the same
    group) stand for."""
    if group is None:
        return q.float() * scale
    return q.float() * scale.repeat_interleave(group, 1)[:, :q.shape[1]]


def _to_fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _blocked(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    bn, bk = block
    n, k = x.shape
    return F.pad(x, (0, -k % bk, 0, -n % bn)).unflatten(1, (-1, bk)).unflatten(0, (-1, bn))


# ---- the layer's product ----


@dataclass(frozen=True)
class Fp8Linear:
    """What a `Linear` with FP8 weights computes with (`Linear.fp8`); the layer holds the tensors:
    `weight` (N, K) float8, `weight_scale` (N,) or block scales, float32, and with static activations
    `input_scale` (one per checkpoint tensor merged into the layer; the largest serves)."""

    block: tuple[int, int] | None  # None: one weight scale per row
    activations: str  # "dynamic", "static" or "none" (16-bit activations)

    @property
    def takes_row_scales(self) -> bool:
        """The activations go in quantized per token (the op before may write them so: layers/fused.py)."""
        return self.block is None and self.activations == "dynamic"

    def matmul_quantized(
        self, qx: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
        bias: torch.Tensor | None, out_dtype: torch.dtype,
    ) -> torch.Tensor:
        """The product with activations quantized per token already ((M, 1) scales; CUDA)."""
        assert self.takes_row_scales
        return _scaled_mm_quantized(qx, x_scale, weight, weight_scale, bias, out_dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, layer.weight, layer.weight_scale, layer.bias, getattr(layer, "input_scale", None))

    def matmul(
        self, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
        input_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x times the FP8 weight (the layer's tensors, or a copy of its weight, as tuning times it)."""
        if x.device.type == "cuda" and self.activations != "none" and x.dim() == 2:
            if self.block is None:
                return _scaled_mm_rows(x, weight, weight_scale, bias, input_scale if self.activations == "static" else None)
            if self.activations == "dynamic":
                return _block_matmul(x, weight, weight_scale, bias, self.block)
        return fp8_linear_reference(x, weight, weight_scale, bias, self, input_scale)


def fp8_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
    method: Fp8Linear, input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The product in float32 of the numbers an FP8 matmul multiplies: the activations quantized
    and dequantized as the kernel would see them, the weights dequantized. Any leading shape."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if method.activations != "none":
        static = input_scale.max() if method.activations == "static" else None
        group = method.block[1] if method.block is not None and static is None else None
        x2 = dequantize_activations(*quantize_activations(x2, group, static), group)
    out = F.linear(x2.float(), dequantize(weight, weight_scale, method.block),
                   None if bias is None else bias.float())
    return out.to(x.dtype).reshape(*shape[:-1], -1)


def _scaled_mm_rows(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
    input_scale: torch.Tensor | None,
) -> torch.Tensor:
    """cuBLASLt's FP8 GEMM with a scale per token and one per output row, applied in the kernel;
    with input_scale, the activations' static scales (the largest serves)."""
    from ferry.kernels.fp8_quant import quantize_rows_fp8  # (Triton: CUDA only)

    static = input_scale.max().reshape(1) if input_scale is not None else None
    qx, sx = quantize_rows_fp8(x if x.stride(-1) == 1 else x.contiguous(), static)  # quantize_activations' numbers
    return _scaled_mm_quantized(qx, sx, weight, weight_scale, bias, x.dtype)


def _scaled_mm_quantized(
    qx: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
    bias: torch.Tensor | None, out_dtype: torch.dtype,
) -> torch.Tensor:
    out = torch._scaled_mm(qx, weight.t(), scale_a=x_scale, scale_b=weight_scale[None, :],
                           bias=bias, out_dtype=torch.bfloat16, use_fast_accum=True)
    return out if out_dtype == torch.bfloat16 else out.to(out_dtype)


def _block_matmul(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
    block: tuple[int, int],
) -> torch.Tensor:
    """Block-scaled weights: the activations quantized per token and block of columns, then ferry's
    Triton FP8 GEMM, which applies both scales tile by tile (kernels/fp8_block_matmul.py)."""
    from ferry.kernels.fp8_block_matmul import fp8_block_matmul  # (Triton: CUDA only)
    from ferry.kernels.fp8_quant import quantize_rows_fp8

    qx, sx = quantize_rows_fp8(x if x.stride(-1) == 1 else x.contiguous(), group=block[1])
    return fp8_block_matmul(qx, sx, weight, weight_scale, bias, block, x.dtype)


# ---- turning a model's layers to FP8 ----


def fp8_layers(model: nn.Module, spec: Fp8Spec) -> Iterator[tuple[str, nn.Module]]:
    """(name, layer) of each of ferry's Linear layers that the spec quantizes (the lm_head and the
    embeddings are never quantized). A merged layer is quantized when the checkpoint's layers it
    merges are, all of them or none."""
    from ferry.layers.linear import Linear, MergedLinear

    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        if isinstance(module, MergedLinear):
            parent = name.rpartition(".")[0]
            originals = [f"{parent}.{shard}" for shard in module.output_sizes]
        else:
            originals = [name]
        ignored = [spec.ignores(original) for original in originals]
        if all(ignored):
            continue
        if any(ignored):
            raise ValueError(f"quantization: {name} merges {', '.join(originals)}, which the checkpoint "
                             "quantizes only in part")
        yield name, module


@torch.no_grad()
def quantize_model(model: nn.Module, spec: Fp8Spec) -> None:
    """Quantize the 16-bit weights of the model's linear layers in place (online quantization, and
    random weights for a quantized checkpoint's config)."""
    for _, layer in fp8_layers(model, spec):
        weight = layer.weight
        if spec.weight_block is None:
            q, scale = quantize_rows(weight)
        else:
            q, scale = quantize_blocks(weight, spec.weight_block)
        _set_fp8(layer, spec, q, scale)
        if spec.activations == "static":  # (random weights: a scale from random activations is as good as any)
            layer.input_scale.fill_(1.0 / FP8_MAX * 8)


def prepare_fp8(model: nn.Module, spec: Fp8Spec) -> None:
    """Give the quantized layers empty FP8 tensors of the checkpoint's layout, for the loader to
    fill by name: `weight`, `weight_scale` and with static activations `input_scale`."""
    for name, layer in fp8_layers(model, spec):
        n, k = layer.weight.shape
        device = layer.weight.device
        q = torch.empty((n, k), dtype=FP8, device=device)
        if spec.weight_block is None:
            scale = torch.empty(n, dtype=torch.float32, device=device)
        else:
            bn, bk = spec.weight_block
            sizes = getattr(layer, "output_sizes", {}).values()
            if any(size % bn for size in sizes):
                raise ValueError(f"quantization: {name} merges layers of {list(sizes)} rows, not whole "
                                 f"weight blocks of {bn}")
            scale = torch.empty((-(-n // bn), -(-k // bk)), dtype=torch.float32, device=device)
        _set_fp8(layer, spec, q, scale)


def _set_fp8(layer: nn.Module, spec: Fp8Spec, q: torch.Tensor, scale: torch.Tensor) -> None:
    layer.weight = nn.Parameter(q, requires_grad=False)
    layer.weight_scale = nn.Parameter(scale, requires_grad=False)
    if spec.activations == "static":
        shards = len(getattr(layer, "output_sizes", {})) or 1
        layer.input_scale = nn.Parameter(torch.ones(shards, dtype=torch.float32, device=q.device), requires_grad=False)
    layer.fp8 = Fp8Linear(spec.weight_block, spec.activations)
    layer.gemv_buckets = ()  # (until tuning finds where ferry's GEMV beats the FP8 GEMM, for row scales)
