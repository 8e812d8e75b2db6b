"""FP8 weights (ferry/quantization): the numbers, the checkpoint formats users download, and what the
bundled model loses.

- Quantizing: e4m3 keeps every weight within its rounding step (1/16 of its size, or the smallest
  step of its row's scale), with one scale per row or per block.
- The layer's product (`fp8_linear_reference`, what the CUDA kernels are held to) is the float32
  product of the dequantized activations and weights.
- Checkpoints: a compressed-tensors checkpoint (llm-compressor's layout: float8 `weight` and its
  `weight_scale`) written here from a tiny model gives the logits transformers computes from the
  same file (transformers quantizes the activations the same way, per token); a Hugging Face fp8
  checkpoint (128x128-style block scales, `weight_scale_inv`) gives transformers' logits with the
  activations left in 16 bits, transformers' own way on a CPU.
- The bundled model with FP8 weights, an FP8 KV cache, and both keeps its held-out perplexity
  within 3%.
- A quantization config ferry does not run is an error naming it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from ferry.quantization.config import Fp8Spec, resolve_quantization
from ferry.quantization.fp8 import (
    FP8, Fp8Linear, dequantize, dequantize_activations, fp8_linear_reference, quantize_activations,
    quantize_blocks, quantize_rows,
)

REPO = Path(__file__).parents[1]


def _within_a_step(w: torch.Tensor, back: torch.Tensor, scale_per_weight: torch.Tensor) -> bool:
    # e4m3: 3 mantissa bits, so a normal number is off by at most 1/16 of itself; below 2**-6 (the
    # subnormals) by at most half the smallest step, 2**-10, of the scale.
    return bool(((back - w).abs() <= w.abs() / 16 + scale_per_weight * 2 ** -10 + 1e-12).all())


def test_rows_and_blocks_quantize_within_a_rounding_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 80, generator=g) * torch.logspace(-3, 1, 96)[:, None]  # rows of very different sizes
    q, scale = quantize_rows(w)
    assert q.dtype == FP8 and scale.shape == (96,)
    assert torch.allclose(q.float().abs().amax(dim=1), torch.full((96,), 448.0))  # each row's largest at 448
    assert _within_a_step(w, dequantize(q, scale), scale[:, None].expand_as(w))
    q, scale = quantize_blocks(w, (32, 32))  # 96 x 80: blocks at the right edge are 32 x 16
    assert scale.shape == (3, 3)
    per_weight = scale.repeat_interleave(32, 0).repeat_interleave(32, 1)[:96, :80]
    assert _within_a_step(w, dequantize(q, scale, (32, 32)), per_weight)
    zero = torch.zeros(4, 8)
    assert torch.equal(dequantize(*quantize_rows(zero)), zero)  # an all-zero row stays zero


def test_activations_quantize_per_token_per_group_or_static():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 40, generator=g) * torch.tensor([1e-3, 1e-1, 1.0, 10.0, 300.0])[:, None]
    q, scale = quantize_activations(x)
    assert scale.shape == (5, 1)
    assert _within_a_step(x, dequantize_activations(q, scale), scale.expand_as(x))
    q, scale = quantize_activations(x, group=16)  # groups of 16, 16 and 8 columns
    assert scale.shape == (5, 3)
    assert _within_a_step(x, dequantize_activations(q, scale, 16), scale.repeat_interleave(16, 1)[:, :40])
    q, scale = quantize_activations(x[:3], static_scale=torch.tensor(2.0 / 448))  # saturates past 2
    back = dequantize_activations(q, scale)
    assert back.abs().max() == 2.0 and (back[x[:3].abs() >= 2].abs() == 2.0).all()  # noqa: PLR2004


@pytest.mark.parametrize("block,activations", [(None, "dynamic"), (None, "static"), (None, "none"),
                                               ((16, 16), "dynamic")])
def test_the_product_is_that_of_the_dequantized_numbers(block, activations):
    g = torch.Generator().manual_seed(2)
    w, x, bias = torch.randn(48, 32, generator=g), torch.randn(3, 7, 32, generator=g), torch.randn(48, generator=g)
    q, scale = quantize_rows(w) if block is None else quantize_blocks(w, block)
    input_scale = torch.tensor([0.01, 0.02])  # (a merged layer's two; the larger serves)
    got = fp8_linear_reference(x, q, scale, bias, Fp8Linear(block, activations), input_scale)
    flat = x.reshape(-1, 32)
    if activations == "dynamic":
        group = None if block is None else block[1]
        flat = dequantize_activations(*quantize_activations(flat, group), group)
    elif activations == "static":
        flat = dequantize_activations(*quantize_activations(flat, static_scale=torch.tensor(0.02)))
    expected = flat @ dequantize(q, scale, block).T + bias
    assert got.shape == (3, 7, 48)
    assert torch.allclose(got.reshape(-1, 48), expected, atol=1e-5, rtol=1e-5)
    assert (got.reshape(-1, 48) - (x.reshape(-1, 32) @ w.T + bias)).abs().max() < 0.05 * expected.abs().max()


# ---- checkpoints ----

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))
from test_models import TOTAL_LENS, prefill_steps, run_ferry  # noqa: E402
from tiny_models import VOCAB_SIZE, make_tiny_model  # noqa: E402


def _quantized_checkpoint(path: Path, arch: str, quantization_config: dict, quantize, scale_suffix: str,
                          input_scale: float | None = None) -> Path:
    """A tiny model saved with float8 decoder-layer projections, as `quantize` makes them."""
    from safetensors.torch import load_file, save_file

    make_tiny_model(arch, path)
    tensors = {}
    for name, tensor in load_file(path / "model.safetensors").items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            q, scale = quantize(tensor)
            tensors[name], tensors[name + scale_suffix] = q, scale
            if input_scale is not None:
                tensors[name.removesuffix("weight") + "input_scale"] = torch.tensor([input_scale])
        else:
            tensors[name] = tensor
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config))
    return path


def _compressed_tensors_config(weights: dict, inputs: dict | None) -> dict:
    # As llm-compressor writes it (FP8_DYNAMIC: channel weights, dynamic per-token activations).
    float8 = {"num_bits": 8, "type": "float", "symmetric": True}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"], "config_groups": {"group_0": {
                "targets": ["Linear"], "weights": {**float8, "dynamic": False, **weights},
                "input_activations": None if inputs is None else {**float8, **inputs}, "output_activations": None}}}


def _logits(path: Path, kv_cache_dtype: str = "auto") -> tuple[list[torch.Tensor], list[torch.Tensor], torch.nn.Module]:
    """(transformers' logits, ferry's logits, ferry's model) of random sequences."""
    from ferry.config import ModelConfig
    from ferry.loader.loader import load_model

    g = torch.Generator().manual_seed(1)
    sequences = [torch.randint(3, VOCAB_SIZE, (n,), generator=g) for n in TOTAL_LENS]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = [hf(s[None]).logits[0].float() for s in sequences]
    model_config = ModelConfig.from_pretrained(path)
    model = load_model(model_config, "cpu")
    return expected, run_ferry(model, model_config, sequences, prefill_steps(), 16, kv_cache_dtype), model


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("arch,weights,inputs", [
    ("llama", {"strategy": "channel"}, {"strategy": "token", "dynamic": True}),  # FP8_DYNAMIC
    ("qwen3", {"strategy": "tensor"}, {"strategy": "tensor", "dynamic": False}),  # FP8 with static scales
])
def test_a_compressed_tensors_checkpoint_gives_transformers_logits(tmp_path, arch, weights, inputs):
    """transformers runs compressed-tensors' own forward (activations quantized as the config says),
    so the two agree to float32 rounding; the tolerance is 1e-4 on logits of order 1."""
    pytest.importorskip("compressed_tensors")
    if weights["strategy"] == "channel":
        def quantize(w):
            q, scale = quantize_rows(w)
            return q, scale[:, None]  # (N, 1), as llm-compressor saves channel scales
    else:
        def quantize(w):
            scale = w.abs().max() / 448
            return (w / scale).to(FP8), scale.reshape(1)
    static = 0.05 if not inputs["dynamic"] else None
    path = _quantized_checkpoint(tmp_path, arch, _compressed_tensors_config(weights, inputs), quantize,
                                 "_scale", input_scale=static)
    expected, got, model = _logits(path)
    layer = model.model.layers[0].self_attn.qkv_proj
    assert layer.weight.dtype == FP8 and layer.fp8.activations == ("dynamic" if static is None else "static")
    assert _max_diff(got, expected) < 1e-4


def test_a_hugging_face_fp8_checkpoint_with_block_scales_loads_exactly(tmp_path):
    """Hugging Face's fp8 format (Qwen3-FP8, DeepSeek): float8 weights with a `weight_scale_inv` per
    block. On a CPU transformers dequantizes it and keeps activations in 16 bits; ferry's layers
    with activations in 16 bits give its logits to float32 rounding (1e-4), and with activations
    quantized per token and block of columns, as ferry runs it, stay close (0.5% of the logits' range)."""
    pytest.importorskip("accelerate")  # (transformers' fp8 loader needs it)
    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [16, 16]}
    path = _quantized_checkpoint(tmp_path, "qwen3", config, lambda w: quantize_blocks(w, (16, 16)), "_scale_inv")
    expected, quantized_activations, model = _logits(path)
    layer = model.model.layers[0].mlp.gate_up_proj
    assert layer.weight.dtype == FP8 and layer.weight_scale.shape == (2 * 128 // 16, 64 // 16)
    for module in model.modules():
        if getattr(module, "fp8", None) is not None:
            module.fp8 = dataclasses.replace(module.fp8, activations="none")
    from ferry.config import ModelConfig

    g = torch.Generator().manual_seed(1)
    sequences = [torch.randint(3, VOCAB_SIZE, (n,), generator=g) for n in TOTAL_LENS]
    weights_only = run_ferry(model, ModelConfig.from_pretrained(path), sequences, prefill_steps(), 16)
    assert _max_diff(weights_only, expected) < 1e-4
    spread = max((e.max() - e.min()).item() for e in expected)
    assert _max_diff(quantized_activations, expected) < 0.5 * spread


@pytest.mark.parametrize("config,message", [
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq' is not supported; ferry supports fp8"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2' is not supported"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme 'static' is not supported"),
    (_compressed_tensors_config({"strategy": "group", "group_size": 128}, None), "weight strategy 'group'"),
    ({**_compressed_tensors_config({"strategy": "channel"}, None), "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "channel"}}}},
     "ferry runs symmetric float8 weights"),
])
def test_quantization_configs_ferry_does_not_run_are_errors_naming_them(config, message):
    with pytest.raises(ValueError, match=message):
        resolve_quantization(None, {"quantization_config": config})


def test_the_quantization_option():
    assert resolve_quantization(None, {}) is None and resolve_quantization("none", {}) is None
    online = resolve_quantization("fp8", {})
    assert online == Fp8Spec("fp8", prequantized=False, weight_block=None, per_tensor=False, activations="dynamic",
                             scale_name="weight_scale")
    with pytest.raises(ValueError, match="quantization 'int4' is not supported"):
        resolve_quantization("int4", {})
    checkpoint = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    assert resolve_quantization("fp8", checkpoint).weight_block == (128, 128)
    with pytest.raises(ValueError, match="already quantized"):
        resolve_quantization("compressed-tensors", checkpoint)


# ---- the bundled model ----


def _held_out_texts(limit: int = 40, chars: int = 3000) -> list[str]:
    """The beginnings of standard-library files of the held-out test split (tools/build_corpus.py)."""
    sys.path.insert(0, str(REPO / "tools"))
    from build_corpus import split_of

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for path in sorted(stdlib.rglob("*.py")):
        relative = path.relative_to(stdlib).as_posix()
        if "site-packages" in path.parts or split_of(relative) != "test":
            continue
        try:
            text = path.read_text()[:chars]
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            texts.append(text)
        if len(texts) == limit:
            break
    return texts


def perplexity(llm, texts: list[str]) -> float:
    """exp of the mean negative log-likelihood of every token after the first, through the engine."""
    from ferry.sampling_params import SamplingParams

    outputs = llm.generate(texts, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0), use_tqdm=False)
    total = count = 0
    for output in outputs:
        for token_id, position in zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:]):
            total -= position[token_id].logprob
            count += 1
    return math.exp(total / count)


def _with_kv_scales(path: Path, scales: dict[str, torch.Tensor]) -> Path:
    """The checkpoint at path, plus KV cache scales (checkpoint name -> tensor)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    save_file({**tensors, **scales}, path / "model.safetensors", metadata={"format": "pt"})
    return path


def _fp8_kv_error(path: Path) -> tuple[float, torch.nn.Module]:
    """(largest logit difference of ferry with an FP8 KV cache from transformers in float32, ferry's model)."""
    expected, got, model = _logits(path, kv_cache_dtype="fp8")
    return _max_diff(got, expected), model


def test_kv_cache_scales_load_from_the_checkpoint_and_scale_the_cache(tmp_path):
    """Per-tensor and per-head k_scale / v_scale, and an older checkpoint's one kv_scale for both, load
    into the attention layers; the cache's values are divided by them: with scales that clamp most
    values the logits move far more than with scales that fit them (the kernel tests check the
    arithmetic itself). The llama tiny model has 2 KV heads and 2 layers, keys and values of order
    1 and logits up to about 8; e4m3's rounding of K and V alone (scale 1) moves them by about 1.3,
    the fitted scales here by 1.5, clamping ones by 12."""
    layer = "model.layers.{}.self_attn."
    fitted = {layer.format(0) + "k_scale": torch.tensor(0.02), layer.format(0) + "v_scale": torch.tensor([0.01, 0.03]),
              layer.format(1) + "kv_scale": torch.tensor([0.02])}
    path = _with_kv_scales(make_tiny_model("llama", tmp_path / "fitted"), fitted)
    error, model = _fp8_kv_error(path)
    attn = [model.model.layers[i].self_attn.attn for i in range(2)]
    assert attn[0].k_scale.tolist() == pytest.approx([0.02, 0.02]) and attn[0].v_scale.tolist() == pytest.approx([0.01, 0.03])
    assert attn[1].k_scale.tolist() == attn[1].v_scale.tolist() == pytest.approx([0.02, 0.02])
    clamping = {name: torch.full_like(t, 1e-4) for name, t in fitted.items()}
    clamped, _ = _fp8_kv_error(_with_kv_scales(make_tiny_model("llama", tmp_path / "clamped"), clamping))
    assert error < 2.5 and clamped > 5 * error, (error, clamped)  # noqa: PLR2004


def test_kv_cache_scales_under_older_names_load_and_attention_scales_are_skipped(tmp_path):
    """Older llm-compressor checkpoints keep K's and V's scales as k_proj's and v_proj's output
    scales; the query's and the probabilities' scales (attention quantized whole) have nothing to
    scale in ferry and are passed over."""
    from ferry.config import ModelConfig
    from ferry.loader.loader import load_model

    layer = "model.layers.0.self_attn."
    scales = {layer + "k_proj.output_scale": torch.tensor([0.5]), layer + "v_proj.output_scale": torch.tensor([0.25]),
              layer + "q_scale": torch.tensor([2.0]), layer + "prob_output_scale": torch.tensor([3.0])}
    model = load_model(ModelConfig.from_pretrained(_with_kv_scales(make_tiny_model("llama", tmp_path), scales)), "cpu")
    attn = model.model.layers[0].self_attn.attn
    assert attn.k_scale.tolist() == [0.5, 0.5] and attn.v_scale.tolist() == [0.25, 0.25]


def test_a_checkpoint_that_quantizes_only_its_kv_cache_keeps_16_bit_weights():
    config = {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {},
                                      "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"}}}
    assert resolve_quantization(None, config) is None
    online = resolve_quantization("fp8", config)
    assert online is not None and not online.prequantized  # and --quantization fp8 still quantizes at load


def test_an_fp8_kv_cache_on_a_gpu_without_e4m3_is_a_clear_error(monkeypatch, tmp_path):
    from ferry.config import EngineConfig
    from ferry.executor import model_runner

    config = EngineConfig.create(make_tiny_model("llama", tmp_path), kv_cache_dtype="fp8")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="compute capability 8.0"):
        model_runner._check_fp8_kv(config, torch.device("cuda"))
    model_runner._check_fp8_kv(config, torch.device("cpu"))  # the CPU path dequantizes in torch


def test_a_kv_cache_scale_that_is_not_positive_is_an_error_naming_it(tmp_path):
    from ferry.config import ModelConfig
    from ferry.loader.loader import load_model

    name = "model.layers.1.self_attn.v_scale"
    path = _with_kv_scales(make_tiny_model("llama", tmp_path), {name: torch.tensor([0.0])})
    with pytest.raises(ValueError, match=f"{name}: a KV cache scale must be positive"):
        load_model(ModelConfig.from_pretrained(path), "cpu")


@pytest.fixture(scope="module")
def held_out():
    """(texts, the unquantized bundled model's perplexity on them)."""
    from ferry import LLM

    texts = _held_out_texts()
    assert len(texts) >= 20  # noqa: PLR2004
    base = perplexity(LLM(), texts)
    assert 1 < base < 20  # noqa: PLR2004
    return texts, base


@pytest.mark.parametrize("options", [{"quantization": "fp8"}, {"kv_cache_dtype": "fp8"},
                                     {"quantization": "fp8", "kv_cache_dtype": "fp8"}], ids=str)
def test_the_bundled_model_in_fp8_keeps_its_perplexity(held_out, options):
    """FP8 weights, an FP8 KV cache (its scales 1: the bundled checkpoint has none), and both."""
    from ferry import LLM

    texts, base = held_out
    llm = LLM(**options)
    model = llm.engine.executor.model.model
    assert (model.layers[0].mlp.down_proj.weight.dtype == FP8) == ("quantization" in options)
    assert (llm.engine.executor.kv_caches[0].dtype == FP8) == ("kv_cache_dtype" in options)
    quantized = perplexity(llm, texts)
    assert abs(quantized / base - 1) < 0.03, (base, quantized)  # noqa: PLR2004
