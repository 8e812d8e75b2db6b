"""The tokenizer: text <-> token ids, and chat messages -> prompt, matching Hugging Face transformers.

A model folder's `tokenizer.json` holds the whole pipeline (normalizer, pre-tokenizer, model,
post-processor, decoder) and the Rust `tokenizers` library runs it; `tokenizer_config.json` adds
the named special tokens, the chat template and the length limit. Results equal transformers 5's
`AutoTokenizer` on the same folder:

- `encode(text)` adds BOS/EOS exactly as the post-processor in tokenizer.json says. transformers 5
  ignores `add_bos_token`/`add_eos_token` in tokenizer_config.json whenever tokenizer.json exists,
  so ferry does too (transformers 4 honoured them for some tokenizer classes).
- The named special tokens (bos_token, eos_token, ...) are made special added tokens of the
  backend, as transformers does when it loads, so `skip_special_tokens` drops them.
- A chat prompt is rendered to a string and then encoded with add_special_tokens=False: the
  template writes any BOS itself (transformers' `apply_chat_template(tokenize=True)`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken

from ferry.tokenizer.chat_template import ChatTemplate, Message, read_chat_templates, select_template

# The special-token attributes transformers knows by name; each becomes a template variable.
_NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

# Texts of at least this many characters are encoded without holding the GIL (see encode).
_LONG_TEXT = 4096

# transformers writes 1e30 as model_max_length when a model sets no limit.
_NO_LIMIT = 2**60


@dataclass(frozen=True)
class ChatPrompt:
    text: str
    token_ids: list[int]


class PromptTooLong(ValueError):
    """A rendered prompt longer than the caller can take."""


@dataclass(frozen=True)
class SpecialTokens:
    """A model's special tokens as strings, from tokenizer_config.json (and the legacy
    special_tokens_map.json). `named` maps attribute to token ("bos_token" -> "<s>") and includes
    model-specific names such as "image_token"; `extra` are the unnamed additional special tokens."""

    named: Mapping[str, str] = field(default_factory=dict)
    extra: tuple[str, ...] = ()

    def all_tokens(self) -> list[str]:
        """Named then extra tokens, without repeats (transformers' `all_special_tokens` order)."""
        return list(dict.fromkeys([*self.named.values(), *self.extra]))


class Tokenizer:
    """Encodes text, decodes ids and renders chat prompts for one model.

    Build it with `Tokenizer.from_pretrained(model_dir)`. `backend` is the underlying
    `tokenizers.Tokenizer`, which the incremental detokenizer drives directly for speed.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        special_tokens: SpecialTokens,
        chat_templates: Mapping[str, str],
        model_max_length: int | None = None,
    ) -> None:
        self.backend = backend
        self.special_tokens = special_tokens
        self.model_max_length = model_max_length
        self._chat_templates = {name: ChatTemplate(source) for name, source in chat_templates.items()}
        vocab = backend.get_vocab(with_added_tokens=True)
        self._vocab_size = max(vocab.values(), default=-1) + 1
        # No token stands for more characters than its vocabulary entry has (byte-level entries have
        # one character a byte), so a text longer than max_chars_per_token * n has more than n tokens.
        self.max_chars_per_token = max(map(len, vocab), default=1)
        self._all_special_ids = [
            i for i in (backend.token_to_id(t) for t in special_tokens.all_tokens()) if i is not None
        ]

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, chat_template: str | None = None) -> Tokenizer:
        """Load the tokenizer of a Hugging Face model folder (tokenizer.json is required); with
        `chat_template`, that template instead of the folder's."""
        model_dir = Path(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"{tokenizer_file} not found: ferry needs the Hugging Face 'fast' tokenizer file "
                "tokenizer.json (convert a SentencePiece/tiktoken-only model with transformers first)"
            )
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        # The engine must see every prompt token; a length limit is enforced (with an error), never
        # applied silently by truncation or padding saved in tokenizer.json.
        backend.no_truncation()
        backend.no_padding()
        config = _read_json(model_dir / "tokenizer_config.json")
        if "added_tokens_decoder" not in config:  # the legacy file only counts without it, as in transformers
            config = {**config, **_read_json(model_dir / "special_tokens_map.json")}
        _sync_added_tokens(backend, config)
        special_tokens = _read_special_tokens(config)
        _register_special_tokens(backend, config, special_tokens)
        limit = config.get("model_max_length")
        return cls(
            backend,
            special_tokens,
            {"default": chat_template} if chat_template is not None else read_chat_templates(model_dir, config),
            int(limit) if isinstance(limit, (int, float)) and limit < _NO_LIMIT else None,
        )

    # ---- vocabulary ----

    @property
    def vocab_size(self) -> int:
        """How many ids the tokenizer can produce, added tokens included: every id it encodes to is
        below this (transformers' `len(tokenizer)`). A model's embedding table (config.json
        vocab_size) is often larger, padded for speed."""
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self._named_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._named_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._named_id("pad_token")

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of the named and extra special tokens (transformers' `all_special_ids`)."""
        return list(self._all_special_ids)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The raw vocabulary entry (e.g. "Ġworld" or "▁world"), not its decoded text."""
        return self.backend.id_to_token(token_id)

    def _named_id(self, name: str) -> int | None:
        token = self.special_tokens.named.get(name)
        return None if token is None else self.backend.token_to_id(token)

    # ---- text ----

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; add_special_tokens applies the post-processor (usually BOS). A long
        text goes through `encode_batch`, which lets go of the GIL (`encode` holds it throughout:
        seconds for a few MB), so other threads, the server's event loop among them, run meanwhile."""
        return self._encoding(text, add_special_tokens).ids

    def encode_with_offsets(self, text: str, add_special_tokens: bool = True) -> tuple[list[int], list[int]]:
        """encode(text), and where each token begins in text. A token with no text there (the BOS
        the post-processor adds) begins where the text before it ends."""
        encoding = self._encoding(text, add_special_tokens)
        starts, end = [], 0
        for start, stop in encoding.offsets:
            starts.append(start if stop > start else end)
            end = max(end, stop)
        return encoding.ids, starts

    def _encoding(self, text: str, add_special_tokens: bool):
        if len(text) < _LONG_TEXT:
            return self.backend.encode(text, add_special_tokens=add_special_tokens)
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`. Ids outside the vocabulary are skipped; bytes that do not form
        valid UTF-8 come out as U+FFFD."""
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    # ---- chat ----

    @property
    def has_chat_template(self) -> bool:
        return bool(self._chat_templates)

    def apply_chat_template(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render `messages` into the prompt string. Extra keyword arguments become template
        variables (e.g. enable_thinking=False) and override the special-token variables.
        Raises ValueError when the model has no template or the template fails."""
        if not messages:
            raise ValueError("cannot apply a chat template to an empty conversation")
        if tools is not None and not all(isinstance(tool, Mapping) for tool in tools):
            raise ValueError("tools must be JSON schemas (dicts)")
        template = self._chat_templates[select_template(self._chat_templates.keys(), tools)]
        variables = {**self.special_tokens.named, **kwargs}
        return template.render(messages, add_generation_prompt, tools, variables)

    def chat_prompt(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        max_chars: int | None = None,
        **kwargs: Any,
    ) -> ChatPrompt:
        """The chat prompt: the rendered text and its token ids, encoded without special tokens (the
        template writes its own). The one way every caller (the server, `LLM.chat`, the command line)
        builds a chat prompt. A text of more than max_chars characters raises PromptTooLong before it
        is tokenized; a failing template, ValueError."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, **kwargs)
        if max_chars is not None and len(text) > max_chars:
            raise PromptTooLong(f"the chat prompt has {len(text)} characters; at most {max_chars} fit")
        return ChatPrompt(text, self.encode(text, add_special_tokens=False))

    def encode_chat(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """Token ids of the chat prompt (chat_prompt's), as transformers' apply_chat_template(tokenize=True)."""
        return self.chat_prompt(messages, add_generation_prompt, tools, **kwargs).token_ids


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _content(value: Any) -> str | None:
    """A token given as a string or as a serialized AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_special_tokens(config: Mapping[str, Any]) -> SpecialTokens:
    named = {key: _content(config.get(key)) for key in _NAMED_TOKENS}
    # Model-specific names (image_token, ...) join the named ones, as in transformers 5.
    named |= {k: v for k, v in config.items() if k.endswith("_token") and k not in named and isinstance(v, str)}
    extra_config = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    if isinstance(extra_config, Mapping):
        named |= {key: _content(value) for key, value in extra_config.items()}
        extra_config = []
    extra = tuple(t for t in map(_content, extra_config) if t is not None)
    return SpecialTokens({k: v for k, v in named.items() if v is not None}, extra)


def _added_token(content: str, flags: Mapping[str, Any]) -> AddedToken:
    """An AddedToken with the flags of a serialized one; absent flags take tokenizers' defaults."""
    settings = {key: bool(flags[key]) for key in ("single_word", "lstrip", "rstrip", "normalized") if key in flags}
    return AddedToken(content, special=bool(flags.get("special", False)), **settings)


def _sync_added_tokens(backend: tokenizers.Tokenizer, config: Mapping[str, Any]) -> None:
    """Add the tokens that tokenizer_config.json's added_tokens_decoder lists but tokenizer.json lacks."""
    have = {token.content for token in backend.get_added_tokens_decoder().values()}
    for entry in config.get("added_tokens_decoder", {}).values():
        if entry.get("content") not in have:
            backend.add_tokens([_added_token(entry["content"], entry)])


def _register_special_tokens(
    backend: tokenizers.Tokenizer, config: Mapping[str, Any], special_tokens: SpecialTokens
) -> None:
    """Make every named/extra special token a special added token of the backend, keeping the
    flags (lstrip, normalized, ...) the model's files give it; a missing one gets a new id."""
    added = {token.content: token for token in backend.get_added_tokens_decoder().values()}
    configured = {entry["content"]: entry for entry in config.get("added_tokens_decoder", {}).values()}
    given = {_content(v): v for v in config.values() if isinstance(v, Mapping) and _content(v) is not None}
    for content in special_tokens.all_tokens():
        existing = added.get(content)
        if existing is not None and existing.special:
            continue
        flags = configured.get(content) or _flags_of(existing) or given.get(content) or {"normalized": False}
        backend.add_special_tokens([_added_token(content, {**flags, "special": True})])


def _flags_of(token: AddedToken | None) -> dict[str, Any] | None:
    if token is None:
        return None
    return {"single_word": token.single_word, "lstrip": token.lstrip, "rstrip": token.rstrip,
            "normalized": token.normalized}
