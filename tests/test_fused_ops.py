"""The fused small-op kernels (ferry/layers/fused.py) against the layers' torch code.

Without a GPU they run on CPU tensors under Triton's interpreter; on a GPU, compiled, and a whole
model's logits on CUDA (fused) are also compared with the same model on CPU (torch code).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
pytest.importorskip("triton")

from ferry.layers import fused  # noqa: E402
from ferry.layers.norm import RMSNorm  # noqa: E402
from ferry.layers.rotary import RotaryEmbedding, apply_rotary  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# bf16: one or two units in the last place of its 8-bit mantissa, where the kernel's float32
# arithmetic rounds once and torch's op-by-op arithmetic rounds at each op.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16]


def _randn(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def _close(actual, expected):
    tol = TOLERANCE[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def _norm(n, dtype, eps=1e-6):
    norm = RMSNorm(n, eps).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(n, generator=torch.Generator().manual_seed(1)))
    return norm.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,n", [(1, 64), (5, 80), (3, 256)])
def test_rms_norm_matches_torch(rows, n, dtype):
    norm, x = _norm(n, dtype), 3 * _randn(rows, n, dtype=dtype)
    _close(fused.rms_norm(x, norm.weight, norm.eps), norm._norm(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_with_residual_updates_it_in_place(dtype):
    norm = _norm(96, dtype)
    x, residual = _randn(4, 96, dtype=dtype), _randn(4, 96, dtype=dtype, seed=1)
    expected_sum = x + residual
    expected = norm._norm(expected_sum)
    out = fused.rms_norm(x, norm.weight, norm.eps, residual)
    _close(out, expected)
    if INTERPRET:  # the interpreter casts float32 to bfloat16 by truncation, not to nearest
        _close(residual, expected_sum)
    else:
        assert torch.equal(residual, expected_sum)  # one rounding of the sum, as torch's add


def test_rms_norm_reads_strided_rows():
    norm = _norm(64, torch.float32)
    wide = _randn(3, 100, dtype=torch.float32)
    _close(fused.rms_norm(wide[:, :64], norm.weight, norm.eps), norm._norm(wide[:, :64]))


def _qkv_views(num_tokens, num_heads, num_kv_heads, head_dim, dtype):
    """q, k, v as the views a merged qkv projection's output is split into."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = _randn(num_tokens, q_size + 2 * kv_size, dtype=dtype, seed=2)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return (q.unflatten(-1, (num_heads, head_dim)), k.unflatten(-1, (num_kv_heads, head_dim)),
            v.unflatten(-1, (num_kv_heads, head_dim)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [16, 128])
@pytest.mark.parametrize("with_norm", [False, True], ids=["rope", "qk_norm+rope"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (6, 3)])  # 6, 3: heads past a power of two masked
def test_rotary_qk_matches_torch(num_heads, num_kv_heads, with_norm, head_dim, dtype):
    num_tokens = 5
    q, k, v = _qkv_views(num_tokens, num_heads, num_kv_heads, head_dim, dtype)
    v_before = v.clone()
    positions = torch.tensor([0, 1, 7, 300, 4095], device=DEVICE)
    cos, sin = RotaryEmbedding(head_dim, {"rope_type": "default", "rope_theta": 10000.0}).to(DEVICE)(positions)
    q_norm = k_norm = None
    if with_norm:
        q_norm, k_norm = _norm(head_dim, dtype), _norm(head_dim, dtype)
        q_norm.weight.data = q_norm.weight.data.flip(0)  # different weights for q and k
    eq, ek = (q_norm(q), k_norm(k)) if with_norm else (q, k)
    expected_q, expected_k = apply_rotary(eq, cos, sin), apply_rotary(ek, cos, sin)
    weights = (q_norm.weight, k_norm.weight, q_norm.eps) if with_norm else ()
    fused.rotary_qk_(q, k, cos, sin, *weights)
    _close(q, expected_q)
    _close(k, expected_k)
    assert torch.equal(v, v_before)  # the neighbouring v columns are untouched


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,d", [(1, 128), (6, 1500)])
def test_silu_and_mul_matches_torch(rows, d, dtype):
    x = 2 * _randn(rows, 2 * d, dtype=dtype)
    gate, up = x.chunk(2, dim=-1)
    _close(fused.silu_and_mul(x), torch.nn.functional.silu(gate) * up)


def test_empty_batches():
    norm = _norm(64, torch.float32)
    assert fused.rms_norm(_randn(0, 64, dtype=torch.float32), norm.weight, 1e-6).shape == (0, 64)
    assert fused.silu_and_mul(_randn(0, 64, dtype=torch.float32)).shape == (0, 32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the layers use the fused kernels on CUDA tensors only")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_model_logits_on_cuda_match_cpu(arch, tmp_path):
    """A whole forward through the fused kernels (CUDA) against the torch code (CPU), float32."""
    from tiny_models import flat_batch, make_tiny_model

    from ferry.attention.backend import ForwardContext
    from ferry.attention.selector import get_attention_backend
    from ferry.config import ModelConfig
    from ferry.loader.loader import load_model

    make_tiny_model(arch, tmp_path)
    config = ModelConfig.from_pretrained(tmp_path, "float32", None, "auto")
    chunks, block_size = [(0, 7), (0, 3)], 4
    tables = [[0, 1], [2]]
    input_ids = torch.tensor([5, 9, 11, 3, 7, 100, 42, 8, 19, 77])
    logits = {}
    for device in ("cpu", "cuda"):
        model = load_model(config, torch.device(device))
        positions, metadata = flat_batch(chunks, tables, block_size)
        for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
            setattr(metadata, name, getattr(metadata, name).to(device))
        kv = [torch.zeros(2, 3, block_size, config.num_kv_heads, config.head_dim, device=device)
              for _ in range(config.num_layers)]
        ctx = ForwardContext(metadata, kv, get_attention_backend(device))
        with torch.inference_mode():
            hidden = model(input_ids.to(device), positions.to(device), ctx)
            logits[device] = model.compute_logits(hidden).cpu()
    torch.testing.assert_close(logits["cuda"], logits["cpu"], atol=1e-3, rtol=1e-3)
