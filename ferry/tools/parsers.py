"""From a model's text to content and tool calls, by the format the model writes them in; the
parsers go by vLLM's `--tool-call-parser` names:

    hermes       (Hermes, Qwen2.5, Qwen3) blocks anywhere, each one call, text around them:
                 Let me look.<tool_call>\\n{"name": "f", "arguments": {"a": 1}}\\n</tool_call>
    llama3_json  (Llama 3.x) JSON objects separated by ";", the output's start or after <|python_tag|>:
                 {"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}
    mistral      (Mistral) a JSON list after [TOOL_CALLS], text before it:
                 [TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}]
    pythonic     (Llama 3.2+, ToolACE) the whole output a Python list of calls with literal arguments:
                 [f(a=1), g(b="x", c=[1, 2])]

Each format is a rule for finding tool-call regions in the text. A region opens at a marker
(`start`), or where the output begins with a call (`opens`: "{" for llama3_json, "[f(" for
pythonic), and runs to its closing marker (`end`) or, where the format has none, to the end of the
output. A region's text either decodes into calls (a call: a string `name` and an object
`arguments`, or `parameters`) or stays content as it was written, markers and all: broken JSON
is never an error, only text.

One code path: `parse(text)` is the fold of `stream()` fed the whole text at once. The stream
gives out content as soon as it cannot be the start of a region (a possible partial marker is held
back) and each call in one delta once its region is complete, so for any split of the text the
deltas add up to `parse(text)`: the content deltas concatenated equal `parse(text).content`
exactly (or "" for None), and a call's one delta carries its whole `arguments`.

Content is the text outside regions, concatenated and stripped of whitespace at both ends; inner
whitespace stays as written ("Hi \\n<tool_call>...</tool_call>\\n bye" -> "Hi \\n\\n bye"). A
stream strips as it goes: it drops whitespace before the first content and holds whitespace back
until more text follows it.
"""

from __future__ import annotations

import ast
import enum
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ferry.tools.calls import (
    ContentDelta,
    Delta,
    ParsedMessage,
    ToolCallDelta,
    arguments_json,
    fold,
    new_call_id,
)

# A region's text -> (name, arguments JSON) of its calls; None (or raising) when it is not calls.
Decoder = Callable[[str], "list[tuple[str, str]] | None"]
# The output's beginning (from its first non-space) -> does a region open there? None: undecided yet.
Opener = Callable[[str], "bool | None"]


@dataclass(frozen=True)
class ToolParser:
    """One format of tool calls (see the module doc): where its regions are, and how a region's
    text decodes. `parse` and `stream` agree on every text, however it is split."""

    name: str
    decode: Decoder
    start: str | None = None  # a marker that opens a region anywhere in the text
    end: str | None = None  # the marker that closes it; None: the region runs to the end of the output
    opens: Opener | None = None  # a region also opens where the output begins so

    def parse(self, text: str) -> ParsedMessage:
        """The content and calls of a whole output."""
        stream = self.stream()
        return fold(stream.feed(text) + stream.finish())

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)

    def calls_of(self, region: str) -> list[tuple[str, str]] | None:
        """decode, with every way that text can fail to be calls meaning None (never raising)."""
        try:
            return self.decode(region) or None
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None


class _State(enum.Enum):
    START = "start"  # the output's beginning cannot tell yet whether a region opens there
    TEXT = "text"  # between regions
    CALL = "call"  # inside a region


class ToolCallStream:
    """One output's deltas as its text arrives: `feed` each new piece, then `finish` once. Each
    call returns what the text so far makes certain; no delta is ever taken back or changed."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self._state = _State.START if parser.opens else _State.TEXT
        self._pending = ""  # text not given out yet: a possible marker, or the open region so far
        self._opener = ""  # the marker that opened the current region ("" where `opens` did)
        self._space = ""  # whitespace held back until content follows it
        self._content_started = False
        self._num_calls = 0

    def feed(self, delta_text: str) -> list[Delta]:
        self._pending += delta_text
        return self._advance(final=False)

    def finish(self) -> list[Delta]:
        """The rest: a held partial marker is content, an open region is decoded as it stands."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> list[Delta]:
        out: list[Delta] = []
        while True:  # each state's step appends to `out`; False: it needs more text than there is
            if self._state is _State.START and not self._open_at_start(final):
                return out
            if self._state is _State.TEXT and not self._text(out, final):
                return out
            if self._state is _State.CALL and not self._region(out, final):
                return out

    def _open_at_start(self, final: bool) -> bool:
        """START -> CALL or TEXT once the output's first non-space text tells; False: wait."""
        head = self._pending.lstrip()
        verdict = self.parser.opens(head) if head else None
        if verdict is None and not final:
            return False
        if verdict:
            self._state, self._pending, self._opener = _State.CALL, head, ""
        else:
            self._state = _State.TEXT
        return True

    def _text(self, out: list[Delta], final: bool) -> bool:
        """Content up to the next marker (-> CALL, True), or up to a possible partial one (False)."""
        start = self.parser.start
        at = self._pending.find(start) if start else -1
        if at >= 0:
            out += self._content(self._pending[:at])
            self._state, self._pending, self._opener = _State.CALL, self._pending[at + len(start):], start
            return True
        keep = 0 if final or not start else _partial_marker(self._pending, start)
        out += self._content(self._pending[:len(self._pending) - keep])
        self._pending = self._pending[len(self._pending) - keep:]
        return False

    def _region(self, out: list[Delta], final: bool) -> bool:
        """The region's calls once it is complete (-> TEXT, True); False: wait."""
        end = self.parser.end
        at = self._pending.find(end) if end else -1
        if at < 0 and not final:
            return False
        body, closer = (self._pending[:at], end) if at >= 0 else (self._pending, "")
        self._pending = self._pending[at + len(end):] if at >= 0 else ""
        self._state = _State.TEXT
        calls = self.parser.calls_of(body)
        if calls is None:
            out += self._content(self._opener + body + closer)
            return True
        for name, arguments in calls:
            out.append(ToolCallDelta(self._num_calls, new_call_id(), name, arguments))
            self._num_calls += 1
        return True

    def _content(self, text: str) -> list[Delta]:
        """Text outside regions, stripped at both ends of the whole content (see the module doc)."""
        if not self._content_started:
            text = text.lstrip()
        body = text.rstrip()
        if not body:
            self._space += text
            return []
        delta = ContentDelta(self._space + body)
        self._space, self._content_started = text[len(body):], True
        return [delta]


def _partial_marker(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is the beginning of `marker` (0: none)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


# ---- decoders -------------------------------------------------------------------------------


def _call(obj: Any) -> tuple[str, str] | None:
    """{"name": "f", "arguments": {...}} (or "parameters") -> ("f", arguments JSON); else None."""
    if not isinstance(obj, dict):
        return None
    name, arguments = obj.get("name"), obj.get("arguments", obj.get("parameters"))
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return name, arguments_json(arguments)


def _all_calls(objs: list[Any]) -> list[tuple[str, str]] | None:
    calls = [_call(obj) for obj in objs]
    return None if None in calls else calls


def _decode_hermes(region: str) -> list[tuple[str, str]] | None:
    return _all_calls([json.loads(region)])


def _decode_mistral(region: str) -> list[tuple[str, str]] | None:
    value = json.loads(region)
    return _all_calls(value if isinstance(value, list) else [value])


_SEMICOLON = re.compile(r"\s*;\s*")


def _decode_llama3_json(region: str) -> list[tuple[str, str]] | None:
    """One or more JSON objects separated by ";", nothing else around them but whitespace."""
    text, decoder, objs, at = region.strip(), json.JSONDecoder(), [], 0
    while True:
        obj, at = decoder.raw_decode(text, at)
        objs.append(obj)
        if at == len(text):
            return _all_calls(objs)
        separator = _SEMICOLON.match(text, at)
        if separator is None:
            return None
        at = separator.end()


def _decode_pythonic(region: str) -> list[tuple[str, str]] | None:
    """[f(a=1), g()]: a list of calls of plain names, keyword arguments only, literal values."""
    tree = ast.parse(region.strip(), mode="eval").body
    if not isinstance(tree, ast.List):
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        if any(keyword.arg is None for keyword in node.keywords):  # **kwargs
            return None
        arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords}
        calls.append((node.func.id, arguments_json(arguments)))
    return calls


# The beginnings of "[f(" as a pattern: whatever matches this whole may yet become one.
_PYTHONIC_CALL = re.compile(r"\[\s*[A-Za-z_]\w*\s*\(")
_PYTHONIC_PREFIX = re.compile(r"\[\s*(?:[A-Za-z_]\w*\s*)?")


def _opens_pythonic(head: str) -> bool | None:
    if _PYTHONIC_CALL.match(head):
        return True
    return None if _PYTHONIC_PREFIX.fullmatch(head) else False


TOOL_PARSERS: dict[str, ToolParser] = {parser.name: parser for parser in (
    ToolParser("hermes", _decode_hermes, start="<tool_call>", end="</tool_call>"),
    ToolParser("llama3_json", _decode_llama3_json, start="<|python_tag|>", opens=lambda head: head[0] == "{"),
    ToolParser("mistral", _decode_mistral, start="[TOOL_CALLS]"),
    ToolParser("pythonic", _decode_pythonic, opens=_opens_pythonic),
)}


def get_tool_parser(name: str) -> ToolParser:
    """The parser of that `--tool-call-parser` name; ValueError naming the known ones."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]
