"""The sampler against hand-computed expectations, Hugging Face's repetition penalty, and the
distributions it should sample from.

Statistical tests draw many identical rows in one batch and allow each token's count a deviation
of 6 standard deviations from its expectation: a correct sampler fails that with probability about
1e-9 per token, while a wrong support or a missing renormalization is off by far more. The sampler
is seeded, so every run draws the same numbers anyway.
"""

from __future__ import annotations

import math

import pytest
import torch

from ferry.sample import Sampler, SamplerOutput, SamplingRow, request_generator
from ferry.sample.metadata import RandomRowParams
from ferry.sample.penalties import apply_penalties_, bad_word_bans
from ferry.sample.sampler import inverse_cdf
from ferry.sample.truncation import truncation_threshold
from ferry.sampling_params import SamplingParams

NUM_DRAWS = 20_000

# A fixed distribution over 8 tokens whose likelihood order is not the id order, so a sort that is
# not undone correctly shows up.
#                      id:    0     1     2     3     4     5     6     7
FIXED_PROBS = torch.tensor([0.11, 0.03, 0.30, 0.05, 0.02, 0.40, 0.00, 0.09])
# ordered by likelihood: 5 (.40), 2 (.30), 0 (.11), 7 (.09), 3 (.05), 1 (.03), 4 (.02), 6 (0)


def fixed_logits() -> torch.Tensor:
    return FIXED_PROBS.log()  # (8,), -inf for token 6


def make_row(params: SamplingParams, prompt=(), output=(), suppress=()) -> SamplingRow:
    generator = None if params.seed is None else request_generator(params.seed)
    return SamplingRow(params, list(prompt), list(output), generator, list(suppress))


def draw(params: SamplingParams, logits: torch.Tensor, n: int = NUM_DRAWS) -> torch.Tensor:
    """Samples n times from one logits vector (vocab,) in one batch; returns counts (vocab,)."""
    rows = [make_row(params) for _ in range(n)]
    out = Sampler(seed=0)(logits.expand(n, -1).contiguous(), rows)
    return torch.bincount(torch.tensor(out.token_ids), minlength=logits.shape[-1])


def assert_distribution(counts: torch.Tensor, expected: torch.Tensor) -> None:
    """counts (vocab,) from sum(counts) draws; expected (vocab,) probabilities summing to 1."""
    n = int(counts.sum())
    expected = expected / expected.sum()
    support = (expected > 0).nonzero().flatten().tolist()
    sampled = (counts > 0).nonzero().flatten().tolist()
    assert sampled == support, f"sampled tokens {sampled}, expected exactly {support}"
    for token, (count, p) in enumerate(zip(counts.tolist(), expected.tolist())):
        bound = 6 * math.sqrt(n * p * (1 - p)) + 1
        assert abs(count - n * p) <= bound, f"token {token}: {count} draws, expected {n * p:.0f}±{bound:.0f}"


def keep(*token_ids: int) -> torch.Tensor:
    """FIXED_PROBS restricted to token_ids (renormalized by assert_distribution)."""
    mask = torch.zeros_like(FIXED_PROBS, dtype=torch.bool)
    mask[list(token_ids)] = True
    return FIXED_PROBS * mask


# --- greedy -------------------------------------------------------------------------------------


def test_greedy_is_argmax():
    logits = torch.randn(16, 1000, generator=torch.Generator().manual_seed(0))
    rows = [make_row(SamplingParams(temperature=0)) for _ in range(16)]
    out = Sampler()(logits, rows)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None and out.ranks is None and out.top_logprobs == [None] * 16


def test_near_zero_temperature_is_greedy():
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(1))
    rows = [make_row(SamplingParams(temperature=1e-7)) for _ in range(4)]
    assert Sampler()(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_input_logits_are_not_modified():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(2))
    before = logits.clone()
    rows = [
        make_row(SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.5), [1, 2], [3], [4]),
        make_row(SamplingParams(temperature=0, frequency_penalty=1.0), [], [5, 5], [6]),
        make_row(SamplingParams(top_k=5, min_p=0.1, logprobs=2)),
    ]
    Sampler()(logits, rows)
    assert torch.equal(logits, before)


# --- penalties ----------------------------------------------------------------------------------


def test_penalties_match_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]] * 2)
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    rows = [make_row(params, prompt=[0, 4], output=[2, 2, 3]), make_row(SamplingParams(), [0], [3])]
    penalized = apply_penalties_(logits.clone(), rows)
    expected = [
        2.0 / 2,  # 0: in the prompt, positive: divided; presence/frequency only count the output
        -1.0,  # 1: never seen
        0.5 / 2 - 0.5 * 2 - 0.25,  # 2: twice in the output
        3.0 / 2 - 0.5 * 1 - 0.25,  # 3: once in the output
        -2.0 * 2,  # 4: in the prompt, negative: multiplied
        1.0,  # 5: never seen
    ]
    assert penalized[0].tolist() == pytest.approx(expected, abs=1e-6)
    assert torch.equal(penalized[1], logits[1])  # a row without penalties is untouched


def test_repetition_penalty_matches_hugging_face():
    transformers = pytest.importorskip("transformers")
    gen = torch.Generator().manual_seed(3)
    vocab = 200
    logits = torch.randn(3, vocab, generator=gen) * 3
    rows = []
    for penalty in (1.3, 0.7, 2.0):
        prompt = torch.randint(vocab, (30,), generator=gen).tolist()
        output = torch.randint(vocab, (10,), generator=gen).tolist()
        rows.append(make_row(SamplingParams(repetition_penalty=penalty), prompt, output))
    ours = apply_penalties_(logits.clone(), rows)
    for i, row in enumerate(rows):
        processor = transformers.RepetitionPenaltyLogitsProcessor(row.params.repetition_penalty)
        input_ids = torch.tensor([list(row.prompt_token_ids) + list(row.output_token_ids)])
        theirs = processor(input_ids, logits[i : i + 1].clone())
        torch.testing.assert_close(ours[i : i + 1], theirs, rtol=0, atol=1e-6)


def test_frequency_penalty_changes_the_greedy_choice():
    logits = torch.tensor([[0.0, 3.0, 2.5, 0.0]])
    plain = make_row(SamplingParams(temperature=0), output=[1, 1])
    penalized = make_row(SamplingParams(temperature=0, frequency_penalty=0.5), output=[1, 1])
    assert Sampler()(logits, [plain]).token_ids == [1]
    assert Sampler()(logits, [penalized]).token_ids == [2]  # 3.0 - 2 * 0.5 < 2.5


# --- truncation and temperature -----------------------------------------------------------------


def test_unrestricted_sampling_follows_the_softmax():
    assert_distribution(draw(SamplingParams(), fixed_logits()), FIXED_PROBS)


def test_top_k_support_and_frequencies():
    assert_distribution(draw(SamplingParams(top_k=3), fixed_logits()), keep(5, 2, 0))
    assert_distribution(draw(SamplingParams(top_k=2), fixed_logits()), keep(5, 2))


def test_top_k_keeps_ties_with_the_kth_token():
    counts = draw(SamplingParams(top_k=2), torch.tensor([2.0, 1.0, 1.0, 0.0]), n=4000)
    assert counts[3] == 0 and (counts[:3] > 0).all()


def test_top_p_keeps_the_smallest_set_reaching_p():
    # .40 + .30 = .70 < .75, + .11 = .81 >= .75: the third token is needed
    assert_distribution(draw(SamplingParams(top_p=0.75), fixed_logits()), keep(5, 2, 0))
    assert_distribution(draw(SamplingParams(top_p=0.65), fixed_logits()), keep(5, 2))


def test_top_p_stops_as_soon_as_the_mass_reaches_p():
    probs = torch.tensor([[0.5, 0.25, 0.125, 0.125]] * 3)  # exact in binary: no rounding at the edges
    rows = [make_row(SamplingParams(top_p=p)) for p in (0.5, 0.75, 0.8)]
    kept = probs >= truncation_threshold(probs, RandomRowParams.from_rows(rows, 4, probs.device))
    assert kept.tolist() == [
        [True, False, False, False],  # .5 reaches .5
        [True, True, False, False],  # .75 reaches .75
        [True, True, True, True],  # .875 is needed; the tie at .125 is kept whole
    ]


def test_top_p_always_keeps_the_most_likely_token():
    # top_p far below the top token's .40: the nucleus is that token alone, never empty
    counts = draw(SamplingParams(top_p=1e-9), fixed_logits(), n=2000)
    assert counts[5] == 2000


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    # threshold 0.2 * .40 = .08: tokens with .11 and .09 stay, .05 and below go
    assert_distribution(draw(SamplingParams(min_p=0.2), fixed_logits()), keep(5, 2, 0, 7))
    assert_distribution(draw(SamplingParams(min_p=0.5), fixed_logits()), keep(5, 2))
    assert draw(SamplingParams(min_p=1.0), fixed_logits(), n=2000)[5] == 2000


def test_top_p_is_measured_after_top_k():
    # after top_k=2 the masses are .40/.70 = .57 and .43: top_p=0.5 keeps only token 5.
    # Measured on the original distribution it would keep 5 and 2 (.40 < .5).
    counts = draw(SamplingParams(top_k=2, top_p=0.5), fixed_logits(), n=2000)
    assert counts[5] == 2000


def test_temperature_sharpens_and_flattens():
    for temperature in (0.5, 2.0):
        counts = draw(SamplingParams(temperature=temperature), fixed_logits())
        assert_distribution(counts, FIXED_PROBS ** (1 / temperature))


@pytest.mark.parametrize(
    "vocab, scale",
    [
        (50, 2.0),  # fewer tokens than the nucleus candidates
        (3000, 0.3),  # flat: most nuclei are larger than the candidates and need the full sort
        (3000, 4.0),  # peaked: most nuclei are found among the candidates
    ],
)
def test_truncation_matches_a_per_row_reference(vocab: int, scale: float):
    gen = torch.Generator().manual_seed(vocab)
    num_rows = 64
    logits = torch.randn(num_rows, vocab, generator=gen) * scale
    choices = dict(top_k=[0, 1, 5, 20, 300, 5000], top_p=[1.0, 0.95, 0.8, 0.5, 0.1], min_p=[0.0, 0.05, 0.3])

    def pick(values: list) -> object:
        return values[int(torch.randint(len(values), (), generator=gen))]

    params = [SamplingParams(**{name: pick(v) for name, v in choices.items()}) for _ in range(num_rows)]
    rows = [make_row(p) for p in params]
    probs = logits.softmax(-1)
    kept = probs >= truncation_threshold(probs, RandomRowParams.from_rows(rows, vocab, logits.device))
    for i, p in enumerate(params):
        assert kept[i].tolist() == reference_support(logits[i], p), f"row {i}: {p}"


def reference_support(logits: torch.Tensor, p: SamplingParams) -> list[bool]:
    """The kept set of one row, the obvious way, in float64."""
    probs = logits.double().softmax(-1).tolist()
    order = sorted(range(len(probs)), key=lambda t: -probs[t])
    kept = order[: p.top_k] if p.top_k > 0 else order
    if p.top_p < 1:
        total = sum(probs[t] for t in kept)
        mass, top_p_set = 0.0, []
        for t in kept:
            if mass >= p.top_p:
                break
            top_p_set.append(t)
            mass += probs[t] / total
        kept = top_p_set
    top = probs[order[0]]
    return [t in kept and probs[t] >= p.min_p * top for t in range(len(probs))]


def test_inverse_cdf_never_lands_on_a_zero_probability_token():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4)
    u = torch.tensor([[0.0], [0.5], [0.25], [1.0 - 2**-24]])
    assert inverse_cdf(probs, u).tolist() == [1, 3, 1, 3]


# --- suppression --------------------------------------------------------------------------------


def test_suppressed_tokens_are_never_chosen():
    logits = fixed_logits().expand(NUM_DRAWS, -1).contiguous()
    rows = [make_row(SamplingParams(), suppress=[5, 2]) for _ in range(NUM_DRAWS)]
    counts = torch.bincount(torch.tensor(Sampler()(logits, rows).token_ids), minlength=8)
    assert_distribution(counts, keep(0, 7, 3, 1, 4))


def test_suppression_comes_before_greedy_and_top_k():
    logits = fixed_logits().expand(2, -1).contiguous()
    rows = [
        make_row(SamplingParams(temperature=0), suppress=[5]),
        make_row(SamplingParams(top_k=1), suppress=[5]),
    ]
    assert Sampler()(logits, rows).token_ids == [2, 2]


# --- logit bias, allowed tokens, bad words ------------------------------------------------------


def test_logit_bias_is_added_to_the_logits():
    logits = fixed_logits().expand(NUM_DRAWS, -1).contiguous()
    rows = [make_row(SamplingParams(logit_bias={0: math.log(2.0), 5: -math.log(4.0)})) for _ in range(NUM_DRAWS)]
    counts = torch.bincount(torch.tensor(Sampler()(logits, rows).token_ids), minlength=8)
    expected = FIXED_PROBS.clone()
    expected[0] *= 2.0
    expected[5] /= 4.0
    assert_distribution(counts, expected)


def test_a_bias_of_100_decides_greedy_and_minus_100_bans():
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(2)) * 5
    least_likely = int(logits[0].argmin())
    most_likely = int(logits[1].argmax())
    rows = [
        make_row(SamplingParams(temperature=0, logit_bias={least_likely: 100})),
        make_row(SamplingParams(temperature=0, logit_bias={most_likely: -100})),
        make_row(SamplingParams(temperature=0)),  # a neighbour without a bias keeps its argmax
    ]
    token_ids = Sampler()(logits, rows).token_ids
    assert token_ids[0] == least_likely
    assert token_ids[1] != most_likely and token_ids[1] == int(logits[1].topk(2).indices[1])
    assert token_ids[2] == int(logits[2].argmax())
    banned = [make_row(SamplingParams(logit_bias={5: -100})) for _ in range(NUM_DRAWS)]
    assert 5 not in Sampler()(fixed_logits().expand(NUM_DRAWS, -1).contiguous(), banned).token_ids


def test_allowed_token_ids_is_the_whole_support():
    logits = fixed_logits().expand(NUM_DRAWS, -1).contiguous()
    rows = [make_row(SamplingParams(allowed_token_ids=[1, 3, 7, 6])) for _ in range(NUM_DRAWS)]
    counts = torch.bincount(torch.tensor(Sampler()(logits, rows).token_ids), minlength=8)
    assert_distribution(counts, keep(1, 3, 7))  # 6 is allowed but has probability 0
    greedy = [make_row(SamplingParams(temperature=0, allowed_token_ids=[4, 1])),
              make_row(SamplingParams(temperature=0))]
    assert Sampler()(fixed_logits().expand(2, -1).contiguous(), greedy).token_ids == [1, 5]


def test_bad_words_ban_the_token_that_would_complete_them():
    words = [[5], [2, 0], [7, 2, 0]]
    assert bad_word_bans(words, []) == [5]
    assert bad_word_bans(words, [3, 2]) == [5, 0]
    assert bad_word_bans(words, [7, 2]) == [5, 0, 0]
    assert bad_word_bans(words, [2, 3]) == [5]
    logits = fixed_logits().expand(3, -1).contiguous()
    params = SamplingParams(temperature=0, bad_words_token_ids=[[5], [2, 2]])
    rows = [make_row(params), make_row(params, prompt=[2], output=[1]), make_row(params, prompt=[1], output=[2])]
    # 5 is always banned, so 2 is the argmax; after a 2, 2 is banned too, and 0 is next. The prompt
    # does not count: a word is banned as the output would complete it.
    assert Sampler()(logits, rows).token_ids == [2, 2, 0]


def test_the_new_bans_only_touch_the_rows_that_ask():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    plain = SamplingParams(temperature=0)
    rows = [make_row(plain), make_row(SamplingParams(temperature=0, allowed_token_ids=[7])),
            make_row(SamplingParams(temperature=0, bad_words_token_ids=[[int(logits[2].argmax())]])), make_row(plain)]
    token_ids = Sampler()(logits, rows).token_ids
    assert token_ids[0] == int(logits[0].argmax()) and token_ids[3] == int(logits[3].argmax())
    assert token_ids[1] == 7 and token_ids[2] == int(logits[2].topk(2).indices[1])


def test_a_step_without_adjustments_copies_nothing(monkeypatch):
    import ferry.sample.sampler as sampler_module

    for name in ("apply_logit_bias_", "apply_penalties_", "apply_bans_"):
        monkeypatch.setattr(sampler_module, name, lambda *_: pytest.fail("an adjustment nobody asked for ran"))
    rows = [make_row(SamplingParams(temperature=0)), make_row(SamplingParams(top_k=3))]
    Sampler()(torch.randn(2, 50), rows)


WORD_IDS = {"bad": 1, " bad": 2, "very": 3, " very": 4, "\n": 5}


def test_bad_words_tokenize_with_and_without_a_leading_space():
    class Words:  # a tokenizer of whole words, a leading space part of the word
        def encode(self, text, add_special_tokens=True):
            return [WORD_IDS[w] for w in text.replace(" ", "| ").split("|") if w]

    params = SamplingParams(bad_words=["bad", " very bad", "\n"]).for_model(10, Words())
    assert params.bad_words_token_ids == [[1], [2], [3, 2], [4, 2], [5]]
    assert params.for_model(10, Words()) == params  # again: nothing changes
    assert params.uses_penalties  # a word of two tokens reads the output: steps do not overlap
    assert not SamplingParams(bad_words_token_ids=[[1], [2]]).uses_penalties
    with pytest.raises(ValueError, match="^bad_words has token id 5"):
        SamplingParams(bad_words=["\n"]).for_model(5, Words())
    with pytest.raises(ValueError, match="^bad_words need the model's tokenizer"):
        SamplingParams(bad_words=["bad"]).for_model(10)


@pytest.mark.parametrize("field, value, message", [
    ("logit_bias", {"7": 101}, r"^logit_bias values must be in \[-100, 100\], got 101 for token 7"),
    ("logit_bias", {"x": 1}, "^logit_bias keys must be token ids"),
    ("logit_bias", {-1: 1}, "^logit_bias keys must be token ids"),
    ("logit_bias", {1: float("nan")}, "^logit_bias values"),
    ("logit_bias", {True: 1}, "^logit_bias keys"),
    ("allowed_token_ids", [], "^allowed_token_ids must be a non-empty list"),
    ("allowed_token_ids", [1, -2], "^allowed_token_ids must be token ids"),
    ("bad_words", [""], "^bad_words must be a list of non-empty strings"),
    ("bad_words_token_ids", [[]], "^bad_words_token_ids must be"),
])
def test_token_fields_are_checked_on_construction(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_token_fields_are_checked_against_the_vocabulary():
    assert SamplingParams(logit_bias={"3": 5}).logit_bias == {3: 5}  # JSON's string keys
    assert SamplingParams(allowed_token_ids=[4, 2, 4]).allowed_token_ids == [4, 2]
    for field, value in (("logit_bias", {9: 1.0}), ("allowed_token_ids", [1, 9]), ("bad_words_token_ids", [[1, 9]])):
        SamplingParams(**{field: value}).for_model(10)
        with pytest.raises(ValueError, match=f"^{field} has token id 9, out of vocabulary"):
            SamplingParams(**{field: value}).for_model(9)


# --- mixed batches and reproducibility ----------------------------------------------------------


def test_rows_with_mixed_params_each_obey_their_own():
    groups = [
        (SamplingParams(temperature=0), keep(5)),
        (SamplingParams(top_k=2), keep(5, 2)),
        (SamplingParams(top_p=0.75), keep(5, 2, 0)),
        (SamplingParams(min_p=0.2), keep(5, 2, 0, 7)),
        (SamplingParams(temperature=2.0), FIXED_PROBS**0.5),
        (SamplingParams(), FIXED_PROBS),
    ]
    per_group = 8000
    # interleaved, so every group's rows are scattered through the batch
    rows = [make_row(params) for _ in range(per_group) for params, _ in groups]
    logits = fixed_logits().expand(len(rows), -1).contiguous()
    token_ids = torch.tensor(Sampler(5)(logits, rows).token_ids).view(per_group, len(groups))
    for g, (_, expected) in enumerate(groups):
        assert_distribution(torch.bincount(token_ids[:, g], minlength=8), expected)


def generate(
    sampler: Sampler, batch: list[SamplingParams], steps: int, keys: list[int] | None = None
) -> list[list[int]]:
    """Runs `steps` sampling steps on fresh random logits, feeding outputs back; one token list per
    row. Row i's logits at each step depend only on (keys[i], step); by default keys[i] is the
    row's seed, so a seeded row sees the same logits wherever it sits in the batch."""
    keys = keys or [p.seed if p.seed is not None else 1000 + i for i, p in enumerate(batch)]
    rows = [make_row(p, prompt=[1, 2, 3]) for p in batch]
    for step in range(steps):
        logits = torch.stack([step_logits(key, step) for key in keys])  # (len(batch), vocab)
        out = sampler(logits, rows)
        for row, token in zip(rows, out.token_ids):
            row.output_token_ids.append(token)
    return [list(row.output_token_ids) for row in rows]


def step_logits(key: int, step: int, vocab: int = 500) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(key * 7919 + step)) * 2


def test_seeded_rows_are_the_same_alone_and_in_any_batch():
    a = SamplingParams(seed=7, top_p=0.9, presence_penalty=0.5)
    b = SamplingParams(seed=8, top_k=50, temperature=0.8)
    batch = [
        SamplingParams(),
        a,
        SamplingParams(temperature=0),
        SamplingParams(min_p=0.1, seed=9),
        b,
        SamplingParams(top_p=0.5),
    ]
    alone_a = generate(Sampler(0), [a], steps=20)[0]
    alone_b = generate(Sampler(1), [b], steps=20)[0]
    batched = generate(Sampler(2), batch, steps=20)
    reordered = generate(Sampler(3), [b, SamplingParams(), a], steps=20)
    assert batched[1] == alone_a and reordered[2] == alone_a
    assert batched[4] == alone_b and reordered[0] == alone_b
    assert len(set(alone_a)) > 5  # really sampled, not stuck on one token


def test_different_seeds_give_different_tokens():
    # the same logits every step for both, so only the seed differs
    first = generate(Sampler(0), [SamplingParams(seed=1)], steps=20, keys=[0])[0]
    second = generate(Sampler(0), [SamplingParams(seed=2)], steps=20, keys=[0])[0]
    assert first != second


def test_unseeded_rows_are_reproducible_from_the_sampler_seed():
    batch = [SamplingParams(), SamplingParams(top_k=10)]
    assert generate(Sampler(11), batch, steps=10) == generate(Sampler(11), batch, steps=10)
    assert generate(Sampler(11), batch, steps=10) != generate(Sampler(12), batch, steps=10)


def test_a_seeded_request_without_its_generator_is_rejected():
    row = SamplingRow(SamplingParams(seed=3), [1], [], generator=None)
    with pytest.raises(ValueError, match="generator"):
        Sampler()(torch.zeros(1, 10), [row])


# --- logprobs -----------------------------------------------------------------------------------


def test_logprobs_come_from_the_raw_distribution():
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(5, 300, generator=gen) * 3
    rows = [
        make_row(SamplingParams(temperature=0, repetition_penalty=2.0, logprobs=5), [1, 2], [3]),
        make_row(SamplingParams(temperature=0.5, top_k=10, logprobs=0)),
        make_row(SamplingParams()),
        make_row(SamplingParams(top_p=0.8, frequency_penalty=1.0, logprobs=20), [], [7, 7], [8]),
        make_row(SamplingParams(min_p=0.1, logprobs=3)),
    ]
    out = Sampler()(logits, rows)
    expected = torch.log_softmax(logits.double(), -1)
    assert out.logprobs[2] is None and out.ranks[2] is None and out.top_logprobs[2] is None
    assert out.top_logprobs[1] == []
    for i, token in enumerate(out.token_ids):
        n = rows[i].params.logprobs
        if n is None:
            continue
        assert out.logprobs[i] == pytest.approx(expected[i, token].item(), abs=1e-6)
        assert out.ranks[i] == int((expected[i] > expected[i, token]).sum()) + 1
        top = out.top_logprobs[i]
        values, ids = expected[i].topk(n)
        assert [t for t, _ in top] == ids.tolist()
        assert [lp for _, lp in top] == pytest.approx(values.tolist(), abs=1e-6)
        assert all(x[1] >= y[1] for x, y in zip(top, top[1:]))


def test_logprobs_ignore_penalties():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]])
    params = SamplingParams(temperature=0, repetition_penalty=2.0, logprobs=2)
    out = Sampler()(logits, [make_row(params, prompt=[0])])
    assert out.token_ids == [1]  # 3.0 / 2 < 2.9
    raw = torch.log_softmax(logits[0].double(), -1)
    assert out.ranks == [2]
    assert out.logprobs[0] == pytest.approx(raw[1].item(), abs=1e-6)
    assert [t for t, _ in out.top_logprobs[0]] == [0, 1]


def test_sampler_output_shape():
    out = Sampler()(torch.zeros(2, 4), [make_row(SamplingParams(logprobs=1)), make_row(SamplingParams())])
    assert isinstance(out, SamplerOutput)
    assert len(out.token_ids) == len(out.logprobs) == len(out.ranks) == len(out.top_logprobs) == 2
    assert all(isinstance(t, int) for t in out.token_ids)
    assert isinstance(out.logprobs[0], float) and out.logprobs[1] is None
