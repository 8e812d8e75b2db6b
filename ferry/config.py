"""Frozen configuration objects, composed into one `EngineConfig`.

Everything the engine needs to know before the first request is decided here, once: which model,
in which dtype, how the KV cache is cut into blocks, and how much work one step may do.

Every option a user sets (`LLM`'s keyword arguments, the command line's flags) is a field made with
`option`, which holds its default and its help text: the command line (engine_args.py) is generated
from those fields, and `EngineConfig.create` is the one constructor that takes them by name. An
option whose default depends on the device or the model is "auto" (None) in its field;
`EngineConfig.create` decides it, once, so the config it builds holds concrete values, and that
config is what travels to the engine process (engine/messages.py encodes it field by field).
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Sequence
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from types import UnionType
from typing import TYPE_CHECKING, Any, NamedTuple, get_args, get_origin, get_type_hints

if TYPE_CHECKING:
    from ferry.quantization.config import Fp8Spec

# The dtypes a model runs in, by torch's names, and their bytes per element. Configuration is plain
# data (no torch here: the scheduler's side imports it); the executor turns a name into a torch dtype.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_DTYPE_ALIASES = {"float": "float32", "half": "float16"}
# What the KV cache may hold, as vLLM names it: "auto", the model's dtype; "fp8" (= "fp8_e4m3"),
# float8 e4m3 values that a per-layer scale (per KV head, from the checkpoint, else 1) multiplies.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def option(
    default: Any, *, help: str, choices: Sequence[str] | None = None, name: str | None = None,
    flag: bool = True, short: str | None = None,
) -> Any:
    """A field that is a user-settable engine option, with its default and help text (and choices),
    written here once. `name`: the option's name where it is not the field's (`model` is
    ModelConfig.path); `flag=False`: a keyword argument of `LLM` only, not on the command line;
    `short`: a one-letter flag beside the long one, as vLLM has it (-q)."""
    metadata = {"help": help, "choices": tuple(choices) if choices else None, "name": name, "flag": flag,
                "short": short}
    return field(default=default, metadata=metadata)


# config.json fields that must be positive integers when present (a -1 would surface far away, as
# "no memory is left for the KV cache" or a shape error).
_POSITIVE_FIELDS = ("max_position_embeddings", "vocab_size", "hidden_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                    "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                    "shared_expert_intermediate_size", "decoder_sparse_step", "query_pre_attn_scalar")
# And those that must be positive numbers when present (a soft cap of 0 divides by zero).
_POSITIVE_NUMBERS = ("attn_logit_softcapping", "final_logit_softcapping")


@dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts model's experts and routing, in Hugging Face's names. Each token goes to
    the `num_experts_per_tok` experts of highest router probability (softmax over all experts), and
    their outputs are summed, weighted by those probabilities (renormalized to sum to one where
    `norm_topk_prob`)."""

    num_experts: int  # routed experts in each sparse layer
    num_experts_per_tok: int  # k
    moe_intermediate_size: int  # of one routed expert's SiLU-gated MLP
    shared_expert_intermediate_size: int | None  # Qwen2-MoE's expert that every token goes through; None: none
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]  # the decoder layers whose MLP is the experts; the others' is dense

    def __post_init__(self) -> None:
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be between 1 and the {self.num_experts} experts, got "
                             f"{self.num_experts_per_tok}")


def read_moe_config(hf: dict[str, Any]) -> MoeConfig | None:
    """The experts of config.json's architecture; None for a dense model (and a Qwen MoE config of
    no experts). The names differ: Mixtral has experts of `intermediate_size` in every layer and
    always renormalizes; Qwen's MoE models have experts of `moe_intermediate_size` in the layers that
    are not in `mlp_only_layers` and whose number + 1 is a multiple of `decoder_sparse_step`, as
    transformers builds them. The number of experts is `num_local_experts` or `num_experts`, which
    transformers takes for one another (and writes Qwen3-MoE's under the first)."""
    architecture = hf["architectures"][0]
    if architecture == "DeepseekV2ForCausalLM":
        return _deepseek_moe_config(hf)
    if architecture not in ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        return None
    layers = range(hf["num_hidden_layers"])
    num_experts = hf["num_local_experts"] if "num_local_experts" in hf else hf["num_experts"]
    if architecture == "MixtralForCausalLM":
        return MoeConfig(num_experts, hf["num_experts_per_tok"], hf["intermediate_size"], None, True, tuple(layers))
    if not num_experts:
        return None
    dense, step = set(hf.get("mlp_only_layers") or ()), hf.get("decoder_sparse_step", 1)
    shared = hf["shared_expert_intermediate_size"] if architecture == "Qwen2MoeForCausalLM" else None
    return MoeConfig(
        num_experts, hf["num_experts_per_tok"], hf["moe_intermediate_size"], shared,
        bool(hf.get("norm_topk_prob", False)), tuple(i for i in layers if i not in dense and (i + 1) % step == 0),
    )


def _deepseek_moe_config(hf: dict[str, Any]) -> MoeConfig | None:
    """DeepSeek-V2's experts: n_routed_experts of moe_intermediate_size from layer
    first_k_dense_replace on, in every moe_layer_freq-th layer, beside n_shared_experts experts'
    worth of one shared MLP."""
    if not hf.get("n_routed_experts"):
        return None
    first, step = hf.get("first_k_dense_replace", 0), hf.get("moe_layer_freq", 1)
    shared = hf["moe_intermediate_size"] * hf["n_shared_experts"] if hf.get("n_shared_experts") else None
    return MoeConfig(
        hf["n_routed_experts"], hf["num_experts_per_tok"], hf["moe_intermediate_size"], shared,
        bool(hf.get("norm_topk_prob", False)),
        tuple(i for i in range(hf["num_hidden_layers"]) if i >= first and i % step == 0),
    )


@dataclass(frozen=True)
class ModelConfig:
    """The model's shape, read from its Hugging Face `config.json` (kept whole in `hf_config`)."""

    path: Path | None = option(None, name="model", help="model folder (default: the bundled model)")  # noqa: RUF009
    tokenizer: Path | None = option(None, help="folder of the tokenizer (default: the model's)")  # noqa: RUF009
    # Built (from_pretrained), a key of DTYPE_BYTES and a number of tokens: "auto" and None are decided.
    dtype: str = option("auto", choices=("auto", *DTYPE_BYTES, *_DTYPE_ALIASES),
                        help="auto: the checkpoint's half-precision dtype on a GPU, float32 on a CPU")
    max_model_len: int | None = option(None, help="context length (default: the model's max_position_embeddings)")
    load_format: str = option("auto", choices=("auto", "dummy"),
                              help="dummy: random weights from config.json alone, for benchmarks")
    generation_config: str = option("auto", help="where EOS ids come from: auto (the model's generation_config.json), "
                                                 "vllm (config.json only), or a folder with a generation_config.json")
    quantization: str | None = option(None, choices=("fp8", "compressed-tensors", "none"), short="-q",
                                      help="fp8: FP8 weights, quantized at load from a 16-bit checkpoint (a checkpoint "
                                           "quantized already runs as it is, without this)")
    # Read from the model's folder, not set: config.json, and the EOS ids that generation_config chose.
    hf_config: dict[str, Any] = field(repr=False, kw_only=True)
    eos_token_ids: tuple[int, ...] = field(kw_only=True)

    @property
    def tokenizer_dir(self) -> Path:
        return self.tokenizer or self.path

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def quantization_spec(self) -> Fp8Spec | None:
        """How the linear layers hold their weights (quantization/config.py): the checkpoint's
        quantization_config, or the quantization asked for; None: as the checkpoint has them."""
        from ferry.quantization.config import resolve_quantization

        return resolve_quantization(self.quantization, self.hf_config)

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
    def latent_attention(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2): the KV cache holds one latent per token
        (models/deepseek_v2.py), seen by the attention backends as one KV head of its width."""
        return bool(self.hf_config.get("kv_lora_rank"))

    @property
    def num_kv_heads(self) -> int:
        if self.latent_attention:
            return 1
        return self.hf_config.get("num_key_value_heads") or self.num_heads

    @property
    def head_dim(self) -> int:
        """The width of a cached key (and value) head: for latent attention, the latent's."""
        if self.latent_attention:
            return self.hf_config["kv_lora_rank"] + self.hf_config["qk_rope_head_dim"]
        return self.hf_config.get("head_dim") or self.hf_config["hidden_size"] // self.num_heads

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's attention window where ferry applies one, None where the layer attends to
        every key: a window at least max_model_len cuts nothing and counts as none. The model class
        says which windows it implements: one for every layer (`sliding_window(hf_config)`, Mistral)
        or one a layer (`layer_windows(hf_config)`, Gemma's local and global layers)."""
        from ferry.models.registry import get_model_class, supported_architectures

        if self.architecture not in supported_architectures():  # (a test's stand-in model)
            return ()
        model_class = get_model_class(self.architecture)
        windows: list[int | None] = [None] * self.num_layers
        if hasattr(model_class, "layer_windows"):
            windows = list(model_class.layer_windows(self.hf_config))
        elif getattr(model_class, "implements_sliding_window", False):
            windows = [model_class.sliding_window(self.hf_config)] * self.num_layers
        for w in windows:  # (Qwen2-MoE's configs carry a sliding_window of 0 where none applies: checked here)
            if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
                raise ValueError(f"config.json: sliding_window must be a positive integer, got {w!r}")
        return tuple(w if w is not None and w < self.max_model_len else None for w in windows)

    @property
    def sliding_window(self) -> int | None:
        """The window of every layer, where all have the same one (then the KV blocks that leave it
        can be given back: core/kv_cache_manager.py); None otherwise."""
        windows = set(self.layer_windows)
        return windows.pop() if len(windows) == 1 else None

    @property
    def moe(self) -> MoeConfig | None:
        """The experts of a mixture-of-experts model; None for a dense one."""
        return read_moe_config(self.hf_config)

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
        quantization: str | None = None,
    ) -> ModelConfig:
        """The model's config from its folder: dtype "auto" and max_model_len None decided (see
        resolve_dtype; the context is the model's max_position_embeddings). generation_config: where
        the EOS ids come from, as vLLM's option says: "auto" (the model's generation_config.json,
        else config.json), "vllm" (config.json alone), or a folder with a generation_config.json."""
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
        for name in _POSITIVE_NUMBERS:
            value = hf_config.get(name)
            if value is not None and (not isinstance(value, int | float) or isinstance(value, bool) or not value > 0
                                      or value == float("inf")):
                raise ValueError(f"{config_file}: {name} must be a positive number (or null), got {value!r}")
        read_moe_config(hf_config)  # (an impossible routing fails here, before any weights)
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
            tokenizer=Path(tokenizer) if tokenizer is not None else None,
            generation_config=generation_config,
            quantization=_checked_quantization(quantization, hf_config, config_file),
        )

    def check_folder(self) -> None:
        """Raise unless the model's folder still holds the config.json this config was read from:
        an engine process started later (a restart) loads the weights from there, and they must be
        the ones this config describes."""
        config_file = self.path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in model folder {self.path}")
        if json.loads(config_file.read_text()) != self.hf_config:
            raise ValueError(f"{config_file} has changed since the engine's configuration was read from it")


def _checked_quantization(quantization: str | None, hf_config: dict[str, Any], config_file: Path) -> str | None:
    """The quantization option as given, once the checkpoint's quantization_config and it are known
    to go together (an error naming the problem otherwise)."""
    from ferry.quantization.config import resolve_quantization

    resolve_quantization(quantization, hf_config)
    return None if quantization == "none" else quantization


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
    block_size: int = option(16, help="tokens per KV cache block")
    kv_cache_dtype: str = option("auto", choices=KV_CACHE_DTYPES,
                                 help="auto: the model's dtype; fp8 (fp8_e4m3): a byte per value, twice the tokens, "
                                      "scaled by the checkpoint's k_scale and v_scale where it has them")
    num_kv_blocks: int | None = option(None, help="KV cache blocks (default: sized from memory)")
    enable_prefix_caching: bool = option(True, help="reuse the KV cache of shared prompt prefixes")
    gpu_memory_utilization: float = option(
        0.9, help="fraction of the GPU's memory for weights, activations and the KV cache")
    cpu_kv_cache_bytes: int = 1 << 30  # KV pool size on CPU when num_kv_blocks is not given

    @property
    def fp8_kv(self) -> bool:
        return self.kv_cache_dtype != "auto"

    def kv_itemsize(self, model: ModelConfig) -> int:
        """Bytes of one cached K or V value."""
        return 1 if self.fp8_kv else model.dtype_bytes

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = option(256, help="most requests running at once")
    # The per-step token budget; None (auto) only until EngineConfig.create decides it.
    max_num_batched_tokens: int | None = option(
        None, help="tokens per step (default: 2048 on a CPU; max(8192, min(max_model_len, 16384)) on a GPU)")
    max_model_len: int = 4096  # the model's, copied here
    # Admission keeps KV blocks free for the decodes already admitted (core/scheduler.py): a share
    # of every running request's output still to come, which starts here, falls while nothing is
    # preempted and comes back here at a preemption. 0: admit whatever fits now.
    decode_reserve: float = option(
        0.7, help="share of running requests' remaining output tokens that admission keeps KV blocks free for "
                  "(it decays to a tenth while nothing is preempted; 0: off)")
    # False: vLLM's scheduling without chunked prefill (core/scheduler.py): every prompt is prefilled
    # whole, in a step of prefills alone, so a step must hold the longest prompt (max_model_len).
    enable_chunked_prefill: bool = option(
        True, help="cut long prompts into chunks that share steps with decodes; --no-enable-chunked-prefill: "
                   "prefill every prompt whole, in steps without decodes (then --max-num-batched-tokens must be "
                   "at least --max-model-len)")

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if not 0.0 <= self.decode_reserve <= 1.0:
            raise ValueError(f"decode_reserve must be in [0, 1], got {self.decode_reserve}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        self._check_whole_prompts_fit()

    def _check_whole_prompts_fit(self) -> None:
        """Without chunked prefill a prompt runs in one step, so a budget below the context would
        leave longer prompts waiting forever; refused here, once, as vLLM refuses it."""
        budget = self.max_num_batched_tokens
        if not self.enable_chunked_prefill and budget is not None and budget < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({budget}) is smaller than max_model_len ({self.max_model_len}): without "
                "chunked prefill every prompt is prefilled whole in one step, so a step must hold the longest; "
                "raise max_num_batched_tokens or lower max_model_len (or enable chunked prefill)")


# Speculative decoding (ferry/spec): how proposals are made. vLLM's speculative_config keys, of
# which ferry takes these; the name of the bundled draft model stands for its folder.
SPEC_METHODS = ("ngram", "draft_model")
_SPEC_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
              "disable_by_batch_size", "draft_tensor_parallel_size", "draft_confidence_threshold")
BUNDLED_DRAFT = "ferry-default-draft"
MAX_SPECULATIVE_TOKENS = 16
# Proposals stop above this many running requests unless speculative_config says otherwise: on an
# H200, Llama-3.1-8B's shape with proposals kept at 0.7 and k = 4 decoded 1.57x as fast at batch 32
# and 0.92x at 128 (docs/benchmarks.md); past ~100 a verify step's extra rows cost more than they save.
DEFAULT_DISABLE_BY_BATCH_SIZE = 64


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer guesses up to `num_speculative_tokens` next tokens of each
    running request, and one step of the model verifies them all (spec/proposer.py). `method`
    "ngram" looks the guesses up in the request's own tokens (prompt lookup: the tokens that followed
    the latest earlier occurrence of its last n tokens, n from prompt_lookup_max down to
    prompt_lookup_min); "draft_model" runs a small model (`model`, the draft's folder) of the same
    vocabulary. Built from a dict of vLLM's keys by `from_dict`."""

    method: str
    num_speculative_tokens: int
    model: Path | None = None  # noqa: RUF009
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # No proposals in a step that runs more requests than this (None: never off): a large batch is
    # bound by compute rather than by reading the weights, and verifying guesses there costs more
    # than it saves.
    disable_by_batch_size: int | None = None
    # A draft model stops guessing for a request, short of num_speculative_tokens, after a guess that
    # had less than this of its probability (0: never; a key of ferry's own, after the assistant
    # confidence threshold of Hugging Face's assisted generation). A draft's confidence says much of
    # whether the target keeps the guess, so a step proposes many tokens where they are likely kept
    # and few where they are not.
    draft_confidence_threshold: float = 0.0
    # The draft model's config, read from its folder (draft_model only).
    draft: ModelConfig | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config: method {self.method!r} is not supported; ferry has "
                             f"{', '.join(SPEC_METHODS)}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config: num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {self.num_speculative_tokens}")
        if self.method == "ngram" and not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.method == "draft_model" and self.draft is None:
            raise ValueError("speculative_config: the draft_model method needs a 'model' (the draft's folder)")
        if not 0.0 <= self.draft_confidence_threshold < 1.0:
            raise ValueError("speculative_config: draft_confidence_threshold must be in [0, 1), got "
                             f"{self.draft_confidence_threshold}")
        if self.draft_confidence_threshold and self.method != "draft_model":
            raise ValueError("speculative_config: draft_confidence_threshold is for a draft model; "
                             f"method {self.method!r} has no confidence")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"speculative_config: disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")

    @classmethod
    def from_dict(cls, spec: Any, target: ModelConfig) -> SpeculativeConfig:
        """vLLM's speculative_config (a dict, or its JSON text) for this target model. A "model"
        without a method is a draft model; the draft must have the target's vocabulary and hold its
        context. Errors name the key."""
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config must be an object of vLLM's keys, got {type(spec).__name__}")
        unknown = sorted(set(spec) - set(_SPEC_KEYS))
        if unknown:
            raise ValueError(f"speculative_config: ferry does not take {', '.join(map(repr, unknown))} "
                             f"(it takes {', '.join(_SPEC_KEYS)})")
        for key, value in spec.items():
            wanted, what = {"method": ((str,), "a string"), "model": ((str,), "a string"),
                            "draft_confidence_threshold": ((int, float), "a number")}.get(key, ((int,), "an integer"))
            if value is not None and (not isinstance(value, wanted) or isinstance(value, bool)):
                raise ValueError(f"speculative_config: {key} must be {what}, got {value!r}")
        if spec.get("draft_tensor_parallel_size") not in (None, 1):
            raise ValueError("speculative_config: draft_tensor_parallel_size must be 1 (ferry runs on one GPU)")
        if spec.get("num_speculative_tokens") is None:
            raise ValueError("speculative_config: num_speculative_tokens is required")
        method = spec.get("method") or ("draft_model" if spec.get("model") else None)
        if method is None:
            raise ValueError(f"speculative_config: give a method ({', '.join(SPEC_METHODS)}) or a draft model")
        lookup_max, lookup_min = spec.get("prompt_lookup_max"), spec.get("prompt_lookup_min")
        if method == "ngram":  # one given stands for both, as in vLLM
            lookup_max, lookup_min = lookup_max or lookup_min or 5, lookup_min or lookup_max or 2
        draft = _draft_model(spec["model"], target) if method == "draft_model" and spec.get("model") else None
        disable = spec.get("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE)
        return cls(method, spec["num_speculative_tokens"], draft.path if draft else None, lookup_max, lookup_min,
                   disable, float(spec.get("draft_confidence_threshold") or 0.0), draft)


def _draft_model(model: str, target: ModelConfig) -> ModelConfig:
    """The draft model's config: the target's dtype and context; its vocabulary must be the target's."""
    if model == BUNDLED_DRAFT:
        from ferry.assets import default_draft_model_path

        model = default_draft_model_path()
    try:
        draft = ModelConfig.from_pretrained(model, dtype=target.dtype, max_model_len=target.max_model_len,
                                            load_format=target.load_format)
    except (OSError, ValueError) as e:
        raise ValueError(f"speculative_config: draft model {model}: {e}") from None
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config: the draft model's vocabulary ({draft.vocab_size} tokens) is not the "
                         f"target's ({target.vocab_size}): a draft must share the target's tokenizer")
    if target.sliding_window is not None:
        # The draft's cache lives in the target's blocks, which the window gives back as it slides.
        raise ValueError(f"speculative_config: a draft model with a sliding-window target ({target.architecture}, "
                         f"window {target.sliding_window}) is not supported; prompt lookup (method ngram) is")
    return draft


ATTENTION_BACKENDS = ("torch", "sdpa", "triton")


def environment_defaults() -> dict[str, Any]:
    """The EngineConfig fields the environment sets, read here once (no kernel reads it):
    FERRY_ATTENTION_BACKEND=torch|sdpa|triton and FERRY_PDL=0."""
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
    device: str = option("cpu", help="cpu or cuda")
    seed: int = option(0, help="seed of the sampler's shared generator")
    # False: decode steps of up to the largest of `cuda_graph_batch_sizes` requests replay CUDA
    # graphs captured at startup (executor/cuda_graph.py); on a CPU they run the same padded batches
    # eagerly. True: every step runs eagerly. None (auto): graphs on CUDA only (see `create`).
    enforce_eager: bool | None = option(
        None, help="run every step eagerly; --no-enforce-eager replays decode steps from CUDA graphs "
                   "(default: graphs on CUDA)")
    # None: the defaults above, up to max_num_seqs (which is added when it falls between two).
    cuda_graph_batch_sizes: tuple[int, ...] | None = option(
        None, flag=False, help="decode batch sizes that get a CUDA graph (default: 1, 2, 4, then multiples of 8, "
                               "up to max_num_seqs)")
    # Steps with prefill chunks of up to this many tokens replay CUDA graphs captured per token count
    # (executor/prefill_graphs.py; `prefill_graph_sizes`); on a CPU they run the same padded steps
    # eagerly. 0: every such step runs eagerly.
    max_prefill_graph_tokens: int = option(
        0, help="steps with prefill chunks of up to this many tokens replay CUDA graphs, captured for 16, 32, "
                "64, ... tokens (multiples of 512 above 512); 0: they run eagerly")
    # Schedule and launch each step before waiting for the last one's tokens (engine/engine.py).
    # None (auto): on CUDA only (see `create`).
    async_scheduling: bool | None = option(
        None, help="schedule and launch each step before waiting for the last one's tokens, so the host's "
                   "work overlaps the device's (default: on CUDA)")
    # None: the device's default (Triton on CUDA where it imports). `create` reads
    # $FERRY_ATTENTION_BACKEND into it when it is not given.
    attention_backend: str | None = option(
        None, flag=False, choices=ATTENTION_BACKENDS,
        help="torch (the reference), sdpa or triton (default: $FERRY_ATTENTION_BACKEND, else the device's: "
             "triton on CUDA, sdpa elsewhere)")
    # Programmatic dependent launch for the decode path's Triton kernels, where the GPU has it
    # (Hopper and newer). None (auto): on, unless FERRY_PDL=0 (see `create`).
    pdl: bool | None = option(
        None, flag=False, help="programmatic dependent launch on Hopper and newer (default: on, unless FERRY_PDL=0)")
    # Built from vLLM's dict (or its JSON text on the command line) by `create`.
    speculative_config: SpeculativeConfig | None = option(
        None, help="speculative decoding, vLLM's JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 3} "
                   "(prompt lookup; prompt_lookup_max/min) or {\"model\": DIR, \"num_speculative_tokens\": 3} "
                   f"(a draft model of the same vocabulary; {BUNDLED_DRAFT}: the bundled one); "
                   f"disable_by_batch_size: no proposals above that many running requests ({DEFAULT_DISABLE_BY_BATCH_SIZE}; "
                   "null: never off); draft_confidence_threshold: a draft stops guessing after a guess of less "
                   "probability (0: never)")

    def __post_init__(self) -> None:
        sizes = self.cuda_graph_batch_sizes
        if sizes is not None and (not sizes or min(sizes) < 1):
            raise ValueError(f"cuda_graph_batch_sizes must be positive batch sizes, got {sizes}")
        if self.max_prefill_graph_tokens < 0:
            raise ValueError(f"max_prefill_graph_tokens must be >= 0, got {self.max_prefill_graph_tokens}")
        if self.attention_backend not in (None, *ATTENTION_BACKENDS):
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS} (or unset), "
                             f"got {self.attention_backend!r}")

    @classmethod
    def create(cls, model: str | Path, **options: Any) -> EngineConfig:
        """The engine's configuration for the model in this folder, from `LLM`'s keyword arguments
        (the fields made with `option`, by name; an unknown name is a TypeError). This is the one
        place where an option left "auto" gets its value, so the config holds concrete values:

        - dtype "auto", max_model_len None: ModelConfig.from_pretrained, from config.json and the device;
        - max_num_batched_tokens None: 2048 on a CPU; on a GPU the context, clamped to [8192, 16384];
          without chunked prefill at least the context (vLLM's rule: a whole prompt fits a step);
        - enforce_eager None: decode steps replay CUDA graphs on a CUDA device, and run eagerly
          elsewhere (padding buys nothing there);
        - async_scheduling None: on a CUDA device, where the host's work can hide behind the
          device's; on a CPU the two are the same cores, and overlapping them gains nothing;
        - attention_backend, pdl None: the environment's (environment_defaults), read here once.
        """
        values = _option_values(options)
        device = values["device"]
        on_cuda = str(device).split(":")[0] == "cuda"
        model_config = ModelConfig.from_pretrained(model, device=device, **_fields_of(ModelConfig, values))
        if values["max_num_batched_tokens"] is None:
            values["max_num_batched_tokens"] = (
                max(8192, min(model_config.max_model_len, 16384)) if device != "cpu" else 2048)
            if not values["enable_chunked_prefill"]:
                values["max_num_batched_tokens"] = max(values["max_num_batched_tokens"], model_config.max_model_len)
        if values["enforce_eager"] is None:
            values["enforce_eager"] = not on_cuda
        if values["async_scheduling"] is None:
            values["async_scheduling"] = on_cuda
        for name, value in environment_defaults().items():
            if values[name] is None:
                values[name] = value
        if values["cuda_graph_batch_sizes"] is not None:
            values["cuda_graph_batch_sizes"] = tuple(values["cuda_graph_batch_sizes"])
        if values["speculative_config"] is not None and not isinstance(values["speculative_config"], SpeculativeConfig):
            values["speculative_config"] = SpeculativeConfig.from_dict(values["speculative_config"], model_config)
        return cls(
            model=model_config,
            cache=CacheConfig(**_fields_of(CacheConfig, values)),
            scheduler=SchedulerConfig(**_fields_of(SchedulerConfig, values), max_model_len=model_config.max_model_len),
            **_fields_of(EngineConfig, values),
        )

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

    @property
    def prefill_graph_sizes(self) -> tuple[int, ...]:
        """The token counts of steps with prefill chunks to capture, ascending (none without
        max_prefill_graph_tokens): powers of two from 16 to 512, then multiples of 512 (a step is
        padded by at most half its tokens, and by at most 511 above 512), up to
        max_prefill_graph_tokens and no further than a step's token budget."""
        limit = min(self.max_prefill_graph_tokens, self.scheduler.max_num_batched_tokens)
        if limit <= 0:
            return ()
        sizes = [s for s in (16, 32, 64, 128, 256, *range(512, limit + 1, 512)) if s <= limit]
        if not sizes or sizes[-1] != limit:
            sizes.append(limit)
        return tuple(sizes)


# ---- the options, as the command line and `create` see them ----


class EngineOption(NamedTuple):
    """One user-settable option: the field `field` of `owner` (EngineConfig or one of its parts)."""

    name: str  # LLM's keyword argument; on the command line --name-with-dashes
    owner: type
    field: Field
    type: type  # the field's type less None: bool, int, float, str, Path or tuple

    @property
    def default(self) -> Any:
        return self.field.default

    @property
    def help(self) -> str:
        return self.field.metadata["help"]

    @property
    def choices(self) -> tuple[str, ...] | None:
        return self.field.metadata["choices"]

    @property
    def flag(self) -> bool:
        """On the command line (otherwise a keyword argument of `LLM` alone)."""
        return self.field.metadata["flag"]

    @property
    def short(self) -> str | None:
        return self.field.metadata["short"]


def field_types(cls: type) -> dict[str, type]:
    """The type of each of a config class's fields, less None (`int | None` -> int) and less its
    parameters (`tuple[int, ...]` -> tuple)."""
    types = {}
    for name, hint in get_type_hints(cls).items():
        if get_origin(hint) is UnionType:
            (hint,) = [arg for arg in get_args(hint) if arg is not type(None)]
        types[name] = get_origin(hint) or hint
    return types


def _collect_options(*classes: type) -> dict[str, EngineOption]:
    options = {}
    for cls in classes:
        types = field_types(cls)
        for f in fields(cls):
            if "help" in f.metadata:
                name = f.metadata["name"] or f.name
                options[name] = EngineOption(name, cls, f, types[f.name])
    return options


# Every option by name, in the order of the command line's help: the model, the KV cache, the
# scheduler, then the engine's own.
ENGINE_OPTIONS = _collect_options(ModelConfig, CacheConfig, SchedulerConfig, EngineConfig)


def _option_values(given: dict[str, Any]) -> dict[str, Any]:
    """Every option's value (given, else the field's default) by name, but the model's folder
    (`create`'s first argument); an unknown name is a TypeError naming the closest ones."""
    names = [name for name in ENGINE_OPTIONS if name != "model"]
    for name in given:
        if name not in names:
            close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
            raise TypeError(f"unknown engine option {name!r}" + (f" (did you mean {', '.join(close)}?)" if close else ""))
    return {name: given.get(name, ENGINE_OPTIONS[name].default) for name in names}


def _fields_of(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """The values of cls's options, as its fields' keyword arguments."""
    return {o.field.name: values[o.name] for o in ENGINE_OPTIONS.values() if o.owner is cls and o.name in values}
