"""Frozen configuration objects, composed into one `EngineConfig`.

Everything the engine needs to know before the first request is decided here, once: which model,
in which dtype, how the KV cache is cut into blocks, and how much work one step may do.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The dtypes a model runs in, by torch's names, and their bytes per element. Configuration is plain
# data (no torch here: the scheduler's side imports it); the executor turns a name into a torch dtype.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_DTYPE_ALIASES = {"float": "float32", "half": "float16"}


# config.json fields that must be positive integers when present (a -1 would surface far away, as
# "no memory is left for the KV cache" or a shape error).
_POSITIVE_FIELDS = ("max_position_embeddings", "vocab_size", "hidden_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")


@dataclass(frozen=True)
class ModelConfig:
    """The model's shape, read from its Hugging Face `config.json` (kept whole in `hf_config`)."""

    path: Path
    hf_config: dict[str, Any] = field(repr=False)
    dtype: str  # a key of DTYPE_BYTES
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    load_format: str = "auto"  # "auto" (safetensors) or "dummy" (random weights)
    tokenizer_path: Path | None = None  # the tokenizer's folder, when it is not the model's

    @property
    def tokenizer_dir(self) -> Path:
        return self.tokenizer_path or self.path

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def architecture(self) -> str:
        return self.hf_config["architectures"][0]

    @property
    def vocab_size(self) -> int:
        return self.hf_config["vocab_size"]

    @property
    def num_layers(self) -> int:
        return self.hf_config["num_hidden_layers"]

    @property
    def num_heads(self) -> int:
        return self.hf_config["num_attention_heads"]

    @property
    def num_kv_heads(self) -> int:
        return self.hf_config.get("num_key_value_heads") or self.num_heads

    @property
    def head_dim(self) -> int:
        return self.hf_config.get("head_dim") or self.hf_config["hidden_size"] // self.num_heads

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: str = "auto",
        max_model_len: int | None = None,
        load_format: str = "auto",
        device: str = "cpu",
        tokenizer: str | Path | None = None,
        generation_config: str = "auto",
    ) -> ModelConfig:
        """generation_config: where the EOS ids come from, as vLLM's option says: "auto" (the
        model's generation_config.json, else config.json), "vllm" (config.json alone), or a folder
        with a generation_config.json."""
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in model folder {path}")
        hf_config = json.loads(config_file.read_text())
        if not isinstance(hf_config, dict) or not hf_config.get("architectures"):
            raise ValueError(f"{config_file} names no 'architectures'")
        for name in _POSITIVE_FIELDS:
            value = hf_config.get(name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{config_file}: {name} must be a positive integer, got {value!r}")
        if tokenizer is not None and not (Path(tokenizer) / "tokenizer.json").is_file():
            raise FileNotFoundError(f"tokenizer: no tokenizer.json in {tokenizer}")
        limit = hf_config.get("max_position_embeddings", 2048)
        if max_model_len is None:
            max_model_len = limit
        elif max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        elif max_model_len > limit:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={limit}")
        return cls(
            path=path,
            hf_config=hf_config,
            dtype=resolve_dtype(dtype, hf_config, device),
            max_model_len=max_model_len,
            eos_token_ids=_read_eos_token_ids(hf_config, _generation_config_file(path, generation_config)),
            load_format=load_format,
            tokenizer_path=Path(tokenizer) if tokenizer is not None else None,
        )


def resolve_dtype(dtype: Any, hf_config: dict[str, Any], device: str = "cpu") -> str:
    """The dtype's name (a torch dtype or its name, or "auto"). Like vLLM, "auto" keeps a
    half-precision checkpoint's dtype on a GPU, but never runs float32 weights there by surprise; on
    a CPU it means float32, which is both exact and fast enough."""
    name = str(dtype).removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name == "auto":
        if str(device).split(":")[0] != "cuda":
            return "float32"
        name = str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32")
        name = _DTYPE_ALIASES.get(name, name)
        return name if name in DTYPE_BYTES else "float32"
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of auto, {', '.join([*DTYPE_BYTES, *_DTYPE_ALIASES])}; got {dtype!r}")
    return name


def _generation_config_file(path: Path, generation_config: str) -> Path | None:
    if generation_config == "vllm":
        return None
    folder = path if generation_config == "auto" else Path(generation_config)
    if generation_config != "auto" and not (folder / "generation_config.json").is_file():
        raise ValueError(f"generation_config: no generation_config.json in {folder}")
    return folder / "generation_config.json"


def _read_eos_token_ids(hf_config: dict[str, Any], gen_file: Path | None) -> tuple[int, ...]:
    """generation_config.json wins over config.json, as in transformers' `generate`."""
    eos = hf_config.get("eos_token_id")
    if gen_file is not None and gen_file.is_file():
        eos = json.loads(gen_file.read_text()).get("eos_token_id", eos)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (eos,)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from memory
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = 1 << 30  # KV pool size on CPU when num_kv_blocks is not given

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256  # most requests running at once
    max_num_batched_tokens: int = 8192  # the per-step token budget
    max_model_len: int = 4096

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


ATTENTION_BACKENDS = ("torch", "triton")


def environment_defaults() -> dict[str, Any]:
    """The EngineConfig fields the environment sets, read here once (no kernel reads it):
    FERRY_ATTENTION_BACKEND=torch|triton and FERRY_PDL=0."""
    return {
        "attention_backend": os.environ.get("FERRY_ATTENTION_BACKEND", "").strip().lower() or None,
        "pdl": os.environ.get("FERRY_PDL", "1") != "0",
    }


# Decode batch sizes that get a CUDA graph by default (as in vLLM): every power of two up to 8, then
# every multiple of 8, so a batch is padded by at most 7 rows; above 256 a step's launches cost
# little next to its matmuls, and each size more adds startup time and graph memory.
_DEFAULT_GRAPH_SIZES = (1, 2, 4, *range(8, 257, 8))


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: str = "cpu"
    seed: int = 0
    # False: decode steps of up to the largest of `cuda_graph_batch_sizes` requests replay CUDA
    # graphs captured at startup (executor/cuda_graph.py); on a CPU they run the same padded batches
    # eagerly. True: every step runs eagerly. (make_engine_config's default: graphs on CUDA only.)
    enforce_eager: bool = True
    # None: the defaults above, up to max_num_seqs (which is added when it falls between two).
    cuda_graph_batch_sizes: tuple[int, ...] | None = None
    # Schedule and launch each step before waiting for the last one's tokens (engine/engine.py;
    # make_engine_config's default: on CUDA only).
    async_scheduling: bool = False
    # The attention backend: "torch" (the reference) or "triton"; None: the device's default (Triton
    # on CUDA where it imports). make_engine_config's default: $FERRY_ATTENTION_BACKEND.
    attention_backend: str | None = None
    # Programmatic dependent launch for the decode path's Triton kernels, where the GPU has it
    # (Hopper and newer). make_engine_config's default: on, unless FERRY_PDL=0.
    pdl: bool = True

    def __post_init__(self) -> None:
        sizes = self.cuda_graph_batch_sizes
        if sizes is not None and (not sizes or min(sizes) < 1):
            raise ValueError(f"cuda_graph_batch_sizes must be positive batch sizes, got {sizes}")
        if self.attention_backend not in (None, *ATTENTION_BACKENDS):
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS} (or unset), "
                             f"got {self.attention_backend!r}")

    @property
    def decode_graph_sizes(self) -> tuple[int, ...]:
        """The decode batch sizes to capture, ascending; a step of n requests runs the smallest >= n."""
        if self.cuda_graph_batch_sizes is not None:
            return tuple(sorted(set(self.cuda_graph_batch_sizes)))
        limit = self.scheduler.max_num_seqs
        sizes = [s for s in _DEFAULT_GRAPH_SIZES if s <= limit]
        if limit <= _DEFAULT_GRAPH_SIZES[-1] and sizes[-1] != limit:
            sizes.append(limit)
        return tuple(sizes)
