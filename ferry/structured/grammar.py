"""From a request's StructuredOutputsParams to a matcher that knows which tokens may come next.

llguidance does the work: it compiles a JSON schema, a regex or a Lark grammar against the
tokenizer's vocabulary in milliseconds, and then, per sequence, computes the mask of allowed next
tokens (tens of microseconds for a large vocabulary, without the GIL) and advances by each
sampled token. `Grammars` holds the tokenizer in llguidance's form, once per process: the server's
to check a request's grammar before admitting it (a 400 naming the problem), the engine's to make
a matcher for every sequence that asks.

A choice becomes a regex of the escaped alternatives; a GBNF / EBNF grammar is translated to Lark.
The end of the output is the grammar's to say: once it is complete, only an EOS token is allowed.
"""

from __future__ import annotations

import functools
import json
import re
import sys
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

from ferry.structured.params import StructuredOutputsParams


# Threads that build matchers for new sequences (Grammars.matcher_later).
BUILDER_THREADS = 4

# The longest a thread that starts or ends a step's masks waits for the GIL (see Grammars.start_masks).
MASK_SWITCH_INTERVAL_S = 5e-5

# JSON laid out as json.dumps writes it: ", " between items, ": " after keys, and no other
# whitespace, so that a model cannot spend its tokens on blank lines between them.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A request's schema or grammar that cannot be compiled; the message names it."""


def grammar_text(params: StructuredOutputsParams) -> str:
    """llguidance's grammar for the request (not yet checked against a tokenizer)."""
    from llguidance import LLMatcher

    kind = params.kind
    if kind == "json":
        try:
            schema = json.loads(params.json)
        except json.JSONDecodeError as e:
            raise GrammarError(f"{params.source}: the JSON schema is not valid JSON ({e})") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"{params.source}: a JSON schema must be an object")
        try:
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        except ValueError as e:
            raise GrammarError(f"{params.source}: invalid JSON schema ({e})") from None
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return LLMatcher.grammar_from_regex("|".join(f"({re.escape(c)})" for c in params.choice))
    return LLMatcher.grammar_from_lark(_as_lark(params.grammar))


def _as_lark(grammar: str) -> str:
    """A Lark grammar as it is; a GBNF / EBNF one (`root ::= ...`) translated."""
    if "::=" not in grammar:
        return grammar
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        return gbnf_to_lark(grammar)
    except Exception as e:  # the translator raises its own error types
        raise GrammarError(f"grammar: cannot read it as GBNF/EBNF ({e})") from None


class MaskRow(NamedTuple):
    """One sequence's part of a step's masks (Grammars.start_masks)."""

    matcher: Any  # an llguidance LLMatcher, or a Future of one (Grammars.matcher_later)
    row: int  # its first row of the bitmask
    new_tokens: list[int]  # tokens the sequence got since its last mask, for the matcher to take first
    proposed: list[int]  # proposals to verify: one more row after each


class Grammars:
    """llguidance's view of one tokenizer, and matchers for it. The view is built on first use
    (a large vocabulary takes a moment), so a process that never sees a grammar never pays.

    vocab_size: the model's (its logits may have more rows than the tokenizer has tokens: those
    are never allowed). eos_token_ids: the tokens that end a sequence, allowed once the grammar is
    complete.
    """

    def __init__(self, tokenizer_json: str | Path, vocab_size: int, eos_token_ids: tuple[int, ...] = ()) -> None:
        """tokenizer_json: the path of a tokenizer.json, or its text."""
        self.tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._tokenizer = None
        # Checked grammars by request form: a request's n sequences, the engine's check and its
        # matchers, and clients that send the same schema again check it once.
        self._checked = functools.lru_cache(maxsize=256)(self._check)
        self._executor = None  # llguidance's pool of threads that fill masks
        self._consumer = None  # llguidance's thread in which matchers take their tokens
        self._builders = None  # the threads that build matchers (matcher_later)
        self._thread = None  # the one thread that starts that work, so that the caller goes on
        self.background = True  # False: start_masks does the work before it returns
        # Time spent filling masks (from the work's start to its end), the batches and the rows filled.
        self.mask_seconds = 0.0
        self.mask_batches = self.mask_rows = 0

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from llguidance import LLTokenizer

            eos = list(self.eos_token_ids) if self.eos_token_ids else None
            try:
                self._tokenizer = LLTokenizer(str(self.tokenizer_json), n_vocab=self.vocab_size, eos_token=eos)
            except TypeError:  # llguidance before 1.7 takes one EOS id
                self._tokenizer = LLTokenizer(str(self.tokenizer_json), n_vocab=self.vocab_size,
                                              eos_token=eos[0] if eos else None)
        return self._tokenizer

    def matcher_later(self, params: StructuredOutputsParams, tokens: Sequence[int] = ()) -> Future:
        """A fresh matcher for one sequence (see `matcher`), advanced past `tokens` (what the
        sequence generated before a preemption), built in a thread of this object's: llguidance
        lets go of the GIL while it builds one (a fraction of a millisecond for a JSON schema), so
        the engine goes on meanwhile. start_masks takes the Future as it takes a matcher."""
        self.tokenizer  # (built here, once, rather than in two threads at once)
        if self._builders is None:
            self._builders = ThreadPoolExecutor(BUILDER_THREADS, thread_name_prefix="ferry-grammar-build")
        return self._builders.submit(self._built, params, list(tokens))

    def _built(self, params: StructuredOutputsParams, tokens: list[int]):
        matcher = self.matcher(params)
        advance(matcher, tokens)
        return matcher

    def start_masks(self, rows: list[MaskRow], bitmask) -> Future:
        """Begin, for each MaskRow, feeding its matcher its new tokens and then writing the allowed
        next tokens into row `row` of bitmask (a contiguous int32 host tensor, structured/bitmask.py),
        and after each proposal the grammar accepts, the allowed tokens after it into the next row
        (the matcher is taken back to where it was). A matcher in an error state allows every token;
        the rows after a refused proposal, or past the grammar's end, allow only EOS. The result's
        result() waits for the work to be done; until then the matchers and the bitmask are the
        work's, and must not be touched. (With `background` False the work is done before this
        returns.)

        The work runs in a thread of this object's, so that the caller goes on with the step, and
        what it asks of llguidance lets go of the GIL: the matchers take their tokens one after
        another in a thread of llguidance's (a few microseconds each; consume_token, which keeps the
        GIL, would take turns with the caller), then the masks are filled in a pool of its threads
        (a mask of a 150k vocabulary takes about 5 us inside a free JSON string and up to a few
        hundred in the hardest places). A matcher still being built (a Future) is waited for there."""
        import torch

        if self._executor is None:
            from llguidance import LLExecutor

            self._executor = LLExecutor()
            # One thread: the matchers' tokens are too small a task to share out (more threads are slower).
            self._consumer = LLExecutor(1)
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="ferry-grammar")
            # That thread takes the GIL to start the work and to end it, while the caller runs Python:
            # it asks for the GIL, and gets it only after the switch interval (5 ms by default, as long
            # as a step). Other threads of the process hardly ever wait for the GIL, so a short
            # interval costs nothing when none does.
            sys.setswitchinterval(min(sys.getswitchinterval(), MASK_SWITCH_INTERVAL_S))
        row_bytes = bitmask.shape[1] * 4
        base, num_rows, executor, consumer = bitmask.data_ptr(), bitmask.shape[0], self._executor, self._consumer
        num_masks = len(rows) + sum(len(r.proposed) for r in rows)

        def fill() -> None:
            start = time.perf_counter()
            matchers = [m.result() if isinstance(m, Future) else m for m, _, _, _ in rows]
            advance_all(consumer, [(matcher, r.new_tokens) for matcher, r in zip(matchers, rows) if r.new_tokens])
            plain, after_proposals = [], []
            with torch.inference_mode():  # (the bitmask may be an inference tensor: this thread is not in that mode)
                for matcher, (_, row, _, proposed) in zip(matchers, rows):
                    if matcher.is_error():
                        bitmask[row:row + 1 + len(proposed)] = -1
                    elif proposed:  # (llguidance leaves the rows it does not reach as they were)
                        bitmask[row + 1:row + 1 + len(proposed)] = self.eos_only
                        after_proposals.append((matcher, row, list(proposed)))
                    else:
                        plain.append((matcher, row))
            if len(plain) == 1:  # (the pool would only add its hand-over)
                matcher, row = plain[0]
                matcher.unsafe_compute_mask_ptr(base + row * row_bytes, row_bytes)
            elif plain:
                executor.unsafe_compute_mask_ptr(plain, base, row_bytes, num_rows)
            if after_proposals:
                executor.unsafe_compute_mask_ptr_with_draft_token(after_proposals, base, row_bytes, num_rows)
            self.mask_seconds += time.perf_counter() - start
            self.mask_batches += 1
            self.mask_rows += num_masks

        if self.background:
            return self._thread.submit(fill)
        done: Future = Future()
        fill()
        done.set_result(None)
        return done

    def check(self, params: StructuredOutputsParams) -> str:
        """The compiled grammar text; GrammarError naming the problem when it does not compile."""
        return self._checked(params)

    def _check(self, params: StructuredOutputsParams) -> str:
        from llguidance import LLMatcher

        text = grammar_text(params)
        error = LLMatcher.validate_grammar(text, self.tokenizer)
        if error:
            raise GrammarError(f"{params.source}: the {_NAMES[params.kind]} does not compile: {error.strip()}")
        return text

    def matcher(self, params: StructuredOutputsParams):
        """A fresh llguidance LLMatcher for one sequence. (Not a copy of another: llguidance's
        deep_copy shares the lexer, its lock and its growing state with the original, so every
        sequence of a schema would fill its mask one after another, and a long-lived original would
        in the end reach the lexer's limit for all of them.)"""
        from llguidance import LLMatcher

        matcher = LLMatcher(self.tokenizer, self.check(params), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{params.source}: {matcher.get_error()}")
        return matcher

    @functools.cached_property
    def eos_only(self):
        """A bitmask row that allows only the tokens that end a sequence (llguidance's EOS)."""
        from ferry.structured.bitmask import only_row

        tokenizer = self.tokenizer
        eos = getattr(tokenizer, "eos_tokens", None) or [tokenizer.eos_token]
        return only_row(self.vocab_size, eos)


def advance(matcher, tokens: Sequence[int]) -> None:
    """Feed a sequence's new tokens to its matcher. Once its grammar is complete the matcher takes
    nothing more, not even a second EOS (with ignore_eos a sequence goes on past the first): the
    tokens after completion are left out, so the mask stays "EOS only" instead of the matcher
    falling into an error state, which would leave the rest of the output unconstrained."""
    for token_id in tokens:
        if matcher.is_stopped():
            return
        matcher.consume_token(token_id)


def advance_all(executor, pairs: list[tuple[Any, Sequence[int]]]) -> None:
    """`advance` for many (matcher, tokens) at once, without the GIL: the matchers take their j-th
    tokens in one call into an llguidance executor (one by one where llguidance is older than that
    call)."""
    together = getattr(executor, "consume_token_par", None)
    for j in range(max((len(tokens) for _, tokens in pairs), default=0)):
        batch = [(matcher, tokens[j]) for matcher, tokens in pairs if len(tokens) > j and not matcher.is_stopped()]
        if together is not None and len(batch) > 1:
            together(batch)
        else:
            for matcher, token_id in batch:
                matcher.consume_token(token_id)


_NAMES = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex", "choice": "choice",
          "grammar": "grammar"}
