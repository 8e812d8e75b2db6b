"""The torch reference backend against plain dense causal attention, through a shuffled paged cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ferry.attention.torch_ref import TorchReferenceBackend
from tiny_models import chunked_schedule, flat_batch, shuffled_block_tables

NUM_HEADS, HEAD_DIM = 8, 16
PROMPT_LENS = [5, 23, 37]
TOTAL_LENS = [9, 26, 41]  # prompt plus a few decode tokens
SCALE = HEAD_DIM**-0.5


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q: (seq, heads, dim); k, v: (seq, kv_heads, dim) -> (seq, heads, dim), computed in float64."""
    group = q.shape[1] // k.shape[1]
    q, k, v = (t.double().transpose(0, 1) for t in (q, k, v))  # (heads, seq, dim)
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE).transpose(0, 1)


def random_sequences(num_kv_heads: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    make = lambda n, heads: torch.randn(n, heads, HEAD_DIM, generator=g)  # noqa: E731
    return [(make(n, NUM_HEADS), make(n, num_kv_heads), make(n, num_kv_heads)) for n in TOTAL_LENS]


def run_steps(seqs, steps, block_size, num_kv_heads):
    """Feed each step's slice of every sequence through the backend; return per-request outputs."""
    tables, num_blocks = shuffled_block_tables(TOTAL_LENS, block_size)
    kv_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, HEAD_DIM)
    outputs = [[] for _ in seqs]
    for step in steps:
        chunks = [(c, n) for _, c, n in step]
        _, metadata = flat_batch(chunks, [tables[i] for i, _, _ in step], block_size)
        q, k, v = (torch.cat([seqs[i][j][c : c + n] for i, c, n in step]) for j in range(3))
        out = TorchReferenceBackend().forward(q, k, v, kv_cache, metadata, SCALE)
        for (i, _, n), rows in zip(step, out.split([n for _, _, n in step])):
            outputs[i].append(rows)
    return [torch.cat(o) for o in outputs], kv_cache


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("schedule", ["prefill", "chunked"])
def test_matches_dense_causal_attention(schedule, group, block_size):
    num_kv_heads = NUM_HEADS // group
    seqs = random_sequences(num_kv_heads)
    if schedule == "prefill":
        steps = [[(i, 0, n) for i, n in enumerate(TOTAL_LENS)]]
    else:
        steps = chunked_schedule(PROMPT_LENS, TOTAL_LENS, chunk=7)
    outputs, _ = run_steps(seqs, steps, block_size, num_kv_heads)
    for (q, k, v), out in zip(seqs, outputs):
        torch.testing.assert_close(out.double(), dense_causal_attention(q, k, v), atol=1e-5, rtol=1e-5)


def test_padding_rows_are_neither_stored_nor_attended():
    block_size, num_kv_heads = 4, 2
    seqs = random_sequences(num_kv_heads)
    tables, num_blocks = shuffled_block_tables(TOTAL_LENS, block_size)
    _, metadata = flat_batch([(0, n) for n in TOTAL_LENS], tables, block_size)
    q, k, v = (torch.cat([s[j] for s in seqs]) for j in range(3))
    clean_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, HEAD_DIM)
    clean = TorchReferenceBackend().forward(q, k, v, clean_cache, metadata, SCALE)

    # Two padding rows at the end, as a fixed-size (graph-captured) batch would carry.
    pad = 2
    metadata.slot_mapping = torch.cat([metadata.slot_mapping, torch.full((pad,), -1)])
    q, k, v = (torch.cat([t, 100 * torch.ones(pad, *t.shape[1:])]) for t in (q, k, v))
    padded_cache = torch.zeros_like(clean_cache)
    padded = TorchReferenceBackend().forward(q, k, v, padded_cache, metadata, SCALE)

    torch.testing.assert_close(padded[:-pad], clean, atol=0, rtol=0)
    assert torch.equal(padded_cache, clean_cache)
    assert torch.count_nonzero(padded[-pad:]) == 0


def test_keeps_input_dtype_and_writes_cache_dtype():
    block_size, num_kv_heads = 16, 2
    seqs = random_sequences(num_kv_heads)
    tables, num_blocks = shuffled_block_tables(TOTAL_LENS, block_size)
    _, metadata = flat_batch([(0, n) for n in TOTAL_LENS], tables, block_size)
    q, k, v = (torch.cat([s[j] for s in seqs]).bfloat16() for j in range(3))
    kv_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, HEAD_DIM, dtype=torch.bfloat16)
    out = TorchReferenceBackend().forward(q, k, v, kv_cache, metadata, SCALE)
    assert out.dtype == torch.bfloat16
    expected = dense_causal_attention(seqs[2][0].bfloat16(), seqs[2][1].bfloat16(), seqs[2][2].bfloat16())
    start = metadata.query_start_loc_cpu[2]
    torch.testing.assert_close(out[start:].double(), expected, atol=2e-2, rtol=2e-2)
