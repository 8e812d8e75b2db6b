"""Which quantization a model runs with, read from the user's option and the checkpoint's config.json.

Plain data (no torch: the scheduler's side reads configs too). Three sources are understood:

    --quantization fp8, a 16-bit checkpoint   -> weights quantized at load, one scale per output row
    quant_method "fp8" (Hugging Face's)       -> float8 weights with `weight_scale_inv`, one scale
                                                 per 128x128 block (weight_block_size), or per tensor
    quant_method "compressed-tensors"          -> float8 weights with `weight_scale` per output
                                                 channel, per tensor or per block, as llm-compressor
                                                 writes them

In every case the activations are quantized per token as they come (per token and 128 channels with
block-scaled weights), unless the checkpoint gives a static scale per tensor (`input_scale`), or
keeps activations in 16 bits (weight-only). Anything else is an error that names the method and
what is supported.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

SUPPORTED = ("fp8: online quantization of a 16-bit checkpoint; a Hugging Face fp8 checkpoint (e4m3 weights "
             "with per-tensor or block scales, dynamic activations); a compressed-tensors checkpoint of float8 "
             "weights (channel, tensor or block scales) with dynamic per-token, static per-tensor or 16-bit "
             "activations")


@dataclass(frozen=True)
class Fp8Spec:
    """How a model's linear layers hold and use FP8 (e4m3) weights."""

    source: str  # "fp8" (online, or Hugging Face's checkpoint format) or "compressed-tensors"
    prequantized: bool  # the checkpoint holds the float8 weights and their scales
    weight_block: tuple[int, int] | None  # (rows, columns) of a scale's block; None: one scale per row
    per_tensor: bool  # the checkpoint has one weight scale per tensor (spread over its rows at load)
    activations: str  # "dynamic" (per token), "static" (a checkpoint scale per tensor) or "none" (16-bit)
    scale_name: str  # the weight scale's name in the checkpoint: weight_scale or weight_scale_inv
    ignore: tuple[str, ...] = ()  # checkpoint module names (or "re:" patterns) kept in 16 bits

    def describe(self) -> str:
        """For the start-up log: 'a scale per row, dynamic activations'."""
        scales = "block scales " + "x".join(map(str, self.weight_block)) if self.weight_block else "a scale per row"
        return f"{scales}, {'16-bit' if self.activations == 'none' else self.activations} activations"

    def ignores(self, module_name: str) -> bool:
        """Whether a checkpoint module (model.layers.0.self_attn.q_proj) stays in 16 bits."""
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], module_name):
                    return True
            elif module_name == pattern or module_name.endswith("." + pattern):
                return True
        return False


def resolve_quantization(requested: str | None, hf_config: dict[str, Any]) -> Fp8Spec | None:
    """The quantization a model runs with: the checkpoint's when it has one (`requested` may then
    name it, or be "fp8", or None), else the one requested: None (or "none") or "fp8"."""
    if requested == "none":
        requested = None
    config = hf_config.get("quantization_config")
    if config is None:
        if requested is None:
            return None
        if requested == "fp8":
            return Fp8Spec("fp8", prequantized=False, weight_block=None, per_tensor=False, activations="dynamic",
                           scale_name="weight_scale")
        raise ValueError(f"quantization {requested!r} is not supported; ferry supports {SUPPORTED}")
    if not isinstance(config, dict):
        raise ValueError("config.json: quantization_config must be an object")
    method = config.get("quant_method")
    if method == "fp8":
        spec = _hf_fp8(config)
    elif method == "compressed-tensors":
        spec = _compressed_tensors(config)
    else:
        raise ValueError(f"config.json: quantization_config.quant_method {method!r} is not supported; "
                         f"ferry supports {SUPPORTED}")
    if requested not in (None, "fp8", method):
        raise ValueError(f"quantization {requested!r}: the checkpoint is already quantized ({method})")
    if spec is None and requested == "fp8":  # (the checkpoint quantizes its KV cache only)
        return resolve_quantization("fp8", {})
    return spec


def _hf_fp8(config: dict[str, Any]) -> Fp8Spec:
    where = "config.json quantization_config (fp8)"
    if config.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"{where}: fmt {config.get('fmt')!r} is not supported; ferry runs e4m3")
    if config.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"{where}: activation_scheme {config.get('activation_scheme')!r} is not supported; "
                         "ferry quantizes activations dynamically")
    block = config.get("weight_block_size")
    return Fp8Spec("fp8", prequantized=True, weight_block=_block(block, where), per_tensor=block is None,
                   activations="dynamic", scale_name="weight_scale_inv",
                   ignore=tuple(config.get("modules_to_not_convert") or ()))


def _compressed_tensors(config: dict[str, Any]) -> Fp8Spec | None:
    """The weights' scheme; None for a checkpoint that quantizes only its KV cache (no config
    group, a kv_cache_scheme: its k_scale and v_scale serve --kv-cache-dtype fp8)."""
    where = "config.json quantization_config (compressed-tensors)"
    groups = config.get("config_groups") or {}
    if not isinstance(groups, dict) or not all(isinstance(g, dict) for g in groups.values()):
        raise ValueError(f"{where}: config_groups must be an object of objects")
    if not groups and config.get("kv_cache_scheme"):
        return None
    if len(groups) != 1:
        raise ValueError(f"{where}: ferry runs one config group (every quantized layer alike), got {len(groups)}")
    (group,) = groups.values()
    if "Linear" not in (group.get("targets") or []):
        raise ValueError(f"{where}: the config group must target Linear layers, got {group.get('targets')}")
    weights, inputs = group.get("weights") or {}, group.get("input_activations")
    if not isinstance(weights, dict) or not isinstance(inputs, (dict, type(None))):
        raise ValueError(f"{where}: weights and input_activations must be objects")
    if (weights.get("type"), weights.get("num_bits")) != ("float", 8) or not weights.get("symmetric", True):
        raise ValueError(f"{where}: ferry runs symmetric float8 weights, got {weights}")
    strategy = weights.get("strategy")
    if strategy not in ("channel", "tensor", "block"):
        raise ValueError(f"{where}: weight strategy {strategy!r} is not supported (channel, tensor or block)")
    block = _block(weights.get("block_structure"), where) if strategy == "block" else None
    if strategy == "block" and block is None:
        raise ValueError(f"{where}: block weights need a block_structure")
    if inputs is None:
        activations = "none"
    elif (inputs.get("type"), inputs.get("num_bits")) != ("float", 8):
        raise ValueError(f"{where}: ferry runs float8 or 16-bit activations, got {inputs}")
    elif inputs.get("dynamic") and (inputs.get("strategy") == "token" or (block and inputs.get("strategy") == "group")):
        activations = "dynamic"  # (with block weights ferry scales each token's block of columns)
    elif not inputs.get("dynamic") and inputs.get("strategy") == "tensor":
        activations = "static"
    else:
        raise ValueError(f"{where}: activations {inputs} are not supported (dynamic per token, or static per tensor)")
    if config.get("format") not in (None, "float-quantized", "naive-quantized"):
        raise ValueError(f"{where}: format {config.get('format')!r} is not supported (float-quantized)")
    return Fp8Spec("compressed-tensors", prequantized=True, weight_block=block, per_tensor=strategy == "tensor",
                   activations=activations, scale_name="weight_scale", ignore=tuple(config.get("ignore") or ()))


def _block(value: Any, where: str) -> tuple[int, int] | None:
    if value is None:
        return None
    if (not isinstance(value, list) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise ValueError(f"{where}: a weight block must be [rows, columns] of positive integers, got {value!r}")
    return value[0], value[1]
