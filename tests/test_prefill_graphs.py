"""Steps with prefill chunks through the prefill graphs (ferry/executor/prefill_graphs.py) against
the eager path.

On a CPU the runner runs the model eagerly on its padded static buffers, so the padding (the request
that owns the padding tokens, the requests of no tokens), the static buffers and the choice between
graph and eager are tested here, with the sdpa backend and with the Triton varlen kernel under its
interpreter; the capture and replay themselves need a GPU (the test at the end).

CPU BLAS picks its kernels by the number of rows, so a step padded from 23 to 32 rows computes the
same real rows with a different summation order: logits agree to float32 rounding, greedy tokens
exactly.
"""

from __future__ import annotations

import argparse
import importlib
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported (test_cuda_graph.py)

from ferry import LLM, SamplingParams  # noqa: E402
from ferry.attention.backend import ForwardContext  # noqa: E402
from ferry.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from ferry.core.outputs import ScheduledRequest, SchedulerOutput  # noqa: E402
from ferry.executor.model_runner import build_model_runner  # noqa: E402
from ferry.executor.prefill_graphs import PrefillGraphRunner  # noqa: E402
from tiny_models import make_tiny_model, shuffled_block_tables  # noqa: E402

pytest.importorskip("transformers")

BLOCK_SIZE = 4
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [20] * 13, [33, 34]]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model("qwen3", tmp_path_factory.mktemp("qwen3"))


def runner_with(path, max_tokens: int, enforce_eager=False, max_num_seqs=8):
    config = EngineConfig.create(path, dtype="float32", device="cpu", block_size=BLOCK_SIZE, num_kv_blocks=128,
                                 max_num_seqs=max_num_seqs, enforce_eager=enforce_eager,
                                 max_prefill_graph_tokens=max_tokens)
    return build_model_runner(config)


def new_requests(prompts, tables, extra=0):
    params = SamplingParams(temperature=0, max_tokens=4)
    return [ScheduledRequest(f"r{i}", p, 0, tables[i], sample=True, new=True, sampling_params=params,
                             prompt_token_ids=p, output_token_ids=[]) for i, p in enumerate(prompts)]


@torch.inference_mode()
def logits_of(runner, scheduled, padded: bool):
    inputs = runner.prepare_inputs(scheduled)
    assert inputs.padded is padded
    if padded:
        hidden = runner.prefill_graphs.forward(inputs.input_ids, inputs.positions, inputs.attn_metadata)
    else:
        hidden = runner.model(inputs.input_ids, inputs.positions,
                              ForwardContext(inputs.attn_metadata, runner.kv_caches, runner.backend))
    return runner.model.compute_logits(hidden[inputs.logits_indices]), inputs


def snapshot(runner):
    return [c.clone() for c in runner.kv_caches]


def changed_slots(before, after) -> set[int]:
    slots = set()
    for b, a in zip(before, after):
        slots.update((b != a).flatten(3).any(-1).any(0).flatten().nonzero().flatten().tolist())
    return slots


# ---- the sizes ----


def test_graph_sizes_follow_the_option_and_the_token_budget():
    def sizes(max_tokens, budget=2048):
        return EngineConfig(None, CacheConfig(), SchedulerConfig(max_num_batched_tokens=budget),
                            max_prefill_graph_tokens=max_tokens).prefill_graph_sizes

    assert sizes(0) == ()
    assert sizes(1000) == (16, 32, 64, 128, 256, 512, 1000)
    assert sizes(4096) == (16, 32, 64, 128, 256, 512, 1024, 1536, 2048)  # no further than the budget
    assert sizes(8) == (8,)
    with pytest.raises(ValueError, match="max_prefill_graph_tokens must be >= 0"):
        sizes(-1)


def test_request_counts_grow_fourfold_up_to_max_num_seqs_and_the_padding():
    from ferry.executor.prefill_graphs import request_counts

    assert request_counts(257) == (2, 8, 32, 128, 257)
    assert request_counts(9) == (2, 9)  # not 8 beside 9
    assert request_counts(2) == (2,)


def test_a_step_takes_the_fewest_requests_that_hold_it(tiny_model):
    """One prompt runs in a graph of two requests (itself and the padding), not of max_num_seqs + 1:
    every empty request's tiles would still be launched."""
    graphs = runner_with(tiny_model, 64).prefill_graphs  # max_num_seqs 8: request counts 2 and 9
    _, _, md = graphs.prepare([1] * 20, np.array([20]), np.array([0]), [[0, 1]])
    assert md.seq_lens.tolist() == [20, 12] and md.query_start_loc.tolist() == [0, 20, 32]
    assert md.block_tables.shape[0] == 2
    _, _, md = graphs.prepare([1] * 3, np.array([1, 2]), np.array([5, 0]), [[0], [1]])
    assert md.seq_lens.tolist() == [6, 2, 13] + [0] * 6 and md.query_start_loc.tolist() == [0, 1, 3] + [16] * 7
    # A graph of 16 tokens is needed for at most 16 requests and the padding.
    many = runner_with(tiny_model, 64, max_num_seqs=63).prefill_graphs
    assert many.request_counts == (2, 8, 32, 64)
    assert many._captured_request_counts(16) == (2, 8, 32) and many._captured_request_counts(64) == (2, 8, 32, 64)


def test_cli_option_reaches_the_runner(tiny_model):
    from ferry.engine_args import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    kwargs = engine_kwargs(parser.parse_args(["--max-prefill-graph-tokens", "64", "--no-enforce-eager",
                                              "--num-kv-blocks", "32"]))
    config = EngineConfig.create(tiny_model, **kwargs)
    assert config.prefill_graph_sizes == (16, 32, 64)
    assert build_model_runner(config).prefill_graphs.token_counts == (16, 32, 64)
    # Off by default, and with enforce_eager.
    assert build_model_runner(EngineConfig.create(tiny_model, num_kv_blocks=32, enforce_eager=False)).prefill_graphs is None
    assert runner_with(tiny_model, 64, enforce_eager=True).prefill_graphs is None


# ---- CPU: padding, static buffers, fallbacks ----


def test_padded_prefill_equals_eager_and_padding_writes_nothing(tiny_model):
    """Four prompts (25 tokens, padded to 32), then a step mixing three decodes with a chunk after a
    cached prefix, padded the same way; each against the eager path over the same cache."""
    eager, graphs = runner_with(tiny_model, 64, enforce_eager=True), runner_with(tiny_model, 64)
    tables, _ = shuffled_block_tables([len(p) + 12 for p in PROMPTS], BLOCK_SIZE)
    first = new_requests(PROMPTS, tables)
    for runner in (eager, graphs):
        runner.update_states(SchedulerOutput(first, 25))
    before = snapshot(graphs)
    expected, eager_inputs = logits_of(eager, first, padded=False)
    logits, inputs = logits_of(graphs, first, padded=True)
    md = inputs.attn_metadata
    assert inputs.input_ids.shape == (32,) and md.seq_lens.shape == (graphs.prefill_graphs.max_reqs,)
    # The real rows carry the eager path's values; request 4 owns the 7 padding tokens, the rest none.
    assert torch.equal(inputs.input_ids[:25], eager_inputs.input_ids)
    assert torch.equal(inputs.positions[:25], eager_inputs.positions)
    assert torch.equal(md.slot_mapping[:25], eager_inputs.attn_metadata.slot_mapping)
    assert md.slot_mapping[25:].eq(-1).all()
    assert md.query_start_loc.tolist() == [0, 3, 10, 23, 25] + [32] * 5
    assert md.seq_lens.tolist() == [3, 7, 13, 2, 7, 0, 0, 0, 0]
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
    assert changed_slots(before, snapshot(graphs)) <= set(eager_inputs.attn_metadata.slot_mapping.tolist())
    for cache, eager_cache in zip(graphs.kv_caches, eager.kv_caches):
        torch.testing.assert_close(cache, eager_cache, atol=1e-5, rtol=1e-5)

    # Decodes of requests 0, 1 and 3 beside 5 more tokens of request 2 after its 13 cached ones.
    tokens = expected.argmax(-1).tolist()
    mixed = [ScheduledRequest("r0", [tokens[0]], 3, [], sample=True),
             ScheduledRequest("r1", [tokens[1]], 7, [], sample=True),
             ScheduledRequest("r2", [1, 2, 3, 4, 5], 13, [], sample=False),
             ScheduledRequest("r3", [tokens[3]], 2, [], sample=True)]
    expected, eager_inputs = logits_of(eager, mixed, padded=False)
    logits, inputs = logits_of(graphs, mixed, padded=True)
    assert inputs.input_ids.shape == (16,) and inputs.sample_rows == [0, 1, 3]
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    for cache, eager_cache in zip(graphs.kv_caches, eager.kv_caches):
        torch.testing.assert_close(cache, eager_cache, atol=1e-5, rtol=1e-5)


def test_padding_tokens_cannot_reach_real_rows_or_the_cache(tiny_model):
    runner = runner_with(tiny_model, 32)
    tables, _ = shuffled_block_tables([len(p) + 4 for p in PROMPTS[:2]], BLOCK_SIZE)
    scheduled = new_requests(PROMPTS[:2], tables)
    runner.update_states(SchedulerOutput(scheduled, 10))
    before = snapshot(runner)
    clean, inputs = logits_of(runner, scheduled, padded=True)
    for cache, saved in zip(runner.kv_caches, before):
        cache.copy_(saved)
    inputs = runner.prepare_inputs(scheduled)
    inputs.input_ids[10:] = 311
    inputs.positions[10:] = 100
    with torch.inference_mode():
        hidden = runner.prefill_graphs.forward(inputs.input_ids, inputs.positions, inputs.attn_metadata)
        dirty = runner.model.compute_logits(hidden[inputs.logits_indices])
    assert torch.equal(dirty, clean)
    assert changed_slots(before, snapshot(runner)) <= set(inputs.attn_metadata.slot_mapping[:10].tolist())


def test_steps_outside_the_graphs_run_eagerly(tiny_model):
    runner = runner_with(tiny_model, 16)
    graphs = runner.prefill_graphs
    assert graphs.prepare([1] * 17, np.array([17]), np.array([0]), [[0] * 5]) is None  # 17 tokens, largest 16
    assert graphs.prepare([1] * 16, np.array([16]), np.array([0]), [[0] * 4]) is not None
    too_many = [1] * graphs.max_reqs  # max_num_seqs + 1 requests of one token
    assert graphs.prepare(too_many, np.ones(graphs.max_reqs, np.int64), np.zeros(graphs.max_reqs, np.int64),
                          [[0]] * graphs.max_reqs) is None
    wide = [[0] * (graphs._static.max_blocks + 1)]
    assert graphs.prepare([1], np.array([1]), np.array([0]), wide) is None


def test_engine_through_prefill_graphs_equals_eager(tiny_model, monkeypatch):
    """Whole requests with chunked prefill (a 24-token budget cuts the 20-token prompt), prefix
    caching (a shared prefix), greedy and seeded sampling, logprobs and prompt logprobs."""
    shared = [9, 8, 7, 6, 5, 4, 3, 2]
    prompts = [{"prompt_token_ids": p} for p in (*PROMPTS, shared + [1, 2], shared + [3], [11] * 20)]
    params = [SamplingParams(temperature=0, max_tokens=m, logprobs=2) for m in (3, 8, 6, 5, 4, 7, 2)]
    params[1] = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=8, logprobs=2)
    params[2] = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1)
    results, calls = {}, []
    for max_tokens in (0, 32):
        llm = LLM(model=tiny_model, dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=128, enforce_eager=False,
                  max_num_batched_tokens=24, enable_prefix_caching=True, max_prefill_graph_tokens=max_tokens)
        graphs = llm.engine.executor.prefill_graphs
        if graphs is not None:
            forward = graphs.forward
            monkeypatch.setattr(graphs, "forward", lambda ids, *rest: calls.append(ids.shape[0]) or forward(ids, *rest))
        results[max_tokens] = llm.generate(prompts, params, use_tqdm=False)
    assert calls and set(calls) <= {16, 24}  # no count above the 24-token budget
    for eager_out, graph_out in zip(results[0], results[32]):
        e, g = eager_out.outputs[0], graph_out.outputs[0]
        assert g.token_ids == e.token_ids
        assert (g.logprobs is None) == (e.logprobs is None)
        for e_lp, g_lp in zip(e.logprobs or [], g.logprobs or []):
            assert e_lp.keys() == g_lp.keys()
            assert [g_lp[t].logprob for t in e_lp] == pytest.approx([e_lp[t].logprob for t in e_lp], abs=1e-4)
        if eager_out.prompt_logprobs is not None:
            for e_lp, g_lp in zip(eager_out.prompt_logprobs[1:], graph_out.prompt_logprobs[1:]):
                assert [v.logprob for v in g_lp.values()] == pytest.approx([v.logprob for v in e_lp.values()], abs=1e-4)


# ---- Triton's varlen kernel over the padded layout, under the interpreter on a CPU ----


def test_triton_varlen_kernel_over_the_padded_layout():
    """The padded step's metadata (a request owning the padding tokens, requests of no tokens, the
    grid of a fixed request count) through the Triton backend: the real rows match the reference on
    the unpadded step, and the cache takes the real tokens only."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        importlib.import_module("test_triton_kernels")  # patches the interpreter's gaps, once a session
    from ferry.attention.torch_ref import TorchReferenceBackend
    from ferry.attention.triton_backend import TritonAttentionBackend
    from tiny_models import flat_batch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    chunks, heads, kv_heads, head_dim, block_size = [(0, 9), (20, 1), (5, 6), (0, 1)], 4, 2, 64, 16
    tables, num_blocks = shuffled_block_tables([c + n for c, n in chunks], block_size)
    _, md = flat_batch(chunks, tables, block_size)
    g = torch.Generator().manual_seed(0)
    n, padded = sum(q for _, q in chunks), 32
    q, k, v = (torch.randn(padded, h, head_dim, generator=g) for h in (heads, kv_heads, kv_heads))
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g)
    expected_cache = cache.clone()
    expected = TorchReferenceBackend().forward(q[:n], k[:n], v[:n], expected_cache, md, head_dim**-0.5)

    runner = PrefillGraphRunner(None, [cache.to(device)], None, (16, padded), max_num_seqs=6, max_model_len=512)
    query_lens = np.array([q for _, q in chunks])
    _, _, padded_md = runner.prepare([0] * n, query_lens, np.array([c for c, _ in chunks]), tables)
    assert padded_md.slot_mapping.shape == (padded,) and padded_md.seq_lens.shape == (7,)
    cache = runner.kv_caches[0]
    out = TritonAttentionBackend().forward(q.to(device), k.to(device), v.to(device), cache, padded_md, head_dim**-0.5)
    torch.testing.assert_close(out[:n].cpu(), expected, atol=1e-4, rtol=1e-4)
    assert torch.isfinite(out).all()
    assert torch.equal(cache.cpu(), expected_cache)


# ---- GPU: capture and replay ----


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_replay_equals_eager_on_gpu(tiny_model):
    results = {}
    for max_tokens in (0, 64):
        llm = LLM(model=tiny_model, dtype="float32", device="cuda", block_size=BLOCK_SIZE, num_kv_blocks=128,
                  max_num_batched_tokens=32, max_prefill_graph_tokens=max_tokens)
        assert (llm.engine.executor.prefill_graphs is not None) == bool(max_tokens)
        if max_tokens:  # 16 and 32 tokens (no more than the budget), each with the request counts it can need
            assert set(llm.engine.executor.prefill_graphs._graphs) == {
                (16, 2), (16, 8), (16, 32), (32, 2), (32, 8), (32, 32), (32, 128)}
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        results[max_tokens] = [o.outputs[0].token_ids for o in llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)]
    assert results[64] == results[0]
