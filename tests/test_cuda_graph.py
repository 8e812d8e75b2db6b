"""Decode steps through the decode graphs (ferry/executor/cuda_graph.py) against the eager path.

On a CPU the graph runner runs the model eagerly on its padded static buffers, so the padding, the
static buffers and the choice between graph and eager are all tested here; the capture and replay
themselves need a GPU (the tests at the end).

CPU BLAS picks its kernels by the number of rows, so a batch padded from 3 to 4 rows computes the
same real rows with a different summation order: logits agree to float32 rounding, not bit for bit,
and greedy tokens agree exactly.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton's kernels run on CPU tensors under its interpreter, which must be chosen before Triton
    # is imported (making a tiny checkpoint with transformers imports it).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from ferry import LLM, SamplingParams  # noqa: E402
from ferry.attention.backend import ForwardContext  # noqa: E402
from ferry.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from ferry.core.outputs import ScheduledRequest, SchedulerOutput  # noqa: E402
from ferry.executor.model_runner import build_model_runner  # noqa: E402
from tiny_models import make_tiny_model, shuffled_block_tables  # noqa: E402

transformers = pytest.importorskip("transformers")

BLOCK_SIZE = 4
GRAPH_SIZES = (1, 2, 4, 8)
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [20] * 20, [33, 34], [40, 41, 42, 43, 44], [7] * 9, [3], [50, 51]]
DECODE_STEPS = 4
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model("qwen3", tmp_path_factory.mktemp("qwen3"))


def graph_runner(path, device="cpu", sizes=GRAPH_SIZES, enforce_eager=False):
    config = EngineConfig.create(
        path, dtype="float32", device=device, block_size=BLOCK_SIZE, num_kv_blocks=128,
        max_num_seqs=max(sizes), enforce_eager=enforce_eager, cuda_graph_batch_sizes=sizes,
    )
    return build_model_runner(config)


def prefill(runner, prompts: list[list[int]]) -> list[int]:
    """Run the prompts as new requests, with blocks for DECODE_STEPS more tokens; their first tokens."""
    tables, num_blocks = shuffled_block_tables([len(p) + DECODE_STEPS for p in prompts], runner.block_size)
    assert num_blocks <= runner.num_kv_blocks
    params = SamplingParams(temperature=0, max_tokens=DECODE_STEPS + 1)
    scheduled = [
        ScheduledRequest(f"r{i}", p, 0, tables[i], sample=True, new=True, sampling_params=params,
                         prompt_token_ids=p, output_token_ids=[])
        for i, p in enumerate(prompts)
    ]
    output = runner.execute(SchedulerOutput(scheduled, sum(map(len, prompts)))).sampled_token_ids
    return [tokens[0] for tokens in output]


def decode_step(prompts: list[list[int]], tokens: list[int], step: int) -> list[ScheduledRequest]:
    """Request i brings its token at position len(prompt) + step."""
    return [
        ScheduledRequest(f"r{i}", [t], len(p) + step, [], sample=True) for i, (p, t) in enumerate(zip(prompts, tokens))
    ]


@torch.inference_mode()
def eager_logits(runner, scheduled):
    inputs = runner.prepare_inputs(scheduled)
    ctx = ForwardContext(inputs.attn_metadata, runner.kv_caches, runner.backend)
    hidden = runner.model(inputs.input_ids, inputs.positions, ctx)
    return runner.model.compute_logits(hidden[inputs.logits_indices]), inputs


@torch.inference_mode()
def graph_logits(runner, scheduled):
    inputs = runner.prepare_decode_graph(scheduled)
    assert inputs is not None, "the step should run through the decode graphs"
    hidden = runner.decode_graphs.forward(inputs)
    return runner.model.compute_logits(hidden[inputs.logits_indices]), inputs


def snapshot(runner) -> list[torch.Tensor]:
    return [c.clone() for c in runner.kv_caches]


def restore(runner, caches: list[torch.Tensor]) -> None:
    for cache, saved in zip(runner.kv_caches, caches):
        cache.copy_(saved)  # in place: a captured graph holds the caches' addresses


def changed_slots(before: list[torch.Tensor], after: list[torch.Tensor]) -> set[int]:
    """Flat KV slots (block * block_size + offset) whose K or V changed in any layer."""
    slots = set()
    for b, a in zip(before, after):
        diff = (b != a).flatten(3).any(-1).any(0)  # (num_blocks, block_size)
        slots.update(diff.flatten().nonzero().flatten().tolist())
    return slots


# ---- CPU: padding, static buffers, fallbacks ----


def test_default_graph_sizes_follow_max_num_seqs():
    def sizes(max_num_seqs, explicit=None):
        scheduler = SchedulerConfig(max_num_seqs=max_num_seqs)
        return EngineConfig(None, CacheConfig(), scheduler, cuda_graph_batch_sizes=explicit).decode_graph_sizes

    assert sizes(256) == (1, 2, 4, *range(8, 257, 8))
    assert sizes(512) == sizes(256)
    assert sizes(12) == (1, 2, 4, 8, 12)
    assert sizes(1) == (1,)
    assert sizes(64, explicit=(4, 1, 4)) == (1, 4)
    with pytest.raises(ValueError, match="cuda_graph_batch_sizes"):
        sizes(8, explicit=(0, 2))


def test_cli_option_reaches_the_config(tiny_model):
    from ferry.engine_args import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args([]))["enforce_eager"] is None  # the device decides
    kwargs = engine_kwargs(parser.parse_args(["--no-enforce-eager"]))
    assert kwargs["enforce_eager"] is False
    assert EngineConfig.create(tiny_model, **kwargs).enforce_eager is False
    assert EngineConfig.create(tiny_model, device="cpu").enforce_eager is True
    assert EngineConfig.create(tiny_model, device="cuda").enforce_eager is False
    assert EngineConfig.create(tiny_model, device="cuda:1", enforce_eager=True).enforce_eager is True
    assert build_model_runner(EngineConfig.create(tiny_model, num_kv_blocks=8)).decode_graphs is None


@pytest.mark.parametrize("num_reqs", [1, 3, 5, 8])
def test_padded_decode_equals_eager_and_padding_writes_nothing(tiny_model, num_reqs):
    runner = graph_runner(tiny_model)
    prompts = PROMPTS[:num_reqs]
    tokens = prefill(runner, prompts)
    for step in range(DECODE_STEPS):
        scheduled = decode_step(prompts, tokens, step)
        before = snapshot(runner)
        expected, eager_inputs = eager_logits(runner, scheduled)
        after_eager = snapshot(runner)
        restore(runner, before)
        logits, inputs = graph_logits(runner, scheduled)

        b = runner.decode_graphs.padded_size(num_reqs)
        md, eager_md = inputs.attn_metadata, eager_inputs.attn_metadata
        assert inputs.input_ids.shape == (b,) and md.block_tables.shape == (b, runner.decode_graphs.max_blocks)
        # Real rows carry exactly the eager path's values; padding rows store nothing, read one key.
        assert torch.equal(inputs.input_ids[:num_reqs], eager_inputs.input_ids)
        assert torch.equal(inputs.positions[:num_reqs], eager_inputs.positions)
        assert torch.equal(md.slot_mapping[:num_reqs], eager_md.slot_mapping)
        assert torch.equal(md.seq_lens[:num_reqs], eager_md.seq_lens)
        width = eager_md.block_tables.shape[1]
        assert torch.equal(md.block_tables[:num_reqs, :width], eager_md.block_tables)
        assert md.slot_mapping[num_reqs:].eq(-1).all() and md.seq_lens[num_reqs:].eq(1).all()
        assert md.query_start_loc.tolist() == list(range(b + 1))

        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))
        real_slots = set(eager_md.slot_mapping.tolist())
        assert changed_slots(before, snapshot(runner)) <= real_slots
        for cache, eager_cache in zip(runner.kv_caches, after_eager):
            torch.testing.assert_close(cache, eager_cache, atol=1e-5, rtol=1e-5)
        tokens = logits.argmax(-1).tolist()


def test_padding_rows_cannot_reach_real_rows_or_the_cache(tiny_model):
    """Whatever garbage the padding rows carry (ids, positions), real rows and the cache outside
    their slots come out the same: rows mix only in attention, and slot -1 is never stored."""
    runner = graph_runner(tiny_model)
    prompts = PROMPTS[:3]
    scheduled = decode_step(prompts, prefill(runner, prompts), 0)
    before = snapshot(runner)
    clean, inputs = graph_logits(runner, scheduled)
    restore(runner, before)
    graphs = runner.decode_graphs
    inputs = runner.prepare_decode_graph(scheduled)
    inputs.input_ids[3:] = 311
    inputs.positions[3:] = 200
    with torch.inference_mode():
        hidden = graphs.forward(inputs)
        dirty = runner.model.compute_logits(hidden[inputs.logits_indices])
    assert torch.equal(dirty, clean)
    assert changed_slots(before, snapshot(runner)) <= set(inputs.attn_metadata.slot_mapping[:3].tolist())


def test_steps_outside_the_graphs_run_eagerly(tiny_model):
    runner = graph_runner(tiny_model, sizes=(1, 2))
    prompts = PROMPTS[:3]
    tokens = prefill(runner, prompts)
    decode = decode_step(prompts, tokens, 0)
    assert runner.prepare_decode_graph(decode) is None  # 3 requests, largest graph 2
    assert runner.prepare_decode_graph(decode[:2]) is not None
    # A prefill chunk beside a decode row.
    mixed = [decode[0], ScheduledRequest("r1", [1, 2], len(prompts[1]), [], sample=True)]
    assert runner.prepare_decode_graph(mixed) is None
    # A token that samples nothing (a chunk short of the prompt's end), or asks for prompt logprobs.
    assert runner.prepare_decode_graph([ScheduledRequest("r0", [1], 0, [], sample=False)]) is None
    assert runner.prepare_decode_graph([ScheduledRequest("r0", [1], 0, [], sample=True, prompt_logprobs=True)]) is None
    # A block table wider than max_model_len needs.
    graphs = runner.decode_graphs
    assert graphs.prepare([1], [0], [[0] * (graphs.max_blocks + 1)]) is None


def test_engine_through_graphs_equals_eager(tiny_model, monkeypatch):
    """Whole requests of different lengths, so the decode batch shrinks through 8, 5, 3, 2, 1 and
    steps run padded, unpadded and (5 > 4 with sizes 1, 2, 4) eagerly; greedy and seeded sampling."""
    params = [SamplingParams(temperature=0, max_tokens=m, logprobs=2) for m in (3, 10, 6, 12, 8, 4, 9, 2)]
    params[1] = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=10, logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    results = {}
    for eager in (True, False):
        llm = LLM(model=tiny_model, dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=128,
                  enforce_eager=eager, cuda_graph_batch_sizes=(1, 2, 4))
        graphs = llm.engine.executor.decode_graphs
        calls = []
        if graphs is not None:
            forward = graphs.forward
            counted = lambda inputs: calls.append(inputs.input_ids.shape[0]) or forward(inputs)  # noqa: E731
            monkeypatch.setattr(graphs, "forward", counted)
        results[eager] = llm.generate(prompts, params, use_tqdm=False)
    assert sorted(set(calls)) == [1, 2, 4]
    for eager_out, graph_out in zip(results[True], results[False]):
        e, g = eager_out.outputs[0], graph_out.outputs[0]
        assert g.token_ids == e.token_ids
        for e_lp, g_lp in zip(e.logprobs, g.logprobs):
            assert e_lp.keys() == g_lp.keys()
            assert [g_lp[t].logprob for t in e_lp] == pytest.approx([e_lp[t].logprob for t in e_lp], abs=1e-4)


# ---- Triton's fixed-split decode, under the interpreter on a CPU ----


@pytest.fixture(scope="module")
def triton_backends():
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        importlib.import_module("test_triton_kernels")  # patches the interpreter's gaps, once a session
    from ferry.attention.torch_ref import TorchReferenceBackend
    from ferry.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend, TorchReferenceBackend


def test_fixed_split_triton_decode_with_padding_rows(triton_backends):
    """Eight splits whatever the context (1 to 301 tokens: most splits empty for short ones), two
    padding rows with slot -1 and seq_len 1: real rows match the reference, the cache too."""
    triton_backend, reference = triton_backends
    from tiny_models import flat_batch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    chunks, pad, heads, kv_heads, head_dim, block_size = [(0, 1), (16, 1), (99, 1), (300, 1)], 2, 8, 2, 64, 16
    tables, num_blocks = shuffled_block_tables([c + n for c, n in chunks], block_size)
    _, md = flat_batch(chunks, tables, block_size)
    g = torch.Generator().manual_seed(0)
    n, b = len(chunks), len(chunks) + pad
    q, k, v = (torch.randn(b, h, head_dim, generator=g) for h in (heads, kv_heads, kv_heads))
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g)
    expected_cache = cache.clone()
    expected = reference().forward(q[:n], k[:n], v[:n], expected_cache, md, head_dim**-0.5)

    md.slot_mapping = torch.cat([md.slot_mapping, torch.full((pad,), -1)])
    md.seq_lens = torch.cat([md.seq_lens, torch.ones(pad, dtype=torch.int32)])
    md.block_tables = torch.cat([md.block_tables, torch.zeros(pad, md.block_tables.shape[1], dtype=torch.int32)])
    md.query_start_loc = torch.arange(b + 1, dtype=torch.int32)
    md.query_start_loc_cpu, md.seq_lens_cpu = list(range(b + 1)), md.seq_lens_cpu + [1] * pad
    for name in ("slot_mapping", "seq_lens", "block_tables", "query_start_loc"):
        setattr(md, name, getattr(md, name).to(device))
    cache = cache.to(device)
    q, k, v = q.to(device), k.to(device), v.to(device)
    out = triton_backend(decode_num_splits=8).forward(q, k, v, cache, md, head_dim**-0.5)
    torch.testing.assert_close(out[:n].cpu(), expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(cache.cpu(), expected_cache)


def test_runner_captures_triton_with_fixed_splits(tiny_model, triton_backends, monkeypatch):
    """With the Triton backend, each graph size gets its own backend with the split count of a
    max_model_len context fixed, and a padded decode step still equals the eager reference."""
    triton_backend, _ = triton_backends
    monkeypatch.setenv("FERRY_ATTENTION_BACKEND", "triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    runner = graph_runner(tiny_model, device=device, sizes=(1, 4))
    graphs = runner.decode_graphs
    assert graphs.capturable and isinstance(runner.backend, triton_backend)
    assert all(backend.decode_num_splits >= 1 for backend in graphs.backends.values())
    prompts = PROMPTS[:3]
    tokens = prefill(runner, prompts)
    scheduled = decode_step(prompts, tokens, 0)
    logits, _ = graph_logits(runner, scheduled)
    monkeypatch.setenv("FERRY_ATTENTION_BACKEND", "torch")
    reference = graph_runner(tiny_model, device=device, enforce_eager=True)
    prefill(reference, prompts)
    expected, _ = eager_logits(reference, scheduled)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


# ---- GPU: captured graphs ----

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")

# Prompt lengths for the GPU runs: single tokens to a long context that the graphs' fixed split
# count must cover, in more requests than the largest size so the batch shrinks through them all.
GPU_PROMPT_LENS = [1, 17, 300, 3000, 40, 900, 5, 64, 130, 2]


def gpu_model_args(name: str, tmp_path_factory) -> dict:
    if name == "tiny":
        return dict(model=make_tiny_model("llama3_scaled", tmp_path_factory.mktemp("llama")), max_model_len=512)
    return dict(model=REPO / "benchmarks/qwen3-0.6b", load_format="dummy", max_model_len=4096)


def generate_on_gpu(model_args: dict, enforce_eager: bool, prompt_lens: list[int], dtype="float32"):
    """Greedy outputs (token ids, top-2 logprobs per step) and the number of graph replays."""
    llm = LLM(**model_args, dtype=dtype, device="cuda", num_kv_blocks=1024, max_num_seqs=8,
              enforce_eager=enforce_eager)
    graphs = llm.engine.executor.decode_graphs
    assert (graphs is None) == enforce_eager
    replays = []
    if graphs is not None:
        assert graphs.num_captured == len(graphs.batch_sizes) == 4  # 1, 2, 4, 8
        forward = graphs.forward
        graphs.forward = lambda inputs: replays.append(inputs.input_ids.shape[0]) or forward(inputs)
    vocab = llm.engine.config.model.vocab_size
    g = torch.Generator().manual_seed(0)
    limit = model_args["max_model_len"] - 40
    prompts = [torch.randint(3, vocab, (min(n, limit),), generator=g).tolist() for n in prompt_lens]
    params = [SamplingParams(temperature=0, max_tokens=8 + 3 * i, ignore_eos=True, logprobs=2)
              for i in range(len(prompts))]
    prompts = [{"prompt_token_ids": p} for p in prompts]
    outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm, graphs
    gc.collect()
    torch.cuda.empty_cache()
    return outputs, replays


def assert_same_greedy_tokens(eager, graph, near_tie=1e-3):
    """Token for token, except that a near tie (top two logprobs closer than near_tie) may break
    either way under a different summation order; the sequences may part only there."""
    for e, g in zip(eager, graph):
        for i, (te, tg) in enumerate(zip(e.token_ids, g.token_ids)):
            if te != tg:
                top = sorted((lp.logprob for lp in e.logprobs[i].values()), reverse=True)
                assert top[0] - top[1] < near_tie, f"token {i} differs ({te} vs {tg}) without a near tie"
                break
            assert g.logprobs[i][tg].logprob == pytest.approx(e.logprobs[i][te].logprob, abs=1e-3)


@gpu
@pytest.mark.parametrize("name", ["tiny", "qwen3-0.6b"])
def test_graph_decode_equals_eager_decode_on_gpu(name, tmp_path_factory):
    model_args = gpu_model_args(name, tmp_path_factory)
    eager, _ = generate_on_gpu(model_args, True, GPU_PROMPT_LENS)
    graph, replays = generate_on_gpu(model_args, False, GPU_PROMPT_LENS)
    assert set(replays) == {1, 2, 4, 8}
    assert_same_greedy_tokens(eager, graph)


@gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=str)
def test_replay_equals_eager_forward_on_the_same_padded_inputs(tiny_model, dtype, tol):
    """The graph against the very launches it recorded, run eagerly, on one padded batch; then
    that a step prepares and replays without any host-device synchronization."""
    config = EngineConfig.create(tiny_model, dtype=str(dtype).removeprefix("torch."), device="cuda",
                                 block_size=16, num_kv_blocks=64, max_num_seqs=8, enforce_eager=False)
    runner = build_model_runner(config)
    graphs = runner.decode_graphs
    prompts = PROMPTS[:5]
    scheduled = decode_step(prompts, prefill(runner, prompts), 0)
    with torch.inference_mode():
        torch.cuda.set_sync_debug_mode("error")
        try:
            inputs = runner.prepare_decode_graph(scheduled)
            replayed = runner.model.compute_logits(graphs.forward(inputs)[inputs.logits_indices])
        finally:
            torch.cuda.set_sync_debug_mode("default")
        eager = runner.model.compute_logits(graphs._eager(inputs)[inputs.logits_indices])
    assert inputs.input_ids.shape[0] == 8
    torch.testing.assert_close(replayed, eager, atol=tol, rtol=tol)


@gpu
def test_programmatic_dependent_launch_changes_no_bit(tiny_model, monkeypatch):
    """Kernels launched with PDL (kernels/pdl.py) start before the one before them ends;
    waiting where they must, they compute exactly what they compute launched one after another.
    The same decode step, replayed many times, against the runner built with PDL off."""
    from ferry.kernels.pdl import enable_pdl, use_pdl

    def replayed_logits(pdl: bool) -> list[torch.Tensor]:
        monkeypatch.setenv("FERRY_PDL", "1" if pdl else "0")
        config = EngineConfig.create(tiny_model, dtype="bfloat16", device="cuda", block_size=16, num_kv_blocks=64,
                                     max_num_seqs=8, enforce_eager=False)
        assert config.pdl == pdl
        runner = build_model_runner(config)
        assert use_pdl(torch.device("cuda")) == (pdl and torch.cuda.get_device_capability() >= (9, 0))
        prompts = PROMPTS[:5]
        scheduled = decode_step(prompts, prefill(runner, prompts), 0)
        with torch.inference_mode():
            inputs = runner.prepare_decode_graph(scheduled)
            return [runner.model.compute_logits(runner.decode_graphs.forward(inputs)[inputs.logits_indices]).clone()
                    for _ in range(20)]

    try:
        with_pdl, without = replayed_logits(True), replayed_logits(False)
    finally:
        enable_pdl(True)
    assert all(torch.equal(a, without[0]) for a in with_pdl + without)
