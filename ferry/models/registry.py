"""config.json's `architectures[0]` -> the ferry model class that runs it.

Imports are lazy so that asking for one model does not import every model file.
"""

from __future__ import annotations

import importlib

from torch import nn

# architecture name -> (module, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "DeepseekV2ForCausalLM": ("ferry.models.deepseek_v2", "DeepseekV2ForCausalLM"),
    "Gemma2ForCausalLM": ("ferry.models.gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("ferry.models.gemma", "Gemma3ForCausalLM"),
    "LlamaForCausalLM": ("ferry.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("ferry.models.llama", "MistralForCausalLM"),
    "MixtralForCausalLM": ("ferry.models.mixtral", "MixtralForCausalLM"),
    "Qwen2ForCausalLM": ("ferry.models.qwen", "Qwen2ForCausalLM"),
    "Qwen2MoeForCausalLM": ("ferry.models.qwen_moe", "Qwen2MoeForCausalLM"),
    "Qwen3ForCausalLM": ("ferry.models.qwen", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("ferry.models.qwen_moe", "Qwen3MoeForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; ferry supports: {', '.join(supported_architectures())}"
        )
    module_name, class_name = _MODELS[architecture]
    return getattr(importlib.import_module(module_name), class_name)
