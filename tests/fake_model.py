"""A fake model that exercises the real model runner, KV paging included, without any math.

Its "KV cache" stores token ids. Each forward writes the step's token ids at their slots, then reads
every request's whole context back through the block table and predicts the next token as a hash of
that context. If a block table, a slot mapping or a preemption ever mixed up KV blocks, the
predicted tokens would differ from `expected_next_token` of the true token sequence.
"""

from __future__ import annotations

import hashlib

import torch

from ferry.attention.backend import ForwardContext
from ferry.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from ferry.engine.engine import LLMEngine
from ferry.executor.model_runner import ModelRunner
from ferry.sample import Sampler

VOCAB = 97


def expected_next_token(context: list[int]) -> int:
    digest = hashlib.blake2b(repr(context).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % VOCAB


class FakeModel(torch.nn.Module):
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        md = ctx.attn_metadata
        cache = ctx.kv_caches[0][0].view(-1)  # (num_blocks * block_size,) token ids as floats
        cache[md.slot_mapping] = input_ids.to(cache.dtype)
        block_size = ctx.kv_caches[0].shape[2]
        hidden = torch.zeros(input_ids.shape[0], VOCAB)
        for i in range(md.num_reqs):
            seq_len = md.seq_lens_cpu[i]
            pos = torch.arange(seq_len)
            slots = md.block_tables[i, pos // block_size].long() * block_size + pos % block_size
            context = cache[slots].long().tolist()
            first_row, end_row = md.query_start_loc_cpu[i], md.query_start_loc_cpu[i + 1]
            # Every query row predicts from the context up to its own position (causal), as a
            # step that verifies proposed tokens needs.
            for row in range(first_row, end_row):
                hidden[row, expected_next_token(context[:seq_len - (end_row - row) + 1])] = 1.0
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden * 1e4  # sampling at any temperature picks the predicted token


def fake_engine_config(
    num_kv_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 32,
    max_model_len: int = 256,
    eos_token_ids: tuple[int, ...] = (),
    enable_prefix_caching: bool = True,
    async_scheduling: bool = False,
    decode_reserve: float = SchedulerConfig.decode_reserve,
) -> EngineConfig:
    model = ModelConfig(
        path=None, hf_config={"vocab_size": VOCAB, "architectures": ["Fake"]}, dtype="float32",
        max_model_len=max_model_len, eos_token_ids=eos_token_ids,
    )
    return EngineConfig(
        model=model,
        cache=CacheConfig(block_size=block_size, num_kv_blocks=num_kv_blocks, enable_prefix_caching=enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, decode_reserve),
        async_scheduling=async_scheduling,
    )


def fake_engine(proposer=None, **kwargs) -> LLMEngine:
    config = fake_engine_config(**kwargs)
    kv_caches = [torch.full((2, config.cache.num_kv_blocks, config.cache.block_size, 1, 1), -1.0)]
    runner = ModelRunner(config, FakeModel(), kv_caches, backend=None, sampler=Sampler(seed=0), proposer=proposer)
    return LLMEngine(config, runner, tokenizer=None)


def reference_tokens(prompt: list[int], max_tokens: int, eos: tuple[int, ...] = ()) -> list[int]:
    out: list[int] = []
    context = list(prompt)
    while len(out) < max_tokens:
        token = expected_next_token(context)
        out.append(token)
        context.append(token)
        if token in eos:
            break
    return out
