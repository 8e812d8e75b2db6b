"""Gemma 2 against Hugging Face transformers on a tiny random checkpoint: local layers with a window
shorter than the prompts beside global ones, soft-capped attention scores and logits, Gemma's
norms and scaled embeddings. Greedy tokens and logprobs through the engine with chunked prefill,
preemption and prefix caching; and the soft cap in every attention backend."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported (test_cuda_graph.py)

from ferry import LLM  # noqa: E402
from tiny_models import (  # noqa: E402
    ENGINE_SETUPS, BOS_TOKEN_ID, EOS_TOKEN_ID, VOCAB_SIZE, assert_engine_equals, hf_greedy, randomize_weights, shared_prefix_prompts,
)

transformers = pytest.importorskip("transformers")

WINDOW = 10
MAX_TOKENS = 10


def tiny_config(arch: str):
    common = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID, pad_token_id=0, sliding_window=WINDOW, query_pre_attn_scalar=24,
    )
    if arch == "gemma2":
        return transformers.Gemma2Config(**common, attn_logit_softcapping=3.0, final_logit_softcapping=5.0,
                                         architectures=["Gemma2ForCausalLM"])
    # Gemma 3: no soft caps; a global layer amid local ones, each kind with its own RoPE (the global
    # one scaled).
    return transformers.Gemma3TextConfig(
        **common, layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        architectures=["Gemma3ForCausalLM"])


def make_tiny_gemma(arch: str, path, seed: int = 0):
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(arch), attn_implementation="eager")
    randomize_weights(model, seed)
    with torch.no_grad():  # Gemma's norms scale by 1 + weight: weights around 0, not 1
        for name, p in model.named_parameters():
            if "norm" in name:
                p.sub_(1.0)
    model.save_pretrained(path)
    transformers.GenerationConfig(bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID).save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def checkpoint(request, tmp_path_factory):
    return make_tiny_gemma(request.param, tmp_path_factory.mktemp(request.param))


def prompts() -> list[list[int]]:
    return shared_prefix_prompts(part=8, extra=([5, 6, 7],))


@pytest.fixture(scope="module")
def reference(checkpoint):
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    expected = hf_greedy(model, prompts(), MAX_TOKENS)
    return expected


@pytest.mark.parametrize("setup", list(ENGINE_SETUPS))
def test_greedy_tokens_and_logprobs_equal_transformers(checkpoint, reference, setup):
    """Two rounds of the same prompts: the second finds their prefixes cached."""
    assert_engine_equals(checkpoint, prompts(), reference, MAX_TOKENS, preempts=setup == "preemption",
                         **ENGINE_SETUPS[setup])


def test_local_and_global_layers(checkpoint):
    llm = LLM(model=checkpoint, dtype="float32", num_kv_blocks=64)
    model = llm.engine.executor.model
    attn = [layer.self_attn.attn for layer in model.model.layers]
    assert {a.scale for a in attn} == {24**-0.5}
    if checkpoint.name.startswith("gemma2"):
        assert [a.sliding_window for a in attn] == [WINDOW, None, WINDOW, None]
        assert {a.softcap for a in attn} == {3.0} and model.final_softcap == 5.0
        assert model.model.local_rotary_emb is None
    else:
        assert [a.sliding_window for a in attn] == [WINDOW, WINDOW, None, WINDOW]
        assert {a.softcap for a in attn} == {None} and model.final_softcap is None
        assert model.model.local_rotary_emb is not None
    # The global layers need every key: no block is given back as the window slides.
    assert llm.engine.scheduler.kv_cache.sliding_window is None


@pytest.mark.parametrize("window", [None, 33])
@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_soft_capped_attention_in_every_backend(kind, window):
    """Triton's kernels (under the interpreter on a CPU) and sdpa against the reference, whose soft
    cap is checked by hand: scores large enough (q scaled by 3) that the cap binds."""
    pytest.importorskip("triton")
    import test_triton_kernels  # noqa: F401  (patches the interpreter's gaps once a session)
    from test_triton_kernels import MIXED_STEP, Step
    from test_sliding_window_kernels import DECODE

    from ferry.attention.sdpa_backend import SdpaAttentionBackend
    from ferry.attention.torch_ref import TorchReferenceBackend, softcapped_attention
    from ferry.attention.triton_backend import TritonAttentionBackend

    step = Step(DECODE if kind == "decode" else MIXED_STEP, 2, 16, 64, torch.float32, q_scale=3.0)

    def run(backend, softcap):
        cache = step.kv_cache.clone()
        return backend.forward(step.q, step.k, step.v, cache, step.metadata, step.scale, None, window, softcap)

    expected = run(TorchReferenceBackend(), 0.5)
    assert not torch.allclose(expected, run(TorchReferenceBackend(), None), atol=1e-3)  # the cap binds
    for backend in (TritonAttentionBackend(), SdpaAttentionBackend()):
        torch.testing.assert_close(run(backend, 0.5), expected, atol=1e-4, rtol=1e-4)
    # The reference's soft cap by hand, one query over three keys.
    q, k, v = torch.randn(1, 2, 4), torch.randn(3, 1, 4), torch.randn(3, 1, 4)
    scores = torch.tanh(torch.einsum("qhd,khd->hqk", q, k.expand(3, 2, 4)) * 0.5 / 2.0) * 2.0
    by_hand = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.expand(3, 2, 4))
    torch.testing.assert_close(softcapped_attention(q, k, v, None, 0.5, 2.0), by_hand)


def test_the_roofline_counts_gemmas_parameters(checkpoint):
    from ferry.bench.roofline import ModelCost
    from ferry.config import ModelConfig

    cost = ModelCost.from_model_config(ModelConfig.from_pretrained(checkpoint))
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    assert cost.num_params == sum(p.numel() for p in model.parameters())  # four norms a layer (and q/k norms)


def test_the_roofline_counts_the_local_layers_window(checkpoint):
    """Half the layers (Gemma 2) or three in four (Gemma 3) read only the window's keys."""
    from ferry.bench.roofline import ModelCost
    from ferry.config import ModelConfig

    config = ModelConfig.from_pretrained(checkpoint)
    cost = ModelCost.from_model_config(config)
    local = sum(w is not None for w in config.layer_windows)
    assert (cost.sliding_window, cost.windowed_layers) == (WINDOW, local) and local in (2, 3)
    assert config.sliding_window is None  # not every layer: no block is given back
    per_layer = 4 * cost.num_heads * cost.head_dim
    for query_len, seq_len in [(1, 5), (1, 40), (30, 30), (7, 19)]:
        full = sum(p + 1 for p in range(seq_len - query_len, seq_len))
        windowed = sum(min(p + 1, WINDOW) for p in range(seq_len - query_len, seq_len))
        assert cost.attention_flops(query_len, seq_len) == per_layer * (local * windowed + (4 - local) * full)
        cached = seq_len - query_len
        read = query_len + (local * min(cached, WINDOW - 1) + (4 - local) * cached) / 4
        assert cost.kv_read_tokens(query_len, seq_len) == pytest.approx(read)


@pytest.mark.parametrize("key,value", [("sliding_window", 0), ("sliding_window", -4), ("sliding_window", "x"),
                                       ("attn_logit_softcapping", 0), ("final_logit_softcapping", -1.0),
                                       ("final_logit_softcapping", float("nan")), ("query_pre_attn_scalar", 0)])
def test_a_window_or_cap_that_cannot_be_is_a_clear_error(checkpoint, tmp_path, key, value):
    """(Rather than NaN scores, or every key masked, at the first request.)"""
    import json
    import shutil

    from ferry.config import ModelConfig

    bad = tmp_path / "bad"
    shutil.copytree(checkpoint, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(ValueError, match=f"config.json: {key} must be a positive"):
        ModelConfig.from_pretrained(bad).layer_windows  # (a window is checked where it applies)
