"""One request's failure is that request's alone: an exception while a step runs, or while one
request's output is processed, fails those requests (finish_reason "error", with the reason) and the
engine goes on; only a device fault propagates. And the sampler has no input that makes it fail or
hand the next step a token id outside the vocabulary."""

import math

import pytest
import torch

from fake_model import VOCAB, fake_engine, reference_tokens
from ferry import SamplingParams
from ferry.engine.faults import is_device_fault
from ferry.sample import Sampler, SamplingRow, request_generator
from test_scheduler import assert_all_blocks_free, run


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(async_scheduling):
    engine = fake_engine(async_scheduling=async_scheduling)
    runner = engine.executor
    launch, calls = runner.launch, {"n": 0}

    def failing_third_launch(scheduler_output):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom in the forward")
        return launch(scheduler_output)

    runner.launch = failing_third_launch
    final = run(engine, [[1, 2, 3], [4, 5, 6, 7]], SamplingParams(max_tokens=6))
    for out in final.values():
        assert out.finished and out.error is not None and "boom in the forward" in out.error
        assert all(c.finish_reason == "error" for c in out.outputs)
    assert_all_blocks_free(engine)
    # The same engine serves the next requests as if nothing had happened.
    final = run(engine, [[9, 8, 7]], SamplingParams(max_tokens=5))
    assert final["0"].error is None and final["0"].outputs[0].token_ids == reference_tokens([9, 8, 7], 5)
    assert_all_blocks_free(engine)


def test_a_failing_output_fails_that_request_alone():
    engine = fake_engine()
    add_tokens = engine.output_processor._add_tokens

    def failing_for_one(completion, update):
        if update.request_id == "1" and len(completion.token_ids) >= 2:
            raise UnicodeError("a detokenizer bug")
        return add_tokens(completion, update)

    engine.output_processor._add_tokens = failing_for_one
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8]]
    final = run(engine, prompts, SamplingParams(max_tokens=6))
    assert final["1"].error == "UnicodeError: a detokenizer bug"
    assert final["1"].outputs[0].finish_reason == "error"
    for i in ("0", "2"):
        assert final[i].error is None
        assert final[i].outputs[0].token_ids == reference_tokens(prompts[int(i)], 6)
    assert_all_blocks_free(engine)


def test_device_faults_propagate():
    engine = fake_engine()

    def cuda_fault(scheduler_output):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    engine.executor.launch = cuda_fault
    engine.add_request("0", {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="CUDA error"):
        engine.step()
    assert is_device_fault(RuntimeError("CUDA error: device-side assert triggered"))
    assert not is_device_fault(IndexError("index 7 is out of bounds"))


EXTREMES = [
    dict(temperature=1.0, top_p=5e-324),  # p * mass rounds to 0: the nucleus is the top token
    dict(temperature=1.0, top_p=1e-300, top_k=1, min_p=1.0),
    dict(temperature=1e-5),
    dict(temperature=math.inf),
    dict(temperature=1.0, repetition_penalty=5e-324),  # 0 in float32: logit / 0 = inf
    dict(temperature=1.0, repetition_penalty=1e308),  # inf in float32: 0 * inf = NaN
    dict(temperature=0.0, repetition_penalty=5e-324),
    dict(temperature=1.7, presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=1e-30),
    dict(temperature=1.0, seed=2**64 - 1),
    dict(temperature=1.0, seed=-(2**63)),
    dict(temperature=1.0, seed=2**200),
    dict(temperature=1.0, top_k=2**62),
]


@pytest.mark.parametrize("extra", EXTREMES)
def test_the_sampler_is_total(extra):
    vocab = 50
    torch.manual_seed(0)
    logits = torch.randn(3, vocab) * 10
    logits[1, :] = float("nan")  # a model that produced NaN for one row
    logits[2, 3] = float("inf")
    params = SamplingParams(**extra)
    generator = request_generator(params.seed) if params.seed is not None else None
    rows = [SamplingRow(params, [1, 2, 3], [3, 4, 4], generator, suppress_token_ids=(0, 1)) for _ in range(3)]
    token_ids = Sampler(seed=0)(logits, rows).token_ids
    assert all(0 <= t < vocab for t in token_ids)
    if not params.uses_penalties and math.isfinite(params.temperature):
        assert token_ids[2] == 3  # +inf is the most likely token there is


def test_every_token_banned_still_gives_an_id_in_range():
    params = SamplingParams(temperature=1.0, min_tokens=5)
    rows = [SamplingRow(params, [1], [], None, suppress_token_ids=tuple(range(VOCAB)))]
    token_ids = Sampler(seed=0)(torch.randn(1, VOCAB), rows).token_ids
    assert 0 <= token_ids[0] < VOCAB


def test_fanned_out_seeds_stay_in_range():
    engine = fake_engine()
    final = run(engine, [[1, 2, 3]], SamplingParams(n=3, temperature=1.0, seed=2**64 - 1, max_tokens=3))
    assert final["0"].error is None and len(final["0"].outputs) == 3
