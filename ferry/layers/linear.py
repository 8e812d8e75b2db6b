"""The linear layers of the models.

`Linear` is nn.Linear that may run small batches through ferry's GEMV kernel (gemv.py) where that
measured faster than cuBLAS on this device (`tune_small_batch`, at startup on CUDA).

Hugging Face checkpoints store q_proj, k_proj and v_proj (and gate_proj, up_proj) as separate
weights, but all of them read the same input, so one matmul over their stacked rows does the same
work with fewer, larger kernels. `MergedLinear` remembers which rows came from which checkpoint
name; the loader uses that to copy each checkpoint tensor straight into its rows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from ferry.layers.gemv import GemvConfig
    from ferry.layers.norm import RMSNorm
    from ferry.quantization.fp8 import Fp8Linear

logger = logging.getLogger(__name__)


class Linear(nn.Linear):
    # Set by tune_small_batch: (up to this many rows, GEMV configuration or None for cuBLAS) for each
    # bucket of gemv.ROW_BUCKETS, in order; empty until tuned. Larger batches reuse the weights
    # across rows, where cuBLAS's tensor-core kernels win.
    gemv_buckets: tuple[tuple[int, GemvConfig | None], ...] = ()
    gemv_fuses_norm = False  # at one row, forward_rms_norm normalizes inside the GEMV
    # The small op that feeds this layer in the model ("rms_norm": forward_rms_norm, "silu_and_mul":
    # forward_silu_and_mul), set by the model: tuning times the layer together with it.
    input_op: str | None = None
    # With FP8 weights (quantization/fp8.py): how the layer computes with them, and the layer holds
    # weight_scale (and input_scale) beside its float8 weight. None: 16-bit weights.
    fp8: Fp8Linear | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        config = self._gemv_config(x)
        if config is not None:
            return _gemv().gemv(x, self.weight, self.bias, config, False, self.row_scales)
        if self.fp8 is not None:
            return self.fp8.apply(self, x)
        return F.linear(x, self.weight, self.bias)

    @property
    def row_scales(self) -> torch.Tensor | None:
        """An FP8 weight's scale per output row, which the GEMV applies; None for 16-bit weights."""
        return self.weight_scale if self.fp8 is not None else None

    def forward_silu_and_mul(self, gate_up: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """self(act(gate_up)) where act is SiLU-and-mul; where the GEMV serves this batch it applies
        the activation itself as it loads gate_up, and the activation's kernel is saved."""
        config = self._gemv_config(gate_up)
        if config is not None:
            return _gemv().gemv(gate_up, self.weight, self.bias, config, True, self.row_scales)
        if self._fp8_rows(gate_up):  # the activation's kernel writes the FP8 GEMM's input
            return self._fp8_matmul_quantized(*_fused().silu_and_mul_fp8(gate_up), gate_up.dtype)
        return self(act(gate_up))

    def forward_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(norm(x + residual)), x + residual), the pre-norm block's opening; x alone without a
        residual. Where the startup timing found it faster (one row), the GEMV normalizes x as it
        loads it, and the norm's kernel is saved."""
        config = self._gemv_config(x)
        if config is not None and self.gemv_fuses_norm and x.shape[0] == 1:
            return _gemv().gemv_rms_norm(x, residual, norm.weight, norm.eps, self.weight, self.bias, config,
                                         self.row_scales)
        if config is None and self._fp8_rows(x):  # the norm's kernel writes the FP8 GEMM's input
            qx, x_scale = _fused().rms_norm_fp8(x, norm.weight, norm.eps, residual)
            return self._fp8_matmul_quantized(qx, x_scale, x.dtype), (x if residual is None else residual)
        if residual is None:
            return self(norm(x)), x
        h, residual = norm(x, residual)
        return self(h), residual

    def _fp8_rows(self, x: torch.Tensor) -> bool:
        """Whether this FP8 layer's GEMM takes activations quantized per token, which the op before
        it then writes itself (CUDA)."""
        return self.fp8 is not None and self.fp8.takes_row_scales and x.is_cuda and x.dim() == 2

    def _fp8_matmul_quantized(self, qx: torch.Tensor, x_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.fp8.matmul_quantized(qx, x_scale, self.weight, self.weight_scale, self.bias, dtype)

    def _gemv_config(self, x: torch.Tensor) -> GemvConfig | None:
        if x.dim() != 2 or x.shape[0] == 0:
            return None
        for rows, config in self.gemv_buckets:
            if x.shape[0] <= rows:
                return config
        return None


def _gemv():
    from ferry.layers import gemv  # imports Triton: only on CUDA, where a layer has a configuration

    return gemv


def _fused():
    from ferry.layers import fused  # imports Triton: only on CUDA

    return fused


def tune_small_batch(model: nn.Module, dtype: torch.dtype | None = None) -> None:
    """Measure, once per distinct shape, whether the GEMV kernel beats cuBLAS (or, for FP8 weights
    with a scale per row, the FP8 GEMM) for small batches, and set each `Linear`'s configurations
    accordingly. CUDA only; a no-op elsewhere. dtype: the activations' (the model's dtype); None:
    the first 16-bit parameter's."""
    layers = [m for m in model.modules() if isinstance(m, Linear) and (m.fp8 is None or m.fp8.block is None)]
    if not layers or layers[0].weight.device.type != "cuda":
        return
    half = (torch.bfloat16, torch.float16)
    dtype = dtype or next((p.dtype for p in model.parameters() if p.dtype in half), torch.float32)
    choices: dict[tuple, tuple[tuple[tuple[int, GemvConfig | None], ...], bool]] = {}
    for layer in layers:
        key = (*layer.weight.shape, layer.weight.dtype, layer.bias is not None, layer.input_op)
        if key not in choices:
            try:
                with torch.inference_mode():
                    choices[key] = _gemv().tune(_layer_weights(layer, dtype), layer.input_op)
            except Exception as e:  # an optimization: cuBLAS serves every shape anyway
                logger.warning("small-batch GEMV tuning failed for %s, using cuBLAS: %s", key, e)
                choices[key] = ((), False)
        layer.gemv_buckets, layer.gemv_fuses_norm = choices[key]
    for key, (buckets, fuses_norm) in choices.items():
        after = f" after {key[4]}" if key[4] else ""
        chosen, low = [], 1
        for rows, config in buckets:
            span = f"{low} row" if rows == 1 else f"{low}-{rows} rows"
            inside = " (RMSNorm inside)" if rows == 1 and fuses_norm else ""
            chosen.append(f"{span} {config or 'cuBLAS'}{inside}")
            low = rows + 1
        logger.info("linear %s x %s%s: %s", key[0], key[1], after, "; ".join(chosen))


def _layer_weights(layer: Linear, dtype: torch.dtype):
    """The layer as the GEMV's tuning sees it; the FP8 GEMM is the path to beat for FP8 weights."""
    if layer.fp8 is None:
        return _gemv().LayerWeights(layer.weight, layer.bias)
    input_scale = getattr(layer, "input_scale", None)
    quantized = None
    if layer.fp8.takes_row_scales:  # (the op before writes the input quantized: forward_rms_norm)
        def quantized(qx, x_scale, w):
            return layer.fp8.matmul_quantized(qx, x_scale, w, layer.weight_scale, layer.bias, dtype)
    return _gemv().LayerWeights(
        layer.weight, layer.bias, layer.weight_scale, dtype,
        lambda x, w: layer.fp8.matmul(x, w, layer.weight_scale, layer.bias, input_scale), quantized,
    )


class MergedLinear(Linear):
    """One nn.Linear whose output rows are the named projections' outputs, in order.

        weight rows:  [ q_proj (q_size) | k_proj (kv_size) | v_proj (kv_size) ]
    """

    def __init__(self, input_size: int, output_sizes: dict[str, int], bias: bool) -> None:
        super().__init__(input_size, sum(output_sizes.values()), bias=bias)
        self.output_sizes = dict(output_sizes)

    def shard_rows(self) -> dict[str, slice]:
        """Checkpoint projection name -> the rows of `weight` (and `bias`) it fills."""
        rows, start = {}, 0
        for name, size in self.output_sizes.items():
            rows[name] = slice(start, start + size)
            start += size
        return rows

    def shard_views(self, param_name: str, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """Checkpoint projection name -> the part of the parameter it fills: rows of the weight, the
        bias and per-row scales, rows of blocks of block scales, an entry of the input scales."""
        if param_name == "input_scale":  # (FP8: one per projection)
            return {name: param[i:i + 1] for i, name in enumerate(self.output_sizes)}
        rows = self.shard_rows()
        if param_name == "weight_scale" and param.dim() == 2:  # (FP8 block scales: whole blocks of rows)
            block = self.fp8.block[0]
            return {name: param[r.start // block:r.stop // block] for name, r in rows.items()}
        return {name: param[r] for name, r in rows.items()}

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(..., sum(sizes)) -> one (..., size) view per projection."""
        return out.split_with_sizes(list(self.output_sizes.values()), dim=-1)
