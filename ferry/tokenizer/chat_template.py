"""Chat templates: finding a model's Jinja template and rendering messages into a prompt string.

Templates come from the model's files, so they are untrusted code: they run in Jinja's immutable
sandbox with exactly the helpers Hugging Face transformers gives them (`raise_exception`,
`strftime_now`, a `tojson` that keeps non-ASCII text, a guarded `namespace`), so that a prompt
rendered here is byte-for-byte the one `tokenizer.apply_chat_template(..., tokenize=False)` renders.

Where a model keeps its template(s), later sources replacing earlier ones as in transformers:
    tokenizer_config.json "chat_template"   a string, or a list of {"name", "template"}
    chat_template.jinja                     the "default" template
    additional_chat_templates/<name>.jinja  further named templates

Rendering is bounded, since a template can loop for ever or build huge values (see ChatTemplate).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils

from ferry.tokenizer.bounded_sandbox import (
    MAX_RENDER_CHARS, MAX_TEMPLATE_CHARS, RENDER_TIMEOUT_S, BoundedSandbox, Limits, RenderTimeout, TooBig, bound,
    check_in_render, checked, finalize,
)

Message = dict[str, Any]


# Names a message's reasoning may come under. Templates read "reasoning_content" (and gpt-oss's
# "thinking"), so a message carrying any of them gets both, as transformers does.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def read_chat_templates(model_dir: Path, tokenizer_config: Mapping[str, Any]) -> dict[str, str]:
    """All of a model's chat templates by name ("default" for the main one); {} when it has none."""
    templates: dict[str, str] = {}
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        templates["default"] = jinja_file.read_text(encoding="utf-8")
    extra_dir = model_dir / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if templates:
        return templates  # template files take priority over the config, as in transformers
    configured = tokenizer_config.get("chat_template")
    if isinstance(configured, str):
        return {"default": configured}
    if isinstance(configured, list):
        return {entry["name"]: entry["template"] for entry in configured}
    return {}


def select_template(names: Collection[str], tools: list | None) -> str:
    """The name of the template to render: "tool_use" when tools are given and the model has one,
    else "default" (or the only one)."""
    if not names:
        raise ValueError(
            "this model has no chat template (no chat_template in tokenizer_config.json and no "
            "chat_template.jinja): send a plain completion prompt instead of chat messages"
        )
    if tools is not None and "tool_use" in names:
        return "tool_use"
    if "default" in names:
        return "default"
    if len(names) == 1:
        return next(iter(names))
    raise ValueError(f"this model has several chat templates and none is named 'default': {sorted(names)}")


class ChatTemplate:
    """One compiled chat template. Compiling is deferred to the first render, so that a model with a
    broken template still loads and serves plain completions.

    A template is the model's code, so a render is bounded (bounded_sandbox.py): past `timeout_s`
    (RENDER_TIMEOUT_S) in whatever thread renders, or when a value it builds or its output would
    pass `max_chars` (MAX_RENDER_CHARS) plus a multiple of its inputs' size, it fails with
    ValueError like any other template error. Sources over MAX_TEMPLATE_CHARS do not compile.
    """

    def __init__(self, source: str, timeout_s: float = RENDER_TIMEOUT_S, max_chars: int = MAX_RENDER_CHARS) -> None:
        self.source = source
        self.timeout_s = timeout_s
        self.max_chars = max_chars
        self._compiled: jinja2.Template | None = None

    def render(
        self,
        messages: list[Message],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None,
        variables: Mapping[str, Any],
    ) -> str:
        """Render the prompt. `variables` are the special tokens (bos_token, ...) and any extra
        template arguments; like transformers, they are passed next to messages/tools/documents.
        Raises ValueError for any error in the template, including its own raise_exception."""
        variables = _plain(dict(variables))
        documents = variables.pop("documents", None)
        arguments = {"messages": _normalize_messages(messages), "tools": _plain(tools), "documents": documents}
        template = self._template()
        try:
            with Limits(self.timeout_s, self.max_chars, inputs=(arguments, variables)):
                parts = template.generate(**arguments, add_generation_prompt=add_generation_prompt, **variables)
                return template.environment.concat(parts)
        except RenderTimeout:
            raise ValueError(f"chat template error: rendering took longer than {self.timeout_s} s") from None
        except TooBig as error:
            raise ValueError(f"chat template error: {error}") from error
        except Exception as error:  # the template is the model's code: any failure is a bad request
            raise ValueError(f"chat template error: {type(error).__name__}: {error}") from error

    def _template(self) -> jinja2.Template:
        if self._compiled is None:
            if len(self.source) > MAX_TEMPLATE_CHARS:
                raise ValueError(f"chat template does not compile: it is longer than {MAX_TEMPLATE_CHARS} characters")
            try:
                self._compiled = _environment().from_string(self.source)
            except Exception as error:  # RecursionError and MemoryError too, from absurdly nested source
                raise ValueError(f"chat template does not compile: {error}") from error
        return self._compiled


def _environment() -> BoundedSandbox:
    # trim_blocks/lstrip_blocks and loopcontrols are what Hub templates are written against.
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols], finalize=finalize)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return bound(env)


def _raise_exception(message: str) -> None:
    # as text now, while the render's limits hold, since the error is printed once they are gone
    raise jinja2.exceptions.TemplateError(str(checked(message)))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; chat prompts want the plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` for templates, without exposing the dict type itself to attribute tricks."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's `namespace`, refusing underscore names so that templates cannot reach internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's own signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    def __repr__(self) -> str:
        # namespaces set into one another can nest a value many times over: measured first, in a render
        check_in_render(self)
        return jinja2.utils.Namespace.__repr__(self)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


def _normalize_messages(messages: list[Message]) -> list[Message]:
    """Plain-data copies of the messages, as transformers gives them to templates: keys whose value
    is None are dropped (OpenAI clients send content=None next to tool_calls), and reasoning is
    aliased under the names templates read."""
    normalized = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise ValueError(f"chat messages must be dicts, got {type(message).__name__}")
        message = {key: _plain(value) for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        normalized.append(message)
    return normalized


def _plain(value: Any) -> Any:
    """A copy built of JSON types only: the sandbox cannot vet the methods of arbitrary objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # subclasses such as str enums carry extra methods
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models, e.g. the server's messages
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"  # media and other objects: templates only test for presence
