"""The request fields that ask for structured output, as OpenAI, vLLM and SGLang spell them, turned
into one StructuredOutputsParams:

    response_format: {"type": "json_object"}                      OpenAI
    response_format: {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    structured_outputs: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}   vLLM
    guided_json, guided_regex, guided_choice, guided_grammar      vLLM's older names
    regex, ebnf                                                   SGLang

At most one of them may ask for something; `response_format: {"type": "text"}` asks for nothing.
"""

from __future__ import annotations

import json
from typing import Any

from ferry.structured.params import StructuredOutputsParams

FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
          "guided_grammar", "regex", "ebnf")


class StructuredRequestError(ValueError):
    """A structured-output field that is malformed; `param` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def structured_outputs_of(fields: dict[str, Any]) -> StructuredOutputsParams | None:
    """The request's structured output from its fields by name (missing or None: not given)."""
    asked = [(name, fields[name]) for name in FIELDS if fields.get(name) is not None]
    asked = [(name, value) for name, value in asked if not _is_plain_text(name, value)]
    if not asked:
        return None
    if len(asked) > 1:
        names = ", ".join(name for name, _ in asked)
        raise StructuredRequestError(f"ask for one structured output at most, got {names}", asked[1][0])
    name, value = asked[0]
    try:
        return _parse(name, value)
    except StructuredRequestError:
        raise
    except (ValueError, TypeError) as e:
        raise StructuredRequestError(f"{name}: {e}", name) from None


def _is_plain_text(name: str, value: Any) -> bool:
    return name == "response_format" and isinstance(value, dict) and value.get("type") == "text"


def _parse(name: str, value: Any) -> StructuredOutputsParams:
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        if not isinstance(value, dict):
            raise StructuredRequestError("structured_outputs must be an object", name)
        known = {"json", "regex", "choice", "grammar", "json_object"}
        given = {k: v for k, v in value.items() if v is not None and v is not False and k in known}
        if "json" in given:
            given["json"] = _schema_text(given["json"], name)
        if "choice" in given:
            given["choice"] = _choices(given["choice"], name)
        for key in ("regex", "grammar"):
            if key in given and not isinstance(given[key], str):
                raise StructuredRequestError(f"{name}.{key} must be a string", name)
        return StructuredOutputsParams(**given, source=name)
    if name == "guided_json":
        return StructuredOutputsParams(json=_schema_text(value, name), source=name)
    if name == "guided_choice":
        return StructuredOutputsParams(choice=_choices(value, name), source=name)
    if not isinstance(value, str):
        raise StructuredRequestError(f"{name} must be a string", name)
    if name in ("guided_regex", "regex"):
        return StructuredOutputsParams(regex=value, source=name)
    return StructuredOutputsParams(grammar=value, source=name)  # guided_grammar, ebnf


def _response_format(value: Any) -> StructuredOutputsParams:
    name = "response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise StructuredRequestError('response_format must be an object with a "type"', name)
    kind = value["type"]
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True, source=name)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise StructuredRequestError('response_format json_schema needs "json_schema": {"name", "schema"}', name)
        schema = spec.get("schema")
        if schema is None:  # OpenAI requires it; a schema-less request asks for JSON of any shape
            return StructuredOutputsParams(json_object=True, source=name)
        return StructuredOutputsParams(json=_schema_text(schema, name), source=name)
    raise StructuredRequestError(
        f"response_format type {kind!r} is not supported: use text, json_object or json_schema", name)


def _schema_text(schema: Any, name: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise StructuredRequestError(f"{name}: the JSON schema is not valid JSON ({e})", name) from None
    if not isinstance(schema, (dict, bool)):
        raise StructuredRequestError(f"{name}: a JSON schema must be an object", name)
    return json.dumps(schema)


def _choices(value: Any, name: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise StructuredRequestError(f"{name}: choice must be a non-empty list of non-empty strings", name)
    return tuple(value)
