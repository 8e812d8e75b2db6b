"""The workloads `ferry bench serve` sends: conversations of one or more turns, made of random tokens.

    random         one turn each; input and output lengths fixed, or uniform in
                   [len * (1 - range_ratio), len * (1 + range_ratio)] (vLLM's definition)
    shared-prefix  one turn each, in groups: every prompt of a group begins with the same long
                   prefix (a system prompt, a document), followed by its own random question
    multi-turn     conversations of several turns; each turn sends the whole history (earlier
                   user turns and the server's own replies) plus a new user message, so a server
                   with prefix caching computes only what is new

A prompt is text made from random tokens of a tokenizer, re-tokenized until it is exactly the asked
number of tokens long (decode and encode do not round-trip: neighbouring tokens merge, and bytes
of a split character come back as other tokens), or, for /v1/completions, the token ids themselves.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

Prompt = str | tuple[int, ...]  # text, or token ids (the completions endpoint only)
MAX_ROUNDS = 10  # re-tokenizing rounds; one nearly always suffices


@dataclass(frozen=True)
class Turn:
    prompt: Prompt  # this turn's new user text alone, without the history before it
    prompt_len: int  # its tokens
    output_len: int  # tokens asked for (max_tokens, with ignore_eos)


@dataclass(frozen=True)
class Conversation:
    turns: tuple[Turn, ...]  # one turn outside multi-turn workloads


@dataclass(frozen=True)
class Lengths:
    input_len: int
    output_len: int
    range_ratio: float = 0.0  # 0: fixed lengths

    def __post_init__(self) -> None:
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"the range ratio must be in [0, 1), not {self.range_ratio}")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("input and output lengths must be at least 1")

    def sample_input(self, rng: random.Random) -> int:
        return _around(self.input_len, self.range_ratio, rng)

    def sample_output(self, rng: random.Random) -> int:
        return _around(self.output_len, self.range_ratio, rng)


def _around(length: int, ratio: float, rng: random.Random) -> int:
    return rng.randint(max(1, math.floor(length * (1 - ratio))), math.ceil(length * (1 + ratio)))


@dataclass(frozen=True)
class WorkloadConfig:
    dataset: str  # a key of WORKLOADS
    num_prompts: int  # requests in all: turns, in a multi-turn workload
    lengths: Lengths
    token_ids: bool = False  # prompts as token ids instead of text
    prefix_groups: int = 4  # shared-prefix: how many distinct prefixes
    prefix_len: int = 512  # shared-prefix: tokens of each prefix
    turns: int = 4  # multi-turn: turns per conversation
    seed: int = 0


class PromptMaker:
    """Random prompts of exact token counts, from one tokenizer's vocabulary."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        special = set(tokenizer.get_added_tokens_decoder())
        # Only tokens that decode to printable text on their own: byte-fallback pieces decode to
        # U+FFFD and re-encode as several tokens, which makes the length hard to hit.
        pieces = tokenizer.decode_batch([[i] for i in range(tokenizer.get_vocab_size())])
        self.pool = [
            i for i, text in enumerate(pieces)
            if i not in special and text and "\ufffd" not in text and text.isprintable()
        ]
        if not self.pool:
            raise ValueError("the tokenizer has no printable tokens to build prompts from")

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def ids(self, n: int, rng: random.Random) -> tuple[int, ...]:
        return tuple(rng.choice(self.pool) for _ in range(n))

    def text(self, n: int, rng: random.Random) -> tuple[str, int]:
        """Text of n tokens (the second value: its count, n unless MAX_ROUNDS were not enough)."""
        ids = list(self.ids(n, rng))
        for _ in range(MAX_ROUNDS):
            text = self.tokenizer.decode(ids)
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
            if len(ids) == n:
                return text, n
            ids = ids[:n] if len(ids) > n else ids + list(self.ids(n - len(ids), rng))
        text = self.tokenizer.decode(ids)
        return text, self.count(text)

    def prompt(self, n: int, rng: random.Random, token_ids: bool) -> tuple[Prompt, int]:
        return (self.ids(n, rng), n) if token_ids else self.text(n, rng)

    def join(self, first: Prompt, second: Prompt) -> tuple[Prompt, int]:
        """Two prompts one after the other, and the tokens of the whole (text may merge at the seam)."""
        if isinstance(first, tuple) and isinstance(second, tuple):
            return first + second, len(first) + len(second)
        assert isinstance(first, str) and isinstance(second, str)
        return first + second, self.count(first + second)


def load_tokenizer(folder: str | Path) -> Tokenizer:
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {folder}")
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def random_workload(config: WorkloadConfig, maker: PromptMaker, rng: random.Random) -> list[Conversation]:
    conversations = []
    for _ in range(config.num_prompts):
        prompt, prompt_len = maker.prompt(config.lengths.sample_input(rng), rng, config.token_ids)
        conversations.append(Conversation((Turn(prompt, prompt_len, config.lengths.sample_output(rng)),)))
    return conversations


def shared_prefix_workload(config: WorkloadConfig, maker: PromptMaker, rng: random.Random) -> list[Conversation]:
    """Request i belongs to group i % groups; the order is then shuffled, so that requests of one
    group arrive spread out among the others, as they would from many users."""
    prefixes = [maker.prompt(config.prefix_len, rng, config.token_ids)[0] for _ in range(config.prefix_groups)]
    conversations = []
    for i in range(config.num_prompts):
        question, _ = maker.prompt(config.lengths.sample_input(rng), rng, config.token_ids)
        prompt, prompt_len = maker.join(prefixes[i % config.prefix_groups], question)
        conversations.append(Conversation((Turn(prompt, prompt_len, config.lengths.sample_output(rng)),)))
    rng.shuffle(conversations)
    return conversations


def multi_turn_workload(config: WorkloadConfig, maker: PromptMaker, rng: random.Random) -> list[Conversation]:
    """ceil(num_prompts / turns) conversations; the last one is shorter when turns does not divide."""
    if config.token_ids:
        raise ValueError("multi-turn conversations resend the server's replies as text: drop --prompt-token-ids")
    conversations = []
    for start in range(0, config.num_prompts, config.turns):
        turns = []
        for _ in range(min(config.turns, config.num_prompts - start)):
            text, prompt_len = maker.text(config.lengths.sample_input(rng), rng)
            turns.append(Turn(text, prompt_len, config.lengths.sample_output(rng)))
        conversations.append(Conversation(tuple(turns)))
    return conversations


WORKLOADS: dict[str, Callable[[WorkloadConfig, PromptMaker, random.Random], list[Conversation]]] = {
    "random": random_workload,
    "shared-prefix": shared_prefix_workload,
    "multi-turn": multi_turn_workload,
}


def make_workload(config: WorkloadConfig, maker: PromptMaker) -> list[Conversation]:
    if config.dataset not in WORKLOADS:
        raise ValueError(f"unknown dataset {config.dataset!r}; one of {', '.join(WORKLOADS)}")
    if config.num_prompts < 1:
        raise ValueError("--num-prompts must be at least 1")
    return WORKLOADS[config.dataset](config, maker, random.Random(config.seed))
