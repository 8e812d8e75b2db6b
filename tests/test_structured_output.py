"""Structured output: a grammar decides which tokens may come next (ferry/structured).

With the bundled model: outputs that match JSON schemas, any JSON object, regexes, choices and
grammars, greedy and sampled, through chunked prefill, preemption, prefix caching, n > 1 and
verified proposals; grammars that cannot compile refused with their name. The bitmask's Triton
kernel against its torch reference (under Triton's interpreter on a CPU).
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from ferry import LLM, SamplingParams  # noqa: E402
from ferry.structured.bitmask import masked_logits_reference, new_bitmask  # noqa: E402
from ferry.structured.grammar import GrammarError, grammar_text  # noqa: E402
from ferry.structured.params import StructuredOutputsParams as Structured  # noqa: E402

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

# Schemas the grammar code was not written against: nesting, enums, arrays with bounds, optional
# fields, numbers, booleans, nulls, and a $ref.
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16},
        "weather": {"enum": ["sunny", "rainy", "cloudy"]},
        "temps": {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 3}},
     "required": ["city", "weather", "temps"], "additionalProperties": False},
    {"type": "object", "properties": {
        "ok": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 10},
        "point": {"$ref": "#/$defs/point"}},
     "required": ["ok", "point"], "additionalProperties": False,
     "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                         "required": ["x", "y"], "additionalProperties": False}}},
    {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0}},
                                "required": ["id"], "additionalProperties": False}, "maxItems": 4},
]
# Longer than a step's 64 tokens, so that every prompt is prefilled in chunks.
PREAMBLE = "Here is what we know so far, written down in full before the answer. " * 6
PROMPTS = [f"Case {i}. {PREAMBLE}{p}"  # each its own prefix: the cache cannot make room
           for i, p in enumerate(("Tell me about a person:", "def main():", "The weather today", "JSON:"))]


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_batched_tokens=64, num_kv_blocks=20, block_size=16, decode_reserve=0)  # chunks and preemptions


def _generate(llm, prompts, params):
    return [o.outputs for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_outputs_validate_against_held_out_schemas(llm, temperature):
    params = [SamplingParams(max_tokens=300, temperature=temperature, seed=i, n=2,
                             structured_outputs=Structured(json=json.dumps(schema)))
              for i, schema in enumerate(SCHEMAS)]
    outputs = _generate(llm, PROMPTS, params)
    for schema, completions in zip(SCHEMAS, outputs):
        for completion in completions:
            assert completion.finish_reason == "stop", completion.text
            jsonschema.validate(json.loads(completion.text), schema)
    assert all(len(llm.tokenizer.encode(p)) > 64 for p in PROMPTS)  # prefilled in chunks
    assert llm.engine.scheduler.num_preemptions > 0  # 20 blocks of 16 tokens do not hold 8 sequences


def test_json_object_mode_returns_an_object(llm):
    outputs = _generate(llm, PROMPTS, SamplingParams(max_tokens=400, temperature=0.7, seed=5,
                                                     structured_outputs=Structured(json_object=True)))
    for (completion,) in outputs:
        if completion.finish_reason == "stop":
            assert isinstance(json.loads(completion.text), dict)
        else:  # a string that ran to max_tokens: still the start of an object
            assert completion.text.startswith("{"), completion.text


def test_regex_choice_and_grammar(llm):
    params = [
        SamplingParams(max_tokens=30, temperature=1.0, seed=2, structured_outputs=Structured(regex=r"\d{3}-\d{4}")),
        SamplingParams(max_tokens=30, temperature=1.0, seed=3,
                       structured_outputs=Structured(choice=("red", "green", "blue"))),
        SamplingParams(max_tokens=30, structured_outputs=Structured(grammar='root ::= "yes" | "no" | ("maybe" [0-9])')),
        SamplingParams(max_tokens=30, structured_outputs=Structured(grammar='start: "on" | "off"')),  # Lark
    ]
    (regex,), (choice,), (gbnf,), (lark,) = _generate(llm, ["Call me at", "My colour is", "Is it?", "Switch"], params)
    assert re.fullmatch(r"\d{3}-\d{4}", regex.text)
    assert choice.text in ("red", "green", "blue")
    assert re.fullmatch(r"yes|no|maybe[0-9]", gbnf.text)
    assert lark.text in ("on", "off")


def test_the_same_prompt_with_and_without_a_grammar_shares_its_prefix(llm):
    """Prefix caching is unaffected: the grammar is about the output only."""
    prompt = "A long shared prompt " * 8
    free, constrained = _generate(llm, [prompt, prompt], [
        SamplingParams(max_tokens=8, temperature=0),
        SamplingParams(max_tokens=40, temperature=0, structured_outputs=Structured(choice=("alpha", "beta")))])
    assert constrained[0].text in ("alpha", "beta") and free[0].text


@pytest.mark.parametrize("params, name", [
    (Structured(regex="(abc"), "regex"),
    (Structured(json='{"type": "nonsense"}'), "JSON schema"),
    (Structured(json="{not json"), "not valid JSON"),
    (Structured(grammar="root ::= unknown_rule"), "grammar"),
])
def test_a_grammar_that_does_not_compile_is_refused_with_its_name(llm, params, name):
    with pytest.raises(ValueError, match=name):
        llm.generate(["x"], SamplingParams(structured_outputs=params), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_exactly_one_form_is_asked_for():
    with pytest.raises(ValueError, match="exactly one"):
        Structured(regex="a", choice=("b",))
    with pytest.raises(ValueError, match="exactly one"):
        Structured()
    with pytest.raises(ValueError, match="non-empty"):
        Structured(choice=())


def test_a_choice_is_escaped():
    text = grammar_text(Structured(choice=("a.b", "(c)")))
    assert "a\\\\.b" in text or "a\\.b" in text
    with pytest.raises(GrammarError):
        grammar_text(Structured(json="[1, 2]"))


def test_verified_proposals_keep_to_the_grammar():
    """A proposer that guesses anything (often what the grammar forbids): the tokens are those of
    single steps, and still match."""
    from ferry.engine.engine import LLMEngine

    from ferry.spec.proposer import Proposer

    class Guesser(Proposer):
        num_speculative_tokens = 3

        def __init__(self, reference):
            self.reference, self.count = reference, 0

        def propose(self, requests, prefilled=()):
            out = []
            for request in requests:
                prompt, output = request.prompt_token_ids, request.output_token_ids
                guess = list(self.reference[tuple(prompt)][len(output):len(output) + 3])
                self.count += 1
                if self.count % 2 and guess:
                    guess[-1] = 7  # most often a token the grammar forbids
                out.append(guess)
            return out

    schema = json.dumps(SCHEMAS[0])
    params = SamplingParams(max_tokens=60, temperature=0, structured_outputs=Structured(json=schema))
    single = LLM()
    prompts = ["Tell me about a person:", "Someone:"]
    reference = single.generate(prompts, params, use_tqdm=False)
    tokens = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in reference}
    from ferry.executor.model_runner import build_model_runner

    engine = single.engine
    runner = build_model_runner(engine.config, Guesser(tokens), grammars=engine.grammars)
    verifying = LLMEngine(engine.config, runner, engine.tokenizer, grammars=engine.grammars)
    for i, prompt in enumerate(prompts):
        verifying.add_request(str(i), prompt, params)
    final = {}
    while verifying.has_unfinished_requests():
        for out in verifying.step():
            if out.finished:
                final[out.request_id] = out.outputs[0]
    for i, out in enumerate(reference):
        assert final[str(i)].token_ids == out.outputs[0].token_ids
        jsonschema.validate(json.loads(final[str(i)].text), SCHEMAS[0])


def test_proposals_after_a_complete_grammar_keep_to_eos():
    """With ignore_eos a sequence goes on after its grammar is complete, and every later token is
    EOS. A proposer that proposes EOS there: the rows after an accepted EOS are masked "EOS only",
    as single steps are (llguidance leaves the rows past a grammar's end unwritten), so the
    outputs stay those of single steps."""
    from ferry.engine.engine import LLMEngine
    from ferry.executor.model_runner import build_model_runner

    single = LLM()
    engine = single.engine
    eos = engine.grammars.eos_token_ids[0]

    from ferry.spec.proposer import Proposer

    class ProposeEos(Proposer):
        num_speculative_tokens = 3

        def propose(self, requests, prefilled=()):
            return [[eos] * 3 for _ in requests]

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                            structured_outputs=Structured(choice=("red", "green")))
    (reference,), = _generate(single, ["My colour is"], params)
    assert reference.text in ("red", "green") and reference.token_ids[-1] == eos
    runner = build_model_runner(engine.config, ProposeEos(), grammars=engine.grammars)
    verifying = LLMEngine(engine.config, runner, engine.tokenizer, grammars=engine.grammars)
    verifying.add_request("0", "My colour is", params)
    final = None
    while verifying.has_unfinished_requests():
        for out in verifying.step():
            if out.finished:
                final = out.outputs[0]
    assert final.token_ids == reference.token_ids


def test_the_bitmask_kernel_matches_its_reference():
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        from triton_interpreter import patch_interpreter

        patch_interpreter()
    from ferry.kernels.bitmask import masked_logits_kernel

    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(0)
    for rows, vocab in ((1, 31), (3, 100), (2, 4100)):
        bitmask = new_bitmask(rows, vocab)
        bitmask.copy_(torch.randint(-2**31, 2**31 - 1, bitmask.shape, generator=generator, dtype=torch.int64)
                      .to(torch.int32))
        logits = torch.randn(rows, vocab, generator=generator)
        expected = masked_logits_reference(logits, bitmask)
        given = logits.to(device)
        got = masked_logits_kernel(given, bitmask.to(device))
        assert torch.equal(got.cpu(), expected) and torch.equal(given.cpu(), logits)
        # Bit b of word w is token 32w + b.
        assert torch.isinf(expected[0, 0]) == (not bitmask[0, 0].item() & 1)


def test_asynchronous_scheduling_gives_the_same_tokens():
    """With asynchronous scheduling the next step's forward is queued before this step's tokens are
    known; its masks wait for them (ModelRunner._advance_grammars), its sampling waits for its masks
    (queued at the next call into the runner), and the tokens are those of synchronous steps."""
    prompts = ["Tell me about a person:", "Someone else:", "The weather today"]
    params = [SamplingParams(max_tokens=60, temperature=0.8, seed=i, structured_outputs=Structured(json=json.dumps(s)))
              for i, s in enumerate(SCHEMAS[:3])]
    params.append(SamplingParams(max_tokens=20, temperature=0))  # and one without a grammar
    prompts.append("def main():")
    runs = []
    for async_scheduling in (False, True):
        llm = LLM(async_scheduling=async_scheduling)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert runs[0] == runs[1]


def test_masks_fill_while_the_engine_processes_the_step_before(monkeypatch):
    """With asynchronous scheduling a step's masks are filled while the engine collects the step
    before it and turns its tokens into outputs; the step's sampling is queued after that, when the
    engine next calls the runner. So every masked sampling follows an output processing that came
    after its masks began, and nothing else samples in between."""
    from ferry.engine.output_processor import OutputProcessor
    from ferry.sample.sampler import Sampler
    from ferry.structured.grammar import Grammars

    events = []
    for owner, name, label in ((Grammars, "start_masks", "masks"), (OutputProcessor, "process", "process"),
                               (Sampler, "choose", "sample")):
        def wrapped(*args, real=getattr(owner, name), label=label, **kwargs):
            events.append(label)
            return real(*args, **kwargs)
        monkeypatch.setattr(owner, name, wrapped)
    llm = LLM(async_scheduling=True)
    params = SamplingParams(max_tokens=12, temperature=0, structured_outputs=Structured(json=json.dumps(SCHEMAS[0])))
    (completion,), = _generate(llm, ["Tell me about a person:"], params)
    if completion.finish_reason == "stop":
        jsonschema.validate(json.loads(completion.text), SCHEMAS[0])
    decode = events[events.index("masks"):]  # from the first step's masks on
    masked = [i for i, e in enumerate(decode) if e == "masks"]
    assert len(masked) >= 10
    # (The first step has no step before it to process, and the last none after it to overlap with.)
    for i in masked[1:-1]:
        assert decode[i + 1:i + 3] == ["process", "sample"], decode[i:i + 4]


def test_min_tokens_with_a_grammar_is_refused():
    """A complete grammar allows only EOS, which min_tokens would ban: the two do not go together."""
    with pytest.raises(ValueError, match="min_tokens cannot be used with structured output"):
        SamplingParams(min_tokens=8, structured_outputs=Structured(choice=("red", "green")))


def test_ignore_eos_after_a_complete_grammar_keeps_to_it(llm):
    """With ignore_eos a sequence goes on after its grammar is complete; the matcher then takes
    nothing more (not a second EOS, which would put it in an error state and leave the rest of the
    output unconstrained), so every later token is EOS and the text stays a choice."""
    (completion,), = _generate(llm, ["My colour is"], SamplingParams(
        max_tokens=12, temperature=1.0, seed=4, ignore_eos=True, structured_outputs=Structured(choice=("red", "green"))))
    assert completion.finish_reason == "length" and len(completion.token_ids) == 12
    assert completion.text in ("red", "green"), completion.text


def test_host_bitmasks_are_kept_and_taken_in_turn():
    """Two host buffers, taken in turn, grown when a step has more rows, and copied out (on a CPU,
    a copy made at once, so that the buffer can be taken again while the copy is in use)."""
    from ferry.structured.bitmask import HostBitmasks

    masks = HostBitmasks(100, torch.device("cpu"))
    a, b, c = masks.take(3), masks.take(3), masks.take(2)
    assert a.shape == (3, 4) and a.dtype == torch.int32 and a.is_contiguous()
    assert a.data_ptr() != b.data_ptr() and a.data_ptr() == c.data_ptr()
    c.fill_(7)
    copied = masks.to_device(c)
    c.fill_(0)
    assert torch.equal(copied, torch.full((2, 4), 7, dtype=torch.int32))
    assert masks.take(200).shape == (200, 4)  # grown
