"""What a reply's tool calls are made of: whole calls, the deltas a stream gives them out in, and the
fold from the one to the other (a non-streamed reply is the fold of the streamed one).

    ToolCall(name="get_weather", arguments='{"city": "Paris"}', id="call_...")
    ContentDelta("Let me check.")                   text of the reply outside tool calls
    ToolCallDelta(0, "call_...", "get_weather", '{"city": ')   a call's first delta: id and name
    ToolCallDelta(0, None, None, '"Paris"}')                     later ones: more argument text
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Any

_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    """An id as OpenAI writes them: "call_" and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


def arguments_json(arguments: dict[str, Any]) -> str:
    """A call's arguments as JSON text, laid out as json.dumps does by default (", " and ": ", as
    structured output lays out JSON too). NaN and infinities raise ValueError: they are not JSON."""
    return json.dumps(arguments, ensure_ascii=False, allow_nan=False)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict[str, Any]:
        """The call as a reply's `message.tool_calls` entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedMessage:
    content: str | None  # the text outside tool calls, stripped; None when that leaves nothing
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    index: int  # which call of the reply, from 0
    id: str | None  # set in a call's first delta only
    name: str | None  # set in a call's first delta only
    arguments: str  # more of the arguments' JSON text (possibly all of it, possibly "")

    def to_openai(self) -> dict[str, Any]:
        """The delta as a streamed chunk's `delta.tool_calls` entry."""
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.name is not None:
            function = {"name": self.name, **function}
        if self.id is None:
            return {"index": self.index, "function": function}
        return {"index": self.index, "id": self.id, "type": "function", "function": function}


Delta = ContentDelta | ToolCallDelta


def call_deltas(calls: list[ToolCall], first_index: int = 0) -> list[ToolCallDelta]:
    """Whole calls as a stream's deltas, one each (for output that is parsed only once complete)."""
    return [ToolCallDelta(first_index + i, c.id, c.name, c.arguments) for i, c in enumerate(calls)]


def fold(deltas: list[Delta]) -> ParsedMessage:
    """The message a stream of deltas adds up to: content concatenated, each call's arguments
    concatenated in its index's order of arrival."""
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    calls: dict[int, list[str]] = {}  # index -> [id, name, arguments so far]
    for d in deltas:
        if isinstance(d, ToolCallDelta):
            if d.index in calls:
                calls[d.index][2] += d.arguments
            else:
                calls[d.index] = [d.id or new_call_id(), d.name or "", d.arguments]
    tool_calls = [ToolCall(name, arguments, id) for _, (id, name, arguments) in sorted(calls.items())]
    return ParsedMessage(content or None, tool_calls)
