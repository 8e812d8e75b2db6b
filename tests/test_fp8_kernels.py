"""The FP8 kernels of ferry/kernels/fp8_quant.py against quantization/fp8.py's torch code, bit for
bit: scales and e4m3 bytes. Without a GPU the kernel runs under Triton's interpreter (with its e4m3
rounding patched to the GPU's, tests/triton_interpreter.py). On a GPU both divide as IEEE divides
(fp8.scale_of says why that needs care in torch): a bfloat16 input's quotient often falls exactly
halfway between two e4m3 numbers, where a scale one bit off would round it the other way.
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

from ferry.kernels.fp8_block_matmul import fp8_block_matmul  # noqa: E402
from ferry.kernels.fp8_quant import quantize_rows_fp8  # noqa: E402
from ferry.quantization.fp8 import (  # noqa: E402
    Fp8Linear, dequantize, dequantize_activations, fp8_linear_reference, quantize_activations, quantize_blocks,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _bytes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def assert_same_quantization(q, scale, expected_q, expected_scale):
    assert torch.equal(scale, expected_scale) and torch.equal(_bytes(q), _bytes(expected_q))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("rows,k", [(1, 64), (5, 1000), (3, 5000)])  # one tile, a ragged one, several
def test_per_token_quantization_matches_torch(rows, k, dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(rows, k, generator=g) * torch.logspace(-3, 3, rows)[:, None]).to(dtype).to(DEVICE)
    x[0, :7] = 0  # zeros stay zeros
    if rows > 1:
        x[1] = 0  # an all-zero row keeps the smallest scale
    q, scale = quantize_rows_fp8(x)
    assert_same_quantization(q, scale, *quantize_activations(x))


def test_a_static_scale_clamps_what_it_cannot_hold():
    g = torch.Generator().manual_seed(1)
    x = (100 * torch.randn(4, 300, generator=g)).to(torch.bfloat16).to(DEVICE)
    static = torch.tensor([0.05], device=DEVICE)  # 448 * 0.05 = 22.4: most values clamp
    q, scale = quantize_rows_fp8(x, static)
    expected_q, expected_scale = quantize_activations(x, None, static)
    assert_same_quantization(q, scale, expected_q, expected_scale.expand(4, 1).contiguous())
    assert q.float().abs().max() == 448  # noqa: PLR2004


def test_a_nan_stays_nan():
    """As in torch (tl.clamp would otherwise make it 448, and hide the overflow that made it)."""
    x = torch.ones(2, 64, device=DEVICE, dtype=torch.bfloat16)
    x[0, 3] = float("nan")
    q, _ = quantize_rows_fp8(x)
    assert q[0, 3].float().isnan() and quantize_activations(x)[0][0, 3].float().isnan()
    assert not q[1].float().isnan().any()


@pytest.mark.parametrize("rows,k", [(2, 256), (3, 300)])  # whole groups, and a ragged last one
def test_per_token_and_group_quantization_matches_torch(rows, k):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(rows, k, generator=g) * torch.logspace(-2, 2, k)[None, :]).to(torch.bfloat16).to(DEVICE)
    q, scale = quantize_rows_fp8(x, group=128)
    assert scale.shape == (rows, -(-k // 128))
    assert_same_quantization(q, scale, *quantize_activations(x, 128))


# M rows: one, a few, past one tile of 64; N past whole blocks of 128 (ragged scale rows); K of
# whole groups and a ragged last one.
@pytest.mark.parametrize("m,n,k,bias", [(1, 128, 256, False), (5, 200, 384, True), (70, 256, 300, False)])
def test_the_block_fp8_matmul_is_that_of_the_dequantized_numbers(m, n, k, bias):
    """Against quantization/fp8.py's reference on the same numbers (activations quantized per token
    and 128 columns, weights per 128 x 128 block), both accumulating in float32: 1e-2, the
    bf16 rounding of outputs of order 1 to 10."""
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(n, k, generator=g) * 0.05 * (1 + torch.arange(n)[:, None] % 5)).to(DEVICE)
    qw, sw = quantize_blocks(w, (128, 128))
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(DEVICE)
    b = torch.randn(n, generator=g).to(torch.bfloat16).to(DEVICE) if bias else None
    qx, sx = quantize_rows_fp8(x, group=128)
    out = fp8_block_matmul(qx, sx, qw, sw, b, (128, 128), torch.bfloat16)
    expected = fp8_linear_reference(x, qw, sw, b, Fp8Linear((128, 128), "dynamic"))
    exact = torch.nn.functional.linear(dequantize_activations(qx, sx, 128), dequantize(qw, sw, (128, 128)),
                                       None if b is None else b.float())
    torch.testing.assert_close(out.float(), exact, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-2, rtol=1e-2)


# ---- the norm and SiLU-and-mul writing FP8: the same numbers as the op, then the quantization ----


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("rows,n", [(1, 64), (3, 1000)])
def test_the_norm_writes_what_quantizing_its_output_gives(rows, n, with_residual):
    from ferry.layers import fused

    g = torch.Generator().manual_seed(5)
    x = torch.randn(rows, n, generator=g).to(torch.bfloat16).to(DEVICE)
    residual = torch.randn(rows, n, generator=g).to(torch.bfloat16).to(DEVICE) if with_residual else None
    weight = (1 + 0.1 * torch.randn(n, generator=g)).to(torch.bfloat16).to(DEVICE)
    kept = None if residual is None else residual.clone()
    expected = quantize_rows_fp8(fused.rms_norm(x, weight, 1e-6, kept))
    q, scale = fused.rms_norm_fp8(x, weight, 1e-6, residual)
    assert torch.equal(scale, expected[1]) and torch.equal(_bytes(q), _bytes(expected[0]))
    if residual is not None:
        assert torch.equal(residual, kept)  # the new residual stream, written in place as rms_norm writes it


@pytest.mark.parametrize("rows,d", [(1, 64), (2, 3000)])  # one tile, several and a ragged one
def test_silu_and_mul_writes_what_quantizing_its_output_gives(rows, d):
    from ferry.layers import fused

    x = torch.randn(rows, 2 * d, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16).to(DEVICE)
    q, scale = fused.silu_and_mul_fp8(x)
    expected_q, expected_scale = quantize_rows_fp8(fused.silu_and_mul(x))
    assert torch.equal(scale, expected_scale) and torch.equal(_bytes(q), _bytes(expected_q))


@pytest.mark.skipif(DEVICE != "cuda", reason="the FP8 GEMM (torch._scaled_mm) runs on CUDA")
def test_an_fp8_layer_takes_its_input_quantized_by_the_op_before():
    """forward_rms_norm and forward_silu_and_mul of an FP8 layer give what the op then the layer give."""
    from ferry.layers import fused
    from ferry.layers.linear import Linear
    from ferry.layers.norm import RMSNorm
    from ferry.quantization.config import Fp8Spec
    from ferry.quantization.fp8 import quantize_model

    model = torch.nn.Sequential(Linear(256, 128, bias=False), Linear(256, 64, bias=False)).to(DEVICE, torch.bfloat16)
    quantize_model(model, Fp8Spec("fp8", False, None, False, "dynamic", "weight_scale"))
    norm = RMSNorm(256, 1e-6).to(DEVICE, torch.bfloat16)
    g = torch.Generator().manual_seed(7)
    x, residual = (torch.randn(16, 256, generator=g).to(torch.bfloat16).to(DEVICE) for _ in range(2))
    y, new_residual = model[0].forward_rms_norm(x, residual.clone(), norm)
    h, expected_residual = norm(x, residual.clone())
    assert torch.equal(y, model[0](h)) and torch.equal(new_residual, expected_residual)
    gate_up = torch.randn(16, 512, generator=g).to(torch.bfloat16).to(DEVICE)
    assert torch.equal(model[1].forward_silu_and_mul(gate_up, fused.silu_and_mul), model[1](fused.silu_and_mul(gate_up)))
