"""Incremental detokenization: the text each new token adds, computed in a few microseconds.

Decoding the whole output again at every step costs O(n) per token, and decoding each token alone
is wrong: a character can span several byte-level tokens ("😀" is 4 bytes, often 2-4 tokens), and
SentencePiece decoders change a token's text by its position (a leading "▁" becomes a space, except
at the very start). So, as in vLLM, each step decodes a short window of recent tokens twice and
emits the difference:

    ids:   ... │ prefix window │ new tokens │
                 decode -> prefix text
                 decode(prefix window + new tokens) = prefix text + NEW TEXT   -> emitted

The text is held back (push returns "") while it ends in U+FFFD, the mark of an incomplete UTF-8
sequence; once a later token completes the character, it is emitted whole. The Rust
`tokenizers.decoders.DecodeStream` runs this loop, window bookkeeping included, in one call per
token (about 1-3 us), so it does the work here; this class adds the prompt context, the flush at
the end and the recovery when a decoder rewrites text already emitted.

What the pieces add up to (`text`, after `finish()`):
- The text the output adds after the prompt: decode(context + output) minus decode(context), the
  context being a short clean tail of the prompt. For byte-level BPE (GPT-2, Llama-3, Qwen) that is
  exactly `decode(output_ids)`. SentencePiece-style decoders strip the leading space of the first
  token of a text, so there it keeps the space that `decode(output_ids)` alone would strip: prompt
  "Paris is" + "▁nice" streams " nice", as vLLM does. prompt_token_ids=[] gives `decode(output_ids)`.
- Invalid UTF-8 (random or broken token sequences): pending bytes come out as U+FFFD once a later
  token shows they cannot complete a character, or from `finish()` at the end; for byte-level BPE
  `text` then still equals the decode exactly. Byte-fallback decoders (<0xNN> tokens) can rewrite
  text already streamed: a run of byte tokens that turns invalid decodes to U+FFFD as a whole,
  characters that were valid before included. Streamed text is never taken back, so where decode
  shows such a run, `text` shows those characters (and possibly U+FFFD for the same bytes); it
  agrees with decode everywhere else.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tokenizers.decoders import DecodeStream

if TYPE_CHECKING:
    from ferry.tokenizer import Tokenizer

# The prompt tail decoded as context: enough tokens for a character split into up to 4 byte tokens
# and for SentencePiece's word-boundary rules, and few enough that priming is cheap.
_MIN_CONTEXT_TOKENS = 4
_MAX_CONTEXT_TOKENS = 24
# Tokens decoded before the held-back ones when `finish()` flushes them.
_FLUSH_CONTEXT_TOKENS = 8
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one sequence's generated tokens into text, one token at a time."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool) -> None:
        self._backend = tokenizer.backend
        self._skip_special_tokens = skip_special_tokens
        self._context = _clean_tail(tokenizer, prompt_token_ids, skip_special_tokens)
        self._stream = DecodeStream(ids=self._context, skip_special_tokens=skip_special_tokens)
        self._output_ids: list[int] = []
        self._held_from = 0  # output_ids[_held_from:] have text not yet emitted
        self._pieces: list[str] = []
        self._text = ""  # the first _joined pieces, joined when `text` is read
        self._joined = 0

    @property
    def output_token_ids(self) -> Sequence[int]:
        """The tokens pushed so far (read-only)."""
        return self._output_ids

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if self._joined != len(self._pieces):
            self._text += "".join(self._pieces[self._joined :])
            self._joined = len(self._pieces)
        return self._text

    def push(self, token_id: int) -> str:
        """Append one generated token; returns the text it completes, possibly ""."""
        self._output_ids.append(token_id)
        try:
            piece = self._stream.step(self._backend, token_id)
        except Exception as error:  # DecodeStream raises a bare Exception
            if "Invalid prefix" not in str(error):
                raise
            piece = self._restart()
        if not piece:
            return ""
        self._held_from = len(self._output_ids)
        self._pieces.append(piece)
        return piece

    def finish(self) -> str:
        """Release the text still held back when the sequence ends: an incomplete character, which
        decode renders as U+FFFD. Returns "" almost always. Call it once, after the last push."""
        held = self._output_ids[self._held_from :]
        if not held:
            return ""
        before = (self._context + self._output_ids[: self._held_from])[-_FLUSH_CONTEXT_TOKENS:]
        head = self._decode(before)
        full = self._decode(before + held)
        piece = full[len(head) :] if full.startswith(head) else self._decode(held)
        self._held_from = len(self._output_ids)
        if piece:
            self._pieces.append(piece)
        return piece

    def _restart(self) -> str | None:
        # The decoder rewrote text that was already emitted (a byte-fallback run that turned
        # invalid). Emitted text stays; decoding starts afresh from the tokens not yet emitted.
        self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
        return self._stream.step(self._backend, self._output_ids[self._held_from :])

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip_special_tokens)


def _clean_tail(tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool) -> list[int]:
    """The shortest prompt tail (of at least a few tokens) that decodes without U+FFFD, so that it
    starts and ends on whole characters; [] when there is none, e.g. when the prompt ends inside a
    character: the output then decodes on its own."""
    recent = list(prompt_token_ids[-_MAX_CONTEXT_TOKENS:])
    for n in range(min(_MIN_CONTEXT_TOKENS, len(recent)), len(recent) + 1):
        tail = recent[len(recent) - n :]
        if _REPLACEMENT_CHAR not in tokenizer.decode(tail, skip_special_tokens=skip_special_tokens):
            return tail
    return []
