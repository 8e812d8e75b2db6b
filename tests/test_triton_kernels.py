"""The Triton kernels against the torch reference backend, through shuffled paged caches.

Without a GPU the kernels run on CPU tensors under Triton's interpreter (slow, so shapes stay
small: contexts up to a few hundred tokens). Shapes up to 32k tokens run only on a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before the kernels are defined: @triton.jit reads it when it wraps a function.
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"


if INTERPRET:
    from triton_interpreter import patch_interpreter

    patch_interpreter()

from ferry.attention.kernels.decode_attention import DecodeConfig, choose_num_splits, decode_attention  # noqa: E402
from ferry.attention.kernels.prefill_attention import PrefillConfig, prefill_attention  # noqa: E402
from ferry.attention.kernels.store_kv import store_kv  # noqa: E402
from ferry.attention.selector import get_attention_backend  # noqa: E402
from ferry.attention.torch_ref import TorchReferenceBackend  # noqa: E402
from ferry.attention.torch_ref import store_kv as reference_store_kv  # noqa: E402
from ferry.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from tiny_models import flat_batch, shuffled_block_tables  # noqa: E402

NUM_KV_HEADS = 2  # GQA ratios come from the number of query heads
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # bf16: a few units of its 8-bit mantissa
# (block_size, head_dim): both block sizes and both head dims, without the full product.
PAGE_SHAPES = [(16, 64), (32, 128)]
DTYPES = [torch.float32, torch.bfloat16]

# (num_computed, num_new) per request: decode rows at context 1 up to 301 tokens.
DECODE_STEP = [(0, 1), (16, 1), (99, 1), (300, 1)]
# Prefill, extend after a cached prefix, decode rows and a one-token prompt, in one step.
MIXED_STEP = [(0, 37), (50, 20), (130, 1), (0, 1), (190, 9)]


class Step:
    """One step's inputs: q/k/v for the new tokens and a cache already holding every prefix.

    The whole cache starts random, not zero: slots past a request's context (the rest of its last
    block, other requests' blocks) hold values that a kernel reading them would be caught by.
    """

    def __init__(self, chunks, group, block_size, head_dim, dtype, seed=0, q_scale=1.0, fp8_kv=False):
        g = torch.Generator().manual_seed(seed)
        tables, num_blocks = shuffled_block_tables([c + n for c, n in chunks], block_size, seed)
        _, self.metadata = flat_batch(chunks, tables, block_size)
        num_tokens = self.metadata.query_start_loc_cpu[-1]
        make = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
        self.q = (q_scale * make(num_tokens, NUM_KV_HEADS * group, head_dim)).to(dtype)
        self.k, self.v = make(num_tokens, NUM_KV_HEADS, head_dim), make(num_tokens, NUM_KV_HEADS, head_dim)
        self.kv_cache = make(2, num_blocks, block_size, NUM_KV_HEADS, head_dim)
        self.scale = head_dim**-0.5
        # An FP8 cache: e4m3 values and a K and a V scale per KV head, not 1, so that a kernel
        # that forgets one (or reads another head's) is caught.
        self.kv_scales = fp8_scales(seed) if fp8_kv else None
        if fp8_kv:
            self.kv_cache = self.kv_cache.float().to(FP8)
        self.to(DEVICE)

    def to(self, device):
        for name in ("q", "k", "v", "kv_cache"):
            setattr(self, name, getattr(self, name).to(device))
        if self.kv_scales is not None:
            self.kv_scales = tuple(scale.to(device) for scale in self.kv_scales)
        m = self.metadata
        for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
            setattr(m, name, getattr(m, name).to(device))

    def run(self, backend):
        """(output, cache after the step) of `backend`, on a copy of the cache."""
        cache = self.kv_cache.clone()
        return backend.forward(self.q, self.k, self.v, cache, self.metadata, self.scale, self.kv_scales), cache


FP8 = torch.float8_e4m3fn


def fp8_scales(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K's and V's scales, one per KV head, in [0.25, 1.25)."""
    g = torch.Generator().manual_seed(seed + 1000)
    return tuple(0.25 + torch.rand(NUM_KV_HEADS, generator=g) for _ in range(2))


def same_cache(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (FP8 caches compare as bytes: torch.equal has no float8 kernel everywhere)."""
    if a.dtype == FP8:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


def assert_matches_reference(step: Step) -> None:
    expected, expected_cache = step.run(TorchReferenceBackend())
    out, cache = step.run(TritonAttentionBackend())
    tol = TOLERANCE[step.q.dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    assert same_cache(cache, expected_cache)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_kv_writes_slots_and_skips_padding(dtype):
    # 37 tokens: not a multiple of the tokens a program takes, so the last program is partial.
    num_tokens, head_dim, num_slots = 37, 64, 64
    g = torch.Generator().manual_seed(0)
    slots = torch.randperm(num_slots, generator=g)[:num_tokens].to(DEVICE)
    slots[::7] = -1  # padding rows
    # k and v as views of a fused projection: rows strided, each token's heads contiguous.
    qkv = torch.randn(num_tokens, 4 * NUM_KV_HEADS * head_dim, generator=g).to(DEVICE, dtype)
    k = qkv[:, : NUM_KV_HEADS * head_dim].view(num_tokens, NUM_KV_HEADS, head_dim)
    v = qkv[:, NUM_KV_HEADS * head_dim : 2 * NUM_KV_HEADS * head_dim].view(num_tokens, NUM_KV_HEADS, head_dim)
    cache = torch.randn(2, num_slots // 16, 16, NUM_KV_HEADS, head_dim, generator=g).to(DEVICE, dtype)
    expected = cache.clone()
    reference_store_kv(k, v, expected, slots)
    head_major = head_major_view(cache)  # the same values in head-major storage
    store_kv(k, v, cache, slots)
    assert torch.equal(cache, expected)
    store_kv(k, v, head_major, slots)
    assert torch.equal(head_major, expected)


def head_major_view(cache: torch.Tensor) -> torch.Tensor:
    """cache's values in (2, blocks, heads, block_size, head_dim) storage, seen in cache's shape."""
    return cache.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp8_store_kv_scales_clamps_and_rounds_as_the_reference(dtype):
    """Each head divided by its own scale, values past e4m3's 448 clamped (not NaN), rounded to
    nearest even: the same bytes as the reference's, padding rows unwritten."""
    num_tokens, head_dim, num_slots = 37, 64, 64
    g = torch.Generator().manual_seed(0)
    slots = torch.randperm(num_slots, generator=g)[:num_tokens].to(DEVICE)
    slots[::7] = -1
    k, v = (200 * torch.randn(num_tokens, NUM_KV_HEADS, head_dim, generator=g) for _ in range(2))
    k, v = k.to(DEVICE, dtype), v.to(DEVICE, dtype)
    scales = tuple(scale.to(DEVICE) for scale in fp8_scales(0))
    cache = torch.randn(2, num_slots // 16, 16, NUM_KV_HEADS, head_dim, generator=g).to(FP8).to(DEVICE)
    expected = cache.clone()
    reference_store_kv(k, v, expected, slots, scales)
    store_kv(k, v, cache, slots, scales)
    assert same_cache(cache, expected)
    stored = cache.float().abs()
    assert stored.max() == 448 and torch.isfinite(stored).all()  # some values clamped
    k[0, 1, 5] = float("nan")  # a NaN is stored as NaN, as in torch (a clamp would make it 448)
    slots[0] = 0
    store_kv(k, v, cache, slots, scales)
    assert cache[0, 0, 0, 1, 5].float().isnan()


@pytest.mark.parametrize("chunks", [DECODE_STEP, MIXED_STEP], ids=["decode", "mixed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size,head_dim", PAGE_SHAPES)
@pytest.mark.parametrize("group", [1, 4])
def test_fp8_cache_matches_reference(group, block_size, head_dim, dtype, chunks):
    """Both kernels over an FP8 cache (decode rows alone, and prefill beside them) against the
    reference, which dequantizes the cache and attends in float32: the tolerances of 16-bit caches,
    because the kernels multiply the same e4m3 numbers (widened exactly) and scales."""
    assert_matches_reference(Step(chunks, group, block_size, head_dim, dtype, fp8_kv=True))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size,head_dim", PAGE_SHAPES)
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_matches_reference(group, block_size, head_dim, dtype):
    assert_matches_reference(Step(DECODE_STEP, group, block_size, head_dim, dtype))


@pytest.mark.parametrize("num_splits,dtype", [(2, torch.float32), (3, torch.bfloat16), (8, torch.float32)], ids=str)
def test_decode_split_k_matches_one_split(num_splits, dtype):
    """Splits of unequal length, and empty trailing ones (the 1-token context under 8 splits)."""
    step = Step(DECODE_STEP, 4, 16, 64, dtype)
    store_kv(step.k, step.v, step.kv_cache, step.metadata.slot_mapping)
    m = step.metadata
    outputs = []
    for splits in (1, num_splits):
        out = torch.empty_like(step.q)
        decode_attention(step.q, step.kv_cache, m.block_tables, m.seq_lens, step.scale, out, splits)
        outputs.append(out)
    tol = 1e-5 if dtype == torch.float32 else TOLERANCE[dtype]
    torch.testing.assert_close(outputs[1].float(), outputs[0].float(), atol=tol, rtol=tol)


# Several query tokens per request (a speculative verify): contexts given by their shared length,
# seq_len - query_len + 1, the keys every query token sees. With 16-key tiles: 1, a context of just
# the query tokens; 4, barely longer; 64, shared keys ending on a tile boundary (the first token
# sees nothing in the masked tile); 62, masked keys across two tiles; 70, whose last split under 3
# splits starts past the last whole tile of shared keys; 200, many tiles and splits.
SHARED_LENS = [1, 4, 64, 62, 70, 200]


def multi_token_decode(
    query_len, group, block_size, head_dim, dtype, num_splits, config=DecodeConfig(), shared_lens=SHARED_LENS, q_scale=1.0,
    fp8_kv=False,
):
    """(decode_attention's output, the reference) for query_len tokens of each of shared_lens."""
    step = Step([(n - 1, query_len) for n in shared_lens], group, block_size, head_dim, dtype, q_scale=q_scale,
                fp8_kv=fp8_kv)
    expected, _ = step.run(TorchReferenceBackend())
    store_kv(step.k, step.v, step.kv_cache, step.metadata.slot_mapping, step.kv_scales)
    m = step.metadata
    out = torch.full_like(step.q, float("nan"))  # a row left unwritten shows
    decode_attention(step.q, step.kv_cache, m.block_tables, m.seq_lens, step.scale, out, num_splits, config,
                     query_len=query_len, kv_scales=step.kv_scales)
    return out, expected


@pytest.mark.parametrize("num_splits", [1, 3, 32])  # 32: more splits than tiles, many of them empty
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("query_len", [1, 2, 5])
def test_multi_token_decode_matches_reference(query_len, group, num_splits):
    out, expected = multi_token_decode(query_len, group, 16, 64, torch.float32, num_splits, DecodeConfig(block_n=16))
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("query_len", [1, 5])
def test_fp8_multi_token_decode_across_splits(query_len, num_splits):
    """V's scale applied to every split's partial output before they merge, and K's in every
    split's scores (their log-sum-exps must agree for the merge to weigh them right)."""
    out, expected = multi_token_decode(query_len, 4, 16, 64, torch.float32, num_splits, DecodeConfig(block_n=16),
                                       fp8_kv=True)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "query_len,group,block_size,head_dim,dtype",
    [(5, 8, 16, 64, torch.float32), (5, 2, 16, 80, torch.float32), (3, 4, 32, 128, torch.bfloat16)],
    ids=str,
)
def test_multi_token_decode_default_tiles(query_len, group, block_size, head_dim, dtype):
    """The launch configuration the backend uses (64-key tiles), GQA 8 (a 64-row tile), a head dim
    that is not a power of two, and bf16."""
    out, expected = multi_token_decode(query_len, group, block_size, head_dim, dtype, num_splits=3)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size,head_dim", PAGE_SHAPES)
@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill_with_cached_prefix_in_mixed_batch_matches_reference(group, block_size, head_dim, dtype):
    assert_matches_reference(Step(MIXED_STEP, group, block_size, head_dim, dtype))


@pytest.mark.parametrize("group", [1, 3])
def test_prefill_small_tiles(group):
    """Tiles much smaller than the chunks: several query tiles per request, several full key tiles
    before the diagonal, spare tiles, and (group 3) a query tile whose last row holds no token."""
    step = Step(MIXED_STEP, group, 16, 64, torch.float32)
    expected, _ = step.run(TorchReferenceBackend())
    store_kv(step.k, step.v, step.kv_cache, step.metadata.slot_mapping)
    m = step.metadata
    out = torch.zeros_like(step.q)
    config = PrefillConfig(block_m=16, block_n=16)
    num_real = m.query_start_loc_cpu[-1]
    prefill_attention(step.q, step.kv_cache, m.block_tables, m.query_start_loc, m.seq_lens, num_real, step.scale, out, config)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chunks", [DECODE_STEP, MIXED_STEP], ids=["decode", "mixed"])
def test_head_dim_not_a_power_of_two(chunks):
    assert_matches_reference(Step(chunks, 2, 16, 80, torch.float32))


@pytest.mark.parametrize("chunks", [DECODE_STEP, MIXED_STEP], ids=["decode", "mixed"])
def test_padding_rows_are_neither_stored_nor_attended(chunks):
    step = Step(chunks, 4, 16, 64, torch.float32)
    clean, clean_cache = step.run(TritonAttentionBackend())
    pad = 3  # rows a fixed-size (graph-captured) batch would carry past the last request
    step.metadata.slot_mapping = torch.cat([step.metadata.slot_mapping, torch.full((pad,), -1, device=DEVICE)])
    step.q, step.k, step.v = (torch.cat([t, 100 * torch.ones(pad, *t.shape[1:], device=DEVICE)]) for t in (step.q, step.k, step.v))
    padded, padded_cache = step.run(TritonAttentionBackend())
    torch.testing.assert_close(padded[:-pad], clean, atol=0, rtol=0)
    assert torch.equal(padded_cache, clean_cache)
    assert torch.count_nonzero(padded[-pad:]) == 0


def test_selector_defaults_and_override(monkeypatch):
    assert isinstance(get_attention_backend("cpu", "triton"), TritonAttentionBackend)
    assert isinstance(get_attention_backend("cuda", "torch"), TorchReferenceBackend)
    with pytest.raises(ValueError, match="flash"):
        get_attention_backend("cpu", "flash")


def test_the_environment_is_read_once_into_the_config(monkeypatch, tmp_path):
    from ferry.config import EngineConfig, environment_defaults

    monkeypatch.delenv("FERRY_ATTENTION_BACKEND", raising=False)
    monkeypatch.delenv("FERRY_PDL", raising=False)
    assert environment_defaults() == {"attention_backend": None, "pdl": True}
    monkeypatch.setenv("FERRY_ATTENTION_BACKEND", "Triton ")
    monkeypatch.setenv("FERRY_PDL", "0")
    assert environment_defaults() == {"attention_backend": "triton", "pdl": False}
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(model=None, cache=None, scheduler=None, attention_backend="flash")


# ---- long contexts: GPU only ----

gpu_only = pytest.mark.skipif(INTERPRET, reason="long contexts are too slow for the interpreter")
LONG_CONTEXTS = [1, 17, 1000, 4095, 8192, 32768]
# Over thousands of keys, scores of spread 1 give a nearly flat softmax whose output is tiny next
# to bf16 tolerances; spread 3 lets a few keys dominate, so a wrong mask or a missed key shows.
PEAKY = 3.0


@gpu_only
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_long_decode_matches_reference(group, block_size):
    chunks = [(n - 1, 1) for n in LONG_CONTEXTS]
    assert_matches_reference(Step(chunks, group, block_size, 128, torch.bfloat16, q_scale=PEAKY))


@gpu_only
@pytest.mark.parametrize("group", [1, 8])
def test_long_fp8_decode_and_prefill_match_reference(group):
    chunks = [(n - 1, 1) for n in LONG_CONTEXTS]
    assert_matches_reference(Step(chunks, group, 16, 128, torch.bfloat16, q_scale=PEAKY, fp8_kv=True))
    chunks = [(32768 - 512, 512), (0, 2048), (8000, 192), (4095, 1), (0, 1)]
    assert_matches_reference(Step(chunks, group, 16, 128, torch.bfloat16, q_scale=PEAKY, fp8_kv=True))


@gpu_only
@pytest.mark.parametrize("group", [1, 4, 8])
def test_long_multi_token_decode_matches_reference(group):
    query_len = 5
    num_splits = choose_num_splits(len(LONG_CONTEXTS), NUM_KV_HEADS, max(LONG_CONTEXTS) + query_len, torch.device(DEVICE))
    out, expected = multi_token_decode(
        query_len, group, 16, 128, torch.bfloat16, num_splits, shared_lens=LONG_CONTEXTS, q_scale=PEAKY
    )
    tol = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@gpu_only
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_long_prefix_prefill_matches_reference(group, block_size):
    # Chunks after long cached prefixes, a whole 2k prompt, and decode rows beside them.
    chunks = [(32768 - 512, 512), (0, 2048), (8000, 192), (4095, 1), (0, 1), (16384, 1)]
    assert_matches_reference(Step(chunks, group, block_size, 128, torch.bfloat16, q_scale=PEAKY))
