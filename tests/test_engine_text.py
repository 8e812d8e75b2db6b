"""The engine end to end with text: a tiny random model with a real tokenizer. Stop strings,
seeded sampling in and out of batches, n, chat, and the text equalling the tokens' decode."""

import pytest
import torch

from ferry import LLM, SamplingParams
from tiny_models import randomize_weights, tiny_hf_config
from tiny_tokenizers import save_tiny_tokenizer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_text_model")
    config = tiny_hf_config("qwen3")
    config.vocab_size = 512  # the tiny tokenizer's ids stay below 512
    model = transformers.AutoModelForCausalLM.from_config(config)
    randomize_weights(model, seed=1)
    model.save_pretrained(path)
    save_tiny_tokenizer(path, "bytelevel")
    return LLM(model=path, dtype="float32", block_size=4, num_kv_blocks=512)


PROMPTS = ["def add(a, b):", "The quick brown fox", "你好，世界", "import os\n"]


def test_text_is_the_decode_of_the_tokens(llm):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    for out in outs:
        c = out.outputs[0]
        assert len(c.token_ids) == 20
        assert c.text == llm.tokenizer.decode(c.token_ids)
        assert out.prompt_token_ids == llm.tokenizer.encode(out.prompt)


def test_stop_strings_cut_the_text(llm):
    base = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    text = base[0].outputs[0].text
    stop = text[10:13]  # a string that really occurs, likely across a token boundary
    first = text.find(stop)
    for include in (False, True):
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop, "never-occurs"],
                                include_stop_str_in_output=include)
        c = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason == stop
        assert c.text == (text[: first + len(stop)] if include else text[:first])
    pool = llm.engine.scheduler.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks


def test_seeded_requests_are_reproducible_alone_and_in_a_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate(PROMPTS[1], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    batch = llm.generate(PROMPTS, [others, seeded, others, SamplingParams(temperature=0.7, seed=99)], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    other_seed = llm.generate(PROMPTS[1], seeded.clone(seed=4321), use_tqdm=False)[0].outputs[0].token_ids
    assert other_seed != alone


def test_n_completions_differ_and_are_reproducible(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    first = llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
    second = llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in second.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1


def test_chat_applies_the_template(llm):
    messages = [{"role": "user", "content": "hello"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    expected = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages), add_special_tokens=False)
    assert out.prompt_token_ids == expected


def test_bad_sampling_values_name_the_field():
    for kwargs, field in [
        (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_k=-2), "top_k"),
        (dict(min_p=1.5), "min_p"), (dict(max_tokens=0), "max_tokens"), (dict(n=0), "n"),
        (dict(logprobs=21), "logprobs"), (dict(presence_penalty=3), "presence_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"), (dict(stop=[""]), "stop"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)


def test_a_bad_prompt_in_a_batch_leaves_the_engine_serving(llm):
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.generate(["fine", {"prompt_token_ids": [10**6]}], SamplingParams(max_tokens=3), use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [5] * 600}, SamplingParams(max_tokens=3), use_tqdm=False)
    out = llm.generate("fine", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert not llm.engine.has_unfinished_requests()


def test_a_stop_string_completed_by_the_last_allowed_token_still_stops(llm):
    checked = 0
    for prompt in PROMPTS:
        base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        c = base[0].outputs[0]
        text_before = llm.tokenizer.decode(c.token_ids[:-1])
        stop = c.text[-3:]
        if len(c.text) <= len(text_before) or stop in text_before or "\ufffd" in stop:
            continue  # the last token must add text that appears nowhere before
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])
        out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == c.text[: c.text.find(stop)]
        checked += 1
    assert checked > 0


def test_a_stop_token_leaves_its_text_out(llm):
    base = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    tokens = base[0].outputs[0].token_ids
    stop_id = tokens[5]
    first = tokens.index(stop_id)
    for include in (False, True):
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop_token_ids=[stop_id],
                                include_stop_str_in_output=include)
        c = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
        assert c.token_ids == tokens[: first + 1] and c.stop_reason == stop_id
        assert c.text == llm.tokenizer.decode(tokens[: first + 1 if include else first])


def test_child_ids_of_n_cannot_collide():
    from fake_model import fake_engine

    engine = fake_engine()
    engine.add_request("x", {"prompt_token_ids": [1, 2]}, SamplingParams(n=2, max_tokens=3))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("0_x", {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=3))
