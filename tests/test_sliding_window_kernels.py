"""Sliding-window attention: the Triton kernels and the sdpa backend against the torch reference,
whose window mask is checked by hand first.

A query at position p sees keys p - W + 1 .. p (transformers' Mistral). Without a GPU the Triton
kernels run under the interpreter (tests/test_triton_kernels.py says how).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import test_triton_kernels  # noqa: E402,F401  (patches the interpreter's gaps once a session)
from test_triton_kernels import MIXED_STEP, Step  # noqa: E402

from ferry.attention.kernels.decode_attention import DecodeConfig, decode_attention  # noqa: E402
from ferry.attention.kernels.prefill_attention import PrefillConfig, prefill_attention  # noqa: E402
from ferry.attention.kernels.store_kv import store_kv  # noqa: E402
from ferry.attention.sdpa_backend import SdpaAttentionBackend  # noqa: E402
from ferry.attention.torch_ref import TorchReferenceBackend, visible_mask  # noqa: E402
from ferry.attention.triton_backend import TritonAttentionBackend  # noqa: E402

# Decode rows whose contexts sit below, at and above the windows (and across several splits).
DECODE = [(0, 1), (6, 1), (7, 1), (40, 1), (150, 1)]


def test_the_reference_window_mask():
    # 3 queries, the last 3 of 6 keys, window 2: query at 3 sees 2, 3; at 4 sees 3, 4; at 5 sees 4, 5.
    assert visible_mask(3, 6, 2, "cpu").int().tolist() == [[0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1]]
    assert visible_mask(1, 6, 2, "cpu").int().tolist() == [[0, 0, 0, 0, 1, 1]]
    assert visible_mask(1, 6, 6, "cpu") is None and visible_mask(1, 6, None, "cpu") is None  # nothing cut
    assert visible_mask(2, 3, None, "cpu").int().tolist() == [[1, 1, 0], [1, 1, 1]]


def run(step: Step, backend, window):
    cache = step.kv_cache.clone()
    return backend.forward(step.q, step.k, step.v, cache, step.metadata, step.scale, None, window), cache


@pytest.mark.parametrize("window", [1, 7, 33, 100])
@pytest.mark.parametrize("chunks", [DECODE, MIXED_STEP], ids=["decode", "mixed"])
def test_backends_match_the_reference_with_a_window(chunks, window):
    step = Step(chunks, 2, 16, 64, torch.float32, q_scale=3.0)
    expected, expected_cache = run(step, TorchReferenceBackend(), window)
    unwindowed, _ = run(step, TorchReferenceBackend(), None)
    assert not torch.allclose(expected, unwindowed)  # the window cuts something here
    for backend in (TritonAttentionBackend(), SdpaAttentionBackend()):
        out, cache = run(step, backend, window)
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
        assert torch.equal(cache, expected_cache)


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_windowed_decode_across_splits(num_splits):
    """Splits cut the window's keys, not the context's: a 150-token context under an 33-key window
    and 8 splits leaves most splits empty, and the merge must skip the same ones."""
    step = Step(DECODE, 4, 16, 64, torch.float32, q_scale=3.0)
    expected, _ = run(step, TorchReferenceBackend(), 33)
    store_kv(step.k, step.v, step.kv_cache, step.metadata.slot_mapping)
    m = step.metadata
    out = torch.full_like(step.q, float("nan"))
    decode_attention(step.q, step.kv_cache, m.block_tables, m.seq_lens, step.scale, out, num_splits,
                     DecodeConfig(block_n=16), sliding_window=33)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("window", [5, 20, 64])
def test_windowed_prefill_small_tiles(window):
    """Query tiles of 8 tokens (block_m 16, group 2) over key tiles of 16: later rows of a tile see
    nothing of its first key tiles, which must not turn their softmax into NaN."""
    step = Step(MIXED_STEP, 2, 16, 64, torch.float32, q_scale=3.0)
    expected, _ = run(step, TorchReferenceBackend(), window)
    store_kv(step.k, step.v, step.kv_cache, step.metadata.slot_mapping)
    m = step.metadata
    out = torch.zeros_like(step.q)
    prefill_attention(step.q, step.kv_cache, m.block_tables, m.query_start_loc, m.seq_lens,
                      m.query_start_loc_cpu[-1], step.scale, out, PrefillConfig(block_m=16, block_n=16),
                      sliding_window=window)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_a_windowed_verify_step_runs_the_varlen_kernel():
    """Several tokens a request under a window (a speculative verify) go to the varlen kernel, which
    masks each token's own window."""
    step = Step([(n - 1, 3) for n in (4, 40, 90)], 2, 16, 64, torch.float32, q_scale=3.0)
    expected, _ = run(step, TorchReferenceBackend(), 17)
    out, _ = run(step, TritonAttentionBackend(), 17)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
