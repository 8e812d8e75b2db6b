"""Multi-token rows: a step verifies proposed tokens, and the outputs are those of single steps.

A fake proposer (an oracle that knows the fake model's answer, wrong where it is told to be) feeds
the real scheduler and model runner. Whatever it proposes, every request's tokens must be exactly
the reference tokens; a right guess must save steps, a wrong one must cost no token. The real
models' side (logits at every verified position, seeds, the decode graphs with several query tokens
a row) is in test_cuda_graph.py.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    # Triton's kernels run on CPU tensors under its interpreter, chosen before Triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fake_model import expected_next_token, fake_engine, reference_tokens
from ferry import SamplingParams
from ferry.spec.proposer import Proposer
from ferry.spec.replay import ReplayProposer
from test_scheduler import assert_all_blocks_free, random_prompts, run
from tiny_tokenizers import save_tiny_tokenizer


class OracleProposer(Proposer):
    """Proposes the fake model's true next tokens; each proposal is replaced by a wrong token with
    probability `wrong` (seeded), so that runs of accepted and rejected proposals of every length
    occur."""

    def __init__(self, k: int, wrong: float = 0.0, seed: int = 0) -> None:
        self.num_speculative_tokens = k
        self.wrong = wrong
        self.rng = random.Random(seed)
        self.calls = 0
        self.proposed = 0

    def propose(self, requests, prefilled=()):
        self.calls += 1
        proposals = []
        for request in requests:
            assert None not in request.output_token_ids, "proposals follow known tokens only"
            context, guess = [*request.prompt_token_ids, *request.output_token_ids], []
            for _ in range(self.num_speculative_tokens):
                token = expected_next_token(context)
                if self.rng.random() < self.wrong:
                    token = (token + 1 + self.rng.randrange(50)) % 97
                guess.append(token)
                context.append(token)
            proposals.append(guess)
            self.proposed += len(guess)
        return proposals


def _steps(engine) -> list:
    """Wrap the scheduler to record every step's SchedulerOutput."""
    outputs, schedule = [], engine.scheduler.schedule

    def recording():
        out = schedule()
        outputs.append(out)
        return out

    engine.scheduler.schedule = recording
    return outputs


@pytest.mark.parametrize("wrong", [0.0, 0.3, 1.0], ids=["right", "mixed", "wrong"])
@pytest.mark.parametrize("block_size", [1, 4])
def test_verified_tokens_equal_single_steps(wrong, block_size):
    proposer = OracleProposer(k=4, wrong=wrong, seed=1)
    engine = fake_engine(proposer, block_size=block_size, num_kv_blocks=2048 // block_size, max_num_batched_tokens=64)
    prompts = random_prompts(6, 1, 30, seed=2)
    steps = _steps(engine)
    final = run(engine, prompts, SamplingParams(max_tokens=17))
    for i, prompt in enumerate(prompts):
        assert final[str(i)].outputs[0].token_ids == reference_tokens(prompt, 17), i
        assert final[str(i)].outputs[0].finish_reason == "length"
    verified = sum(s.num_draft_tokens for out in steps for s in out.scheduled)
    assert verified > 0
    single = len(reference_tokens([0], 17))  # decode steps a request needs one token at a time
    if wrong == 0.0:
        assert len(steps) <= 2 + -(-single // 5) + 2  # five tokens a step, give or take the prefill
    if wrong == 1.0:
        assert len(steps) >= single  # nothing accepted: one token a step, and none lost
    assert_all_blocks_free(engine)


def test_preemption_and_prefix_caching_with_proposals():
    """A pool too small for all: proposals take slots, preempted requests are recomputed, shared
    prefixes are reused, and the tokens stay the reference."""
    engine = fake_engine(OracleProposer(k=4, wrong=0.3, seed=5), block_size=4, num_kv_blocks=30,
                         max_num_batched_tokens=48)
    prompts = random_prompts(6, 4, 20, seed=3)
    prompts += [prompts[0] + p for p in random_prompts(3, 1, 6, seed=4)]  # shared prefixes
    final = run(engine, prompts, SamplingParams(max_tokens=20))
    assert engine.scheduler.num_preemptions > 0
    for i, prompt in enumerate(prompts):
        assert final[str(i)].outputs[0].token_ids == reference_tokens(prompt, 20), i
    assert_all_blocks_free(engine)


def test_stops_inside_an_accepted_run_drop_the_tokens_after_them():
    prompts = random_prompts(6, 2, 12, seed=7)
    eos = tuple(sorted({reference_tokens(p, 12)[5] for p in prompts}))
    engine = fake_engine(OracleProposer(k=4), eos_token_ids=eos)
    final = run(engine, prompts, SamplingParams(max_tokens=12))
    for i, prompt in enumerate(prompts):
        expected = reference_tokens(prompt, 12, eos)
        output = final[str(i)].outputs[0]
        assert output.token_ids == expected, i
        assert output.finish_reason == ("stop" if expected[-1] in eos else "length")
    # max_tokens inside a run: the proposals are cut to what max_tokens leaves room for.
    engine = fake_engine(OracleProposer(k=4))
    steps = _steps(engine)
    final = run(engine, [[3, 4]], SamplingParams(max_tokens=3))
    steps_seen = [s.num_draft_tokens for out in steps for s in out.scheduled]
    assert final["0"].outputs[0].token_ids == reference_tokens([3, 4], 3)
    assert steps_seen == [0, 1]  # the prefill samples one token; one proposal, then the last token
    assert_all_blocks_free(engine)


def test_n_sequences_aborts_and_the_budget():
    engine = fake_engine(OracleProposer(k=3, wrong=0.2, seed=9), max_num_batched_tokens=8)
    prompts = random_prompts(4, 1, 6, seed=11)
    final = run(engine, prompts, SamplingParams(max_tokens=9, n=2), abort_after={"3": 2})
    for i, prompt in enumerate(prompts[:3]):
        for completion in final[str(i)].outputs:
            assert completion.token_ids == reference_tokens(prompt, 9)
    assert "3" not in final or final["3"].outputs[0].finish_reason == "abort"
    assert_all_blocks_free(engine)


def test_asynchronous_scheduling_waits_for_the_step_whose_tokens_proposals_follow():
    engine = fake_engine(OracleProposer(k=4), async_scheduling=True)
    steps = _steps(engine)
    prompts = random_prompts(4, 1, 10, seed=13)
    final = run(engine, prompts, SamplingParams(max_tokens=13))
    for i, prompt in enumerate(prompts):
        assert final[str(i)].outputs[0].token_ids == reference_tokens(prompt, 13)
    assert all(None not in s.token_ids for out in steps for s in out.scheduled)
    assert sum(s.num_draft_tokens for out in steps for s in out.scheduled) > 0


def test_stop_strings_inside_an_accepted_run(tmp_path):
    """A stop string completed by a token in the middle of an accepted run ends the text there, and
    the run's later tokens are not part of the output."""
    from ferry.engine.output_processor import OutputProcessor
    from ferry.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(save_tiny_tokenizer(tmp_path))
    prompt = [45, 46, 47]
    tokens = reference_tokens(prompt, 14)
    text = tokenizer.decode(tokens)
    stop = tokenizer.decode(tokens[5:7])
    assert stop and text.find(stop) >= 0
    # The first token after which the text holds the stop string: it ends the output.
    last = next(m for m in range(1, 15) if stop in tokenizer.decode(tokens[:m]))
    engine = fake_engine(OracleProposer(k=4))
    engine.output_processor = OutputProcessor(tokenizer)
    steps = _steps(engine)
    final = run(engine, [prompt], SamplingParams(max_tokens=14, stop=[stop]))
    output = final["0"].outputs[0]
    assert output.finish_reason == "stop" and output.stop_reason == stop
    assert output.text == text[:text.find(stop)]
    assert output.token_ids == tokens[:last]
    assert len(steps) < last  # the stop was found inside a run of several tokens
    assert_all_blocks_free(engine)


# ---- a real model: logits at every verified position, seeds, logprobs, the decode graphs ----


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    pytest.importorskip("transformers")
    from tiny_models import make_tiny_model

    return make_tiny_model("qwen3", tmp_path_factory.mktemp("qwen3"))


def _real_engine(path, proposer=None, enforce_eager=True, backend=None):
    from ferry.config import EngineConfig
    from ferry.engine.engine import LLMEngine
    from ferry.executor.model_runner import build_model_runner

    config = EngineConfig.create(
        path, dtype="float32", block_size=4, num_kv_blocks=256, max_num_seqs=8, enforce_eager=enforce_eager,
        cuda_graph_batch_sizes=(1, 2, 4, 8), attention_backend=backend,
        device="cuda" if backend == "triton" and torch.cuda.is_available() else "cpu",
    )
    return LLMEngine(config, build_model_runner(config, proposer), tokenizer=None)


REAL_PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48], [100] * 11]


def _real_params():
    return [
        SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, repetition_penalty=1.3),
    ]


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graph-buffers"])
def test_a_real_model_verifying_four_tokens_a_step_equals_single_steps(tiny_qwen3, enforce_eager):
    """Greedy, seeded sampling, penalties and logprobs: the tokens of a run whose proposals are
    verified four at a time are those of single steps (the logprobs to float32 rounding, since
    the rows are computed in batches of other shapes)."""
    single = run(_real_engine(tiny_qwen3, enforce_eager=enforce_eager), REAL_PROMPTS, _real_params())
    reference = {tuple(p): single[str(i)].outputs[0].token_ids for i, p in enumerate(REAL_PROMPTS)}
    proposer = ReplayProposer(4, reference, wrong_every=3, vocab_size=500)
    engine = _real_engine(tiny_qwen3, proposer, enforce_eager=enforce_eager)
    steps = _steps(engine)
    prepared = []
    if not enforce_eager:  # count the verify steps that ran on the decode graphs' padded buffers
        graphs = engine.executor.decode_graphs
        prepare = graphs.prepare

        def counting(*args, **kwargs):
            inputs = prepare(*args, **kwargs)
            prepared.append(inputs is not None and inputs.attn_metadata.max_query_len == 5)
            return inputs

        graphs.prepare = counting
    verified = run(engine, REAL_PROMPTS, _real_params())
    for i in range(len(REAL_PROMPTS)):
        a, b = single[str(i)].outputs[0], verified[str(i)].outputs[0]
        assert b.token_ids == a.token_ids, i
        if a.logprobs is not None:
            for pa, pb in zip(a.logprobs, b.logprobs, strict=True):
                assert pa.keys() == pb.keys()
                for token_id in pa:
                    assert pb[token_id].logprob == pytest.approx(pa[token_id].logprob, abs=1e-4)
    assert len(steps) < 14  # several tokens a step
    assert sum(s.num_draft_tokens for out in steps for s in out.scheduled) > 0
    if not enforce_eager:
        assert any(prepared)


def test_the_triton_kernels_verify_too(tiny_qwen3, monkeypatch):
    """The same with the Triton attention backend (under Triton's interpreter on a CPU): a verify
    step's rows go through the decode kernel with five query tokens a request."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton on a CPU needs TRITON_INTERPRET=1 before Triton is imported")
        from triton_interpreter import patch_interpreter

        patch_interpreter()
    from ferry.attention.kernels import decode_attention as kernel

    calls = []
    original = kernel.decode_attention

    def recording(*args, **kwargs):
        calls.append(kwargs.get("query_len", 1))
        return original(*args, **kwargs)

    import ferry.attention.triton_backend as triton_backend

    monkeypatch.setattr(triton_backend, "decode_attention", recording)
    prompts, params = REAL_PROMPTS[:2], [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * 2
    single = run(_real_engine(tiny_qwen3, backend="triton"), prompts, params)
    reference = {tuple(p): single[str(i)].outputs[0].token_ids for i, p in enumerate(prompts)}
    proposer = ReplayProposer(4, reference, wrong_every=3, vocab_size=500)
    verified = run(_real_engine(tiny_qwen3, proposer, backend="triton"), prompts, params)
    for i in range(len(prompts)):
        assert verified[str(i)].outputs[0].token_ids == single[str(i)].outputs[0].token_ids
    assert 5 in calls


def test_the_verify_step_benchmark_checks_its_outputs_on_a_cpu(tmp_path, capsys):
    """`python -m ferry.bench.verify_step` (a GPU benchmark) runs its whole path on a CPU, where the
    decode graphs' padded steps run eagerly: the timing table, and outputs equal to single steps."""
    import json

    from ferry.bench import verify_step

    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 10000,
              "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    code = verify_step.main(["--config-dir", str(tmp_path), "--dtype", "float32", "--device", "cpu",
                             "--batch-sizes", "1", "2", "--contexts", "40", "--iters", "2", "--prompt-len", "20", "--output-len", "12",
                             "--num-kv-blocks", "256"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.count("outputs equal to single steps: True") == 2
