"""What a request asks its output to match: exactly one of a JSON schema, any JSON object, a regular
expression, one of a list of strings, or a grammar (Lark, or the GBNF / EBNF that llama.cpp,
xgrammar and SGLang take). vLLM's `StructuredOutputsParams`, by its field names.

Plain, hashable data (the schema travels as JSON text), so it crosses the process boundary in the
message codec and keys the compiled-grammar cache.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | None = None  # a JSON schema, serialized
    json_object: bool = False  # any JSON object (OpenAI's response_format json_object)
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None  # Lark, or GBNF / EBNF
    # Where the request said it (for error messages: "response_format", "guided_regex", ...).
    source: str = "structured_outputs"

    def __post_init__(self) -> None:
        given = [f.name for f in fields(self) if f.name != "source" and getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"{self.source}: give exactly one of json, json_object, regex, choice or grammar"
                             + (f" (got {', '.join(given)})" if given else ""))
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"{self.source}: choice must be a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        return next(f.name for f in fields(self) if f.name != "source" and getattr(self, f.name) not in (None, False))

    def to_json(self) -> dict:
        value = getattr(self, self.kind)
        return {self.kind: list(value) if isinstance(value, tuple) else value, "source": self.source}

    @classmethod
    def from_json(cls, body: dict) -> StructuredOutputsParams:
        if not isinstance(body, dict):
            raise ValueError("structured outputs must be an object")
        body = dict(body)
        if isinstance(body.get("choice"), list):
            body["choice"] = tuple(body["choice"])
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in body.items() if k in known})
