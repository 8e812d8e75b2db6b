"""Tool calling: reading calls out of a model's text, and constraining the text to calls.

    calls.py     ToolCall, ParsedMessage, the stream's deltas, and the fold from deltas to a message
    parsers.py   the formats models write calls in (hermes, llama3_json, mistral, pythonic), each
                 as parse(text) and as a stream fed the text piece by piece (tool_choice "auto")
    choice.py    tool_choice "required" or a named function as a JSON schema for structured
                 output, and the calls back out of the output it constrained

Pure Python and the standard library: no engine, no server.
"""

from ferry.tools.calls import (
    ContentDelta,
    Delta,
    ParsedMessage,
    ToolCall,
    ToolCallDelta,
    call_deltas,
    fold,
    new_call_id,
)
from ferry.tools.choice import (
    ToolChoiceError,
    tool_calls_from_constrained,
    tool_choice_schema,
    tool_functions,
)
from ferry.tools.parsers import (
    TOOL_PARSERS,
    ToolCallStream,
    ToolParser,
    get_tool_parser,
)

__all__ = [
    "TOOL_PARSERS", "ContentDelta", "Delta", "ParsedMessage", "ToolCall", "ToolCallDelta", "ToolCallStream",
    "ToolChoiceError", "ToolParser", "call_deltas", "fold", "get_tool_parser", "new_call_id",
    "tool_calls_from_constrained", "tool_choice_schema", "tool_functions",
]
