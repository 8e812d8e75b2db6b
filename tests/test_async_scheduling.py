"""Asynchronous scheduling: step k+1 is scheduled and launched before step k's tokens reach the host.

The outputs must be exactly those of synchronous scheduling, whatever happens while a token is in
flight: preemption, prefix caching, aborts, stops that only the token can tell, and the sampling
features that need the host (logprobs, penalties).
"""

import pytest
import torch

from fake_model import fake_engine, reference_tokens
from ferry import LLM, SamplingParams
from ferry.sampling_params import RequestOutputKind
from test_scheduler import assert_all_blocks_free, random_prompts, run
from tiny_models import randomize_weights, tiny_hf_config
from tiny_tokenizers import save_tiny_tokenizer


def _count_in_flight(engine) -> list[int]:
    """Wrap the scheduler to count the scheduled tokens that were still in flight (one list entry
    per step)."""
    counts, schedule = [], engine.scheduler.schedule

    def recording():
        out = schedule()
        counts.append(sum(s.token_ids.count(None) for s in out.scheduled))
        return out

    engine.scheduler.schedule = recording
    return counts


def _scheduled_tokens(engine) -> list[int]:
    """Wrap the scheduler to record each step's scheduled token count."""
    counts, schedule = [], engine.scheduler.schedule

    def recording():
        out = schedule()
        counts.append(out.num_scheduled_tokens)
        return out

    engine.scheduler.schedule = recording
    return counts


@pytest.mark.parametrize("num_kv_blocks", [512, 24], ids=["roomy", "preempting"])
@pytest.mark.parametrize("block_size", [1, 4])
def test_tokens_follow_the_true_context(block_size, num_kv_blocks):
    """The fake model predicts from the whole context read back from its KV cache, so an in-flight
    token that reached the device wrong (or not at all) changes every later token."""
    engine = fake_engine(block_size=block_size, num_kv_blocks=num_kv_blocks * 4 // block_size,
                         async_scheduling=True)
    prompts = random_prompts(8, 1, 30, seed=3)
    prompts += [prompts[0] + p for p in random_prompts(3, 1, 10, seed=4)]  # shared prefixes
    in_flight = _count_in_flight(engine)
    final = run(engine, prompts, SamplingParams(max_tokens=15))
    assert sum(in_flight) > 0.5 * len(prompts) * 14  # most decodes began before their token was known
    for i, prompt in enumerate(prompts):
        assert final[str(i)].outputs[0].token_ids == reference_tokens(prompt, 15), i
    if num_kv_blocks == 24:
        assert engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(engine)


def test_max_tokens_costs_no_extra_step():
    """The token that reaches max_tokens is known to be the last before it is sampled."""
    computed = {}
    for mode in (False, True):
        engine = fake_engine(async_scheduling=mode)
        counts = _scheduled_tokens(engine)
        final = run(engine, [[5, 6, 7]], SamplingParams(max_tokens=6))
        assert final["0"].outputs[0].token_ids == reference_tokens([5, 6, 7], 6)
        computed[mode] = sum(counts)
    assert computed[True] == computed[False] == 3 + 5


def test_eos_is_found_one_step_late_and_the_extra_token_dropped():
    prompts = random_prompts(6, 2, 12, seed=5)
    eos = tuple(sorted({reference_tokens(p, 8)[3] for p in prompts}))  # most requests stop early
    outputs = {}
    for mode in (False, True):
        engine = fake_engine(eos_token_ids=eos, async_scheduling=mode)
        final = run(engine, prompts, SamplingParams(max_tokens=8))
        outputs[mode] = [(final[str(i)].outputs[0].token_ids, final[str(i)].outputs[0].finish_reason)
                         for i in range(len(prompts))]
        assert_all_blocks_free(engine)
    assert outputs[True] == outputs[False]
    assert any(reason == "stop" for _, reason in outputs[True])
    for prompt, (tokens, _) in zip(prompts, outputs[True]):
        assert tokens == reference_tokens(prompt, 8, eos)


def test_abort_with_a_token_in_flight():
    engine = fake_engine(async_scheduling=True)
    prompts = random_prompts(4, 3, 9, seed=6)
    final = run(engine, prompts, SamplingParams(max_tokens=20), abort_after={"1": 4, "2": 9})
    for i in (0, 3):
        assert final[str(i)].outputs[0].token_ids == reference_tokens(prompts[i], 20)
    assert "1" not in final and "2" not in final  # aborted requests end without an output
    assert_all_blocks_free(engine)


def _final(engine, prompts, params):
    return {k: (v.outputs[0].token_ids, v.outputs[0].finish_reason) for k, v in run(engine, prompts, params).items()}


@pytest.mark.parametrize("eos_second", [False, True], ids=["runs out", "eos"])
def test_a_request_too_long_for_the_cache_waits_for_its_token_in_flight(eos_second):
    """Alone and out of blocks: the token in flight is still delivered (and may be an EOS, which
    needs no block) before the request ends with kv_cache_full."""
    prompt = list(range(1, 16))  # 15 tokens; the cache holds 16
    eos = (reference_tokens(prompt, 2)[1],) if eos_second else ()
    results = {mode: _final(fake_engine(num_kv_blocks=4, block_size=4, eos_token_ids=eos, async_scheduling=mode),
                            [prompt], SamplingParams(max_tokens=20))
               for mode in (False, True)}
    assert results[True] == results[False]
    assert results[True]["0"][1] == ("stop" if eos_second else "length")


@pytest.mark.parametrize("logprobs", [None, 1])
def test_an_id_reused_while_its_old_token_is_in_flight(logprobs):
    """A request aborted with a token in flight, and a new one under the same id in the next step:
    the old token belongs to neither."""
    results = {}
    for mode in (False, True):
        engine = fake_engine(async_scheduling=mode)
        engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=10))
        for _ in range(3):
            engine.step()
        engine.abort_request("a")
        engine.add_request("a", {"prompt_token_ids": [9, 9, 9, 9]}, SamplingParams(max_tokens=5, logprobs=logprobs))
        final = {}
        while engine.has_unfinished_requests():
            final.update((out.request_id, out.outputs[0].token_ids) for out in engine.step() if out.finished)
        results[mode] = final
    assert results[True] == results[False] == {"a": reference_tokens([9, 9, 9, 9], 5)}


def test_a_block_filled_by_a_token_in_flight_is_cached_when_the_request_ends():
    prompt = [1, 2, 3, 4, 5, 6]  # with 2 outputs, block 1 (tokens 4-7) is full
    hits = {}
    for mode in (False, True):
        engine = fake_engine(block_size=4, async_scheduling=mode)
        (tokens, _), = _final(engine, [prompt], SamplingParams(max_tokens=3)).values()
        follow_up = prompt + tokens[:2] + [50]
        engine.add_request("next", {"prompt_token_ids": follow_up}, SamplingParams(max_tokens=1))
        hits[mode] = engine.scheduler.schedule().scheduled[0].start_pos
    assert hits[True] == hits[False] == 8


def test_delta_outputs_carry_every_token_once():
    engine = fake_engine(async_scheduling=True)
    prompts = random_prompts(3, 2, 6, seed=7)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt},
                           SamplingParams(max_tokens=9, output_kind=RequestOutputKind.DELTA))
    got = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] += out.outputs[0].token_ids
    for i, prompt in enumerate(prompts):
        assert got[str(i)] == reference_tokens(prompt, 9)


transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_async_model")
    config = tiny_hf_config("qwen3")
    config.vocab_size = 512
    model = transformers.AutoModelForCausalLM.from_config(config)
    randomize_weights(model, seed=2)
    model.save_pretrained(path)
    save_tiny_tokenizer(path, "bytelevel")
    return path


@pytest.fixture(scope="module")
def llms(model_path):
    return {mode: LLM(model=model_path, dtype="float32", block_size=4, num_kv_blocks=64, async_scheduling=mode)
            for mode in (False, True)}


PROMPTS = ["def add(a, b):", "The quick brown fox", "import os\n", "for i in range(10):"]
PARAMS = {
    "greedy": SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=24, ignore_eos=True),
    "n=2": SamplingParams(temperature=1.0, n=2, seed=3, max_tokens=16, ignore_eos=True),
    "stop string": SamplingParams(temperature=0.7, seed=5, max_tokens=40, stop=["e", " "]),
    "logprobs": SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True),
    "penalties": SamplingParams(temperature=0.8, seed=9, max_tokens=20, repetition_penalty=1.3,
                                frequency_penalty=0.5, ignore_eos=True),
}


@pytest.mark.parametrize("name", list(PARAMS))
def test_same_outputs_as_synchronous_scheduling(llms, name):
    """A small KV cache (64 blocks of 4) also makes the batch preempt."""
    in_flight = _count_in_flight(llms[True].engine)
    results = {mode: llm.generate(PROMPTS, PARAMS[name], use_tqdm=False) for mode, llm in llms.items()}
    del llms[True].engine.scheduler.schedule
    # Steps overlap unless a penalized request runs (logprobs steps still overlap: they are complete
    # at launch, but the next step is scheduled from the ids they leave on the device).
    assert (sum(in_flight) == 0) == (name == "penalties")
    for sync, overlapped in zip(results[False], results[True]):
        for a, b in zip(sync.outputs, overlapped.outputs):
            assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
            if a.logprobs is not None:
                for pa, pb in zip(a.logprobs, b.logprobs):
                    assert pa.keys() == pb.keys()
                    for token in pa:
                        assert pb[token].logprob == pytest.approx(pa[token].logprob, abs=1e-5)


def test_mixed_batch_of_overlapping_and_host_bound_requests(llms):
    """Requests with and without penalties and logprobs in one batch: steps overlap only while no
    penalized request runs, and the results do not depend on it."""
    params = [PARAMS["greedy"], PARAMS["penalties"], PARAMS["logprobs"], PARAMS["seeded"]]
    results = {mode: llm.generate(PROMPTS, params, use_tqdm=False) for mode, llm in llms.items()}
    for sync, overlapped in zip(results[False], results[True]):
        assert overlapped.outputs[0].token_ids == sync.outputs[0].token_ids


@pytest.mark.parametrize("name", ["greedy", "seeded", "stop string"])
def test_padded_decode_batches_take_in_flight_tokens_too(model_path, llms, name):
    """With decode graphs (run eagerly on CPU over the same static buffers), the in-flight tokens
    are written into the padded input buffer."""
    llm = LLM(model=model_path, dtype="float32", block_size=4, num_kv_blocks=64, async_scheduling=True,
              enforce_eager=False, cuda_graph_batch_sizes=[1, 2, 4])
    expected = llms[False].generate(PROMPTS[:3], PARAMS[name], use_tqdm=False)
    got = llm.generate(PROMPTS[:3], PARAMS[name], use_tqdm=False)
    for a, b in zip(expected, got):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host-device synchronization exists on a GPU only")
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("name", ["greedy", "seeded", "min_tokens"])
def test_launching_a_decode_step_never_waits_for_the_device(model_path, eager, name):
    """The point of it all: scheduling and launching step k+1 does not wait for step k."""
    params = {"greedy": PARAMS["greedy"], "seeded": PARAMS["seeded"],
              "min_tokens": SamplingParams(temperature=0.8, top_k=20, min_tokens=30, max_tokens=40)}[name]
    llm = LLM(model=model_path, dtype="bfloat16", device="cuda", block_size=4, num_kv_blocks=256,
              async_scheduling=True, enforce_eager=eager, cuda_graph_batch_sizes=[1, 2, 4])
    engine, runner = llm.engine, llm.engine.executor
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(str(i), prompt, params)
    for _ in range(3):  # prefill, then decodes
        engine.step()
    launch = runner.launch

    def checked(scheduler_output):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(scheduler_output)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    runner.launch = checked
    in_flight = _count_in_flight(engine)
    for _ in range(8):
        engine.step()
    assert all(count == 3 for count in in_flight)  # every decode token was still in flight
    while engine.has_unfinished_requests():
        engine.step()


def test_server_with_async_scheduling(tmp_path):
    """`ferry serve --async-scheduling`: streamed and whole completions equal offline generation."""
    openai = pytest.importorskip("openai")
    from test_server import ServerProcess, make_tiny_served_model

    model = make_tiny_served_model(tmp_path / "model")
    expected = LLM(model=model, dtype="float32").generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )
    server = ServerProcess(model, tmp_path / "server.log", "--async-scheduling").wait_ready()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        kwargs = dict(model=str(model), max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
        for prompt, want in zip(PROMPTS, expected):
            whole = client.completions.create(prompt=prompt, **kwargs).choices[0].text
            streamed = "".join(c.choices[0].text for c in client.completions.create(prompt=prompt, stream=True, **kwargs)
                               if c.choices)
            assert whole == streamed == want.outputs[0].text
    finally:
        server.stop()
