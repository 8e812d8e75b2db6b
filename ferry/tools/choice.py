"""tool_choice "required" and a named function as a JSON schema that constrains the output, in
vLLM's way: whatever the model's own format for calls, the output is plain JSON.

    named     {"type": "function", "function": {"name": "f"}}  ->  f's `parameters`: the output IS
              the arguments object, {"city": "Paris"}
    required  ->  a list of one call or more (just one when parallel_tool_calls is false):
              [{"name": "f", "parameters": {"city": "Paris"}}, {"name": "g", "parameters": {}}]
              (an anyOf over the tools, each name a const with its own parameters)
    auto, none  ->  no schema: the output is free, and a tool parser reads calls out of it

The request's tools keep OpenAI's shape, as plain dicts:
    {"type": "function", "function": {"name", "description", "parameters", "strict"}}
Every problem with them raises ToolChoiceError naming it (a ValueError: the server answers 400
with the message).
"""

from __future__ import annotations

import json
from typing import Any

from ferry.tools.calls import ToolCall, arguments_json


class ToolChoiceError(ValueError):
    """A request's tools or tool_choice that cannot be used; the message names the problem."""


_NO_PARAMETERS = {"type": "object", "properties": {}}
_DEFS = ("$defs", "definitions")  # where a schema keeps what its "$ref"s point at


def tool_choice_schema(tools: list[dict] | None, tool_choice: str | dict | None,
                       parallel_tool_calls: bool = True) -> dict | None:
    """The JSON schema the output must follow, or None where tool_choice leaves it free."""
    functions = tool_functions(tools)
    mode, name = _mode(tool_choice, functions)
    if mode == "function":
        return functions[name]
    if mode != "required":
        return None
    items, defs = [], {key: {} for key in _DEFS}
    for fn_name, parameters in functions.items():
        parameters = _hoist_defs(fn_name, parameters, defs)
        items.append({"type": "object", "properties": {"name": {"const": fn_name}, "parameters": parameters},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": items}, "minItems": 1}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    schema.update((key, found) for key, found in defs.items() if found)
    return schema


def tool_calls_from_constrained(text: str, tools: list[dict] | None, tool_choice: str | dict | None) -> list[ToolCall]:
    """The calls in an output that followed tool_choice_schema(tools, tool_choice); ValueError when
    it is not such an output (cut short by max_tokens, say) or tool_choice does not constrain it."""
    functions = tool_functions(tools)
    mode, name = _mode(tool_choice, functions)
    if mode not in ("function", "required"):
        raise ValueError(f"tool_choice {mode!r} does not constrain the output to tool calls")
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"the constrained output is not JSON ({e}): {text[:80]!r}") from None
    if mode == "function":
        if not isinstance(value, dict):
            raise ValueError(f"the constrained output for {name!r} is not a JSON object")
        return [ToolCall(name, arguments_json(value))]
    if not isinstance(value, list) or not value:
        raise ValueError("the constrained output for tool_choice 'required' is not a non-empty list")
    calls = []
    for item in value:
        fn_name = item.get("name") if isinstance(item, dict) else None
        if fn_name not in functions or not isinstance(item.get("parameters"), dict):
            raise ValueError(f"the constrained output has no call of a tool in: {json.dumps(item)[:80]}")
        calls.append(ToolCall(fn_name, arguments_json(item["parameters"])))
    return calls


def tool_functions(tools: list[dict] | None) -> dict[str, dict]:
    """The request's functions, name -> parameters (an object schema), checked."""
    if tools is None:
        return {}
    if not isinstance(tools, list):
        raise ToolChoiceError("tools must be a list")
    functions: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ToolChoiceError(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}')
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ToolChoiceError(f"tools[{i}].function has no name")
        if name in functions:
            raise ToolChoiceError(f"tools[{i}]: a second function named {name!r}")
        functions[name] = _object_schema(f"tools[{i}] ({name!r}).function.parameters", function.get("parameters"))
    return functions


def _object_schema(where: str, parameters: Any) -> dict:
    """parameters as a schema of objects (None: a function without any)."""
    if parameters is None:
        return dict(_NO_PARAMETERS)
    if not isinstance(parameters, dict):
        raise ToolChoiceError(f"{where} must be a JSON schema object, not {type(parameters).__name__}")
    kind = parameters.get("type", "object")
    if kind != "object":
        raise ToolChoiceError(f"{where} must be a schema of type 'object', not {kind!r}")
    return {**parameters, "type": "object"}  # no "type" at all would also let non-objects through


def _mode(tool_choice: str | dict | None, functions: dict[str, dict]) -> tuple[str, str | None]:
    """("auto" | "none" | "required", None), or ("function", the name a named tool_choice picks)."""
    if tool_choice is None:
        return "auto", None  # OpenAI's default where tools are given (and harmless where not)
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ToolChoiceError(f"unknown tool_choice {tool_choice!r}: expected 'none', 'auto', 'required' "
                             'or {"type": "function", "function": {"name": ...}}')
        if tool_choice == "required" and not functions:
            raise ToolChoiceError("tool_choice 'required' needs at least one tool in tools")
        return tool_choice, None
    is_named = isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
    function = tool_choice.get("function") if is_named else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ToolChoiceError('a named tool_choice must be {"type": "function", "function": {"name": ...}}')
    if name not in functions:
        known = ", ".join(repr(n) for n in functions) or "none"
        raise ToolChoiceError(f"tool_choice names function {name!r}, which is not in tools (there: {known})")
    return "function", name


def _hoist_defs(fn_name: str, parameters: dict, defs: dict[str, dict]) -> dict:
    """parameters without their definitions, which move into `defs` (by where they were kept):
    nested under "items" a "$ref": "#/$defs/x" would point nowhere, at the root it resolves."""
    if not any(key in parameters for key in _DEFS):
        return parameters
    parameters = dict(parameters)
    for key in _DEFS:
        found = parameters.pop(key, {})
        if not isinstance(found, dict):
            raise ToolChoiceError(f"tool {fn_name!r}: parameters.{key} must be an object")
        for def_name, definition in found.items():
            if defs[key].setdefault(def_name, definition) != definition:
                raise ToolChoiceError(f"tool {fn_name!r} defines {def_name!r} unlike another tool does: "
                                 "tool_choice 'required' needs one definition of each name")
    return parameters
