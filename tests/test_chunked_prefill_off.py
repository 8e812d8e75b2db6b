"""Scheduling without chunked prefill (`enable_chunked_prefill=False`, vLLM's
`--no-enable-chunked-prefill`): every prompt is prefilled whole in one step, a step that prefills
decodes nobody, a budget that cannot hold the longest prompt is refused, and the greedy outputs are
those of the default scheduling, through preemption, prefix caching, asynchronous scheduling and
speculative decoding."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from fake_model import VOCAB, FakeModel, fake_engine_config, reference_tokens
from ferry import LLM, SamplingParams
from ferry.config import SchedulerConfig
from ferry.engine.engine import LLMEngine
from ferry.executor.model_runner import ModelRunner
from ferry.sample.sampler import Sampler
from test_scheduler import assert_all_blocks_free, run


def whole_prompt_engine(**kwargs) -> LLMEngine:
    """fake_model's engine, scheduling without chunked prefill."""
    config = fake_engine_config(**kwargs)
    config = replace(config, scheduler=replace(config.scheduler, enable_chunked_prefill=False))
    kv_caches = [torch.full((2, config.cache.num_kv_blocks, config.cache.block_size, 1, 1), -1.0)]
    runner = ModelRunner(config, FakeModel(), kv_caches, backend=None, sampler=Sampler(seed=0))
    return LLMEngine(config, runner, tokenizer=None)


def random_prompts(n: int, low: int, high: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(low, high))] for _ in range(n)]


def test_whole_prompts_in_steps_without_decodes():
    """Prompts of up to 60 tokens under a budget of 64, arriving while others decode: each prompt
    is computed in the one step that admits it, and a step holds prefills or decodes, never both."""
    engine = whole_prompt_engine(max_num_batched_tokens=64, max_model_len=64, num_kv_blocks=256)
    prompts = random_prompts(12, 20, 60, seed=1)
    steps, final = [], {}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, SamplingParams(max_tokens=4, ignore_eos=True))
        for _ in range(3):  # arrivals between steps
            so = engine.scheduler.schedule()
            steps.append(so)
            updates = engine.scheduler.update_from_output(so, engine.executor.execute(so))
            final.update((out.request_id, out) for out in engine.output_processor.process(updates)[0] if out.finished)
    while engine.has_unfinished_requests():
        final.update((out.request_id, out) for out in engine.step() if out.finished)
    prefilled = {}
    for so in steps:
        assert so.num_scheduled_tokens <= 64
        kinds = {s.new for s in so.scheduled}
        assert len(kinds) <= 1, "a step mixed prefills with decodes"
        for s in so.scheduled:
            if s.new:
                prefilled[s.request_id] = len(s.token_ids)
            else:
                assert len(s.token_ids) == 1  # a decode; never the rest of a prompt
    assert prefilled == {str(i): len(p) for i, p in enumerate(prompts) if str(i) in prefilled}
    assert len(prefilled) > 6 and any(not s.new for so in steps for s in so.scheduled)
    for i, prompt in enumerate(prompts):
        assert final[str(i)].outputs[0].token_ids == reference_tokens(prompt, 4)
    assert_all_blocks_free(engine)


def test_prefills_wait_for_a_step_with_room_for_all_of_them():
    """Three prompts of 40 under a budget of 64: one a step, never a cut one."""
    engine = whole_prompt_engine(max_num_batched_tokens=64, max_model_len=64)
    for i, prompt in enumerate(random_prompts(3, 40, 40, seed=2)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, SamplingParams(max_tokens=2, ignore_eos=True))
    for request_id in ("0", "1", "2"):
        so = engine.scheduler.schedule()
        assert [(s.request_id, len(s.token_ids)) for s in so.scheduled] == [(request_id, 40)]
        engine.scheduler.update_from_output(so, engine.executor.execute(so))


def test_a_budget_below_the_context_is_refused_and_longer_prompts_too():
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(64\) is smaller than max_model_len \(128\).*"
                                         "without chunked prefill"):
        SchedulerConfig(max_num_batched_tokens=64, max_model_len=128, enable_chunked_prefill=False)
    SchedulerConfig(max_num_batched_tokens=64, max_model_len=128)  # chunks: any budget will do
    engine = whole_prompt_engine(max_num_batched_tokens=64, max_model_len=64)
    with pytest.raises(ValueError, match="the prompt has 64 tokens, but max_model_len is 64"):
        engine.add_request("long", {"prompt_token_ids": [1] * 64}, SamplingParams())


@pytest.mark.parametrize("block_size", [1, 4])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_by_recompute_keeps_outputs_exact(block_size, async_scheduling):
    """8 requests that each grow to about 45 tokens in a pool of 96 slots: preempted requests are
    recomputed whole, prompt and output so far, in a prefill step of their own."""
    engine = whole_prompt_engine(block_size=block_size, num_kv_blocks=96 // block_size, max_num_batched_tokens=64,
                                 max_model_len=64, decode_reserve=0, async_scheduling=async_scheduling)
    prompts = random_prompts(8, 10, 20, seed=3)
    final = run(engine, prompts, SamplingParams(max_tokens=25, ignore_eos=True))
    assert engine.scheduler.num_preemptions > 0
    for i, prompt in enumerate(prompts):
        assert final[str(i)].outputs[0].token_ids == reference_tokens(prompt, 25)
    assert_all_blocks_free(engine)


# ---- the bundled model ----

HEADER = "import os\nimport sys\n\n\ndef walk(path):\n    \"\"\"Every file under path, depth first.\"\"\"\n"
# Code the bundled model continues with repeats (prompt lookup finds something), sharing a header
# (prefix caching), some longer than the default mode's budget below (it chunks them).
TEXTS = [HEADER + "    for root, dirs, files in os.walk(path):", HEADER + "    result = []\n    for name in",
         "def fibonacci(n):",
         "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
         "def read_lines(filename):\n    with open(filename) as f:", HEADER]


def greedy(llm: LLM, prompts: list[str]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [output.outputs[0].token_ids for output in outputs]


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3},
                                  {"model": "ferry-default-draft", "num_speculative_tokens": 2}],
                         ids=["plain", "ngram", "draft"])
def test_greedy_outputs_equal_the_default_modes_on_the_bundled_model(spec):
    """A pool too small for all (preemption) and shared prefixes (prefix caching): the same tokens as
    the default mode, which cuts these prompts into chunks of 32, with and without speculation."""
    options = dict(dtype="float32", block_size=4, num_kv_blocks=40, max_model_len=128, decode_reserve=0,
                   speculative_config=spec)
    reference = greedy(LLM(max_num_batched_tokens=32, **options), TEXTS)
    llm = LLM(enable_chunked_prefill=False, max_num_batched_tokens=128, **options)
    assert greedy(llm, TEXTS) == reference
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions > 0 and scheduler.kv_cache.prefix_cache.hits > 0
    if spec is not None:
        assert scheduler.spec_stats.num_draft_tokens > 0
    assert_all_blocks_free(llm.engine)
