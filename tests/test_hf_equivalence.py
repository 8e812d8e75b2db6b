"""End to end against Hugging Face transformers: the same weights, float32 on CPU, greedy decoding must
give identical tokens, through every path of the engine: paging at block sizes 1 and 16, chunked
prefill under a small token budget, and preemption under a small KV pool."""

import math

import pytest
import torch

from ferry import LLM, SamplingParams
from tiny_models import ARCHS, make_tiny_model

transformers = pytest.importorskip("transformers")

PROMPT_LENS = [3, 29, 11, 40, 1]
MAX_TOKENS = 12


def prompts_for(seed: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=ARCHS)
def reference(request, tmp_path_factory):
    """A tiny checkpoint of one architecture and HF's greedy tokens and logprobs for the prompts."""
    path = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = prompts_for(0, model.config.vocab_size)
    expected = []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                output_logits=True, return_dict_in_generate=True, pad_token_id=0,
            )
        tokens = out.sequences[0, len(prompt):].tolist()
        logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]
        expected.append((tokens, logprobs))
    return path, prompts, expected


ENGINE_SETUPS = {
    "plain": dict(),
    "chunked_prefill": dict(max_num_batched_tokens=7),
    # ~1.3 requests' worth of KV slots for 5 requests: they must preempt each other to finish.
    "preemption": dict(num_kv_blocks_tokens=70, max_num_batched_tokens=64),
}


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("setup", list(ENGINE_SETUPS))
def test_greedy_tokens_and_logprobs_equal_transformers(reference, block_size, setup):
    path, prompts, expected = reference
    args = dict(ENGINE_SETUPS[setup])
    if "num_kv_blocks_tokens" in args:
        args["num_kv_blocks"] = math.ceil(args.pop("num_kv_blocks_tokens") / block_size)
    llm = LLM(model=path, dtype="float32", block_size=block_size, **args)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, (tokens, logprobs) in zip(outputs, expected):
        completion = out.outputs[0]
        assert completion.token_ids == tokens
        got = [completion.logprobs[i][t].logprob for i, t in enumerate(tokens)]
        assert got == pytest.approx(logprobs, abs=1e-4)
    if setup == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    pool = llm.engine.scheduler.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks
