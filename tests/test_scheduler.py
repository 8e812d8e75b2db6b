"""The scheduler, KV bookkeeping and engine loop, on CPU with a fake model (see fake_model.py)."""

import random

import pytest

from fake_model import VOCAB, fake_engine, reference_tokens
from ferry.sampling_params import RequestOutputKind, SamplingParams


def run(engine, prompts, params, abort_after: dict[str, int] | None = None):
    """Drive the engine to completion; returns request id -> final cumulative output."""
    for i, prompt in enumerate(prompts):
        p = params[i] if isinstance(params, list) else params
        engine.add_request(str(i), {"prompt_token_ids": prompt}, p)
    final, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        steps += 1
        for request_id, at in (abort_after or {}).items():
            if steps == at:
                engine.abort_request(request_id)
        assert steps < 10_000, "the engine does not make progress"
    return final


def assert_all_blocks_free(engine):
    assert engine.step() == []  # delivers the last finished ids to the runner
    pool = engine.scheduler.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(count == 0 for count in pool.ref_counts)
    assert not engine.scheduler.requests
    assert not engine.executor._states


def random_prompts(n, low, high, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(low, high))] for _ in range(n)]


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_outputs_follow_the_true_context(block_size):
    engine = fake_engine(block_size=block_size, num_kv_blocks=4096 // block_size)
    prompts = random_prompts(6, 1, 40)
    final = run(engine, prompts, SamplingParams(max_tokens=12))
    for i, prompt in enumerate(prompts):
        assert final[str(i)].outputs[0].token_ids == reference_tokens(prompt, 12)
        assert final[str(i)].outputs[0].finish_reason == "length"
    assert_all_blocks_free(engine)


def test_chunked_prefill_shares_steps_with_decodes():
    engine = fake_engine(max_num_batched_tokens=8, num_kv_blocks=256)
    prompts = random_prompts(5, 20, 60, seed=1)
    scheduled_mixes = []
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, SamplingParams(max_tokens=10))
    final = {}
    while engine.has_unfinished_requests():
        so = engine.scheduler.schedule()
        assert so.num_scheduled_tokens <= 8
        scheduled_mixes.append(sorted(len(s.token_ids) for s in so.scheduled))
        runner_output = engine.executor.execute(so)
        updates = engine.scheduler.update_from_output(so, runner_output)
        for out in engine.output_processor.process(updates)[0]:
            if out.finished:
                final[out.request_id] = out
    assert any(mix[0] == 1 and mix[-1] > 1 for mix in scheduled_mixes), "no step mixed decode and prefill"
    for i, prompt in enumerate(prompts):
        assert final[str(i)].outputs[0].token_ids == reference_tokens(prompt, 10)
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("block_size", [1, 4])
def test_preemption_by_recompute_keeps_outputs_exact(block_size):
    # 8 requests that each grow to ~40 tokens, in a pool of 96 token slots: preemption is forced.
    engine = fake_engine(block_size=block_size, num_kv_blocks=96 // block_size, max_num_batched_tokens=64)
    prompts = random_prompts(8, 10, 20, seed=2)
    final = run(engine, prompts, SamplingParams(max_tokens=25))
    assert engine.scheduler.num_preemptions > 0
    for i, prompt in enumerate(prompts):
        assert final[str(i)].outputs[0].token_ids == reference_tokens(prompt, 25)
    assert_all_blocks_free(engine)


def test_admission_keeps_room_for_the_decodes_it_admitted():
    """16 requests of 20 prompt and 100 output tokens in a pool of 800 slots: admitting every prompt
    that fits fills the pool, and the decodes then preempt and recompute, again and again. With
    the decode reserve the pool takes fewer at a time, and far less is recomputed (a share of 0.7,
    decaying, still lets a few preemptions happen: it is an estimate, not a guarantee); the outputs
    are the same."""
    prompts = random_prompts(16, 20, 20, seed=5)
    results = {}
    for reserve in (0.0, 0.7):
        engine = fake_engine(block_size=4, num_kv_blocks=200, max_num_seqs=16, max_num_batched_tokens=64,
                             max_model_len=512, decode_reserve=reserve)
        steps, step = [0], engine.step

        def counted():
            steps[0] += 1
            return step()

        engine.step = counted
        final = run(engine, prompts, SamplingParams(max_tokens=100))
        for i, prompt in enumerate(prompts):
            assert final[str(i)].outputs[0].token_ids == reference_tokens(prompt, 100)
        assert_all_blocks_free(engine)
        results[reserve] = (engine.scheduler.num_preemptions, engine.scheduler.num_recomputed_tokens, steps[0])
    (thrash, thrown_away, _), (preemptions, recomputed, _) = results[0.0], results[0.7]
    assert thrash > 0 and thrown_away > 0
    assert preemptions <= thrash / 2 and recomputed <= thrown_away * 0.6


def test_abort_mid_decode_and_while_waiting_frees_everything():
    engine = fake_engine(num_kv_blocks=40, max_num_seqs=3)
    prompts = random_prompts(6, 5, 15, seed=3)
    final = run(engine, prompts, SamplingParams(max_tokens=30), abort_after={"0": 3, "1": 8, "5": 2})
    assert "0" not in final and "1" not in final and "5" not in final
    for i in (2, 3, 4):
        assert final[str(i)].outputs[0].token_ids == reference_tokens(prompts[i], 30)
    assert_all_blocks_free(engine)


def test_request_that_can_never_fit_finishes_with_a_reason():
    engine = fake_engine(num_kv_blocks=4, block_size=4)  # 16 token slots
    with pytest.raises(ValueError, match="KV cache holds at most 16 tokens"):
        engine.add_request("big", {"prompt_token_ids": [1] * 16}, SamplingParams())
    final = run(engine, [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]], SamplingParams(max_tokens=50, ignore_eos=True))
    out = final["0"].outputs[0]
    assert out.finish_reason == "length" and out.stop_reason == "kv_cache_full"
    # 16 slots hold the prompt and 6 outputs; the 7th output was sampled but has no slot to go to.
    assert len(out.token_ids) == 7
    assert_all_blocks_free(engine)


def test_token_level_stops():
    prompt = [5, 6, 7]
    ref = reference_tokens(prompt, 40)
    eos = ref[4]
    engine = fake_engine(eos_token_ids=(eos,))
    final = run(engine, [prompt] * 4, [
        SamplingParams(max_tokens=40),
        SamplingParams(max_tokens=40, ignore_eos=True),
        SamplingParams(max_tokens=40, stop_token_ids=[ref[2]]),
        SamplingParams(max_tokens=3),
    ])
    first_eos = ref.index(eos)
    assert final["0"].outputs[0].token_ids == ref[: first_eos + 1]
    assert final["0"].outputs[0].finish_reason == "stop"
    assert final["1"].outputs[0].token_ids == ref and final["1"].outputs[0].finish_reason == "length"
    assert final["2"].outputs[0].stop_reason == ref[2]
    assert final["3"].outputs[0].token_ids == ref[:3]


def test_min_tokens_suppresses_eos():
    prompt = [5, 6, 7]
    ref = reference_tokens(prompt, 5)
    engine = fake_engine(eos_token_ids=(ref[0],))
    final = run(engine, [prompt], SamplingParams(max_tokens=6, min_tokens=3, temperature=0))
    tokens = final["0"].outputs[0].token_ids
    assert ref[0] not in tokens[:3]


def test_max_model_len_caps_output():
    engine = fake_engine(max_model_len=20)
    final = run(engine, [list(range(15))], SamplingParams(max_tokens=100, ignore_eos=True))
    assert len(final["0"].outputs[0].token_ids) == 5
    with pytest.raises(ValueError, match="max_model_len is 20"):
        engine.add_request("x", {"prompt_token_ids": list(range(20))}, SamplingParams())


def test_bad_inputs_are_rejected_and_the_engine_keeps_serving():
    engine = fake_engine()
    for prompt, match in [
        ({"prompt_token_ids": []}, "empty"),
        ({"prompt_token_ids": [1, VOCAB]}, f"token id {VOCAB} is out of vocabulary"),
        ({"prompt_token_ids": [-1]}, "out of vocabulary"),
        ({"prompt_token_ids": "abc"}, "list of integers"),
        (42, "a prompt must be"),
        ("text", "no tokenizer"),
    ]:
        with pytest.raises(ValueError, match=match):
            engine.add_request("bad", prompt, SamplingParams())
    final = run(engine, [[1, 2, 3]], SamplingParams(max_tokens=4))
    assert final["0"].outputs[0].token_ids == reference_tokens([1, 2, 3], 4)
    assert_all_blocks_free(engine)


def test_n_completions_and_output_kinds():
    engine = fake_engine()
    engine.add_request("a", {"prompt_token_ids": [1, 2]}, SamplingParams(n=3, max_tokens=4, output_kind=RequestOutputKind.DELTA))
    engine.add_request("b", {"prompt_token_ids": [3]}, SamplingParams(n=2, max_tokens=4, output_kind=RequestOutputKind.FINAL_ONLY))
    deltas: dict[int, list[int]] = {0: [], 1: [], 2: []}
    finals = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "a":
                for c in out.outputs:
                    deltas[c.index] += c.token_ids
            else:
                finals.append(out)
    ref = reference_tokens([1, 2], 4)
    assert all(d == ref for d in deltas.values())  # greedy fake model: the n completions agree
    assert len(finals) == 1 and finals[0].finished and len(finals[0].outputs) == 2
    assert_all_blocks_free(engine)


def test_duplicate_request_id_is_rejected():
    engine = fake_engine()
    engine.add_request("a", {"prompt_token_ids": [1]}, SamplingParams())
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", {"prompt_token_ids": [1]}, SamplingParams())


class OnlyTheSeam:
    """An executor that is nothing but the members of the Executor protocol, over a ModelRunner:
    what a multi-process executor would offer."""

    def __init__(self, runner) -> None:
        self._runner = runner
        self.launched = 0

    @property
    def num_kv_blocks(self) -> int:
        return self._runner.num_kv_blocks

    @property
    def proposes_tokens(self) -> bool:
        return self._runner.proposes_tokens

    @property
    def num_lookahead_slots(self) -> int:
        return self._runner.num_lookahead_slots

    def launch(self, scheduler_output):
        self.launched += 1
        return self._runner.launch(scheduler_output)

    def collect(self, step):
        return self._runner.collect(step)

    def shutdown(self) -> None:
        self._runner.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_engine_needs_nothing_of_its_executor_but_the_protocol(async_scheduling):
    from ferry.engine.engine import LLMEngine
    from ferry.executor.executor import Executor

    inner = fake_engine(async_scheduling=async_scheduling)
    executor = OnlyTheSeam(inner.executor)
    assert isinstance(executor, Executor) and isinstance(inner.executor, Executor)
    engine = LLMEngine(inner.config, executor, tokenizer=None)
    prompts = random_prompts(5, 1, 30)
    final = run(engine, prompts, SamplingParams(max_tokens=9))
    for i, prompt in enumerate(prompts):
        assert final[str(i)].outputs[0].token_ids == reference_tokens(prompt, 9)
    assert executor.launched > 0
    engine.shutdown()
    assert inner.executor.model is None and not inner.executor.kv_caches
