"""Check the Triton attention kernels on a GPU: correctness against the torch reference, then speed.

    python -m ferry.bench.kernel_check            # CUDA: correctness sweep, decode and prefill timings
    python -m ferry.bench.kernel_check --sweep    # also time a few launch configurations of each kernel
    python -m ferry.bench.kernel_check --compile  # anywhere (no GPU needed): compile for sm_90 and
                                                  # print registers, spills and shared memory

Correctness covers GQA ratios 1/4/8, block sizes 16 and 32, contexts from 1 to 32k tokens and mixed
batches (prefill chunks after long cached prefixes beside decode rows), in bf16, over a bf16 and an
FP8 cache (per-head scales, against the reference's dequantized cache). Decode is timed on
the attention shapes of Qwen3-0.6B and Llama-3.1-8B (benchmarks/*/config.json): decode must read
every cached K and V once, so its figure is the achieved bandwidth of that read against the
device-to-device copy bandwidth measured in the same run; each shape also over an FP8 cache, half
the bytes. A speculative verify (5 query tokens per
request through the same decode kernel) is timed against a 1-token decode on Llama-3.1-8B at batch 1,
and checked against the torch reference. Prefill of one 8192-token prompt is timed in TFLOP/s, next
to torch's fused SDPA on the same (unpaged) data and a bf16 matmul.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from ferry.attention.backend import AttentionMetadata
from ferry.config import ModelConfig

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
# Scores of spread 3 (q scaled by 3) make a few keys dominate each softmax, so a wrong mask or a
# missed key moves the output far more than bf16 rounding does, even over 32k keys.
PEAKY = 3.0
BF16_TOL = 2e-2


# ---- building a step ----


def make_step(chunks, num_heads, num_kv_heads, head_dim, block_size, dtype, device, q_scale=1.0, seed=0):
    """q, k, v, a random cache and metadata for one step in which request i brings tokens
    chunks[i] = (num_computed, num_new); blocks are handed out in shuffled order."""
    g = torch.Generator(device=device).manual_seed(seed)
    needed = [-(-(c + n) // block_size) for c, n in chunks]
    pool = torch.randperm(sum(needed), generator=g, device=device).tolist()
    tables, start = [], 0
    for n in needed:
        tables.append(pool[start:start + n])
        start += n
    width = max(needed)
    slots, qsl = [], [0]
    for (computed, new), table in zip(chunks, tables):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(computed, computed + new)]
        qsl.append(qsl[-1] + new)
    seq_lens = [c + n for c, n in chunks]
    as_tensor = lambda x, dtype: torch.tensor(x, dtype=dtype, device=device)  # noqa: E731
    metadata = AttentionMetadata(
        slot_mapping=as_tensor(slots, torch.int64),
        query_start_loc=as_tensor(qsl, torch.int32),
        seq_lens=as_tensor(seq_lens, torch.int32),
        block_tables=as_tensor([t + [0] * (width - len(t)) for t in tables], torch.int32),
        max_query_len=max(n for _, n in chunks),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )
    randn = lambda *shape: torch.randn(*shape, generator=g, device=device, dtype=dtype)  # noqa: E731
    q = randn(qsl[-1], num_heads, head_dim) * q_scale
    k, v = randn(qsl[-1], num_kv_heads, head_dim), randn(qsl[-1], num_kv_heads, head_dim)
    cache = randn(2, sum(needed), block_size, num_kv_heads, head_dim)
    return q, k, v, cache, metadata


# ---- correctness ----

SWEEP_KV_HEADS, SWEEP_HEAD_DIM = 4, 128
DECODE_CONTEXTS = [1, 2, 17, 1000, 4095, 8192, 16384, 32768]
MIXED_CHUNKS = [(32768 - 512, 512), (0, 2048), (8000, 192), (4095, 1), (0, 1), (16384, 1), (100, 300), (31, 33)]


def fp8_cache(cache: torch.Tensor, num_kv_heads: int, seed: int = 0) -> tuple[torch.Tensor, tuple]:
    """The cache in e4m3 and K and V scales per head in [0.5, 1.5) (not 1: a kernel that forgets
    one shows)."""
    g = torch.Generator(device=cache.device).manual_seed(seed)
    scales = tuple(0.5 + torch.rand(num_kv_heads, generator=g, device=cache.device) for _ in range(2))
    return cache.to(torch.float8_e4m3fn), scales


def check_correctness(device) -> list[tuple[str, float, float, bool]]:
    from ferry.attention.torch_ref import TorchReferenceBackend
    from ferry.attention.triton_backend import TritonAttentionBackend

    rows = []
    for fp8 in (False, True):
        for group in (1, 4, 8):
            for block_size in (16, 32):
                for name, chunks in (("decode", [(n - 1, 1) for n in DECODE_CONTEXTS]), ("mixed", MIXED_CHUNKS)):
                    q, k, v, cache, md = make_step(
                        chunks, SWEEP_KV_HEADS * group, SWEEP_KV_HEADS, SWEEP_HEAD_DIM, block_size,
                        torch.bfloat16, device, q_scale=PEAKY,
                    )
                    cache, scales = fp8_cache(cache, SWEEP_KV_HEADS) if fp8 else (cache, None)
                    scale = SWEEP_HEAD_DIM**-0.5
                    ref_cache, cache = cache.clone(), cache
                    expected = TorchReferenceBackend().forward(q, k, v, ref_cache, md, scale, scales).float()
                    out = TritonAttentionBackend().forward(q, k, v, cache, md, scale, scales).float()
                    max_err = (out - expected).abs().max().item()
                    rel_l2 = ((out - expected).norm() / expected.norm()).item()
                    same = torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8)) if fp8 else torch.equal(cache, ref_cache)
                    ok = torch.allclose(out, expected, atol=BF16_TOL, rtol=BF16_TOL) and same
                    kv = "fp8" if fp8 else "bf16"
                    rows.append((f"{name:6s} gqa {group} block {block_size:2d} {kv}", max_err, rel_l2, ok))
    return rows


# ---- timing ----


def copy_bandwidth(device) -> float:
    """Device-to-device copy, bytes read plus written per second, on 1 GiB (far above L2)."""
    from triton.testing import do_bench

    src = torch.empty(1 << 29, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def matmul_tflops(device) -> float:
    from triton.testing import do_bench

    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    ms = do_bench(lambda: a @ a)
    return 2 * 8192**3 / (ms * 1e-3) / 1e12


def time_decode(
    model: ModelConfig, batch: int, context: int, block_size: int, device, config=None, query_len: int = 1,
    fp8_kv: bool = False,
) -> tuple[float, float]:
    """(ms, GB/s of K/V read) of one layer's decode attention of query_len tokens per request (the
    last query_len of its context), split-K chosen as the backend does; fp8_kv: over an FP8 cache."""
    from triton.testing import do_bench

    from ferry.attention.kernels.decode_attention import choose_num_splits, decode_attention

    q, _, _, cache, md = make_step(
        [(context - query_len, query_len)] * batch, model.num_heads, model.num_kv_heads, model.head_dim,
        block_size, torch.bfloat16, device,
    )
    cache, scales = fp8_cache(cache, model.num_kv_heads) if fp8_kv else (cache, None)
    out = torch.empty_like(q)
    splits = choose_num_splits(batch, model.num_kv_heads, context, q.device)
    run = lambda: decode_attention(  # noqa: E731
        q, cache, md.block_tables, md.seq_lens, model.head_dim**-0.5, out, splits, config,
        query_len=query_len, kv_scales=scales,
    )
    ms = do_bench(run)
    kv_bytes = 2 * batch * context * model.num_kv_heads * model.head_dim * cache.element_size()
    return ms, kv_bytes / (ms * 1e-3) / 1e9


def time_prefill(model: ModelConfig, prompt: int, block_size: int, device, config=None) -> tuple[float, float]:
    """(ms, TFLOP/s) of one layer's causal attention over one prompt, read through the paged cache."""
    from triton.testing import do_bench

    from ferry.attention.kernels.prefill_attention import PrefillConfig, prefill_attention

    q, _, _, cache, md = make_step(
        [(0, prompt)], model.num_heads, model.num_kv_heads, model.head_dim, block_size, torch.bfloat16, device
    )
    out = torch.empty_like(q)
    run = lambda: prefill_attention(  # noqa: E731
        q, cache, md.block_tables, md.query_start_loc, md.seq_lens, prompt, model.head_dim**-0.5, out,
        config,
    )
    ms = do_bench(run)
    return ms, causal_flops(model, prompt) / (ms * 1e-3) / 1e12


def causal_flops(model: ModelConfig, prompt: int) -> float:
    """QK^T and PV, 2 FLOPs per multiply-add each, over the n(n+1)/2 visible (query, key) pairs."""
    return 4 * model.num_heads * model.head_dim * prompt * (prompt + 1) / 2


def time_sdpa(model: ModelConfig, prompt: int, device) -> float | None:
    """TFLOP/s of torch's fused causal SDPA on contiguous (1, heads, prompt, head_dim) tensors."""
    import torch.nn.functional as F
    from triton.testing import do_bench

    q = torch.randn(1, model.num_heads, prompt, model.head_dim, dtype=torch.bfloat16, device=device)
    k = torch.randn(1, model.num_kv_heads, prompt, model.head_dim, dtype=torch.bfloat16, device=device)
    group = model.num_heads // model.num_kv_heads
    try:
        run = lambda: F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)  # noqa: E731
        run()
    except TypeError:  # torch without enable_gqa
        k = k.repeat_interleave(group, dim=1)
        run = lambda: F.scaled_dot_product_attention(q, k, k, is_causal=True)  # noqa: E731
    ms = do_bench(run)
    return causal_flops(model, prompt) / (ms * 1e-3) / 1e12


DECODE_SHAPES = [(1, 1024), (1, 8192), (1, 32768), (32, 4096), (128, 2048), (256, 1024)]


def decode_table(models, device, copy_gbs) -> list[str]:
    lines = [f"{'decode (one layer)':34s} {'splits':>6s} {'ms':>8s} {'GB/s':>8s} {'of copy':>8s} "
             f"{'FP8 ms':>8s} {'GB/s':>8s} {'speed-up':>8s}"]
    from ferry.attention.kernels.decode_attention import choose_num_splits

    for name, model in models.items():
        for batch, context in DECODE_SHAPES:
            ms, gbs = time_decode(model, batch, context, 16, device)
            fp8_ms, fp8_gbs = time_decode(model, batch, context, 16, device, fp8_kv=True)
            splits = choose_num_splits(batch, model.num_kv_heads, context, torch.device(device))
            label = f"{name} bs {batch} ctx {context}"
            lines.append(f"{label:34s} {splits:6d} {ms:8.4f} {gbs:8.0f} {gbs / copy_gbs:8.0%} "
                         f"{fp8_ms:8.4f} {fp8_gbs:8.0f} {ms / fp8_ms:7.2f}x")
    return lines


VERIFY_TOKENS = 5  # a speculative verify: the request's last token and 4 draft proposals
VERIFY_CONTEXTS = [512, 4096, 32768]


def check_verify(model: ModelConfig, context: int, device) -> tuple[float, bool]:
    """(max error, within tolerance) of decode_attention's VERIFY_TOKENS query tokens of one request
    against the torch reference backend, which also stores their K/V in the cache first."""
    from ferry.attention.kernels.decode_attention import choose_num_splits, decode_attention
    from ferry.attention.torch_ref import TorchReferenceBackend

    q, k, v, cache, md = make_step(
        [(context - VERIFY_TOKENS, VERIFY_TOKENS)], model.num_heads, model.num_kv_heads, model.head_dim, 16,
        torch.bfloat16, device, q_scale=PEAKY,
    )
    scale = model.head_dim**-0.5
    expected = TorchReferenceBackend().forward(q, k, v, cache, md, scale).float()
    out = torch.empty_like(q)
    splits = choose_num_splits(1, model.num_kv_heads, context, q.device)
    decode_attention(q, cache, md.block_tables, md.seq_lens, scale, out, splits, query_len=VERIFY_TOKENS)
    max_err = (out.float() - expected).abs().max().item()
    return max_err, torch.allclose(out.float(), expected, atol=BF16_TOL, rtol=BF16_TOL)


def verify_table(model: ModelConfig, device) -> tuple[list[str], int]:
    """A VERIFY_TOKENS-token verify against a 1-token decode at batch 1: both read the request's K/V
    once, so the ratio should stay near 1. Returns the lines and how many correctness checks failed."""
    lines = [f"{'verify vs decode (llama, bs 1)':34s} {'1 tok ms':>8s} {f'{VERIFY_TOKENS} tok ms':>8s} {'ratio':>6s} {'max err':>9s}"]
    failed = 0
    for context in VERIFY_CONTEXTS:
        ms_one, _ = time_decode(model, 1, context, 16, device)
        ms_verify, _ = time_decode(model, 1, context, 16, device, query_len=VERIFY_TOKENS)
        max_err, ok = check_verify(model, context, device)
        failed += not ok
        lines.append(f"{f'ctx {context}':34s} {ms_one:8.4f} {ms_verify:8.4f} {ms_verify / ms_one:6.2f} "
                     f"{max_err:9.2e} {'PASS' if ok else 'FAIL'}")
    return lines, failed


def sweep(models, device) -> list[str]:
    """A few launch configurations of each kernel, on shapes that stress each."""
    from ferry.attention.kernels.decode_attention import DecodeConfig
    from ferry.attention.kernels.prefill_attention import PrefillConfig

    llama = models["llama-3.1-8b"]
    lines = [f"{'decode config (llama)':40s} {'bs1 32k GB/s':>13s} {'bs128 2k GB/s':>14s} {'FP8 bs128 2k':>13s}"]
    for block_n in (32, 64, 128):
        for num_warps in (4, 8):
            for num_stages in (2, 3, 4):
                config = DecodeConfig(block_n, num_warps, num_stages)
                try:
                    a = f"{time_decode(llama, 1, 32768, 16, device, config)[1]:13.0f}"
                    b = f"{time_decode(llama, 128, 2048, 16, device, config)[1]:14.0f}"
                    c = f"{time_decode(llama, 128, 2048, 16, device, config, fp8_kv=True)[1]:13.0f}"
                except Exception as e:  # out of shared memory, say
                    a, b, c = type(e).__name__, "", ""
                lines.append(f"{str(config):40s} {a:>13s} {b:>14s} {c:>13s}")
    lines.append(f"{'prefill config (llama, 8192 tokens)':52s} {'TFLOP/s':>8s}")
    for block_m in (64, 128):
        for block_n in (32, 64, 128):
            for num_stages in (2, 3):
                config = PrefillConfig(block_m, block_n, 8 if block_m == 128 else 4, num_stages)
                try:
                    tflops = f"{time_prefill(llama, 8192, 16, device, config)[1]:8.0f}"
                except Exception as e:  # out of shared memory, say
                    tflops = type(e).__name__
                lines.append(f"{str(config):52s} {tflops:>8s}")
    return lines


# ---- compiling without a GPU ----


def compile_report() -> list[str]:
    """Compile the kernels for sm_90 at the benchmark shapes, as the JIT would at launch (16-byte
    aligned pointers, strides divisible by 16), and read ptxas's register and spill counts."""
    import os
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ferry.attention.kernels import decode_attention as decode, prefill_attention as prefill, store_kv

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"

    def build(kernel, args: dict, constexprs: dict, num_warps: int, num_stages: int) -> str:
        signature = {**args, **{name: "constexpr" for name in constexprs}}
        attrs = {
            (i,): [["tt.divisibility", 16]]
            for i, (name, kind) in enumerate(signature.items())
            if kind.startswith("*") or name.startswith("stride")
        }
        src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(compiled.asm["ptx"])
        info = subprocess.run([str(ptxas), "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull], capture_output=True, text=True).stderr
        os.unlink(f.name)
        regs = re.search(r"Used (\d+) registers", info)
        spills = re.search(r"(\d+) bytes spill stores", info)
        return f"{regs.group(1) if regs else '?':>5s} regs {spills.group(1) if spills else '?':>5s} B spilled {compiled.metadata.shared // 1024:4d} KB smem"

    def strides(*names):
        return {name: "i32" for name in names}

    lines = []
    decode_cfg, prefill_cfg = decode.DecodeConfig(), prefill.default_config(128)
    decode_args = {"q_ptr": "*bf16", "cache_ptr": "*bf16", "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
                   "out_ptr": "*bf16", "lse_ptr": "*fp32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
                   "scale_log2": "fp32", "num_splits": "i32",
                   **strides("stride_q_tok", "stride_q_head", "stride_cache_kv", "stride_cache_block",
                             "stride_cache_tok", "stride_cache_head", "stride_table_req", "stride_out_tok",
                             "stride_out_head", "stride_out_split", "stride_lse_tok", "stride_lse_head")}

    def decode_consts(query_len, group, page):
        block_h = max(16, triton.next_power_of_2(query_len * group))
        return dict(QUERY_LEN=query_len, GROUP=group, BLOCK_H=block_h, HEAD_DIM=128, BLOCK_D=128, PAGE_SIZE=page,
                    BLOCK_N=decode_cfg.block_n, DOT_PRECISION="tf32", FP8_KV=False, WIDEN_Q=False, PDL=True)

    for group, page in ((2, 16), (4, 16), (8, 32)):
        consts = decode_consts(1, group, page)
        lines.append(f"{f'decode gqa {group} block {page}':26s}" + build(decode._decode_split_kernel, decode_args, consts, decode_cfg.num_warps, decode_cfg.num_stages))
        args = {"q_ptr": "*bf16", "cache_ptr": "*bf16", "block_tables_ptr": "*i32", "query_start_loc_ptr": "*i32",
                "seq_lens_ptr": "*i32", "out_ptr": "*bf16", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
                "scale_log2": "fp32", "num_reqs": "i32",
                **strides("stride_q_tok", "stride_q_head", "stride_cache_kv", "stride_cache_block", "stride_cache_tok",
                          "stride_cache_head", "stride_table_req", "stride_out_tok", "stride_out_head")}
        consts = dict(GROUP=group, BLOCK_M=prefill_cfg.block_m, BLOCK_Q=prefill_cfg.block_m // group, HEAD_DIM=128,
                      BLOCK_D=128, PAGE_SIZE=page, BLOCK_N=prefill_cfg.block_n, DOT_PRECISION="tf32", FP8_KV=False, WIDEN_Q=False)
        lines.append(f"{f'prefill gqa {group} block {page}':26s}" + build(prefill._prefill_kernel, args, consts, prefill_cfg.num_warps, prefill_cfg.num_stages))
        if group == 4:  # over an FP8 cache (its V widened by PTX in paged_tiles.load_kv_tile)
            fp8_consts = {**consts, "FP8_KV": True, "WIDEN_Q": True}
            lines.append(f"{f'prefill gqa {group} fp8':26s}" + build(prefill._prefill_kernel, {**args, "cache_ptr": "*fp8e4nv"}, fp8_consts, prefill_cfg.num_warps, prefill_cfg.num_stages))
    # Gemma 2's attention: head_dim 256, a sliding window and soft-capped scores.
    window_args = {"window": "i32", "softcap_log2": "fp32"}
    consts = {**decode_consts(1, 2, 16), "HEAD_DIM": 256, "BLOCK_D": 256, "WINDOW": True, "SOFTCAP": True}
    lines.append(f"{'decode window+softcap 256':26s}" + build(decode._decode_split_kernel, {**decode_args, **window_args},
                                                             consts, decode_cfg.num_warps, decode_cfg.num_stages))
    gemma_cfg = prefill.default_config(256)
    consts = dict(GROUP=2, BLOCK_M=gemma_cfg.block_m, BLOCK_Q=gemma_cfg.block_m // 2, HEAD_DIM=256, BLOCK_D=256,
                  PAGE_SIZE=16, BLOCK_N=gemma_cfg.block_n, DOT_PRECISION="tf32", FP8_KV=False, WIDEN_Q=False,
                  WINDOW=True, SOFTCAP=True)
    lines.append(f"{'prefill window+softcap 256':26s}" + build(prefill._prefill_kernel, {**args, **window_args}, consts,
                                                              gemma_cfg.num_warps, gemma_cfg.num_stages))
    fp8_args, fp8_cfg = {**decode_args, "cache_ptr": "*fp8e4nv"}, decode.FP8_DECODE_CONFIG
    for query_len, group in ((1, 4), (VERIFY_TOKENS, 8)):  # decode, and the largest verify tile (64 rows)
        consts = {**decode_consts(query_len, group, 16), "BLOCK_N": fp8_cfg.block_n, "FP8_KV": True, "WIDEN_Q": True}
        lines.append(f"{f'decode {query_len} tok gqa {group} fp8':26s}"
                     + build(decode._decode_split_kernel, fp8_args, consts, fp8_cfg.num_warps, fp8_cfg.num_stages))
    many = decode.FP8_MANY_PROGRAMS_CONFIG
    consts = {**decode_consts(1, 2, 16), "BLOCK_N": many.block_n, "FP8_KV": True, "WIDEN_Q": True}
    lines.append(f"{'decode gqa 2 fp8 many':26s}" + build(decode._decode_split_kernel, fp8_args, consts, many.num_warps, many.num_stages))
    consts = decode_consts(VERIFY_TOKENS, 4, 16)  # Llama-3.1-8B's verify: 5 tokens x 4 heads in 32 rows
    lines.append(f"{f'verify {VERIFY_TOKENS} gqa 4 block 16':26s}" + build(decode._decode_split_kernel, decode_args, consts, decode_cfg.num_warps, decode_cfg.num_stages))
    args = {"partial_ptr": "*fp32", "lse_ptr": "*fp32", "seq_lens_ptr": "*i32", "out_ptr": "*bf16", "num_splits": "i32",
            **strides("stride_part_tok", "stride_part_head", "stride_part_split", "stride_lse_tok",
                      "stride_lse_head", "stride_out_tok", "stride_out_head")}
    consts = dict(QUERY_LEN=1, HEAD_DIM=128, BLOCK_D=128, BLOCK_S=64, BLOCK_N=decode_cfg.block_n, PDL=True)
    lines.append(f"{'merge 64 splits':26s}" + build(decode._decode_merge_kernel, args, consts, 4, 1))
    args = {"k_ptr": "*bf16", "v_ptr": "*bf16", "cache_ptr": "*bf16", "slot_mapping_ptr": "*i64", "num_tokens": "i32",
            "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
            **strides("stride_k_tok", "stride_v_tok", "stride_cache_kv", "stride_cache_block", "stride_cache_tok",
                      "stride_cache_head")}
    for block_t, num_warps in ((1, 2), (16, 8)):
        consts = dict(ROW=1024, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_T=block_t, BLOCK_ROW=1024, FP8=False, PDL=True)
        lines.append(f"{f'store {block_t} tokens/program':26s}" + build(store_kv._store_kv_kernel, args, consts, num_warps, 1))
    consts = dict(ROW=1024, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_T=16, BLOCK_ROW=1024, FP8=True, PDL=True)
    lines.append(f"{'store 16 tokens fp8':26s}"
                 + build(store_kv._store_kv_kernel, {**args, "cache_ptr": "*fp8e4nv"}, consts, 8, 1))
    from ferry.kernels import fp8_quant

    args = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "static_scale_ptr": "*fp32", "k": "i32",
            **strides("stride_x", "stride_q")}
    for static in (False, True):
        label = f"fp8 quant{' static' if static else ''} 4096"
        consts = dict(GROUP=4096, STATIC=static, BLOCK_K=4096, PDL=True)
        lines.append(f"{label:26s}" + build(fp8_quant._quantize_rows_kernel, {**args, "stride_scale": "i32"}, consts, 8, 1))
    from ferry.layers import fused

    args = {"x_ptr": "*bf16", "residual_ptr": "*bf16", "weight_ptr": "*bf16", "out_ptr": "*fp8e4nv",
            "scale_ptr": "*fp32", **strides("stride_x", "stride_residual", "stride_out"), "n": "i32", "eps": "fp32"}
    consts = dict(HAS_RESIDUAL=True, BLOCK=4096, OUT_FP8=True, PDL=True)
    lines.append(f"{'add+norm to fp8 4096':26s}" + build(fused._rms_norm_kernel, args, consts, 16, 1))
    args = {"q_ptr": "*bf16", "k_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "q_weight_ptr": "*bf16",
            "k_weight_ptr": "*bf16", **strides("stride_q_tok", "stride_q_head", "stride_k_tok", "stride_k_head",
                                               "stride_rope_tok"), "eps": "fp32"}
    consts = dict(NUM_Q_HEADS=16, NUM_KV_HEADS=8, HEAD_DIM=128, HAS_NORM=True, BLOCK_H=16, BLOCK_HALF=64, PDL=True)
    lines.append(f"{'q/k norm+rope 16+8 heads':26s}" + build(fused._rotary_qk_kernel, args, consts, 4, 1))
    args = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", **strides("stride_x", "stride_q"), "d": "i32"}
    lines.append(f"{'silu*mul to fp8 14336':26s}"
                 + build(fused._silu_and_mul_fp8_kernel, args, dict(BLOCK=2048, PDL=True), 8, 1))
    from ferry.kernels import fp8_block_matmul as block_mm

    args = {"a_ptr": "*fp8e4nv", "a_scale_ptr": "*fp32", "b_ptr": "*fp8e4nv", "b_scale_ptr": "*fp32",
            "bias_ptr": "*fp32", "c_ptr": "*bf16", "m": "i32", "n": "i32", "k": "i32",
            **strides("stride_am", "stride_bn", "stride_cm", "stride_as", "stride_bs")}
    for block_m, num_warps in ((64, 8), (128, 8)):
        consts = dict(GROUP_N=128, GROUP_K=128, HAS_BIAS=False, BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=128)
        lines.append(f"{f'fp8 block matmul {block_m}x128':26s}" + build(block_mm._fp8_block_matmul_kernel, args, consts, num_warps, 3))
    from ferry.layers import gemv

    args = {"x_ptr": "*bf16", "w_ptr": "*bf16", "w_scale_ptr": "*fp32", "bias_ptr": "*bf16", "y_ptr": "*bf16",
            "residual_ptr": "*bf16",
            "residual_out_ptr": "*bf16", "norm_ptr": "*bf16", "m": "i32", "n": "i32", "k": "i32",
            **strides("stride_xm", "stride_wn", "stride_ym", "stride_rm"), "eps": "fp32"}
    for config in gemv.CANDIDATES:
        for name, silu, norm in (("plain", False, False), ("silu*mul", True, False), ("add+norm", False, True)):
            consts = dict(HAS_BIAS=False, BLOCK_M=1, BLOCK_N=config.block_n, BLOCK_K=config.block_k, EVEN_K=True,
                          SILU_MUL=silu, NORM=norm, HAS_RESIDUAL=norm, W_SCALE=False, PDL=True)
            label = f"gemv {config.block_n}x{config.block_k} {name}"
            lines.append(f"{label:26s}" + build(gemv._gemv_kernel, args, consts, config.num_warps, 1))
        consts = dict(HAS_BIAS=False, BLOCK_M=1, BLOCK_N=config.block_n, BLOCK_K=config.block_k, EVEN_K=True,
                      SILU_MUL=False, NORM=True, HAS_RESIDUAL=True, W_SCALE=True, PDL=True)
        label = f"gemv {config.block_n}x{config.block_k} fp8 norm"
        lines.append(f"{label:26s}" + build(gemv._gemv_kernel, {**args, "w_ptr": "*fp8e4nv"}, consts, config.num_warps, 1))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="also time a few launch configurations")
    parser.add_argument("--compile", action="store_true", help="only compile for sm_90 and report registers")
    args = parser.parse_args()
    if args.compile:
        print("\n".join(compile_report()))
        return
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --compile, or the tests under TRITON_INTERPRET=1")
    device = "cuda"
    t0 = time.perf_counter()
    rows = check_correctness(device)
    print(f"correctness ({time.perf_counter() - t0:.0f} s, bf16, tolerance {BF16_TOL}):")
    for label, max_err, rel_l2, ok in rows:
        print(f"  {label:28s} max err {max_err:.2e}  rel L2 {rel_l2:.2e}  {'PASS' if ok else 'FAIL'}")

    models = {name: ModelConfig.from_pretrained(BENCHMARKS / name, device=device) for name in ("qwen3-0.6b", "llama-3.1-8b")}
    copy_gbs = copy_bandwidth(device) / 1e9
    peak = matmul_tflops(device)
    lines = decode_table(models, device, copy_gbs)
    llama = models["llama-3.1-8b"]
    verify_lines, verify_failed = verify_table(llama, device)
    lines += verify_lines
    ms, tflops = time_prefill(llama, 8192, 16, device)
    sdpa = time_sdpa(llama, 8192, device)
    lines.append(f"prefill llama 8192 tokens (one layer): {ms:.3f} ms, {tflops:.0f} TFLOP/s "
                 f"({tflops / peak:.0%} of matmul); torch SDPA {sdpa:.0f} TFLOP/s")
    if args.sweep:
        lines += sweep(models, device)
    print(f"\ncopy bandwidth {copy_gbs:.0f} GB/s (read + written), bf16 matmul {peak:.0f} TFLOP/s")
    print("\n".join(lines))
    failed = sum(not ok for *_, ok in rows) + verify_failed
    checks = len(rows) + len(VERIFY_CONTEXTS)
    print(f"\ncorrectness: {checks - failed}/{checks} PASS")


if __name__ == "__main__":
    main()
