"""DeepSeek-V2 (multi-head latent attention and shared experts, ferry/models/deepseek_v2.py) against
Hugging Face transformers on tiny random checkpoints: greedy tokens and logprobs through the engine
with chunked prefill, preemption and prefix caching; the latent cache's shape; YaRN's frequencies."""

from __future__ import annotations

import logging
from types import SimpleNamespace
import math
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton kernels' test runs them on CPU tensors

from ferry.config import EngineConfig  # noqa: E402
from tiny_models import (  # noqa: E402
    BOS_TOKEN_ID, EOS_TOKEN_ID, VOCAB_SIZE, assert_engine_equals, hf_greedy, randomize_weights, shared_prefix_prompts,
)

transformers = pytest.importorskip("transformers")

MAX_TOKENS = 10
YARN = {"type": "yarn", "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1}
# V2-Lite's form (q_proj, greedy routing, one dense layer first), and V2's (a low-rank query,
# experts routed within the best groups, scaled), each with YaRN. (transformers ignores
# moe_layer_freq, which DeepSeek's own code honours: every published checkpoint has 1.)
CASES = {
    "v2_lite": dict(q_lora_rank=None, topk_method="greedy", n_group=1, topk_group=1, num_hidden_layers=3,
                    first_k_dense_replace=1, moe_layer_freq=1, routed_scaling_factor=1.0),
    "v2": dict(q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2, num_hidden_layers=3,
               first_k_dense_replace=0, moe_layer_freq=1, routed_scaling_factor=2.5),
}


def tiny_config(case: str):
    return transformers.DeepseekV2Config(
        vocab_size=VOCAB_SIZE, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=96,
        moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2, kv_lora_rank=32,
        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24, max_position_embeddings=512, rms_norm_eps=1e-6,
        rope_scaling=YARN, norm_topk_prob=False, bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID,
        architectures=["DeepseekV2ForCausalLM"], tie_word_embeddings=False, **CASES[case])


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(request.param))
    randomize_weights(model, seed=0)
    model.save_pretrained(path)
    transformers.GenerationConfig(bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reference(checkpoint):
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32,
                                                              experts_implementation="eager").eval()
    return checkpoint, hf_greedy(model, shared_prefix_prompts(0, tails=(3, 17, 9, 1)), MAX_TOKENS)


ENGINE_SETUPS = {
    "chunked_prefill": dict(block_size=4, max_num_batched_tokens=7),
    "preemption": dict(block_size=16, num_kv_blocks=math.ceil(80 / 16), max_num_batched_tokens=64, decode_reserve=0),
}


@pytest.mark.parametrize("setup", list(ENGINE_SETUPS))
def test_greedy_tokens_and_logprobs_equal_transformers(reference, setup):
    path, expected = reference
    assert_engine_equals(path, shared_prefix_prompts(0, tails=(3, 17, 9, 1)), expected, MAX_TOKENS,
                         preempts=setup == "preemption", **ENGINE_SETUPS[setup])


def test_the_cache_holds_one_latent_a_token(checkpoint):
    """One KV head of kv_lora_rank + qk_rope_head_dim, stored once: the V half is the K half."""
    from ferry import LLM, SamplingParams
    from ferry.attention.kv_cache import kv_cache_bytes_per_block

    config = EngineConfig.create(checkpoint, dtype="float32", block_size=4)
    assert (config.model.num_kv_heads, config.model.head_dim) == (1, 32 + 16)
    assert kv_cache_bytes_per_block(config.model, config.cache) == 3 * 4 * 48 * 4
    assert config.model.moe is not None and config.model.moe.shared_expert_intermediate_size == 2 * 32
    llm = LLM(model=checkpoint, dtype="float32", block_size=4, num_kv_blocks=16)
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9]}], SamplingParams(max_tokens=3), use_tqdm=False)
    cache = llm.engine.executor.kv_caches[0]
    assert cache.shape == (2, 16, 4, 1, 48) and cache.stride(0) == 0 and cache.untyped_storage().nbytes() == 16 * 4 * 48 * 4
    assert cache[0].abs().sum() > 0  # written


def test_yarn_frequencies_and_attention_factor_are_transformers():
    from ferry.layers.rotary import inverse_frequencies, rope_parameters, yarn_attention_factor
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for mscale_all_dim in (0.707, 0.0):
        hf = tiny_config("v2_lite")
        hf.rope_parameters = {**hf.rope_parameters, "mscale_all_dim": mscale_all_dim}
        expected, factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
        params = rope_parameters(hf.to_dict())
        assert torch.allclose(inverse_frequencies(16, params), expected, rtol=1e-6)
        assert yarn_attention_factor(params) == pytest.approx(factor)


def test_a_latent_wider_than_triton_tiles_gets_sdpa_on_cuda():
    from ferry.attention.selector import default_backend_name

    assert default_backend_name(torch.device("cuda"), 576) == "sdpa"
    assert default_backend_name(torch.device("cpu"), 128) == "sdpa"


def test_triton_kernels_run_the_latent_heads_under_the_interpreter():
    """Four query heads over one KV head of the latent's width (48 in the tiny models), whose values
    are its keys, stored once (the V half a stride-0 view of the K half), through Triton's store,
    decode and varlen kernels against the reference over a cache of two equal halves."""
    pytest.importorskip("triton")
    import test_triton_kernels  # noqa: F401  (patches the interpreter's gaps once a session)
    from test_triton_kernels import MIXED_STEP

    from ferry.attention.torch_ref import TorchReferenceBackend
    from ferry.attention.triton_backend import TritonAttentionBackend
    from tiny_models import flat_batch, shuffled_block_tables

    g = torch.Generator().manual_seed(0)
    for chunks in ([(7, 1), (30, 1), (2, 1)], MIXED_STEP):
        tables, num_blocks = shuffled_block_tables([c + n for c, n in chunks], 4)
        _, md = flat_batch(chunks, tables, 4)
        n = md.query_start_loc_cpu[-1]
        q, latent = torch.randn(n, 4, 48, generator=g), torch.randn(n, 1, 48, generator=g)
        latent_half = torch.randn(1, num_blocks, 4, 1, 48, generator=g)
        expected = TorchReferenceBackend().forward(q, latent, latent, latent_half.repeat(2, 1, 1, 1, 1), md, 0.3)
        cache = latent_half.clone()
        got = TritonAttentionBackend().forward(q, latent, latent, cache.expand(2, -1, -1, -1, -1), md, 0.3)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        assert not torch.equal(cache, latent_half)  # the step's latents were stored, through the K half


def test_param_count_matches_transformers(checkpoint):
    from ferry.bench.roofline import ModelCost

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    cost = ModelCost.from_model_config(EngineConfig.create(checkpoint, dtype="float32").model)
    assert cost.num_params == sum(p.numel() for p in model.parameters())
    assert cost.kv_bytes_per_token == 3 * (32 + 16) * 4  # the latent, 3 layers, float32


def test_deepseek_v2_lite_shape_by_hand():
    """The shipped config against DeepSeek's model card (15.7B parameters, 2.4B activated): 15.71B,
    and 2.45B active without the embedding's lookup (2.66B with it)."""
    from ferry.bench.roofline import ModelCost

    path = Path(__file__).parents[1] / "benchmarks" / "deepseek-v2-lite"
    if not path.exists():
        pytest.skip("no benchmarks/deepseek-v2-lite")
    cost = ModelCost.from_model_config(EngineConfig.create(path, load_format="dummy", dtype="bfloat16").model)
    assert cost.num_params / 1e9 == pytest.approx(15.7, abs=0.05)
    assert (cost.active_params - 102400 * 2048) / 1e9 == pytest.approx(2.4, abs=0.1)
    assert cost.kv_bytes_per_token == 27 * 576 * 2  # 31 KB, where MHA's keys and values would take 276 KB


def test_graphs_give_way_to_eager_steps_where_the_backend_cannot_be_captured(checkpoint, caplog):
    """On CUDA a latent this wide gets sdpa, whose steps read host values: no graph is captured for
    it (a warning says so), where capturing would fail or, for prefill, replay a stale plan."""


    from ferry.attention.sdpa_backend import SdpaAttentionBackend
    from ferry.executor.model_runner import _decode_graphs, _prefill_graphs

    config = EngineConfig.create(checkpoint, dtype="float32", enforce_eager=False, max_prefill_graph_tokens=64)
    on_cuda = [SimpleNamespace(device=torch.device("cuda"), shape=(2, 8, 4, 1, 48))]
    ferry_logger = logging.getLogger("ferry")  # (it keeps its records from the root's handlers)
    ferry_logger.addHandler(caplog.handler)
    try:
        assert _decode_graphs(config, None, on_cuda, SdpaAttentionBackend(), (1,)) is None
        assert _prefill_graphs(config, None, on_cuda, SdpaAttentionBackend()) is None
    finally:
        ferry_logger.removeHandler(caplog.handler)
    assert "decode steps run eagerly" in caplog.text and "max_prefill_graph_tokens is ignored" in caplog.text


def test_what_is_not_supported_is_named(tmp_path):
    import json

    from ferry.loader.loader import load_model

    for change, message in (({"attention_bias": True}, "attention_bias"), ({"topk_method": "noaux_tc"}, "noaux_tc"),
                            ({"scoring_func": "sigmoid"}, "scoring_func")):
        config = {**tiny_config("v2_lite").to_dict(), **change}
        (tmp_path / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=message):
            load_model(EngineConfig.create(tmp_path, dtype="float32", load_format="dummy").model, "cpu")


def test_router_renormalizes_or_scales_as_deepseek_does():
    from ferry.models.deepseek_v2 import DeepseekRouter

    def router(norm: bool, k: int):
        hf = {**tiny_config("v2").to_dict(), "norm_topk_prob": norm, "num_experts_per_tok": k}
        config = SimpleNamespace(moe=SimpleNamespace(num_experts=8, num_experts_per_tok=k, norm_topk_prob=norm),
                                 hf_config=hf)
        r = DeepseekRouter(64, config)
        torch.nn.init.normal_(r.weight, generator=torch.Generator().manual_seed(0))
        return r

    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    weights, _ = router(True, 2)(x)
    assert torch.allclose(weights.sum(-1), torch.ones(5))  # renormalized, not scaled by 2.5
    plain = router(False, 2)
    scaled, ids = plain(x)
    probs = torch.softmax(x @ plain.weight.T, dim=-1)
    assert torch.allclose(scaled, 2.5 * probs.gather(1, ids))  # routed_scaling_factor, no renormalizing
    one, _ = router(True, 1)(x)  # one expert: scaled, never renormalized to 1
    assert not torch.allclose(one, torch.ones_like(one))


def test_yarn_defaults_as_transformers():
    from ferry.layers.rotary import rope_parameters

    hf = {"max_position_embeddings": 4096, "rope_scaling": {"type": "yarn", "factor": None}, "rope_theta": 1e4,
          "original_max_position_embeddings": 1024}
    params = rope_parameters(hf)
    assert params["factor"] == 4.0 and params["original_max_position_embeddings"] == 1024
    del hf["original_max_position_embeddings"]
    hf["rope_scaling"] = {"type": "yarn", "factor": 2.0}
    assert rope_parameters(hf)["original_max_position_embeddings"] == 4096


def test_prefill_tiles_hold_a_tokens_query_heads():
    from ferry.attention.kernels.prefill_attention import default_config

    assert default_config(128, 16).block_m == 64 and default_config(128, 128).block_m == 128
