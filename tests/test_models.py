"""ferry's models and loader against Hugging Face transformers on tiny random checkpoints.

Every case runs the same three prompts two ways, (a) prefilled together in one flat forward and
(b) prefilled in chunks then decoded token by token with the KV cache carrying the context, over
block tables of shuffled block ids, and compares every logit row with HF's full forward.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ferry.attention.backend import ForwardContext
from ferry.attention.kv_cache import allocate_kv_caches, kv_cache_bytes_per_block
from ferry.attention.torch_ref import TorchReferenceBackend
from ferry.config import CacheConfig, ModelConfig
from ferry.layers.rotary import inverse_frequencies, rope_parameters
from ferry.loader.loader import load_model
from tiny_models import VOCAB_SIZE, chunked_schedule, flat_batch, make_tiny_model, shuffled_block_tables

transformers = pytest.importorskip("transformers")

PROMPT_LENS = [5, 23, 37]
TOTAL_LENS = [9, 27, 41]  # each prompt followed by four decoded tokens
ATOL = 1e-4
BENCHMARKS = Path(__file__).parents[1] / "benchmarks"

# case id -> make_tiny_model arguments; tied: qwen2, qwen3; untied: llama, llama3_scaled, mistral
CASES = {
    "llama": dict(arch="llama"),
    "llama3_scaled": dict(arch="llama3_scaled"),
    "qwen2": dict(arch="qwen2"),
    "qwen3": dict(arch="qwen3"),
    "mistral": dict(arch="mistral"),
    "qwen3_untied_sharded": dict(arch="qwen3", tie=False, max_shard_size="100KB"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case id -> (checkpoint path, HF logits (total_len, vocab) per sequence, the sequences)."""
    g = torch.Generator().manual_seed(1)
    sequences = [torch.randint(3, VOCAB_SIZE, (n,), generator=g) for n in TOTAL_LENS]
    built = {}
    for case, kwargs in CASES.items():
        path = make_tiny_model(path=tmp_path_factory.mktemp(case), **kwargs)
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            hf_logits = [hf(s[None]).logits[0].float() for s in sequences]
        built[case] = (path, hf_logits, sequences)
    return built


def run_ferry(model, model_config, sequences, steps, block_size, kv_cache_dtype="auto"):
    """Run `steps` of (request, num_computed, num_new); return each request's logits rows in order."""
    tables, num_blocks = shuffled_block_tables([len(s) for s in sequences], block_size)
    cache_config = CacheConfig(block_size=block_size, kv_cache_dtype=kv_cache_dtype)
    kv_caches = allocate_kv_caches(model_config, cache_config, num_blocks, "cpu")
    logits = [[] for _ in sequences]
    for step in steps:
        positions, metadata = flat_batch([(c, n) for _, c, n in step], [tables[i] for i, _, _ in step], block_size)
        input_ids = torch.cat([sequences[i][c : c + n] for i, c, n in step])
        ctx = ForwardContext(attn_metadata=metadata, kv_caches=kv_caches, backend=TorchReferenceBackend())
        with torch.inference_mode():
            hidden = model(input_ids, positions, ctx)
            rows = model.compute_logits(hidden)
        assert hidden.shape == (len(input_ids), model_config.hf_config["hidden_size"])
        assert rows.dtype == torch.float32
        for (i, _, n), part in zip(step, rows.split([n for _, _, n in step])):
            logits[i].append(part)
    return [torch.cat(rows) for rows in logits]


def prefill_steps():
    return [[(i, 0, n) for i, n in enumerate(TOTAL_LENS)]]


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("schedule", ["prefill", "chunked"])
@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(checkpoints, case, schedule, block_size):
    path, hf_logits, sequences = checkpoints[case]
    model_config = ModelConfig.from_pretrained(path, dtype="float32")
    model = load_model(model_config, "cpu")
    steps = prefill_steps() if schedule == "prefill" else chunked_schedule(PROMPT_LENS, TOTAL_LENS, chunk=7)
    ferry_logits = run_ferry(model, model_config, sequences, steps, block_size)
    for ours, theirs in zip(ferry_logits, hf_logits):
        assert ours.shape == theirs.shape
        assert (ours - theirs).abs().max().item() <= ATOL


def test_llama3_scaling_changes_the_logits(checkpoints):
    """Guard for the test above: the scaled-RoPE case must really depend on the scaling."""
    path, hf_logits, sequences = checkpoints["llama3_scaled"]
    model_config = ModelConfig.from_pretrained(path, dtype="float32")
    plain_rope = {"rope_type": "default", "rope_theta": 10000.0}
    unscaled = dataclasses.replace(model_config, hf_config={**model_config.hf_config, "rope_parameters": plain_rope})
    ferry_logits = run_ferry(load_model(unscaled, "cpu"), unscaled, sequences, prefill_steps(), 16)
    assert (ferry_logits[2] - hf_logits[2]).abs().max().item() > 1e-2


def test_bfloat16_is_close_to_float32(checkpoints):
    path, hf_logits, sequences = checkpoints["qwen3"]
    model_config = ModelConfig.from_pretrained(path, dtype="bfloat16")
    model = load_model(model_config, "cpu")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    ferry_logits = run_ferry(model, model_config, sequences, prefill_steps(), 16)
    for ours, theirs in zip(ferry_logits, hf_logits):
        assert (ours - theirs).abs().max().item() < 0.05 * theirs.abs().max().item()


# --- rope parameters in the spelling of real checkpoints --------------------------------------


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-0.6b"])
def test_rope_frequencies_match_transformers_for_real_configs(name):
    """The benchmark configs use the older `rope_theta` + `rope_scaling` spelling."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    folder = BENCHMARKS / name
    hf_dict = json.loads((folder / "config.json").read_text())
    head_dim = hf_dict.get("head_dim") or hf_dict["hidden_size"] // hf_dict["num_attention_heads"]
    ours = inverse_frequencies(head_dim, rope_parameters(hf_dict))
    theirs = LlamaRotaryEmbedding(transformers.AutoConfig.from_pretrained(folder)).inv_freq
    torch.testing.assert_close(ours, theirs, atol=0, rtol=0)


# --- loader -------------------------------------------------------------------------------------


def test_tied_checkpoint_may_carry_lm_head(tmp_path):
    path = make_tiny_model("qwen2", tmp_path)
    tensors = load_file(path / "model.safetensors")
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = torch.zeros_like(tensors["model.embed_tokens.weight"])
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    model = load_model(ModelConfig.from_pretrained(path), "cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(model.lm_head.weight, tensors["model.embed_tokens.weight"])


def test_missing_tensor_is_named(tmp_path):
    path = make_tiny_model("llama", tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(ModelConfig.from_pretrained(path), "cpu")


def test_unexpected_tensor_is_named(tmp_path):
    path = make_tiny_model("llama", tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"does not use: model\.layers\.0\.self_attn\.q_norm\.weight"):
        load_model(ModelConfig.from_pretrained(path), "cpu")


def test_missing_shard_is_named(tmp_path):
    path = make_tiny_model("llama", tmp_path, max_shard_size="100KB")
    shards = sorted(path.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[1].unlink()
    with pytest.raises(FileNotFoundError, match=shards[1].name):
        load_model(ModelConfig.from_pretrained(path), "cpu")


def test_missing_checkpoint_is_explained(tmp_path):
    path = make_tiny_model("llama", tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors or model.safetensors.index.json"):
        load_model(ModelConfig.from_pretrained(path), "cpu")


def test_unknown_architecture_lists_supported(tmp_path):
    config = ModelConfig.from_pretrained(make_tiny_model("llama", tmp_path))
    config = dataclasses.replace(config, hf_config={**config.hf_config, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_model(config, "cpu")


def test_a_window_ferry_does_not_implement_is_refused_where_it_binds(tmp_path):
    """Qwen2's windows (per layer, past max_window_layers) are not built; Mistral's are (one window
    for every layer: test_sliding_window.py)."""
    config = ModelConfig.from_pretrained(make_tiny_model("qwen2", tmp_path))
    windowed = dataclasses.replace(config, hf_config={**config.hf_config, "sliding_window": 64,
                                                      "use_sliding_window": True})
    assert windowed.sliding_window is None  # not applied, so refused:
    with pytest.raises(ValueError, match="sliding-window"):
        load_model(windowed, "cpu")
    load_model(dataclasses.replace(windowed, max_model_len=64), "cpu")  # the window never binds
    mistral = ModelConfig.from_pretrained(make_tiny_model("mistral", tmp_path / "mistral"))
    mistral = dataclasses.replace(mistral, hf_config={**mistral.hf_config, "sliding_window": 64})
    assert mistral.sliding_window == 64
    load_model(mistral, "cpu")


def test_dummy_weights_need_no_checkpoint_and_are_reproducible(tmp_path):
    path = make_tiny_model("qwen3", tmp_path)
    for file in path.glob("*.safetensors"):
        file.unlink()
    config = ModelConfig.from_pretrained(path, load_format="dummy")
    first, second = load_model(config, "cpu"), load_model(config, "cpu")
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values()):
        assert torch.equal(a, b), name
    assert torch.equal(first.model.layers[0].self_attn.q_norm.weight, torch.ones(32))
    assert first.model.layers[0].self_attn.qkv_proj.weight.std().item() == pytest.approx(0.02, rel=0.1)
    logits = run_ferry(first, config, [torch.arange(3, 20)], [[(0, 0, 17)]], 16)[0]
    assert torch.isfinite(logits).all()


def test_kv_cache_helpers(tmp_path):
    config = ModelConfig.from_pretrained(make_tiny_model("qwen3", tmp_path), dtype="bfloat16")
    for cache_config, dtype in ((CacheConfig(block_size=16), torch.bfloat16),
                                (CacheConfig(block_size=16, kv_cache_dtype="fp8"), torch.float8_e4m3fn)):
        caches = allocate_kv_caches(config, cache_config, num_blocks=5, device="cpu")
        assert len(caches) == 2
        assert caches[0].shape == (2, 5, 16, 2, 32) and caches[0].dtype == dtype
        assert kv_cache_bytes_per_block(config, cache_config) == sum(c[:, 0].numel() * c.element_size() for c in caches)
