"""IncrementalDetokenizer: the pieces it streams add up to the decode, without half characters."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ferry.engine.detokenizer import IncrementalDetokenizer
from ferry.tokenizer import Tokenizer
from tiny_tokenizers import STYLES, save_tiny_tokenizer

REPLACEMENT = "\ufffd"
BYTE_LEVEL = ("bytelevel", "bytelevel_bos")

TEXTS = [
    "Hello world! How are you today?",
    "Emoji: 😀🎉🚀 👍🏽 family 👨‍👩‍👧 heart ❤️ flag 🇫🇷 crab 🦀 test tube 🧪.",
    "中文：你好，世界！我很感谢你的热情。日本語：こんにちは。한국어: 안녕하세요",
    "Combining marks: e\u0301 a\u0308 n\u0303 o\u0302\u0323 and precomposed é ä ñ ộ",
    "Lines\n\nwith\ttabs\r\n  and   runs of spaces   \n",
    'def add(a, b):\n    """Sum."""\n    return {"sum": a + b}  # 🚀\n',
    "Mixed: café 😀 你好 e\u0301\n\tdef f(x): return x ** 2 🦀🦀🦀",
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    return {
        style: Tokenizer.from_pretrained(save_tiny_tokenizer(tmp_path_factory.mktemp(style), style))
        for style in STYLES
    }


def stream(tokenizer: Tokenizer, prompt: list[int], output: list[int], skip: bool) -> tuple[list[str], str]:
    """All pieces pushed, and what finish() released."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, skip)
    pieces = [detokenizer.push(token_id) for token_id in output]
    tail = detokenizer.finish()
    assert detokenizer.text == "".join(pieces) + tail
    assert list(detokenizer.output_token_ids) == output
    return pieces, tail


def after_prompt(tokenizer: Tokenizer, prompt: list[int], output: list[int], skip: bool) -> str:
    """The text `output` adds after `prompt`."""
    head = tokenizer.decode(prompt, skip_special_tokens=skip)
    full = tokenizer.decode(prompt + output, skip_special_tokens=skip)
    assert full.startswith(head)
    return full[len(head) :]


def clean_splits(tokenizer: Tokenizer, ids: list[int]) -> list[int]:
    """Token boundaries that fall between whole characters."""
    return [k for k in range(len(ids) + 1) if REPLACEMENT not in tokenizer.decode(ids[:k], skip_special_tokens=False)]


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("text", TEXTS)
def test_pieces_add_up_to_decode(tokenizers, style: str, text: str) -> None:
    tokenizer = tokenizers[style]
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces, tail = stream(tokenizer, [], ids, skip=True)
    assert "".join(pieces) == tokenizer.decode(ids)
    assert tail == ""
    assert not any(REPLACEMENT in piece for piece in pieces)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("text", TEXTS)
def test_prompt_gives_context(tokenizers, style: str, text: str) -> None:
    tokenizer = tokenizers[style]
    ids = tokenizer.encode(text)
    for split in clean_splits(tokenizer, ids)[1::3]:
        prompt, output = ids[:split], ids[split:]
        pieces, tail = stream(tokenizer, prompt, output, skip=True)
        assert "".join(pieces) == after_prompt(tokenizer, prompt, output, skip=True)
        assert tail == "" and not any(REPLACEMENT in piece for piece in pieces)
        if style in BYTE_LEVEL:  # no position-dependent decoding: exactly the output's own decode
            assert "".join(pieces) == tokenizer.decode(output)


def test_sentencepiece_keeps_the_space_after_the_prompt(tokenizers) -> None:
    tokenizer = tokenizers["sentencepiece"]
    ids = tokenizer.encode("Paris is nice")
    split = next(k for k in range(len(ids)) if tokenizer.decode(ids[:k]) == "Paris is")
    prompt, output = ids[:split], ids[split:]
    pieces, _ = stream(tokenizer, prompt, output, skip=True)
    assert "".join(pieces) == " nice"
    pieces, _ = stream(tokenizer, [], output, skip=True)  # no context: like decode(output) alone
    assert "".join(pieces) == tokenizer.decode(output) == "nice"


@pytest.mark.parametrize("style", STYLES)
def test_split_character_is_held_back_until_complete(tokenizers, style: str) -> None:
    tokenizer = tokenizers[style]
    ids = tokenizer.encode("a🦀", add_special_tokens=False)  # 🦀 is not in the corpus: 4 byte tokens
    assert len(ids) >= 3
    pieces, _ = stream(tokenizer, [], ids, skip=True)
    assert pieces[-1].endswith("🦀")
    assert all(piece == "" for piece in pieces[1:-1])


@pytest.mark.parametrize("style", STYLES)
def test_finish_releases_an_incomplete_character(tokenizers, style: str) -> None:
    tokenizer = tokenizers[style]
    ids = tokenizer.encode("ok 🦀", add_special_tokens=False)[:-1]  # cut inside the crab
    pieces, tail = stream(tokenizer, [], ids, skip=True)
    assert not any(REPLACEMENT in piece for piece in pieces)
    assert tail.endswith(REPLACEMENT)
    assert "".join(pieces) + tail == tokenizer.decode(ids)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_skipped_or_kept(tokenizers, style: str, skip: bool) -> None:
    tokenizer = tokenizers[style]
    eos = tokenizer.special_tokens.named["eos_token"]
    ids = tokenizer.encode(f"Hi 😀{eos}more{eos}", add_special_tokens=True)
    pieces, tail = stream(tokenizer, [], ids, skip=skip)
    expected = tokenizer.decode(ids, skip_special_tokens=skip)
    assert "".join(pieces) + tail == expected
    assert (eos in expected) is not skip


def test_rewritten_byte_run_is_not_taken_back(tokenizers) -> None:
    tokenizer = tokenizers["sentencepiece"]
    byte = [tokenizer.token_to_id(f"<0x{b:02X}>") for b in (0xE2, 0x82, 0xAC, 0xC3)]
    ids = [tokenizer.token_to_id("▁a"), *byte, tokenizer.token_to_id("b")]
    # "€" is streamed once complete; the stray 0xC3 then makes decode turn the whole run into
    # U+FFFD. The stream keeps "€" and goes on with what follows it.
    assert tokenizer.decode(ids) == f"a{REPLACEMENT * 4}b"
    pieces, tail = stream(tokenizer, [], ids, skip=True)
    assert pieces == ["a", "", "", "€", "", f"{REPLACEMENT}b"] and tail == ""


def test_out_of_vocabulary_id_yields_no_text(tokenizers) -> None:
    tokenizer = tokenizers["bytelevel"]
    pieces, tail = stream(tokenizer, [], [tokenizer.vocab_size, 1000], skip=True)
    assert pieces == ["", ""] and tail == ""


# ---- properties ----

_VALID_TEXT = st.text(
    alphabet=st.one_of(
        st.sampled_from(list("ab xy\n\t.,(){}'0123456789")),
        st.sampled_from(list("你好世界éñ😀🎉🦀👍🏽❤️\u0301\u200d🇫🇷")),
        st.characters(codec="utf-8", exclude_characters=REPLACEMENT),
    ),
    max_size=30,
)


@pytest.mark.parametrize("style", STYLES)
@settings(max_examples=100, deadline=None)
@given(text=_VALID_TEXT, cut=st.integers(0, 40), skip=st.booleans())
def test_valid_text_never_streams_replacement_chars(tokenizers, style: str, text: str, cut: int, skip: bool):
    tokenizer = tokenizers[style]
    ids = tokenizer.encode(text)
    splits = clean_splits(tokenizer, ids)
    split = splits[cut % len(splits)]
    prompt, output = ids[:split], ids[split:]
    pieces, tail = stream(tokenizer, prompt, output, skip)
    assert not any(REPLACEMENT in piece for piece in pieces) and tail == ""
    assert "".join(pieces) == after_prompt(tokenizer, prompt, output, skip)


# Any id below 512, the tiny models' vocabulary: ids past the tokenizer's own vocabulary included.
_IDS = st.lists(st.integers(0, 511), max_size=14)


@pytest.mark.parametrize("style", BYTE_LEVEL)
@settings(max_examples=300, deadline=None)
@given(prompt=_IDS, output=_IDS, skip=st.booleans())
def test_random_ids_byte_level_equal_decode(tokenizers, style: str, prompt, output, skip: bool) -> None:
    # Byte-level decoding is plain lossy UTF-8 decoding of the tokens' bytes: even for invalid
    # sequences, the stream plus finish() is exactly decode(output), whatever the prompt.
    tokenizer = tokenizers[style]
    pieces, tail = stream(tokenizer, prompt, output, skip)
    assert "".join(pieces) + tail == tokenizer.decode(output, skip_special_tokens=skip)


def _decoding_is_monotonic(tokenizer: Tokenizer, ids: list[int], skip: bool) -> bool:
    """True when no token rewrites text already decoded (beyond a pending U+FFFD tail)."""
    previous = ""
    for k in range(1, len(ids) + 1):
        current = tokenizer.decode(ids[:k], skip_special_tokens=skip)
        if not current.startswith(previous.rstrip(REPLACEMENT)):
            return False
        previous = current
    return True


def _agrees_outside_replacements(streamed: str, decoded: str) -> bool:
    """streamed equals decoded, except that a run of k U+FFFD in decoded (k bytes) may stand for
    1..2k characters of streamed: characters of that run streamed while it was still valid, then
    up to one U+FFFD per byte once it turned invalid."""
    parts = re.split(f"({REPLACEMENT}+)", decoded)
    pattern = "".join(f"(?s:.{{1,{2 * len(p)}}})" if p.startswith(REPLACEMENT) else re.escape(p) for p in parts)
    return re.fullmatch(pattern, streamed) is not None


@settings(max_examples=400, deadline=None)
@given(output=_IDS, skip=st.booleans())
@example(output=[0, 35, 131, 0], skip=False)  # <unk> <0x20> <0x80> <unk>: a streamed space rewritten
def test_random_ids_byte_fallback(tokenizers, output, skip: bool) -> None:
    tokenizer = tokenizers["sentencepiece"]
    pieces, tail = stream(tokenizer, [], output, skip)
    streamed, decoded = "".join(pieces) + tail, tokenizer.decode(output, skip_special_tokens=skip)
    if _decoding_is_monotonic(tokenizer, output, skip):
        assert streamed == decoded
    else:  # decode turned an already streamed byte run into U+FFFD; streamed text is not taken back
        assert _agrees_outside_replacements(streamed, decoded)


def test_agreement_check_can_fail() -> None:
    two = REPLACEMENT * 2
    assert _agrees_outside_replacements(f"a {two}c", f"a{two}c")
    assert not _agrees_outside_replacements("abbbbbc", f"a{two}c")
    assert not _agrees_outside_replacements("ac", f"a{two}c")
    assert not _agrees_outside_replacements("xbc", f"a{REPLACEMENT}c")
