"""Tiny random-weight Hugging Face checkpoints, and flat paged batches to run them on.

`make_tiny_model(arch, path)` saves a transformers model small enough to run on a CPU in
milliseconds, with every weight random (biases and norm scales too, so a tensor loaded into the
wrong place changes the output). `flat_batch` lays out one step of several requests the way the
model runner does: tokens concatenated, KV slots taken from each request's block table.
`hf_greedy` and `assert_engine_equals` compare the engine with transformers on such a checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ferry.attention.backend import AttentionMetadata

ARCHS = ("llama", "llama3_scaled", "qwen2", "qwen2_yarn", "qwen3", "mistral")
VOCAB_SIZE = 320
BOS_TOKEN_ID, EOS_TOKEN_ID = 1, 2

# Shared shape: GQA with 4 query heads; each arch varies one thing the others don't.
_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=BOS_TOKEN_ID,
    eos_token_id=EOS_TOKEN_ID,
)

# Llama 3.1 scaling with a tiny "original context" of 64 tokens: with head_dim 16, seven of the
# eight frequencies have wavelengths over 64 / high_freq_factor = 16 tokens and are scaled or
# blended, which changes the angles of every position past 0.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}


def tiny_hf_config(arch: str, tie: bool | None = None):
    """The transformers config of a tiny `arch`; `tie` overrides the arch's default tying."""
    import transformers

    if arch in ("llama", "llama3_scaled"):
        rope = LLAMA3_ROPE if arch == "llama3_scaled" else {"rope_type": "default", "rope_theta": 10000.0}
        config = transformers.LlamaConfig(**_COMMON, rope_parameters=rope, tie_word_embeddings=False)
    elif arch in ("qwen2", "qwen2_yarn"):
        # Qwen2 always has q/k/v biases; ratio 4 between query and kv heads. Qwen2.5's long-context
        # form: YaRN (its frequencies, and cos and sin scaled by 0.1 ln(4) + 1).
        rope = YARN_ROPE if arch == "qwen2_yarn" else {"rope_type": "default", "rope_theta": 10000.0}
        config = transformers.Qwen2Config(**{**_COMMON, "num_key_value_heads": 1}, rope_parameters=rope,
                                          tie_word_embeddings=True)
    elif arch == "qwen3":
        # head_dim 32 while hidden_size / num_heads is 16: q_proj widens, o_proj narrows back.
        config = transformers.Qwen3Config(**_COMMON, head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=True)
    elif arch == "mistral":
        config = transformers.MistralConfig(**{**_COMMON, "num_key_value_heads": 4}, sliding_window=None, tie_word_embeddings=False)
    else:
        raise ValueError(f"unknown tiny arch {arch!r}; choose from {ARCHS}")
    if tie is not None:
        config.tie_word_embeddings = tie
    return config


def make_tiny_model(
    arch: str, path: str | Path, tie: bool | None = None, max_shard_size: str | None = None, seed: int = 0
) -> Path:
    """Save a tiny random `arch` checkpoint (config, safetensors, generation_config) at `path`.

    max_shard_size (e.g. "100KB") splits the weights into shards with an index file.
    """
    import transformers

    path = Path(path)
    config = tiny_hf_config(arch, tie)
    model = transformers.AutoModelForCausalLM.from_config(config)
    randomize_weights(model, seed)
    model.save_pretrained(path, max_shard_size=max_shard_size or "50GB")
    transformers.GenerationConfig(bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID).save_pretrained(path)
    return path


@torch.no_grad()
def randomize_weights(model: torch.nn.Module, seed: int, std: float = 0.2) -> None:
    """Overwrite every parameter: norm scales near 1, the rest normal(0, std).

    std 0.2 (not HF's 0.02) makes attention scores of order one, so attention is far from uniform
    and a wrong mask, position or cache slot shows up clearly in the logits.
    """
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator)
        param.copy_(1.0 + 0.2 * noise if "norm" in name else std * noise)


def shuffled_block_tables(seq_lens: list[int], block_size: int, seed: int = 0) -> tuple[list[list[int]], int]:
    """Block tables for requests of these final lengths, drawn from a shuffled pool with a few
    spare blocks, so no request's blocks are contiguous or in order. Returns (tables, num_blocks)."""
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + 3
    pool = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, start = [], 0
    for n in needed:
        tables.append(pool[start : start + n])
        start += n
    return tables, num_blocks


def flat_batch(
    chunks: list[tuple[int, int]], block_tables: list[list[int]], block_size: int
) -> tuple[torch.Tensor, AttentionMetadata]:
    """positions and metadata for one step in which request i, with chunks[i] = (num_computed,
    num_new), brings tokens num_computed .. num_computed + num_new - 1 of its sequence."""
    positions = [p for computed, new in chunks for p in range(computed, computed + new)]
    owners = [i for i, (_, new) in enumerate(chunks) for _ in range(new)]
    slots = [block_tables[i][p // block_size] * block_size + p % block_size for i, p in zip(owners, positions)]
    query_start_loc = [0]
    for _, new in chunks:
        query_start_loc.append(query_start_loc[-1] + new)
    seq_lens = [computed + new for computed, new in chunks]
    width = max(len(t) for t in block_tables)
    tables = [t + [0] * (width - len(t)) for t in block_tables]
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        max_query_len=max(new for _, new in chunks),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )
    return torch.tensor(positions, dtype=torch.int64), metadata


def chunked_schedule(prompt_lens: list[int], total_lens: list[int], chunk: int) -> list[list[tuple[int, int, int]]]:
    """Steps of (request, num_computed, num_new): prompts in chunks of at most `chunk` tokens, then
    one token per step, all requests in every step until each reaches its total length. Requests
    in one step are at different stages, as in continuous batching."""
    computed = [0] * len(prompt_lens)
    steps = []
    while any(c < t for c, t in zip(computed, total_lens)):
        step = []
        for i, (c, p, t) in enumerate(zip(computed, prompt_lens, total_lens)):
            if c < t:
                new = min(chunk, p - c) if c < p else 1
                step.append((i, c, new))
                computed[i] += new
        steps.append(step)
    return steps


# ---- the engine against transformers ----


# Engine settings that force chunked prefill, preemption, and one-token blocks on the prompts of
# shared_prefix_prompts (up to 39 tokens a request with 10 out).
ENGINE_SETUPS = {
    "chunked_prefill": dict(block_size=4, max_num_batched_tokens=7),
    # About two requests' worth of KV slots for six: they must preempt each other to finish.
    "preemption": dict(block_size=4, num_kv_blocks=20, max_num_batched_tokens=64, decode_reserve=0),
    "one_token_blocks": dict(block_size=1),
}


def shared_prefix_prompts(seed: int = 0, tails=(3, 17, 9), alone: int = 29, part: int = 16, extra=()) -> list[list[int]]:
    """Prompts that share a 20-token prefix (the prefix cache serves it), one of `alone` tokens that
    shares nothing, the first `part` tokens of the prefix, and any `extra` prompts."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, VOCAB_SIZE, (20,), generator=g).tolist()
    shared = [prefix + torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for n in tails]
    return [*shared, torch.randint(3, VOCAB_SIZE, (alone,), generator=g).tolist(), prefix[:part], *extra]


def hf_greedy(model, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy tokens for each prompt, and each token's logprob."""
    expected = []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        tokens = out.sequences[0, len(prompt):].tolist()
        logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]
        expected.append((tokens, logprobs))
    return expected


def assert_engine_equals(path, prompts, expected, max_tokens: int, preempts: bool = False, **engine) -> None:
    """Greedy tokens equal to `expected` (hf_greedy's) and logprobs within 1e-4, through the engine
    with prefix caching, twice: the second round finds the prefixes cached. Every block is free after."""
    from ferry import LLM, SamplingParams

    llm = LLM(model=path, dtype="float32", enable_prefix_caching=True, **engine)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0)
    requests = [{"prompt_token_ids": p} for p in prompts]
    for _ in range(2):
        outputs = llm.generate(requests, params, use_tqdm=False)
        for out, (tokens, logprobs) in zip(outputs, expected):
            completion = out.outputs[0]
            assert completion.token_ids == tokens
            got = [completion.logprobs[i][t].logprob for i, t in enumerate(tokens)]
            assert got == pytest.approx(logprobs, abs=1e-4)
    assert sum(out.num_cached_tokens for out in outputs) > 0
    if preempts:
        assert llm.engine.scheduler.num_preemptions > 0
    pool = llm.engine.scheduler.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks

