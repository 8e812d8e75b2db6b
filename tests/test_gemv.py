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
# Ragged K (a last tile partly masked), output columns not a multiple of BLOCK_N, 1 to 4 rows, 3
# rows padded to a block of 4, and K spanning several tiles.
@pytest.mark.parametrize("rows,n,k,bias", [(1, 48, 200, False), (3, 100, 64, True), (4, 64, 1024, False),
                                           (2, 37, 2500, True)])
def test_gemv_matches_linear(rows, n, k, bias, config, dtype):
    weight, b = _layer(n, k, bias, dtype)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(gemv.gemv(x, weight, b, config).float(), torch.nn.functional.linear(x, weight, b).float(),
                               atol=tol, rtol=tol)


def test_gemv_reads_strided_rows():
    """x may be a view whose rows are further apart than K (a slice of a wider activation)."""
    weight, _ = _layer(40, 96, False, DTYPES[-1])
    wide = torch.randn(3, 160, device=DEVICE).to(DTYPES[-1])
    x = wide[:, :96]
    tol = TOLERANCE[DTYPES[-1]]
    torch.testing.assert_close(gemv.gemv(x, weight, None, gemv.CANDIDATES[0]).float(),
                               torch.nn.functional.linear(x, weight).float(), atol=tol, rtol=tol)


def test_linear_uses_each_configuration_for_its_rows_only(monkeypatch):
    layer = Linear(64, 48, bias=True).to(DEVICE, DTYPES[-1])
    calls = []
    real = gemv.gemv
    monkeypatch.setattr(gemv, "gemv", lambda *a: calls.append((a[0].shape[0], a[3])) or real(*a))
    one, few = gemv.CANDIDATES[0], gemv.CANDIDATES[1]
    layer.gemv_one_row, layer.gemv_few_rows = one, few
    tol = TOLERANCE[DTYPES[-1]]
    for rows in (1, 2, gemv.MAX_ROWS, gemv.MAX_ROWS + 1):
        x = torch.randn(rows, 64, device=DEVICE).to(DTYPES[-1])
        torch.testing.assert_close(layer(x).float(), torch.nn.functional.linear(x, layer.weight, layer.bias).float(),
                                   atol=tol, rtol=tol)
    assert calls == [(1, one), (2, few), (gemv.MAX_ROWS, few)]
    calls.clear()
    layer.gemv_few_rows = None  # cuBLAS for a few rows, the GEMV still for one
    layer(torch.randn(2, 64, device=DEVICE).to(DTYPES[-1]))
    layer(torch.randn(1, 64, device=DEVICE).to(DTYPES[-1]))
    assert calls == [(1, one)]


def _timings(rows, cublas, candidates):
    times = {(rows, None): cublas}
    for config, t in zip(gemv.CANDIDATES, candidates):
        times[rows, config] = t
    return times


def test_choice_needs_a_clear_win_over_cublas():
    a, b, c, *rest = gemv.CANDIDATES
    inf = float("inf")
    others = (inf,) * len(rest)
    assert gemv.choose(_timings(1, 10, (9.5, 5, 6, *others)), 1) == b
    assert gemv.choose(_timings(4, 10, (9.5, 9.2, 9.8, *others)), 4) is None  # under 10%: noise
    assert gemv.choose(_timings(1, 10, (inf, inf, inf, *others)), 1) is None  # none ran


def test_float32_layers_keep_cublas():
    weight = torch.zeros(8, 8)  # no timing happens: the dtype decides
    assert gemv.tune(weight, None) == (None, None)


def test_tuning_leaves_cpu_models_alone():
    model = torch.nn.Sequential(Linear(8, 8), Linear(8, 4))
    tune_small_batch(model)
    assert all(layer.gemv_one_row is None and layer.gemv_few_rows is None for layer in model)


@pytest.mark.skipif(DEVICE != "cuda", reason="tuning times kernels on a GPU")
def test_tuning_chooses_per_shape_and_keeps_results():
    model = torch.nn.Sequential(Linear(2048, 1024, bias=False), Linear(1024, 4096, bias=False),
                                Linear(2048, 1024, bias=False)).to(DEVICE, torch.bfloat16)
    times = gemv.measure(model[0].weight, None)
    assert all(0 < times[rows, None] < 1e-3 for rows in (1, gemv.MAX_ROWS))  # cuBLAS, timed
    assert any(times[1, c] < float("inf") for c in gemv.CANDIDATES)  # the candidates run and agree
    tune_small_batch(model)
    assert model[0].gemv_one_row == model[2].gemv_one_row  # one decision per shape
    assert model[0].gemv_few_rows == model[2].gemv_few_rows
    x = torch.randn(1, 2048, device=DEVICE, dtype=torch.bfloat16)
    torch.testing.assert_close(model[0](x).float(), torch.nn.functional.linear(x, model[0].weight).float(),
                               atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,k", [(1, 200), (3, 1024), (4, 700)])
def test_gemv_applies_silu_and_mul_to_its_input(rows, k, dtype):
    """down_proj(silu(gate) * up) in one kernel equals the activation then the product, with the
    activation rounded to the dtype as the separate kernel rounds it."""
    weight, b = _layer(40, k, True, dtype)
    gate_up = torch.randn(rows, 2 * k, generator=torch.Generator().manual_seed(2)).to(dtype).to(DEVICE)
    gate, up = gate_up.float().chunk(2, dim=-1)
    act = (torch.nn.functional.silu(gate).to(dtype).float() * up).to(dtype)
    tol = TOLERANCE[dtype]
    for config in gemv.CANDIDATES[:2]:
        torch.testing.assert_close(gemv.gemv(gate_up, weight, b, config, silu_mul=True).float(),
                                   torch.nn.functional.linear(act, weight, b).float(), atol=tol, rtol=tol)


def test_linear_fuses_the_activation_only_where_the_gemv_runs(monkeypatch):
    layer = Linear(64, 48, bias=False).to(DEVICE, DTYPES[-1])
    acts = []

    def act(gate_up):
        acts.append(gate_up.shape[0])
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    layer.gemv_one_row = gemv.CANDIDATES[0]
    tol = TOLERANCE[DTYPES[-1]]
    for rows in (1, 2):
        gate_up = torch.randn(rows, 128, device=DEVICE).to(DTYPES[-1])
        torch.testing.assert_close(layer.forward_silu_and_mul(gate_up, act).float(),
                                   layer(act(gate_up)).float(), atol=tol, rtol=tol)
    assert acts == [1, 2, 2]  # the reference's calls, and the two-row batch's own: one row fused
