"""ModelConfig -> a ready model: built on the device in the model's dtype, then filled with weights.

Loading is a name-for-name copy: every checkpoint tensor has a destination named exactly as in the
checkpoint (up to a model's `checkpoint_renames`). Most destinations are parameters; projections
that ferry merges into one matmul (q/k/v, gate/up) contribute one destination per checkpoint name, a
view of their rows, and so do a mixture's experts, stacked into one weight per layer (w13, w2).

With FP8 (quantization/): a checkpoint that holds float8 weights gets layers of its layout before
the copy (`prepare_fp8`), and its scales are copied like weights (a scale per tensor spread over
the rows it scales); a 16-bit checkpoint, or random weights, is quantized after it (`quantize_model`).
The scales of an FP8 KV cache (`self_attn.k_scale` and `v_scale`, or one `kv_scale` for both, per
tensor or per KV head) are copied when the checkpoint has them, and stay 1 when it has not.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ferry.config import ModelConfig
from ferry.layers.linear import MergedLinear
from ferry.layers.moe import FusedMoE
from ferry.layers.norm import RMSNorm
from ferry.loader.checkpoint import checkpoint_files, iterate_tensors
from ferry.models.registry import get_model_class

DUMMY_SEED = 0
DUMMY_STD = 0.02  # like HF's initializer_range: keeps random activations from blowing up


def load_model(model_config: ModelConfig, device: torch.device | str) -> nn.Module:
    """The model of `model_config` on `device`, in `model_config.dtype`, in eval mode, no grads."""
    if model_config.load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {model_config.load_format!r}")
    model_class = get_model_class(model_config.architecture)
    if model_config.moe is not None and model_config.quantization_spec is not None:
        raise ValueError(f"{model_config.architecture}: FP8 weights are not supported for mixtures of experts")
    # Find the files before building, so a wrong path fails in a moment, not after allocation.
    files = checkpoint_files(model_config.path) if model_config.load_format == "auto" else []
    with torch.device(device), _default_dtype(getattr(torch, model_config.dtype)):
        model = model_class(model_config)
    spec = model_config.quantization_spec
    if model_config.load_format == "dummy":
        init_dummy_weights(model, torch.device(device))
    elif spec is not None and spec.prequantized:
        from ferry.quantization.fp8 import prepare_fp8

        prepare_fp8(model, spec)
        load_weights(model, _fp8_names(iterate_tensors(files)))
        return model.eval().requires_grad_(False)
    else:
        load_weights(model, iterate_tensors(files))
    if spec is not None:
        from ferry.quantization.fp8 import quantize_model

        quantize_model(model, spec)
    return model.eval().requires_grad_(False)


def _fp8_names(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Hugging Face's FP8 checkpoints call the weight scale `weight_scale_inv` (it multiplies)."""
    for name, tensor in tensors:
        yield name.removesuffix("_inv") if name.endswith(".weight_scale_inv") else name, tensor


@torch.no_grad()
def load_weights(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy each (checkpoint name, tensor) into the model; every destination must be filled once."""
    targets = weight_targets(model)
    optional = kv_scale_targets(model)
    targets.update(optional)
    ignored = _ignored_names(model)
    unexpected = []
    for name, tensor in _kv_scale_names(_renamed(tensors, getattr(model, "checkpoint_renames", {}))):
        if name in ignored or name.endswith("rotary_emb.inv_freq"):
            continue  # old checkpoints saved the RoPE buffer; ferry derives it from the config
        if name not in targets:
            unexpected.append(name)
            continue
        dest = targets.pop(name)
        if dest.shape != tensor.shape:
            tensor = _fitted_scale(name, tensor, dest)
        dest.copy_(tensor)
    if unexpected:
        raise ValueError(f"checkpoint has tensors this model does not use: {_some(unexpected)}")
    missing = sorted(set(targets) - set(optional))
    if missing:
        raise ValueError(f"checkpoint is missing tensors: {_some(missing)}")
    for name, scale in optional.items():
        if not bool(torch.isfinite(scale).all() and (scale > 0).all()):
            raise ValueError(f"checkpoint tensor {name}: a KV cache scale must be positive and finite, got "
                             f"{scale.flatten()[:8].tolist()}")


def kv_scale_targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """Checkpoint name -> each attention layer's K and V scale buffer, named as vLLM's checkpoints
    name them: beside the projections (model.layers.0.self_attn.k_scale), not on ferry's `attn`."""
    from ferry.layers.attention import Attention

    targets = {}
    for module_name, module in model.named_modules():
        if isinstance(module, Attention):
            parent = module_name.rpartition(".")[0]
            targets[f"{parent}.k_scale"] = module.k_scale
            targets[f"{parent}.v_scale"] = module.v_scale
    return targets


# Scales of attention quantized whole (the query, the probabilities): ferry's attention multiplies
# 16-bit queries and probabilities, so they have nothing to scale.
_UNUSED_ATTENTION_SCALES = (".self_attn.q_scale", ".self_attn.prob_output_scale")


def _kv_scale_names(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """KV cache scales under their older names: one `kv_scale` for K and V both, or the output
    scales of k_proj and v_proj (older llm-compressor checkpoints)."""
    for name, tensor in tensors:
        if name.endswith(".kv_scale"):
            yield name.removesuffix("kv_scale") + "k_scale", tensor
            yield name.removesuffix("kv_scale") + "v_scale", tensor
        elif name.endswith((".k_proj.output_scale", ".v_proj.output_scale")):
            yield name.removesuffix("_proj.output_scale") + "_scale", tensor
        elif not name.endswith(_UNUSED_ATTENTION_SCALES):
            yield name, tensor


def _renamed(
    tensors: Iterable[tuple[str, torch.Tensor]], renames: dict[str, str],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint names with each part a model renames (".block_sparse_moe." -> ".mlp.") replaced."""
    for name, tensor in tensors:
        for old, new in renames.items():
            name = name.replace(old, new)
        yield name, tensor


def _fitted_scale(name: str, tensor: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
    """A quantization scale in the shape of its destination: (N, 1) per-channel scales as (N,), one
    scale per tensor spread over the rows it scales. Any other mismatch is an error."""
    if name.endswith("_scale"):  # (k_scale and v_scale too: per tensor, or per KV head)
        if tensor.numel() == dest.numel():
            return tensor.reshape(dest.shape)
        if tensor.numel() == 1:
            return tensor.reshape(()).expand(dest.shape)
    raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, model expects {tuple(dest.shape)}")


def weight_targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """Checkpoint tensor name -> the tensor it is copied into (a parameter or part of one)."""
    targets = {}
    for module_name, module in model.named_modules():
        targets.update(_module_targets(module_name, module))
    for name in _ignored_names(model):
        targets.pop(name, None)
    return targets


def _module_targets(module_name: str, module: nn.Module) -> dict[str, torch.Tensor]:
    """Checkpoint name -> destination, for the module's own parameters. A module that stacks several
    checkpoint tensors into one parameter says which part each fills: a MergedLinear, projections
    beside it (self_attn.{q,k,v}_proj -> rows of self_attn.qkv_proj); a FusedMoE, every expert's
    projections below it (mlp.experts.3.up_proj -> the up rows of mlp.experts.w13[3])."""
    if isinstance(module, FusedMoE):
        return {f"{module_name}.{name}": view for name, view in module.expert_views().items()}
    targets = {}
    prefix = f"{module_name}." if module_name else ""
    for param_name, param in module.named_parameters(recurse=False):
        if isinstance(module, MergedLinear):
            parent = module_name.rpartition(".")[0]
            for shard, view in module.shard_views(param_name, param).items():
                targets[f"{parent}.{shard}.{param_name}"] = view
        else:
            targets[prefix + param_name] = param
    return targets


def _ignored_names(model: nn.Module) -> set[str]:
    # With tied embeddings lm_head.weight *is* embed_tokens.weight; as in transformers, the
    # embedding wins, and a checkpoint may or may not carry a copy of it under lm_head.
    return {"lm_head.weight"} if getattr(model, "tie_word_embeddings", False) else set()


@torch.no_grad()
def init_dummy_weights(model: nn.Module, device: torch.device) -> None:
    """Random weights from the config alone, the same on every run on one kind of device: norms at
    one, everything else small and normal. For benchmarks and tests that need no checkpoint."""
    generator = torch.Generator(device=device).manual_seed(DUMMY_SEED)
    for module in model.modules():  # (buffers, a KV cache's scales among them, keep their values)
        for param in module.parameters(recurse=False):
            if isinstance(module, RMSNorm):
                param.fill_(1.0)
            else:
                param.normal_(0.0, DUMMY_STD, generator=generator)


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Create parameters directly in `dtype`, so a bfloat16 model never exists in float32 first."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _some(names: list[str], limit: int = 10) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
