"""Prefix caching: the same outputs with and without it, the cached-token counts it reports, and
block accounting under random traffic (property-based)."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fake_model import VOCAB, fake_engine, reference_tokens
from ferry import LLM, SamplingParams
from tiny_models import make_tiny_model

transformers = pytest.importorskip("transformers")


def check_block_accounting(engine):
    """Every block's reference count equals the number of requests holding it; the free queue holds
    exactly the unreferenced blocks; a cached block in use is never in the free queue."""
    kv = engine.scheduler.kv_cache
    holders = [0] * kv.num_blocks
    for blocks in kv._blocks.values():
        for block in blocks:
            holders[block] += 1
    assert holders == kv.pool.ref_counts
    for block in range(kv.num_blocks):
        assert kv.pool.is_free(block) == (holders[block] == 0)


def drain(engine):
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        check_block_accounting(engine)
    engine.step()
    return final


# ---- exactness against a real model: caching on and off ----

@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model("qwen3", tmp_path_factory.mktemp("prefix_model"))


def shared_prefix_prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(3, 320, (37,), generator=g).tolist()
    prompts = [system + torch.randint(3, 320, (n,), generator=g).tolist() for n in (5, 12, 1, 20)]
    return prompts + [prompts[0], system[:32]]  # a repeat, and a block-aligned prefix of the others


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("preempt", [False, True])
def test_outputs_equal_with_caching_on_and_off(model_path, block_size, preempt):
    prompts = [{"prompt_token_ids": p} for p in shared_prefix_prompts()]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    # (admission without a reserve, so that the pool runs dry)
    extra = dict(num_kv_blocks=-(-80 // block_size), max_num_batched_tokens=64, decode_reserve=0) if preempt else {}
    results = {}
    for caching in (False, True):
        llm = LLM(model=model_path, dtype="float32", block_size=block_size, enable_prefix_caching=caching, **extra)
        warm = llm.generate(prompts, params, use_tqdm=False)  # the second round hits the cache
        again = llm.generate(prompts, params, use_tqdm=False)
        results[caching] = ([o.outputs[0].token_ids for o in warm], [o.outputs[0].token_ids for o in again])
        if preempt:
            assert llm.engine.scheduler.num_preemptions > 0
        if caching:
            assert sum(o.num_cached_tokens for o in again) > 0
        pool = llm.engine.scheduler.kv_cache.pool
        assert pool.num_free_blocks == pool.num_blocks
    assert results[True] == results[False]
    assert results[True][0] == results[True][1]


def test_cached_token_counts_and_salt(model_path):
    llm = LLM(model=model_path, dtype="float32", block_size=16)
    params = SamplingParams(temperature=0, max_tokens=1)
    g = torch.Generator().manual_seed(5)
    for length in (40, 48, 16, 17, 15):
        prompt = {"prompt_token_ids": torch.randint(3, 320, (length,), generator=g).tolist()}
        first = llm.generate(prompt, params, use_tqdm=False)[0]
        second = llm.generate(prompt, params, use_tqdm=False)[0]
        assert first.num_cached_tokens == 0
        expected = (length // 16) * 16
        if expected == length:
            expected -= 1  # the last token is recomputed for its logits
        assert second.num_cached_tokens == expected, length
        assert second.outputs[0].token_ids == first.outputs[0].token_ids
        salted = llm.generate({**prompt, "cache_salt": "tenant-b"}, params, use_tqdm=False)[0]
        assert salted.num_cached_tokens == 0
        salted_again = llm.generate({**prompt, "cache_salt": "tenant-b"}, params, use_tqdm=False)[0]
        assert salted_again.num_cached_tokens == second.num_cached_tokens


# ---- the fake model: paging errors would change the tokens ----

def test_requests_admitted_together_share_blocks_in_the_same_step():
    engine = fake_engine(block_size=4, num_kv_blocks=64, max_num_batched_tokens=256)
    prompt = list(range(1, 33))
    for i in range(3):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, SamplingParams(max_tokens=5))
    final = drain(engine)
    assert [final[str(i)].num_cached_tokens for i in range(3)] == [0, 28, 28]  # whole blocks, last recomputed
    for i in range(3):
        assert final[str(i)].outputs[0].token_ids == reference_tokens(prompt, 5)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_block_accounting_under_random_traffic(data):
    block_size = data.draw(st.sampled_from([1, 2, 4]))
    engine = fake_engine(block_size=block_size, num_kv_blocks=48 // block_size, max_num_batched_tokens=24,
                         max_num_seqs=4)
    rng = random.Random(data.draw(st.integers(0, 10**6)))
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))] for _ in range(3)]
    live: dict[str, tuple[list[int], int]] = {}
    finished = {}
    for step in range(data.draw(st.integers(5, 40))):
        action = data.draw(st.sampled_from(["add", "add", "abort", "step", "step", "step"]))
        if action == "add":
            prompt = rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 6))]
            max_tokens = rng.randint(1, 8)
            request_id = f"r{step}"
            engine.add_request(request_id, {"prompt_token_ids": prompt}, SamplingParams(max_tokens=max_tokens))
            live[request_id] = (prompt, max_tokens)
        elif action == "abort" and live:
            request_id = rng.choice(sorted(live))
            engine.abort_request(request_id)
            del live[request_id]
        else:
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
                    live.pop(out.request_id, None)
        check_block_accounting(engine)
    finished.update(drain(engine))
    for request_id, out in finished.items():
        prompt = out.prompt_token_ids
        assert out.outputs[0].token_ids == reference_tokens(prompt, len(out.outputs[0].token_ids))
    kv = engine.scheduler.kv_cache
    assert kv.pool.num_free_blocks == kv.num_blocks  # every block free or evictable
