"""Speculative decoding end to end: prompt lookup and draft models in front of real models.

- Greedy outputs with speculation are token for token those without, for tiny models of every
  architecture and the bundled model, with chunked prefill, preemption and prefix caching forced,
  with a draft that is always right (the target itself) and one that is mostly wrong.
- Sampled outputs follow the target's distribution: a chi-square test of thousands of samples
  against the exact distribution, computed by transformers from the same weights.
- No KV block leaks: every block is free after runs with speculation, aborts and preemption.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path

import pytest
import torch

from ferry import SamplingParams
from ferry.config import EngineConfig
from ferry.engine.engine import LLMEngine
from test_scheduler import assert_all_blocks_free, run

transformers = pytest.importorskip("transformers")

ARCHS = ("llama", "qwen2", "qwen3", "mistral")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Tiny checkpoints of every architecture, and a 'bad' draft: a llama of other weights."""
    from tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("spec")
    paths = {arch: make_tiny_model(arch, root / arch) for arch in ARCHS}
    paths["bad_draft"] = make_tiny_model("llama", root / "bad_draft", seed=7)
    return paths


def _engine(path, spec=None, **options) -> LLMEngine:
    defaults = dict(dtype="float32", block_size=4, num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=16)
    return LLMEngine.from_config(EngineConfig.create(path, speculative_config=spec, **{**defaults, **options}))


def _prompts(seed: int, vocab: int = 320) -> list[list[int]]:
    """Prompts longer than the step's budget (chunked), some sharing a prefix (prefix cache), some
    repeating themselves (prompt lookup finds something)."""
    rng = random.Random(seed)
    base = [rng.randrange(3, vocab) for _ in range(24)]
    loop = [rng.randrange(3, vocab) for _ in range(5)]
    return [base + [rng.randrange(3, vocab) for _ in range(6)], base + [rng.randrange(3, vocab) for _ in range(9)],
            loop * 5, [rng.randrange(3, vocab) for _ in range(19)], base[:12] + loop * 3,
            [rng.randrange(3, vocab) for _ in range(30)]]


def _greedy(engine: LLMEngine, prompts, max_tokens=24) -> list[list[int]]:
    final = run(engine, prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return [final[str(i)].outputs[0].token_ids for i in range(len(prompts))]


def _spec(method: str, k: int, tiny: dict, arch: str) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    draft = tiny[arch] if method == "self_draft" else tiny["bad_draft"]
    return {"model": str(draft), "num_speculative_tokens": k}


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("method", ["ngram", "self_draft", "bad_draft"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_outputs_equal_those_without_speculation(tiny, arch, method, k):
    """A pool too small for all (preemption), prompts over the step's budget (chunked prefill) and
    shared prefixes (prefix caching): whatever is proposed, the greedy tokens are those of plain
    decoding, and every block is free at the end."""
    prompts = _prompts(seed=ARCHS.index(arch))
    options = dict(num_kv_blocks=24, decode_reserve=0)  # (no admission reserve: the pool runs dry)
    reference = _greedy(_engine(tiny[arch], **options), prompts)
    engine = _engine(tiny[arch], _spec(method, k, tiny, arch), **options)
    assert _greedy(engine, prompts) == reference
    scheduler = engine.scheduler
    assert scheduler.num_preemptions > 0
    assert scheduler.kv_cache.prefix_cache.hits > 0
    stats = scheduler.spec_stats
    assert stats.num_draft_tokens > 0
    if method == "self_draft":  # the target as its own draft: every guess is right
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    if method == "bad_draft":
        assert stats.num_accepted_tokens < stats.num_draft_tokens
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3},
    {"model": "ferry-default-draft", "num_speculative_tokens": 1},
    {"model": "ferry-default-draft", "num_speculative_tokens": 3},
    {"model": "ferry-default-draft", "num_speculative_tokens": 5},
    {"model": "ferry-default-draft", "num_speculative_tokens": 6, "draft_confidence_threshold": 0.5},
], ids=["ngram3", "draft1", "draft3", "draft5", "draft6_confident"])
def test_the_bundled_model_and_its_draft(spec):
    from ferry.assets import default_model_path
    from ferry.tokenizer import Tokenizer

    path = default_model_path()
    tokenizer = Tokenizer.from_pretrained(path)
    texts = ["def fibonacci(n):", "import os\n\ndef walk(path):", "class Stack:\n    def __init__(self):",
             "def read_lines(filename):\n    with open(filename) as f:"]
    prompts = [tokenizer.encode(t) for t in texts] + [tokenizer.encode(texts[1] + "\n    for root in path:")]
    options = dict(num_kv_blocks=22, block_size=8, max_num_batched_tokens=24, decode_reserve=0)
    reference = _greedy(_engine(path, **options), prompts, max_tokens=40)
    engine = _engine(path, spec, **options)
    assert _greedy(engine, prompts, max_tokens=40) == reference
    assert engine.scheduler.num_preemptions > 0
    stats = engine.scheduler.spec_stats
    assert stats.num_accepted_tokens > stats.num_draft_tokens * 0.3  # it is a trained draft of this model
    if spec.get("draft_confidence_threshold"):  # it stopped short where unsure, and went far where sure
        assert stats.num_draft_tokens < spec["num_speculative_tokens"] * stats.num_drafts
        assert len(stats.accepted_per_pos) == spec["num_speculative_tokens"]
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("method", ["draft", "ngram"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_speculation_runs_on_the_decode_graphs(device, method):
    """Without enforce_eager the target's verify steps (requests with fewer proposals padded to the
    graph's rows) and the draft's forwards of one and two tokens a request go through decode graphs
    (replayed on CUDA; on a CPU the same padded buffers run eagerly), and the outputs stay those of
    plain decoding (float32: no near-tie flips)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from ferry.assets import default_model_path

    path = default_model_path()
    prompts = [[1, 100 + i, 200, 300 + 7 * i, 45] for i in range(5)]
    options = dict(device=device, block_size=16, num_kv_blocks=256, enforce_eager=False, max_num_batched_tokens=256,
                   cuda_graph_batch_sizes=(1, 2, 4, 8))
    reference = _greedy(_engine(path, **options), prompts, max_tokens=48)
    spec = ({"model": "ferry-default-draft", "num_speculative_tokens": 3} if method == "draft"
            else {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    engine = _engine(path, spec, **options)
    used = {}

    def counting(graphs, name):
        forward = graphs.forward

        def count(inputs):
            key = (name, inputs.attn_metadata.max_query_len, isinstance(inputs.logits_indices, torch.Tensor))
            used[key] = used.get(key, 0) + 1
            return forward(inputs)

        graphs.forward = count

    counting(engine.executor.decode_graphs, "target")
    if method == "draft":
        counting(engine.executor.proposer.graphs, "draft")
    assert _greedy(engine, prompts, max_tokens=48) == reference
    assert used.get(("target", 4, False)) or used.get(("target", 4, True))  # verify steps
    if method == "draft":
        assert used.get(("draft", 1, False)) and used.get(("draft", 2, False))
    else:  # prompt lookup guesses a varying number of tokens: padded rows
        assert used.get(("target", 4, True))
    assert_all_blocks_free(engine)


def test_aborts_and_n_sequences_leave_no_block_behind(tiny):
    engine = _engine(tiny["qwen3"], {"model": str(tiny["bad_draft"]), "num_speculative_tokens": 3},
                     num_kv_blocks=30, decode_reserve=0)
    prompts = _prompts(seed=4)
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.9, max_tokens=30, ignore_eos=True, n=2, seed=3)] * 3
    final = run(engine, prompts, params, abort_after={"0": 3, "3": 7, "5": 1})
    assert {final[i].outputs[0].finish_reason for i in ("0", "3", "5") if i in final} <= {"abort"}
    assert engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(engine)


def test_rejected_proposals_give_their_blocks_back(tiny):
    """A running request holds no block past its computed tokens, the token just sampled and the
    draft's lookahead: what rejected proposals filled goes back to the pool."""
    engine = _engine(tiny["llama"], {"model": str(tiny["bad_draft"]), "num_speculative_tokens": 5},
                     block_size=2, num_kv_blocks=200)
    engine.add_request("a", {"prompt_token_ids": _prompts(1)[3]}, SamplingParams(temperature=0, max_tokens=40,
                                                                                  ignore_eos=True))
    kv, lookahead, trimmed = engine.scheduler.kv_cache, engine.scheduler.lookahead_slots, 0
    assert lookahead == 5
    while engine.has_unfinished_requests():
        engine.step()
        request = engine.scheduler.requests.get("a")
        if request is not None:
            held = len(kv.block_ids("a"))
            assert held <= -(-(request.num_computed_tokens + 1 + lookahead) // kv.block_size)
            trimmed += kv._dropped.get("a", 0)
    assert trimmed > 0
    assert_all_blocks_free(engine)


def test_seeded_sampling_is_reproducible_and_logprobs_are_those_of_the_tokens(tiny):
    spec = {"model": str(tiny["bad_draft"]), "num_speculative_tokens": 3}
    prompts = _prompts(seed=5)[:4]
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=20, ignore_eos=True, logprobs=2)
    first = run(_engine(tiny["qwen2"], spec), prompts, params)
    second = run(_engine(tiny["qwen2"], spec), prompts, params)
    for i in range(len(prompts)):
        a, b = first[str(i)].outputs[0], second[str(i)].outputs[0]
        assert a.token_ids == b.token_ids
        assert [set(p) for p in a.logprobs] == [set(p) for p in b.logprobs]
        assert all(token in p for token, p in zip(a.token_ids, a.logprobs))
    # Greedy: the logprobs with speculation are those without (computed in rows of other shapes).
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
    plain = run(_engine(tiny["qwen2"]), prompts, greedy)
    verified = run(_engine(tiny["qwen2"], spec), prompts, greedy)
    for i in range(len(prompts)):
        a, b = plain[str(i)].outputs[0], verified[str(i)].outputs[0]
        assert a.token_ids == b.token_ids
        for pa, pb in zip(a.logprobs, b.logprobs, strict=True):
            assert pa.keys() == pb.keys()
            for token in pa:
                assert pb[token].logprob == pytest.approx(pa[token].logprob, abs=1e-4)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_disable_by_batch_size_turns_proposals_off_in_large_batches(tiny, method, async_scheduling):
    """No proposals while more than two requests run, and with asynchronous scheduling the steps
    overlap then; once the short ones are done, proposals."""
    spec = ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1} if method == "ngram"
            else {"model": str(tiny["llama"]), "num_speculative_tokens": 3})
    spec["disable_by_batch_size"] = 2
    prompts = _prompts(seed=6)
    params = [SamplingParams(temperature=0, max_tokens=40 if i < 2 else 6, ignore_eos=True) for i in range(6)]
    engine = _engine(tiny["llama"], spec, num_kv_blocks=200, max_num_batched_tokens=256,
                     async_scheduling=async_scheduling)
    verified, overlapped = [], []
    schedule = engine.scheduler.schedule

    def recording():
        out = schedule()
        verified.append((len(out.scheduled), sum(s.num_draft_tokens for s in out.scheduled)))
        overlapped.append(any(None in s.token_ids for s in out.scheduled))
        return out

    engine.scheduler.schedule = recording
    reference = run(_engine(tiny["llama"], num_kv_blocks=200, max_num_batched_tokens=256), prompts, params)
    final = run(engine, prompts, params)
    for i in range(6):
        assert final[str(i)].outputs[0].token_ids == reference[str(i)].outputs[0].token_ids
    assert any(drafts for _, drafts in verified)
    # A step verifies proposals that the step before made, which ran no more than two requests.
    for (before, _), (_, drafts) in zip(verified, verified[1:]):
        assert drafts == 0 or before <= 2
    assert any(overlapped) == async_scheduling
    assert_all_blocks_free(engine)


# ---- the distribution: speculative sampling is exact ----


VOCAB = 8


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """A one-layer llama of 8 tokens, with peaked distributions (weights of std 0.5), and a draft of
    other weights: a 'good' draft (the target itself) and a bad one."""
    from tiny_models import randomize_weights

    root = tmp_path_factory.mktemp("vocab8")
    paths = {}
    for name, seed in (("target", 0), ("bad_draft", 5)):
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
            tie_word_embeddings=False)
        model = transformers.AutoModelForCausalLM.from_config(config)
        randomize_weights(model, seed, std=0.5)
        model.save_pretrained(root / name)
        paths[name] = root / name
    return paths


def _exact_distribution(path: Path, prompt: list[int], depth: int, top_p: float) -> dict[tuple[int, ...], float]:
    """P(t1 .. t_depth) of sampling at temperature 1 (then top-p), from transformers' own forward."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    paths = list(itertools.product(range(VOCAB), repeat=depth - 1))
    ids = torch.tensor([prompt + list(p) for p in paths])
    with torch.no_grad():
        probs = model(ids).logits[:, len(prompt) - 1:].float().softmax(dim=-1)  # (paths, depth, vocab)
    if top_p < 1:  # the smallest set of most likely tokens whose mass reaches top_p
        ordered, order = probs.sort(dim=-1, descending=True)
        before = ordered.cumsum(dim=-1) - ordered  # mass of the tokens more likely than each
        kept = torch.zeros_like(probs).scatter_(-1, order, (before < top_p).float())
        probs = probs * kept
        probs = probs / probs.sum(dim=-1, keepdim=True)
    out = {}
    for row, prefix in enumerate(paths):
        for last in range(VOCAB):
            tokens = (*prefix, last)
            p = math.prod(probs[row, j, tokens[j]].item() for j in range(depth))
            out[tokens] = out.get(tokens, 0.0) + p
    return out


def _chi_square_p_value(counts: dict, expected: dict[tuple[int, ...], float], n: int) -> float:
    """Goodness of fit of the observed counts to the exact probabilities; cells expected below 5
    are pooled into one."""
    observed_cells, expected_cells, pooled_o, pooled_e = [], [], 0, 0.0
    for cell, p in expected.items():
        if p * n >= 5:
            observed_cells.append(counts.get(cell, 0))
            expected_cells.append(p * n)
        else:
            pooled_o += counts.get(cell, 0)
            pooled_e += p * n
    if pooled_e > 0:
        observed_cells.append(pooled_o)
        expected_cells.append(pooled_e)
    stat = sum((o - e) ** 2 / e for o, e in zip(observed_cells, expected_cells))
    dof = len(observed_cells) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.parametrize("top_p", [1.0, 0.9], ids=["temperature1", "top_p0.9"])
@pytest.mark.parametrize("draft", ["target", "bad_draft", "ngram", "confident_bad_draft"])
def test_sampled_tokens_follow_the_targets_distribution(small_vocab, draft, top_p):
    """6000 samples of four tokens with speculation (up to two proposals verified after the first
    token): the joint distribution of the first three tokens, and the fourth's, match the exact
    ones (p > 0.01), whether the guesses are always kept, mostly replaced, plain tokens, or as many
    as the draft was sure of."""
    prompt, n = [1, 5, 3], 6000
    spec = ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1} if draft == "ngram"
            else {"model": str(small_vocab[draft.removeprefix("confident_")]), "num_speculative_tokens": 3})
    if draft.startswith("confident_"):
        spec["draft_confidence_threshold"] = 0.2
    spec["disable_by_batch_size"] = None  # (batches of 256: on, whatever the default)
    engine = _engine(small_vocab["target"], spec, num_kv_blocks=4096, max_num_seqs=256, max_num_batched_tokens=1024,
                     seed=17)
    final = run(engine, [prompt] * n, SamplingParams(temperature=1.0, top_p=top_p, max_tokens=4, ignore_eos=True))
    samples = [tuple(final[str(i)].outputs[0].token_ids) for i in range(n)]
    stats = engine.scheduler.spec_stats
    assert stats.num_drafts > n / 3  # samples went through verification
    if draft == "bad_draft":
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    if draft.startswith("confident_"):  # some proposals stopped short
        assert stats.num_draft_tokens < 3 * stats.num_drafts
    joint = _exact_distribution(small_vocab["target"], prompt, 3, top_p)
    counts = {}
    for s in samples:
        counts[s[:3]] = counts.get(s[:3], 0) + 1
    assert _chi_square_p_value(counts, joint, n) > 0.01
    fourth = {}
    for tokens, p in _exact_distribution(small_vocab["target"], prompt, 4, top_p).items():
        fourth[tokens[3:]] = fourth.get(tokens[3:], 0.0) + p
    counts = {}
    for s in samples:
        counts[s[3:]] = counts.get(s[3:], 0) + 1
    assert _chi_square_p_value(counts, fourth, n) > 0.01
    assert_all_blocks_free(engine)


def test_a_wrong_rejection_rule_fails_the_distribution_test(small_vocab, monkeypatch):
    """The test above can fail: keeping every guess (no rejection) skews the samples far from p."""
    from ferry.sample import rejection

    def keep_everything(probs, draft, accept_u):
        probs.zero_().scatter_(1, draft.token_ids.unsqueeze(1), 1.0)
        return probs

    monkeypatch.setattr(rejection, "verify_rows_", keep_everything)
    monkeypatch.setattr("ferry.sample.sampler.verify_rows_", keep_everything)
    prompt, n = [1, 5, 3], 3000
    engine = _engine(small_vocab["target"], {"model": str(small_vocab["bad_draft"]), "num_speculative_tokens": 3,
                                              "disable_by_batch_size": None},
                     num_kv_blocks=4096, max_num_seqs=256, max_num_batched_tokens=1024, seed=17)
    final = run(engine, [prompt] * n, SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True))
    counts = {}
    for i in range(n):
        key = tuple(final[str(i)].outputs[0].token_ids)
        counts[key] = counts.get(key, 0) + 1
    assert _chi_square_p_value(counts, _exact_distribution(small_vocab["target"], prompt, 3, 1.0), n) < 1e-6


def test_the_rejection_rule_gives_p_for_any_q():
    """For every guess d drawn from q: keep it with min(1, p(d)/q(d)), else draw from the residual.
    The mixture over d is p, exactly (up to float rounding)."""
    from ferry.sample.rejection import DraftRows, verify_rows_

    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        p = torch.rand(6, generator=generator) ** 3
        p[torch.randint(6, (1,), generator=generator)] = 0.0
        q = torch.rand(6, generator=generator) ** 2
        p, q = p / p.sum(), q / q.sum()
        total = torch.zeros(6, dtype=torch.float64)
        for d in range(6):
            keep = min(1.0, (p[d] / q[d]).item())
            rejected = verify_rows_(p.clone()[None], DraftRows([0], torch.tensor([d]), q[None]),
                                    torch.tensor([[1 - 1e-7]]))[0]  # drawn above every ratio below 1
            rejected = rejected / rejected.sum()
            if keep < 1:
                total += q[d].item() * ((1 - keep) * rejected.double())
            total[d] += q[d].item() * keep
        assert torch.allclose(total, p.double(), atol=1e-6)


# ---- prompt lookup ----


def _lookup(tokens: list[int], k=3, max_n=3, min_n=1) -> list[int]:
    from ferry.spec.ngram import NgramProposer
    from ferry.spec.proposer import SpecRequest

    request = SpecRequest("r", SamplingParams(), tokens[:2], tokens[2:], [])
    return NgramProposer(k, max_n, min_n).propose([request])[0]


def test_prompt_lookup_takes_the_longest_latest_match():
    assert _lookup([1, 2, 3, 4, 9, 9, 2, 3]) == [4, 9, 9]  # "2 3" was followed by 4 9 9
    assert _lookup([5, 2, 3, 7, 8, 1, 3, 6, 6, 2, 3]) == [7, 8, 1]  # "2 3" beats "3" alone
    assert _lookup([1, 2, 8, 8, 1, 2, 9, 9, 1, 2]) == [9, 9, 1]  # the latest of equal matches
    assert _lookup([4, 5, 4, 5]) == [4, 5, 4]  # a loop goes on past the context's end
    assert _lookup([1, 2, 3, 4]) == []  # nothing repeats
    assert _lookup([1, 2, 3, 4, 2, 3], min_n=3) == []  # shorter than prompt_lookup_min


def test_prompt_lookup_indexes_only_new_tokens():
    """Incrementally, step by step, the proposals are those of looking at the whole context anew."""
    from ferry.spec.ngram import NgramProposer
    from ferry.spec.proposer import SpecRequest

    rng = random.Random(3)
    tokens = [rng.randrange(6) for _ in range(200)]
    proposer = NgramProposer(4, 4, 2)
    request = SpecRequest("r", SamplingParams(), tokens[:20], [], [])
    for end in range(20, 200, 3):
        request.output_token_ids[:] = tokens[20:end]
        assert proposer.propose([request])[0] == _lookup(tokens[:end], 4, 4, 2), end


# ---- configuration ----


@pytest.mark.parametrize(("spec", "message"), [
    ({"method": "eagle", "num_speculative_tokens": 3}, "not supported"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "must be in"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup"),
    ({"method": "ngram", "num_speculative_tokens": 3, "speculative_token_tree": "x"}, "does not take"),
    ({"model": "/no/such/folder", "num_speculative_tokens": 3}, "no config.json"),
    ({"num_speculative_tokens": 3}, "give a method"),
    ({"method": "ngram", "num_speculative_tokens": "3"}, "must be an integer"),
    ({"method": "ngram", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2}, "must be 1"),
    ({"model": "ferry-default-draft", "num_speculative_tokens": 3, "draft_confidence_threshold": 1.5}, r"\[0, 1\)"),
    ({"model": "ferry-default-draft", "num_speculative_tokens": 3, "draft_confidence_threshold": "0.5"},
     "must be a number"),
    ({"method": "ngram", "num_speculative_tokens": 3, "draft_confidence_threshold": 0.5}, "has no confidence"),
    ("{not json", "not valid JSON"),
    ([1, 2], "must be an object"),
])
def test_bad_speculative_configs_are_errors_naming_the_key(spec, message):
    from ferry.assets import default_model_path

    with pytest.raises(ValueError, match=message):
        EngineConfig.create(default_model_path(), speculative_config=spec)


def test_proposals_stop_above_64_running_requests_unless_told():
    from ferry.assets import default_model_path

    create = EngineConfig.create
    spec = create(default_model_path(), speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert spec.speculative_config.disable_by_batch_size == 64
    spec = create(default_model_path(), speculative_config='{"method": "ngram", "num_speculative_tokens": 2, '
                                                           '"disable_by_batch_size": null}')
    assert spec.speculative_config.disable_by_batch_size is None


def test_a_draft_of_another_vocabulary_is_refused(tiny, small_vocab):
    with pytest.raises(ValueError, match="vocabulary"):
        EngineConfig.create(tiny["llama"], max_model_len=64, speculative_config={"model": str(small_vocab["target"]),
                                                                                 "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="max_position_embeddings"):  # a draft must hold the target's context
        EngineConfig.create(tiny["llama"], speculative_config={"model": str(small_vocab["target"]),
                                                               "num_speculative_tokens": 2})


def test_the_command_line_takes_vllms_json(capsys):
    """`ferry generate --speculative-config JSON` runs with it; a bad value is an error naming it."""
    from ferry.cli import main

    spec = {"model": "ferry-default-draft", "num_speculative_tokens": 3}
    assert main(["generate", "def add(a, b):", "--max-tokens", "8", "--speculative-config", json.dumps(spec)]) == 0
    assert capsys.readouterr().out.startswith("def add(a, b):")
    assert main(["generate", "x", "--speculative-config", '{"method": "ngram"}']) == 2
    assert "num_speculative_tokens is required" in capsys.readouterr().err


# ---- through HTTP ----


def test_a_server_with_the_bundled_draft_answers_as_plain_decoding_and_counts_its_proposals(tmp_path):
    """`ferry serve --speculative-config`: greedy text through HTTP is the plain engine's, streamed or
    not, and /metrics counts drafts, proposed and accepted tokens, by position (vLLM's names)."""
    httpx = pytest.importorskip("httpx")
    from test_server import metric_values, serving

    from ferry import LLM
    from ferry.assets import default_model_path

    prompt, params = "def fibonacci(n):", dict(max_tokens=40, temperature=0, ignore_eos=True)
    expected = LLM().generate([prompt], SamplingParams(**params), use_tqdm=False)[0].outputs[0].text
    spec = json.dumps({"model": "ferry-default-draft", "num_speculative_tokens": 3})
    with serving(default_model_path(), tmp_path / "server.log", "--served-model-name", "ferry-default",
                 "--speculative-config", spec) as server, \
            httpx.Client(base_url=server.url, timeout=60) as http:
        body = {"model": "ferry-default", "prompt": prompt, **params}
        assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == expected
        stream = http.post("/v1/completions", json={**body, "stream": True})
        chunks = [json.loads(line[6:]) for line in stream.text.split("\n") if line.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks) == expected
        sampled = http.post("/v1/completions", json={**body, "temperature": 0.8, "seed": 5, "n": 2}).json()
        assert len(sampled["choices"]) == 2 and sampled["usage"]["completion_tokens"] == 80
        metrics = metric_values(http)
        drafts = metrics["ferry:spec_decode_num_drafts_total"]
        proposed = metrics["ferry:spec_decode_num_draft_tokens_total"]
        accepted = metrics["ferry:spec_decode_num_accepted_tokens_total"]
        assert 0 < accepted <= proposed <= 3 * drafts
        per_pos = http.get("/metrics").text
        assert 'ferry:spec_decode_num_accepted_tokens_per_pos_total{model_name="ferry-default",position="0"}' in per_pos


def test_a_bad_speculative_config_stops_ferry_serve_with_a_message(capsys):
    from ferry.cli import main

    assert main(["serve", "--speculative-config", '{"method": "medusa", "num_speculative_tokens": 2}']) == 2
    assert "method 'medusa' is not supported" in capsys.readouterr().err


# ---- the benchmarks ----


def test_the_speculative_benchmark_runs_its_whole_path_on_a_cpu(tmp_path, capsys):
    """`python -m ferry.bench.spec_decode` (a GPU benchmark) on a random-weight model: the planted
    continuation makes the oracle's outputs equal plain decoding, and proposals are kept at about
    the asked rate; with --speculative-config it measures a real proposer."""
    from ferry.bench import spec_decode

    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 5000,
              "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "result.json"
    assert spec_decode.main(["--config-dir", str(tmp_path), "--dtype", "bfloat16", "--device", "cpu",
                             "--batch-sizes", "1", "4", "--input-len", "16", "--output-len", "96",
                             "--num-kv-blocks", "256", "--phases", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert all(row["equal"] for row in rows)
    first = sum(row["accepted_per_pos"][0] for row in rows) / sum(row["num_drafts"] for row in rows)
    assert 0.55 < first < 0.85  # the first proposal of a step is kept with probability 0.7
    assert "ms per speculative step" in capsys.readouterr().out
    assert spec_decode.main(["--prompts", "code", "--batch-sizes", "1", "--output-len", "24", "--speculative-config",
                             '{"method": "ngram", "num_speculative_tokens": 2}']) == 0


def test_the_throughput_benchmark_reports_how_proposals_fared(capsys):
    from ferry.bench import throughput

    assert throughput.main(["--num-prompts", "4", "--input-len", "20", "--output-len", "24", "--device", "cpu",
                            "--num-warmup-prompts", "0", "--speculative-config",
                            '{"model": "ferry-default-draft", "num_speculative_tokens": 2}']) == 0
    assert "speculative (draft_model, k = 2)" in capsys.readouterr().out
