"""Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE) against Hugging Face transformers on tiny
random checkpoints: greedy tokens and logprobs through the engine with chunked prefill, preemption
and prefix caching; each expert block bit for bit in bfloat16 (routing, rounding and the order of
the sums); the stacking of per-expert checkpoint tensors; and the roofline's parameter counts."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ferry import LLM, SamplingParams
from ferry.bench.roofline import ModelCost
from ferry.config import ModelConfig
from ferry.layers.moe import FusedMoE, torch_experts
from ferry.loader.loader import load_model
from ferry.models.registry import get_model_class
from tiny_models import (
    BOS_TOKEN_ID, EOS_TOKEN_ID, VOCAB_SIZE, assert_engine_equals, hf_greedy, randomize_weights, shared_prefix_prompts,
)

transformers = pytest.importorskip("transformers")

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
MAX_TOKENS = 10

_COMMON = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID,
)
# Each case varies what the others don't: Mixtral's names and float32 weights; Qwen2-MoE's shared
# expert, a dense layer (mlp_only_layers) and tied embeddings; Qwen3-MoE with and without the
# renormalized top k, and sparse layers every decoder_sparse_step.
CASES = ("mixtral", "qwen2_moe", "qwen3_moe", "qwen3_moe_unnormed")


def tiny_moe_config(case: str):
    if case == "mixtral":
        return transformers.MixtralConfig(
            **_COMMON, architectures=["MixtralForCausalLM"], num_hidden_layers=2, intermediate_size=96,
            num_local_experts=8, num_experts_per_tok=2, sliding_window=None, tie_word_embeddings=False)
    if case == "qwen2_moe":
        return transformers.Qwen2MoeConfig(
            **_COMMON, architectures=["Qwen2MoeForCausalLM"], num_hidden_layers=4, intermediate_size=128,
            moe_intermediate_size=48, shared_expert_intermediate_size=80, num_experts=8, num_experts_per_tok=2,
            mlp_only_layers=[2], norm_topk_prob=False, tie_word_embeddings=True)
    normed = case == "qwen3_moe"
    return transformers.Qwen3MoeConfig(
        **_COMMON, architectures=["Qwen3MoeForCausalLM"], num_hidden_layers=2 if normed else 4, head_dim=32,
        intermediate_size=128, moe_intermediate_size=48, num_experts=4 if normed else 6, num_experts_per_tok=2,
        norm_topk_prob=normed, decoder_sparse_step=1 if normed else 2, tie_word_embeddings=False)


def make_tiny_moe_model(case: str, path: Path, seed: int = 0) -> Path:
    model = transformers.AutoModelForCausalLM.from_config(tiny_moe_config(case))
    randomize_weights(model, seed)
    model.save_pretrained(path)
    transformers.GenerationConfig(bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID).save_pretrained(path)
    return path


def hf_model(path: Path, dtype: torch.dtype):
    """transformers' model as each architecture defines it: its experts' loop (`eager`), not a
    grouped matmul that rounds differently."""
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, experts_implementation="eager").eval()


@pytest.fixture(scope="module", params=CASES)
def checkpoint(request, tmp_path_factory):
    return request.param, make_tiny_moe_model(request.param, tmp_path_factory.mktemp(request.param))


# ---- the engine against transformers ----


def prompts_for(seed: int) -> list[list[int]]:
    return shared_prefix_prompts(seed, tails=(3, 17, 9, 1))


@pytest.fixture(scope="module")
def reference(checkpoint):
    """HF's greedy tokens and logprobs for the prompts."""
    _, path = checkpoint
    return path, hf_greedy(hf_model(path, torch.float32), prompts_for(0), MAX_TOKENS)


ENGINE_SETUPS = {
    "chunked_prefill": dict(block_size=4, max_num_batched_tokens=7),
    # About two requests' worth of KV slots for six: they must preempt each other to finish.
    "preemption": dict(block_size=16, num_kv_blocks=math.ceil(80 / 16), max_num_batched_tokens=64, decode_reserve=0),
    "one_token_blocks": dict(block_size=1),
}


@pytest.mark.parametrize("setup", list(ENGINE_SETUPS))
def test_greedy_tokens_and_logprobs_equal_transformers(reference, setup):
    """Two rounds of the same prompts: the second finds their prefixes cached."""
    path, expected = reference
    assert_engine_equals(path, prompts_for(0), expected, MAX_TOKENS, preempts=setup == "preemption",
                         **ENGINE_SETUPS[setup])


# ---- each expert block, bit for bit ----


SPARSE_LAYERS = {"mixtral": (0, 1), "qwen2_moe": (0, 1, 3), "qwen3_moe": (0, 1), "qwen3_moe_unnormed": (1, 3)}


def test_sparse_layers_are_transformers(checkpoint):
    """mlp_only_layers and decoder_sparse_step pick the same layers as in transformers."""
    case, path = checkpoint
    hf = hf_model(path, torch.float32)
    sparse = tuple(i for i, layer in enumerate(hf.model.layers) if type(layer.mlp).__name__.endswith("SparseMoeBlock"))
    assert ModelConfig.from_pretrained(path).moe.sparse_layers == sparse == SPARSE_LAYERS[case]


def test_expert_blocks_equal_transformers_bit_for_bit_in_bfloat16(checkpoint):
    """The same router probabilities, top k, renormalization, weights' rounding (Mixtral's float32,
    Qwen's bfloat16) and order of the sums give the same bits."""
    case, path = checkpoint
    hf = hf_model(path, torch.bfloat16)
    ours = load_model(ModelConfig.from_pretrained(path, dtype="bfloat16"), "cpu")
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for layer in ModelConfig.from_pretrained(path).moe.sparse_layers:
        with torch.no_grad():
            theirs = hf.model.layers[layer].mlp(x[None])[0]
            assert torch.equal(ours.model.layers[layer].mlp(x), theirs), layer


def test_reference_experts_follow_the_kernel_contract():
    """out[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = ids[t, j], token by token."""
    g = torch.Generator().manual_seed(2)
    tokens, hidden, inter, experts, k = 9, 16, 8, 5, 2
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g)
    w2 = torch.randn(experts, hidden, inter, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g)
    expected = torch.zeros(tokens, hidden)
    for t in range(tokens):
        for j in range(k):
            gate, up = (w13[ids[t, j]] @ x[t]).split(inter)
            expected[t] += weights[t, j] * (w2[ids[t, j]] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(torch_experts(x, w13, w2, weights, ids), expected)


def test_cpu_never_imports_the_fused_kernel():
    code = ("import sys, torch; from ferry.config import MoeConfig; from ferry.layers.moe import FusedMoE; "
            "moe = FusedMoE(8, MoeConfig(4, 2, 16, None, True, (0,)), ('gate_proj', 'up_proj', 'down_proj')); "
            "moe(torch.randn(3, 8), torch.rand(3, 2), torch.tensor([[0, 1], [2, 3], [1, 0]])); "
            "print('ferry.kernels.fused_moe' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---- loading the experts ----


def test_per_expert_tensors_fill_the_stacked_weights(tmp_path):
    """Mixtral's w1 (gate) and w3 (up) become each expert's rows of w13, in that order; w2 its down."""
    path = make_tiny_moe_model("mixtral", tmp_path)
    tensors = load_file(path / "model.safetensors")
    experts = load_model(ModelConfig.from_pretrained(path), "cpu").model.layers[1].mlp.experts
    assert isinstance(experts, FusedMoE) and experts.w13.shape == (8, 2 * 96, 64) and experts.w2.shape == (8, 64, 96)
    for e in range(8):
        name = f"model.layers.1.block_sparse_moe.experts.{e}"
        assert torch.equal(experts.w13[e], torch.cat([tensors[f"{name}.w1.weight"], tensors[f"{name}.w3.weight"]]))
        assert torch.equal(experts.w2[e], tensors[f"{name}.w2.weight"])


def test_missing_expert_tensor_is_named(tmp_path):
    path = make_tiny_moe_model("qwen2_moe", tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.3.mlp.experts.5.up_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.3\.mlp\.experts\.5\.up_proj\.weight"):
        load_model(ModelConfig.from_pretrained(path), "cpu")


@pytest.mark.parametrize("case", CASES)
def test_dummy_weights_from_a_config_alone(case, tmp_path):
    tiny_moe_config(case).save_pretrained(tmp_path)
    config = ModelConfig.from_pretrained(tmp_path, load_format="dummy")
    experts = load_model(config, "cpu").model.layers[config.moe.sparse_layers[0]].mlp.experts
    assert experts.w13.std().item() == pytest.approx(0.02, rel=0.1)
    llm = LLM(model=tmp_path, load_format="dummy")
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_fp8_weights_are_refused(tmp_path):
    path = make_tiny_moe_model("qwen3_moe", tmp_path)
    with pytest.raises(ValueError, match="FP8 weights are not supported for mixtures of experts"):
        load_model(ModelConfig.from_pretrained(path, quantization="fp8"), "cpu")


def test_impossible_routing_is_refused(tmp_path):
    tiny_moe_config("mixtral").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": 9}))
    with pytest.raises(ValueError, match="num_experts_per_tok must be between 1 and the 8 experts"):
        ModelConfig.from_pretrained(tmp_path)


# ---- the roofline ----


def test_qwen3_30b_a3b_params_by_hand():
    h, q, kv, layers, vocab, head_dim = 2048, 32 * 128, 4 * 128, 48, 151936, 128
    experts, active, expert = 128, 8, 3 * 2048 * 768  # gate, up, down of 768 rows each
    attention = h * q + 2 * h * kv + q * h  # no biases
    norms = 2 * h + 2 * head_dim  # two RMSNorms, q_norm and k_norm
    router = experts * h
    embeddings = 2 * vocab * h  # untied
    total = layers * (attention + norms + router + experts * expert) + h + embeddings
    per_token = layers * (attention + norms + router + active * expert) + h + embeddings
    cost = ModelCost.from_model_config(ModelConfig.from_pretrained(BENCHMARKS / "qwen3-30b-a3b", "bfloat16"))
    assert cost.num_params == total == 30_532_122_624  # "30B"
    assert cost.active_params == per_token == 3_353_032_704  # "A3B"
    assert cost.active_linear_params == layers * (attention + router + active * expert)


def test_qwen3_30b_a3b_step_reads_the_experts_its_tokens_touch():
    """At T tokens a sparse layer reads at most min(E, k T) experts: 8 at one token, all 128 from 16."""
    cost = ModelCost.from_model_config(ModelConfig.from_pretrained(BENCHMARKS / "qwen3-30b-a3b", "bfloat16"))
    expert_bytes = 48 * 3 * 2048 * 768 * 2  # one expert in every layer, bf16
    decode = [cost.step_cost([(1, 100)] * batch, batch) for batch in (1, 2, 16, 64)]
    kv = [cost.kv_bytes_per_token * 100 * batch for batch in (1, 2, 16, 64)]
    weights = [c.bytes - k for c, k in zip(decode, kv)]
    embedding_rows = 2048 * 2
    assert weights[1] - weights[0] == 8 * expert_bytes + embedding_rows  # 8 more experts, one more row gathered
    assert weights[2] == cost.weight_bytes - (151936 - 16) * embedding_rows  # every expert read
    assert weights[3] - weights[2] == 48 * embedding_rows  # no more experts to read
    assert decode[0].flops == 2 * cost.active_linear_params + 2 * 151936 * 2048 + cost.attention_flops(1, 100)


@pytest.mark.parametrize("case", [*CASES, "qwen2_moe_no_qkv_bias", "qwen3-30b-a3b"])
def test_param_count_matches_the_model(case, tmp_path):
    if case == "qwen3-30b-a3b":
        path = BENCHMARKS / case
    elif case == "qwen2_moe_no_qkv_bias":
        path = tmp_path
        config = tiny_moe_config("qwen2_moe")
        config.qkv_bias = False
        config.save_pretrained(path)
    else:
        path = tmp_path
        tiny_moe_config(case).save_pretrained(path)
    config = ModelConfig.from_pretrained(path, "bfloat16", None, "dummy")
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config)
    assert ModelCost.from_model_config(config).num_params == sum(p.numel() for p in model.parameters())

