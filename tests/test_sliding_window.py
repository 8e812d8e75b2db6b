"""Mistral's sliding window against Hugging Face transformers on a tiny random checkpoint whose
window is shorter than the prompts: greedy tokens and logprobs through the engine with chunked
prefill, preemption and prefix caching; and the KV blocks a long generation holds."""

from __future__ import annotations

import math

import pytest
import torch

from ferry import LLM, SamplingParams
from ferry.config import ModelConfig
from tiny_models import (
    ENGINE_SETUPS, BOS_TOKEN_ID, EOS_TOKEN_ID, VOCAB_SIZE, assert_engine_equals, hf_greedy, randomize_weights, shared_prefix_prompts,
)

transformers = pytest.importorskip("transformers")

WINDOW = 12
MAX_TOKENS = 10


def make_windowed_mistral(path, window: int = WINDOW, seed: int = 0):
    config = transformers.MistralConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID, sliding_window=window, tie_word_embeddings=False, architectures=["MistralForCausalLM"],
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    randomize_weights(model, seed)
    model.save_pretrained(path)
    transformers.GenerationConfig(bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_windowed_mistral(tmp_path_factory.mktemp("mistral_window"))


def prompts() -> list[list[int]]:
    """Prompts longer and shorter than the window; three share a 20-token prefix (the prefix cache
    serves it), one is a block-aligned part of it."""
    return shared_prefix_prompts(part=8, extra=([5, 6, 7],))


@pytest.fixture(scope="module")
def reference(checkpoint):
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    expected = hf_greedy(model, prompts(), MAX_TOKENS)
    # The window changes transformers' own tokens here (else this would test nothing about it).
    unwindowed = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32,
                                                                   sliding_window=None).eval()
    with torch.no_grad():
        full = [unwindowed.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
                [0, len(p):].tolist() for p in prompts()]
    assert full != [tokens for tokens, _ in expected]
    return expected


def test_the_window_reaches_the_layers(checkpoint):
    config = ModelConfig.from_pretrained(checkpoint)
    assert config.sliding_window == WINDOW
    llm = LLM(model=checkpoint, dtype="float32", num_kv_blocks=64)
    layers = llm.engine.executor.model.model.layers
    assert {layer.self_attn.attn.sliding_window for layer in layers} == {WINDOW}
    assert llm.engine.scheduler.kv_cache.sliding_window == WINDOW
    # A window at least max_model_len cuts nothing: none is applied.
    assert ModelConfig.from_pretrained(checkpoint, max_model_len=WINDOW).sliding_window is None


@pytest.mark.parametrize("setup", list(ENGINE_SETUPS))
def test_greedy_tokens_and_logprobs_equal_transformers(checkpoint, reference, setup):
    """Two rounds of the same prompts: the second finds their prefixes cached."""
    assert_engine_equals(checkpoint, prompts(), reference, MAX_TOKENS, preempts=setup == "preemption",
                         **ENGINE_SETUPS[setup])


@pytest.mark.parametrize("block_size", [4, 5])
def test_a_long_generation_holds_the_window_not_its_context(checkpoint, block_size):
    """Ten times the window generated: once its prompt is computed (its step writes every prompt
    token's K/V, so it holds the prompt's blocks) the request holds at most window / block_size + 2
    blocks at every step (the window's, and a partial one at each end), while its table grows with
    the context."""
    llm = LLM(model=checkpoint, dtype="float32", block_size=block_size, num_kv_blocks=64, enable_prefix_caching=True)
    engine = llm.engine
    kv = engine.scheduler.kv_cache
    prompt = prompts()[3]  # 29 tokens
    engine.add_request("long", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=10 * WINDOW, ignore_eos=True))
    engine.step()  # the prompt
    assert len(kv.held_block_ids("long")) == math.ceil((len(prompt) + 1) / block_size)
    most, steps = 0, 1
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        held = kv.held_block_ids("long")
        most = max(most, len(held))
        assert len(held) <= WINDOW / block_size + 2
        assert kv.pool.num_free_blocks == kv.pool.num_blocks - len(held)
        if engine.has_unfinished_requests():  # (and the table spans the context)
            assert len(kv.block_ids("long")) * block_size >= len(prompt) + steps - 1
    assert steps == 10 * WINDOW
    assert most >= WINDOW // block_size  # it did hold its window
    assert kv.pool.num_free_blocks == kv.pool.num_blocks


def test_a_draft_model_with_a_windowed_target_is_a_clear_error(checkpoint):
    with pytest.raises(ValueError, match="draft model with a sliding-window target"):
        LLM(model=checkpoint, num_kv_blocks=64, speculative_config={"model": str(checkpoint), "num_speculative_tokens": 2})


def test_the_roofline_counts_only_the_window(checkpoint):
    """Attention's (query, key) pairs and the KV a step moves, against a count by hand."""
    from ferry.bench.roofline import ModelCost

    cost = ModelCost.from_model_config(ModelConfig.from_pretrained(checkpoint))
    assert cost.sliding_window == WINDOW
    per_pair = 4 * cost.num_layers * cost.num_heads * cost.head_dim
    for query_len, seq_len in [(1, 5), (1, 40), (30, 30), (7, 19), (3, 12)]:
        pairs = sum(min(p + 1, WINDOW) for p in range(seq_len - query_len, seq_len))
        assert cost.attention_flops(query_len, seq_len) == per_pair * pairs
        seen = len({k for p in range(seq_len - query_len, seq_len) for k in range(max(0, p - WINDOW + 1), p + 1)})
        assert cost.kv_read_tokens(query_len, seq_len) == seen
    # A decode step at context 1,000 reads the window, not the context.
    step = cost.step_cost([(1, 1000)], 1)
    assert step.bytes - cost.step_cost([(1, 1)], 1).bytes == cost.kv_bytes_per_token * (WINDOW - 1)
