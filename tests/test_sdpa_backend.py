"""The SDPA backend (the CPU's) against the torch reference: the same cache contents and the same
outputs, step by step, for prefill chunks, mixed steps, decode steps of one and of many requests
(the batched path), padding rows, FP8 and 16-bit caches."""

from __future__ import annotations

import pytest
import torch

from ferry.attention.sdpa_backend import SdpaAttentionBackend
from ferry.attention.selector import get_attention_backend
from ferry.attention.torch_ref import TorchReferenceBackend
from ferry.quantization.e4m3 import FP8
from tiny_models import chunked_schedule, flat_batch, shuffled_block_tables

NUM_HEADS, HEAD_DIM = 8, 16
PROMPT_LENS = [5, 23, 37, 1]
TOTAL_LENS = [9, 30, 41, 12]  # several decode steps of every request after its prompt
SCALE = HEAD_DIM**-0.5


def run_both(steps, block_size: int, num_kv_heads: int, cache_dtype=torch.float32, dtype=torch.float32,
             pad: int = 0, scales=None):
    """Each step through both backends, each with its own cache; every step's outputs and the final
    caches. `pad` rows of slot -1 (and garbage values) end each step, as a padded batch carries."""
    g = torch.Generator().manual_seed(0)
    seqs = [[torch.randn(n, heads, HEAD_DIM, generator=g).to(dtype) for heads in (NUM_HEADS, num_kv_heads, num_kv_heads)]
            for n in TOTAL_LENS]
    tables, num_blocks = shuffled_block_tables(TOTAL_LENS, block_size)
    caches = [torch.zeros(2, num_blocks, block_size, num_kv_heads, HEAD_DIM, dtype=cache_dtype) for _ in range(2)]
    scales = scales or (torch.full((num_kv_heads,), 0.5), torch.linspace(0.25, 2.0, num_kv_heads))
    sdpa, reference = SdpaAttentionBackend(), TorchReferenceBackend()
    outputs = []
    for step in steps:
        _, metadata = flat_batch([(c, n) for _, c, n in step], [tables[i] for i, _, _ in step], block_size)
        q, k, v = (torch.cat([seqs[i][j][c:c + n] for i, c, n in step]) for j in range(3))
        if pad:
            metadata.slot_mapping = torch.cat([metadata.slot_mapping, torch.full((pad,), -1)])
            q, k, v = (torch.cat([t, 100 * torch.ones(pad, *t.shape[1:], dtype=dtype)]) for t in (q, k, v))
        ours = sdpa.forward(q, k, v, caches[0], metadata, SCALE, scales)
        theirs = reference.forward(q, k, v, caches[1], metadata, SCALE, scales)
        outputs.append((ours, theirs))
    return outputs, caches


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("group", [1, 4])
def test_every_step_matches_the_reference(block_size, group):
    outputs, (ours, theirs) = run_both(chunked_schedule(PROMPT_LENS, TOTAL_LENS, chunk=7), block_size, NUM_HEADS // group)
    for mine, reference in outputs:
        torch.testing.assert_close(mine, reference, atol=1e-6, rtol=1e-5)
    assert torch.equal(ours, theirs)


def test_decode_steps_of_many_requests_attend_in_one_batch():
    """Prompts one step each, then steps where every request brings one token: the batched path,
    each request's keys past its own context masked."""
    steps = [[(i, 0, n) for i, n in enumerate(PROMPT_LENS)]]
    steps += [[(i, n + j, 1) for i, (n, total) in enumerate(zip(PROMPT_LENS, TOTAL_LENS)) if n + j < total]
              for j in range(max(t - p for p, t in zip(PROMPT_LENS, TOTAL_LENS)))]
    assert any(len(step) > 1 and all(new == 1 for _, _, new in step) for step in steps)
    outputs, (ours, theirs) = run_both(steps, 4, 2)
    for mine, reference in outputs:
        torch.testing.assert_close(mine, reference, atol=1e-6, rtol=1e-5)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("decode", [False, True])
def test_padding_rows_are_neither_stored_nor_attended(decode):
    steps = [[(i, 0, n) for i, n in enumerate(PROMPT_LENS)]]
    if decode:
        steps.append([(i, n, 1) for i, n in enumerate(PROMPT_LENS)])
    outputs, (ours, theirs) = run_both(steps, 4, 2, pad=2)
    for mine, reference in outputs:
        torch.testing.assert_close(mine[:-2], reference[:-2], atol=1e-6, rtol=1e-5)
        assert torch.count_nonzero(mine[-2:]) == 0
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("cache_dtype,dtype", [(FP8, torch.float32), (FP8, torch.bfloat16), (torch.bfloat16, torch.bfloat16)])
def test_fp8_and_16_bit_caches(cache_dtype, dtype):
    """FP8 K/V are scaled back in float32 whatever the query's dtype, as the reference reads them
    (scales that are not powers of two, so that rounding them to bf16 would show)."""
    scales = (torch.tensor([0.0137, 0.0291]), torch.tensor([0.0453, 0.0119]))
    outputs, (ours, theirs) = run_both(chunked_schedule(PROMPT_LENS, TOTAL_LENS, chunk=7), 4, 2, cache_dtype, dtype,
                                       scales=scales)
    for mine, reference in outputs:
        assert mine.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(mine, reference, atol=1e-6, rtol=1e-5)
        else:  # the same float32 arithmetic, rounded once to bf16 at the end: at most one bf16 step apart
            torch.testing.assert_close(mine.float(), reference.float(), atol=1e-2, rtol=2**-7)
            assert (mine == reference).float().mean() > 0.99
    assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))  # the same bytes stored


def test_it_is_the_cpu_default_and_the_reference_stays_selectable():
    assert isinstance(get_attention_backend("cpu"), SdpaAttentionBackend)
    assert isinstance(get_attention_backend("cpu", "torch"), TorchReferenceBackend)
