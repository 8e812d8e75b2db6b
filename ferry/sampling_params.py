"""How one request wants its tokens chosen and when it wants generation to stop.

Field names and defaults follow vLLM's `SamplingParams`, so code written for vLLM works here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from ferry.structured.params import StructuredOutputsParams

# OpenAI allows at most 20 top logprobs; we allow the same.
MAX_LOGPROBS = 20
# OpenAI's range for a logit bias: -100 bans a token in practice, +100 makes it all but certain.
MAX_LOGIT_BIAS = 100.0


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries everything generated so far
    DELTA = 1  # every output carries only what is new since the last one (streaming)
    FINAL_ONLY = 2  # one output, when the request finishes (offline batch)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) means no top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # how many top logprobs to return besides the chosen token's
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    # token id -> added to its logit before sampling, in [-100, 100] (OpenAI's); string keys of
    # decimal ids are taken too, as JSON writes them
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    # Words whose tokens must not be generated in sequence: the last token of a word is banned
    # while the output ends in the others (vLLM's rule). `for_model` tokenizes them into
    # bad_words_token_ids, which is what the sampler reads; token sequences may be given there too.
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    # The grammar the output must match (a JSON schema, a regex, a choice, a grammar): vLLM's
    # `structured_outputs`; a dict of its fields is taken too.
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_json(self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._normalize_token_fields()
        self._validate()

    def _normalize_token_fields(self) -> None:
        """Copies of the token fields in one form: int keys, lists, no repeated allowed ids. Values
        of the wrong type are left for _validate to name."""
        if isinstance(self.logit_bias, dict):
            self.logit_bias = {_token_key(k): v for k, v in self.logit_bias.items()}
        if isinstance(self.allowed_token_ids, (list, tuple)):
            self.allowed_token_ids = list(dict.fromkeys(self.allowed_token_ids))
        if isinstance(self.bad_words, (list, tuple)):
            self.bad_words = list(self.bad_words)
        if isinstance(self.bad_words_token_ids, (list, tuple)):
            words = self.bad_words_token_ids
            self.bad_words_token_ids = [list(w) if isinstance(w, (list, tuple)) else w for w in words]

    def _validate(self) -> None:
        def check(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        check(isinstance(self.n, int) and self.n >= 1, "n", "must be an integer >= 1")
        # A grammar decides where its output ends (once complete it allows only EOS), so a floor
        # on the length would make it invalid.
        check(self.structured_outputs is None or not self.min_tokens, "min_tokens",
              "cannot be used with structured output (the grammar decides where the output ends)")
        check(_is_number(self.temperature) and self.temperature >= 0, "temperature", "must be >= 0")
        check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "must be -1, 0 (disabled) or >= 1")
        check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        check(self.seed is None or isinstance(self.seed, int), "seed", "must be an integer")
        check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            "max_tokens", "must be an integer >= 1",
        )
        check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens}, max_tokens={self.max_tokens}"
            )
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids", "must be non-negative integers",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(
                value is None or (isinstance(value, int) and 0 <= value <= MAX_LOGPROBS),
                name, f"must be an integer in [0, {MAX_LOGPROBS}]",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            check(_is_number(getattr(self, name)) and -2 <= getattr(self, name) <= 2, name, "must be in [-2, 2]")
        check(
            _is_number(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty", "must be > 0",
        )
        self._validate_token_fields()

    def _validate_token_fields(self) -> None:
        """Each error names the entry at fault, not the whole value: a bias map can be as long as
        the vocabulary."""
        def fail(name: str, why: str) -> None:
            raise ValueError(f"{name} {why}")

        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                fail("logit_bias", f"must map token ids to biases, got {type(self.logit_bias).__name__}")
            for token, bias in self.logit_bias.items():
                if not _is_token_id(token):
                    fail("logit_bias", f"keys must be token ids (integers >= 0), got {token!r}")
                if not (_is_number(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                    fail("logit_bias", f"values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias!r} "
                                       f"for token {token}")
        allowed = self.allowed_token_ids
        if allowed is not None and not (isinstance(allowed, list) and allowed):
            fail("allowed_token_ids", "must be a non-empty list of token ids")
        bad = next((t for t in allowed or () if not _is_token_id(t)), None)
        if bad is not None:
            fail("allowed_token_ids", f"must be token ids (integers >= 0), got {bad!r}")
        words = self.bad_words
        if words is not None and not (isinstance(words, list) and all(isinstance(w, str) and w for w in words)):
            fail("bad_words", "must be a list of non-empty strings")
        sequences = self.bad_words_token_ids
        if sequences is not None and not (isinstance(sequences, list) and all(
                isinstance(w, list) and w and all(_is_token_id(t) for t in w) for w in sequences)):
            fail("bad_words_token_ids", "must be a list of non-empty lists of token ids (integers >= 0)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalizes_repeats(self) -> bool:
        """Whether a repetition, frequency or presence penalty applies."""
        return (
            self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
        )

    @property
    def uses_penalties(self) -> bool:
        """Whether sampling reads the request's tokens so far: its repetition, frequency or presence
        penalties, or a bad word of several tokens (whose last one is banned after the others). The
        engine then waits for each of the request's tokens before it schedules the next step."""
        words = self.bad_words_token_ids
        return self.penalizes_repeats or (words is not None and any(len(word) > 1 for word in words))

    @property
    def adjusts_logits(self) -> bool:
        """Whether the sampler changes any logit of this request before it chooses (other than the
        engine's min_tokens bans): penalties, a logit bias, allowed tokens, bad words."""
        return bool(self.penalizes_repeats or self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids)

    def for_model(self, vocab_size: int, tokenizer=None) -> SamplingParams:
        """These parameters checked against a model: every id of logit_bias, allowed_token_ids and
        bad_words_token_ids within its vocabulary, and bad_words tokenized into bad_words_token_ids
        (with `tokenizer`, which encodes text). Raises ValueError naming the field. The engine's
        callers (the server, `LLM`) call it; calling it again changes nothing."""
        given = list(self.bad_words_token_ids or [])
        tokenized = []
        if self.bad_words:
            if tokenizer is None:
                raise ValueError("bad_words need the model's tokenizer, and this model has none")
            tokenized = [ids for word in self.bad_words for ids in _bad_word_token_ids(word, tokenizer)]
        for name, ids in (("logit_bias", self.logit_bias or ()), ("allowed_token_ids", self.allowed_token_ids or ()),
                          ("bad_words_token_ids", [t for word in given for t in word]),
                          ("bad_words", [t for word in tokenized for t in word])):
            bad = next((t for t in ids if t >= vocab_size), None)
            if bad is not None:
                raise ValueError(f"{name} has token id {bad}, out of vocabulary (valid ids: 0 to {vocab_size - 1})")
        if not tokenized:
            return self
        unique = [list(word) for word in dict.fromkeys(map(tuple, given + tokenized))]
        return self.clone(bad_words_token_ids=unique)

    def clone(self, **changes) -> SamplingParams:
        return replace(self, **changes)


def _bad_word_token_ids(word: str, tokenizer) -> list[list[int]]:
    """The token sequences of a bad word: as it begins a text and as it follows a space (a
    tokenizer spells " word" with other tokens than "word", as vLLM considers too). A word of
    whitespace alone is taken as it is."""
    stripped = word.lstrip()
    spellings = [stripped, " " + stripped] if stripped else [word]
    sequences = [tokenizer.encode(text, add_special_tokens=False) for text in spellings]
    return [ids for ids in sequences if ids]


def _token_key(key: object) -> object:
    """A logit_bias key as an int: JSON object keys are strings ("50256")."""
    if isinstance(key, str) and key.isascii() and key.isdigit():
        return int(key)
    return key


def _is_token_id(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
