"""The small-batch GEMV kernel (ferry/layers/gemv.py) against F.linear, and its use by `Linear`.

Without a GPU the kernel runs under Triton's interpreter in float32; on a GPU also in bfloat16, and
the startup tuning is checked to choose only configurations that compute the same result.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel is defined
pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    from triton_interpreter import patch_interpreter

    patch_interpreter()

from ferry.layers import gemv  # noqa: E402
from ferry.layers.linear import Linear, tune_small_batch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The kernel is for 16-bit weights (gemv.DTYPES); float32 checks its indexing exactly, in the interpreter.
DTYPES = [torch.bfloat16] + ([torch.float32] if DEVICE == "cpu" else [])
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _layer(n, k, bias, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE) if bias else None
    return weight, b


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", gemv.CANDIDATES, ids=str)
# The last: split 4 with three k-tiles a slice.
@pytest.mark.parametrize("rows,n,k,bias", [(1, 48, 200, False), (3, 100, 64, True), (4, 64, 300, False),
                                           (2, 40, 1100, True)])
def test_gemv_matches_linear(rows, n, k, bias, config, dtype):
    weight, b = _layer(n, k, bias, dtype)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(gemv.gemv(x, weight, b, config).float(), torch.nn.functional.linear(x, weight, b).float(),
                               atol=tol, rtol=tol)


def test_split_k_is_deterministic():
    """Partials summed, not added atomically (on a GPU, atomics would add in any order)."""
    weight, _ = _layer(64, 512, False, torch.bfloat16)
    x = torch.randn(2, 512, device=DEVICE).to(torch.bfloat16)
    config = gemv.GemvConfig(32, 128, 4)
    assert torch.equal(gemv.gemv(x, weight, None, config), gemv.gemv(x, weight, None, config))


def test_linear_uses_the_kernel_for_small_batches_only(monkeypatch):
    layer = Linear(64, 48, bias=True).to(DEVICE, DTYPES[-1])
    calls = []
    real = gemv.gemv
    monkeypatch.setattr(gemv, "gemv", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    layer.small_batch = gemv.GemvConfig(32, 128, 1)
    tol = TOLERANCE[DTYPES[-1]]
    for rows in (1, gemv.MAX_ROWS, gemv.MAX_ROWS + 1):
        x = torch.randn(rows, 64, device=DEVICE).to(DTYPES[-1])
        torch.testing.assert_close(layer(x).float(), torch.nn.functional.linear(x, layer.weight, layer.bias).float(),
                                   atol=tol, rtol=tol)
    assert calls == [1, gemv.MAX_ROWS]


def _timings(cublas, candidates_1, candidates_4):
    times = {(1, None): cublas[0], (gemv.MAX_ROWS, None): cublas[1]}
    for config, t1, t4 in zip(gemv.CANDIDATES, candidates_1, candidates_4):
        times[1, config], times[gemv.MAX_ROWS, config] = t1, t4
    return times


def test_choice_needs_a_clear_win_at_one_row_and_no_loss_at_four():
    a, b, c, d = gemv.CANDIDATES
    inf = float("inf")
    # b is fastest at one row but loses at four rows; c wins both; d failed to run.
    assert gemv.choose(_timings((10, 10), (9.5, 5, 6, inf), (9, 11, 9, inf))) == c
    assert gemv.choose(_timings((10, 10), (9.5, 9.2, 9.8, inf), (9, 9, 9, inf))) is None  # under 10%
    assert gemv.choose(_timings((10, 10), (8, 7, 9, inf), (10, 10, 10, inf))) == b  # ties at four rows
    assert gemv.choose(_timings((10, 10), (inf,) * 4, (inf,) * 4)) is None


def test_float32_layers_keep_cublas():
    weight = torch.zeros(8, 8)  # no timing happens: the dtype decides
    assert gemv.tune(weight, None) is None


def test_tuning_leaves_cpu_models_alone():
    model = torch.nn.Sequential(Linear(8, 8), Linear(8, 4))
    tune_small_batch(model)
    assert all(layer.small_batch is None for layer in model)


@pytest.mark.skipif(DEVICE != "cuda", reason="tuning times kernels on a GPU")
def test_tuning_chooses_per_shape_and_keeps_results():
    model = torch.nn.Sequential(Linear(2048, 1024, bias=False), Linear(1024, 4096, bias=False),
                                Linear(2048, 1024, bias=False)).to(DEVICE, torch.bfloat16)
    times = gemv.measure(model[0].weight, None)
    assert all(0 < times[rows, None] < 1e-3 for rows in (1, gemv.MAX_ROWS))  # cuBLAS, timed
    assert any(times[1, c] < float("inf") for c in gemv.CANDIDATES)  # the candidates run and agree
    tune_small_batch(model)
    assert model[0].small_batch == model[2].small_batch  # one decision per shape
    x = torch.randn(1, 2048, device=DEVICE, dtype=torch.bfloat16)
    torch.testing.assert_close(model[0](x).float(), torch.nn.functional.linear(x, model[0].weight).float(),
                               atol=2e-2, rtol=2e-2)
