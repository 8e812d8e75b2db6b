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
@pytest.mark.parametrize("config", gemv.CANDIDATES + gemv.FEW_ROW_CANDIDATES, ids=str)
# Ragged K (a last tile partly masked), output columns not a multiple of BLOCK_N, 1 to 8 rows, 3
# and 5 rows in blocks of 4 and 8 (the rest skipped), and K spanning several tiles.
@pytest.mark.parametrize("rows,n,k,bias", [(1, 48, 200, False), (3, 100, 64, True), (4, 64, 1024, False),
                                           (2, 37, 2500, True), (5, 40, 300, True), (8, 24, 512, False)])
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
    one, few, more = gemv.CANDIDATES[0], gemv.CANDIDATES[1], gemv.CANDIDATES[2]
    layer.gemv_buckets = ((1, one), (4, few), (8, more))
    tol = TOLERANCE[DTYPES[-1]]
    for rows in (1, 2, 4, 5, 8, 9):
        x = torch.randn(rows, 64, device=DEVICE).to(DTYPES[-1])
        torch.testing.assert_close(layer(x).float(), torch.nn.functional.linear(x, layer.weight, layer.bias).float(),
                                   atol=tol, rtol=tol)
    assert calls == [(1, one), (2, few), (4, few), (5, more), (8, more)]
    calls.clear()
    layer.gemv_buckets = ((1, one), (4, None), (8, more))  # cuBLAS for a few rows, the GEMV still for one
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
    assert gemv.choose(_timings(4, 10, (9.9, 9.75, 9.8, *others)), 4) is None  # under 3%: noise
    assert gemv.choose(_timings(4, 10, (9.9, 9.6, 9.8, *others)), 4) == b  # 4%: a win
    assert gemv.choose(_timings(1, 10, (inf, inf, inf, *others)), 1) is None  # none ran


def test_the_fastest_path_must_win_clearly():
    a, b, *_ = gemv.CANDIDATES
    # cuBLAS after the op's kernel takes 10; the GEMV after it 8.5, with the op inside 7.
    assert gemv.fastest_path({(None, False): 10, (a, False): 8.5, (a, True): 7, (b, False): 9.5}) == (a, True)
    assert gemv.fastest_path({(None, False): 10, (a, False): 8.5, (b, True): 9.5}) == (a, False)
    assert gemv.fastest_path({(None, False): 10, (a, False): 9.9, (a, True): 9.75}) == (None, False)  # noise
    assert gemv.fastest_path({(None, False): 10}) == (None, False)  # no candidate ran
    assert gemv.fastest_path({(a, True): 1}) == (None, False)  # nothing to compare with: keep cuBLAS


def test_float32_layers_keep_cublas():
    weight = torch.zeros(8, 8)  # no timing happens: the dtype decides
    assert gemv.tune(gemv.LayerWeights(weight)) == (tuple((rows, None) for rows in gemv.ROW_BUCKETS), False)


def test_tuning_leaves_cpu_models_alone():
    model = torch.nn.Sequential(Linear(8, 8), Linear(8, 4))
    tune_small_batch(model)
    assert all(layer.gemv_buckets == () for layer in model)


@pytest.mark.skipif(DEVICE != "cuda", reason="tuning times kernels on a GPU")
def test_tuning_chooses_per_shape_and_keeps_results():
    model = torch.nn.Sequential(Linear(2048, 1024, bias=False), Linear(1024, 4096, bias=False),
                                Linear(2048, 1024, bias=False)).to(DEVICE, torch.bfloat16)
    times = gemv.measure(model[0].weight, None)
    assert all(0 < times[rows, None] < 1e-3 for rows in gemv.ROW_BUCKETS)  # cuBLAS, timed
    assert any(times[1, c] < float("inf") for c in gemv.CANDIDATES)  # the candidates run and agree
    tune_small_batch(model)
    copies = gemv.cold_copies(model[0].weight)
    paths = gemv.path_times(gemv.LayerWeights(model[0].weight), "rms_norm", 1, copies)
    assert 0 < paths[None, False] < 1e-3  # the norm's kernel, then cuBLAS
    assert all((c, True) in paths and (c, False) in paths for c in gemv.CANDIDATES)  # inside, and after
    paths = gemv.path_times(gemv.LayerWeights(model[0].weight), "rms_norm", gemv.MAX_ROWS, copies)
    assert not any(inside for _, inside in paths)  # the norm goes inside at one row only
    x = torch.randn(1, 2048, device=DEVICE, dtype=torch.bfloat16)
    torch.testing.assert_close(model[0](x).float(), torch.nn.functional.linear(x, model[0].weight).float(),
                               atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,k", [(1, 200), (3, 1024), (4, 700), (5, 300)])
def test_gemv_applies_silu_and_mul_to_its_input(rows, k, dtype):
    """down_proj(silu(gate) * up) in one kernel equals the activation then the product, with the
    activation rounded to the dtype as the separate kernel rounds it."""
    weight, b = _layer(40, k, True, dtype)
    gate_up = torch.randn(rows, 2 * k, generator=torch.Generator().manual_seed(2)).to(dtype).to(DEVICE)
    gate, up = gate_up.float().chunk(2, dim=-1)
    act = (torch.nn.functional.silu(gate).to(dtype).float() * up).to(dtype)
    tol = TOLERANCE[dtype]
    for config in (*gemv.CANDIDATES[:2], *gemv.FEW_ROW_CANDIDATES[:2]):
        torch.testing.assert_close(gemv.gemv(gate_up, weight, b, config, silu_mul=True).float(),
                                   torch.nn.functional.linear(act, weight, b).float(), atol=tol, rtol=tol)


def test_linear_fuses_the_activation_only_where_the_gemv_runs(monkeypatch):
    layer = Linear(64, 48, bias=False).to(DEVICE, DTYPES[-1])
    acts = []

    def act(gate_up):
        acts.append(gate_up.shape[0])
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    layer.gemv_buckets = ((1, gemv.CANDIDATES[0]),)
    tol = TOLERANCE[DTYPES[-1]]
    for rows in (1, 2):
        gate_up = torch.randn(rows, 128, device=DEVICE).to(DTYPES[-1])
        torch.testing.assert_close(layer.forward_silu_and_mul(gate_up, act).float(),
                                   layer(act(gate_up)).float(), atol=tol, rtol=tol)
    assert acts == [1, 2, 2]  # the reference's calls, and the two-row batch's own: one row fused


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,k,with_residual", [(1, 200, True), (3, 1024, True), (2, 700, False), (4, 2500, True),
                                                   (6, 300, True)])
def test_gemv_applies_the_rms_norm_to_its_input(rows, k, with_residual, dtype):
    """linear(rms_norm(x + residual)) in one kernel equals RMSNorm (Hugging Face's rounding) then the
    product, and the new residual stream is x + residual rounded to the dtype (x without one)."""
    from ferry.layers.norm import RMSNorm

    weight, b = _layer(36, k, True, dtype)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(rows, k, generator=g).to(dtype).to(DEVICE)
    residual = torch.randn(rows, k, generator=g).to(dtype).to(DEVICE) if with_residual else None
    norm = RMSNorm(k, eps=1e-6)
    norm.weight.data = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype)
    norm = norm.to(DEVICE)
    expected_residual = (x.float() + residual.float()).to(dtype) if with_residual else x
    expected_h = norm._norm(expected_residual)
    tol = TOLERANCE[dtype]
    for config in gemv.CANDIDATES[:2]:
        kept = None if residual is None else residual.clone()
        y, new_residual = gemv.gemv_rms_norm(x, residual, norm.weight, norm.eps, weight, b, config)
        torch.testing.assert_close(y.float(), torch.nn.functional.linear(expected_h, weight, b).float(),
                                   atol=tol, rtol=tol)
        # (Triton's interpreter rounds float32 to bfloat16 its own way: one unit in the last place.)
        torch.testing.assert_close(new_residual.float(), expected_residual.float(), atol=0, rtol=tol / 2)
        if residual is not None:
            assert torch.equal(residual, kept)  # the old stream is left as it was


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_decode_through_the_gemv_matches_the_layers_without_it(arch, tmp_path, monkeypatch):
    """A one-token step of a whole model with every linear layer on the GEMV, the norms and the
    activation inside it, against the same model on its usual path (float32)."""
    from tiny_models import flat_batch, make_tiny_model

    from ferry.attention.backend import ForwardContext
    from ferry.attention.selector import get_attention_backend
    from ferry.config import ModelConfig
    from ferry.loader.loader import load_model

    make_tiny_model(arch, tmp_path)
    config = ModelConfig.from_pretrained(tmp_path, "float32", None, "auto")
    model = load_model(config, torch.device(DEVICE))
    block_size = 4
    kv = [torch.randn(2, 3, block_size, config.num_kv_heads, config.head_dim, device=DEVICE) * 0.3
          for _ in range(config.num_layers)]
    calls = []
    for name in ("gemv", "gemv_rms_norm"):
        real = getattr(gemv, name)
        monkeypatch.setattr(gemv, name, lambda *a, real=real, name=name, **kw: calls.append(name) or real(*a, **kw))
    logits = []
    for config_for_rows in (None, gemv.CANDIDATES[0]):
        for layer in model.modules():
            if isinstance(layer, Linear):
                layer.gemv_buckets, layer.gemv_fuses_norm = ((1, config_for_rows),), config_for_rows is not None
        positions, metadata = flat_batch([(6, 1)], [[0, 1]], block_size)  # the 7th token of a request
        for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
            setattr(metadata, name, getattr(metadata, name).to(DEVICE))
        ctx = ForwardContext(metadata, [c.clone() for c in kv], get_attention_backend(torch.device(DEVICE)))
        with torch.inference_mode():
            hidden = model(torch.tensor([17], device=DEVICE), positions.to(DEVICE), ctx)
            logits.append(model.compute_logits(hidden).cpu())
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)
    # Per layer: qkv and gate_up with their norms, o_proj plain, down_proj with the activation.
    assert calls.count("gemv_rms_norm") == 2 * config.num_layers
    assert calls.count("gemv") == 2 * config.num_layers


def test_the_norm_runs_inside_the_gemv_only_where_tuning_said_so(monkeypatch):
    from ferry.layers.norm import RMSNorm

    layer = Linear(64, 48, bias=False).to(DEVICE, DTYPES[-1])
    norm = RMSNorm(64, eps=1e-6).to(DEVICE, DTYPES[-1])
    calls = []
    real = gemv.gemv_rms_norm
    monkeypatch.setattr(gemv, "gemv_rms_norm", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    layer.gemv_buckets = ((1, gemv.CANDIDATES[0]), (4, gemv.CANDIDATES[0]))
    x = torch.randn(2, 64, device=DEVICE).to(DTYPES[-1])
    for fuses, rows in ((False, 1), (True, 2), (True, 1)):
        layer.gemv_fuses_norm = fuses
        y, residual = layer.forward_rms_norm(x[:rows], None, norm)
        tol = TOLERANCE[DTYPES[-1]]
        torch.testing.assert_close(y.float(), layer(norm(x[:rows])).float(), atol=tol, rtol=tol)
        assert torch.equal(residual, x[:rows])
    assert calls == [1]  # fused for one row, once tuning chose it
    residual = torch.randn(1, 64, device=DEVICE).to(DTYPES[-1])
    expected_h, expected_residual = norm(x[:1], residual.clone())
    y, new_residual = layer.forward_rms_norm(x[:1], residual, norm)
    torch.testing.assert_close(y.float(), layer(expected_h).float(), atol=tol, rtol=tol)
    torch.testing.assert_close(new_residual.float(), expected_residual.float(), atol=0, rtol=tol / 2)
    assert calls == [1, 1]


def test_tuning_checks_every_variant_it_will_run(monkeypatch):
    """A configuration whose GEMV (plain or with the activation's input) or norm fusion computes
    something else is refused before any step can use it."""
    weight, _ = _layer(24, 96, False, DTYPES[-1])
    layer = gemv.LayerWeights(weight)
    config = gemv.CANDIDATES[0]
    assert gemv._variants_agree(layer, config, (1, 2, 3))
    assert gemv._norm_fusion_agrees(layer, config)
    assert gemv._variants_agree(layer, None, (1,))  # no configuration: nothing to check
    real = gemv.gemv
    monkeypatch.setattr(gemv, "gemv", lambda x, *a, silu_mul=False, **kw: real(x, *a, silu_mul=silu_mul, **kw) * (1 + silu_mul))
    assert not gemv._variants_agree(layer, config, (1,))  # the activation's variant is off
    monkeypatch.setattr(gemv, "gemv", real)
    real_norm = gemv.gemv_rms_norm
    monkeypatch.setattr(gemv, "gemv_rms_norm", lambda *a: (real_norm(*a)[0] + 1, real_norm(*a)[1]))
    assert not gemv._norm_fusion_agrees(layer, config)


def test_empty_batches_take_the_usual_path():
    layer = Linear(64, 48, bias=False).to(DEVICE, DTYPES[-1])
    layer.gemv_buckets = ((1, gemv.CANDIDATES[0]), (4, gemv.CANDIDATES[0]))
    assert layer(torch.empty(0, 64, device=DEVICE, dtype=DTYPES[-1])).shape == (0, 48)


def test_a_path_that_fails_its_check_gives_way_to_the_next_fastest(monkeypatch):
    a, b, c, *_ = gemv.CANDIDATES
    layer = gemv.LayerWeights(_layer(24, 96, False, DTYPES[-1])[0])
    times = {(None, False): 10, (a, True): 5, (a, False): 8.5, (b, False): 6, (c, False): 9.8}
    monkeypatch.setattr(gemv, "_norm_fusion_agrees", lambda *args: False)  # a's norm inside is wrong
    monkeypatch.setattr(gemv, "_variants_agree", lambda layer, config, rows: config != b)  # b is wrong
    assert gemv._fastest_that_agrees(layer, times, (1,)) == (a, False)
    monkeypatch.setattr(gemv, "_variants_agree", lambda layer, config, rows: False)
    assert gemv._fastest_that_agrees(layer, times, (1,)) == (None, False)  # cuBLAS, after all


# ---- FP8 weights (a scale per row): the GEMV reads a byte a weight ----

ACT_DTYPE = DTYPES[-1]  # the activations stay 16-bit on a GPU (float32 in the interpreter)


def _fp8_layer(n, k, bias, seed=0):
    from ferry.quantization.fp8 import quantize_rows

    weight, b = _layer(n, k, bias, torch.float32, seed)
    q, scale = quantize_rows(weight * (1 + torch.arange(n, device=DEVICE)[:, None] % 7))  # rows of unequal scales
    return q, scale, None if b is None else b.to(ACT_DTYPE)


def _dequantized(q, scale):
    return q.float() * scale[:, None]


@pytest.mark.parametrize("config", gemv.CANDIDATES + gemv.FEW_ROW_CANDIDATES, ids=str)
@pytest.mark.parametrize("rows,n,k,bias", [(1, 48, 200, False), (3, 100, 64, True), (5, 40, 300, True),
                                           (8, 24, 512, False)])
def test_gemv_reads_fp8_weights_with_row_scales(rows, n, k, bias, config):
    """Against the dequantized weight times the 16-bit activations in float32 (weight-only FP8:
    the activations are not quantized), within the activations' dtype's tolerance."""
    q, scale, b = _fp8_layer(n, k, bias)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).to(ACT_DTYPE).to(DEVICE)
    expected = torch.nn.functional.linear(x.float(), _dequantized(q, scale), None if b is None else b.float())
    tol = TOLERANCE[ACT_DTYPE]
    torch.testing.assert_close(gemv.gemv(x, q, b, config, weight_scale=scale).float(), expected, atol=tol, rtol=tol)
    with pytest.raises(AssertionError, match="row scales"):
        gemv.gemv(x, q, b, config)  # an FP8 weight without its scales


def test_an_fp8_linear_runs_the_gemv_with_its_norm_and_activation_where_tuned():
    """Linear's three entry points with FP8 weights on the GEMV (plain, SiLU-and-mul, RMSNorm inside)
    against the FP8 layer's own product (quantization/fp8.py) on its dequantized reference path."""
    from ferry.layers.norm import RMSNorm
    from ferry.quantization.fp8 import Fp8Linear

    k, n = 96, 40
    q, scale, _ = _fp8_layer(n, k, False)
    layer = Linear(k, n, bias=False).to(DEVICE, ACT_DTYPE)
    layer.weight = torch.nn.Parameter(q, requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
    layer.fp8 = Fp8Linear(None, "none")  # 16-bit activations: the reference multiplies what the GEMV does
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, k, generator=g).to(ACT_DTYPE).to(DEVICE)
    gate_up = torch.randn(1, 2 * k, generator=g).to(ACT_DTYPE).to(DEVICE)
    norm = RMSNorm(k, eps=1e-6).to(DEVICE, ACT_DTYPE)
    act = lambda t: torch.nn.functional.silu(t[:, :k]) * t[:, k:]  # noqa: E731
    untuned = (layer(x), layer.forward_silu_and_mul(gate_up, act), layer.forward_rms_norm(x, None, norm)[0])
    layer.gemv_buckets, layer.gemv_fuses_norm = ((1, gemv.CANDIDATES[0]),), True
    tuned = (layer(x), layer.forward_silu_and_mul(gate_up, act), layer.forward_rms_norm(x, None, norm)[0])
    tol = TOLERANCE[ACT_DTYPE]
    for a, b in zip(tuned, untuned):
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


@pytest.mark.skipif(DEVICE != "cuda", reason="tuning times kernels on a GPU")
def test_fp8_tuning_races_the_gemv_against_the_fp8_gemm():
    from ferry.quantization.config import Fp8Spec
    from ferry.quantization.fp8 import quantize_model

    model = torch.nn.Sequential(Linear(4096, 6144, bias=False), Linear(4096, 4096, bias=False)).to(DEVICE, torch.bfloat16)
    quantize_model(model, Fp8Spec("fp8", False, None, False, "dynamic", "weight_scale"))
    tune_small_batch(model, torch.bfloat16)
    assert all(layer.weight.dtype == gemv.FP8 and len(layer.gemv_buckets) == len(gemv.ROW_BUCKETS) for layer in model)
    x = torch.randn(1, 4096, device=DEVICE, dtype=torch.bfloat16)
    expected = torch.nn.functional.linear(x.float(), _dequantized(model[0].weight, model[0].weight_scale))
    torch.testing.assert_close(model[0](x).float(), expected, atol=5e-2, rtol=5e-2)
