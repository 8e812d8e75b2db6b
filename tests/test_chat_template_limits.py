"""Hostile chat templates fail fast, in bounded memory, with a ValueError; normal ones render as before."""

from __future__ import annotations

import json
import sys
import threading
import time
import tracemalloc

import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ferry.tokenizer.chat_template import MAX_RENDER_CHARS, MAX_TEMPLATE_CHARS, RENDER_TIMEOUT_S, ChatTemplate
from tiny_tokenizers import CHATML_TEMPLATE

MESSAGES = [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "What is 2+2?"},
]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "required": ["a"]}}}]
MEMORY_BUDGET = 100 * 2**20  # bytes a failed render may allocate at its peak

NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HOSTILE = {
    "nested loops": NESTED_LOOPS,
    "a string times a literal": "{{ 'a' * 1000000000 }}",
    "a string times a power": "{{ 'a' * 10**9 }}",
    "a list times a power": "{{ [0] * 10**9 }}",
    "a huge power": "{{ 10 ** 100000000 }}",
    "an int squared in a loop": "{% set ns = namespace(x=10) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}"
    "{% endfor %}",
    "doubling with ~": "{% set ns = namespace(s='a') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}",
    "doubling with +": "{% set ns = namespace(s='a') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
    "{% endfor %}",
    "doubling with %": "{% set ns = namespace(s='a') %}{% for i in range(40) %}{% set ns.s = '%s%s' % (ns.s, ns.s) %}"
    "{% endfor %}",
    "doubling in a block": "{% set ns = namespace(s='a') %}{% for i in range(40) %}"
    "{% set block %}{{ ns.s }}{{ ns.s }}{% endset %}{% set ns.s = block %}{% endfor %}",
    "a wide % field": "{{ '%1000000000s' % 'a' }}",
    "a wide format field": "{{ '{:>1000000000}'.format('a') }}",
    "a wide format filter": "{{ '%1000000000s'|format('a') }}",
    "a wide center": "{{ 'a'.center(1000000000) }}",
    "a wide center filter": "{{ 'a'|center(1000000000) }}",
    "lists of ranges": "{% set ns = namespace(l=[]) %}{% for i in range(100000) %}"
    "{% set ns.l = ns.l + (range(100000)|list) %}{% endfor %}",
    "a list that nests itself": "{% set ns = namespace(x=[1]) %}{% for i in range(60) %}{% set ns.x = [ns.x, ns.x] %}"
    "{% endfor %}{{ ns.x|tojson }}",
    "a striptags on many tags": "{{ ('<a>' * 300000)|striptags }}",
    "a long output": "{% for i in range(100000) %}{{ 'a' * 100000 }}{% endfor %}",
    "a test on every pair": "{% set l = range(100000)|list %}{{ l|select('in', l)|list|length }}",
    "endless recursion": "{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}",
    "a syntax error": "{% for %}",
    "absurd nesting": "{{ " + "(" * 20000 + "1" + ")" * 20000 + " }}",
    "a huge source": "{{ 1 }}" * (MAX_TEMPLATE_CHARS // 7 + 1),
}


def _render(template: ChatTemplate, messages: list[dict] = MESSAGES, tools: list[dict] | None = None) -> str:
    return template.render(messages, add_generation_prompt=True, tools=tools, variables={"bos_token": "<s>"})


def _reference(source: str, messages: list[dict] = MESSAGES, tools: list[dict] | None = None) -> str:
    """What the bare sandbox, set up as in transformers, renders."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    return env.from_string(source).render(messages=messages, tools=tools, add_generation_prompt=True, bos_token="<s>")


@pytest.mark.parametrize("source", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_template_fails_fast(source: str) -> None:
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"^chat template (error|does not compile)"):
        _render(ChatTemplate(source))
    assert time.monotonic() - start < 2 * RENDER_TIMEOUT_S


@pytest.mark.parametrize("source", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_template_fails_in_bounded_memory(source: str) -> None:
    tracemalloc.start()  # which slows allocations down: time is measured above, without it
    try:
        with pytest.raises(ValueError):
            _render(ChatTemplate(source))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MEMORY_BUDGET


def test_the_deadline_is_what_stops_a_loop() -> None:
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"^chat template error: rendering took longer than 0.2 s"):
        _render(ChatTemplate(NESTED_LOOPS, timeout_s=0.2))
    assert 0.2 <= time.monotonic() - start < 0.4


def test_max_chars_bounds_values() -> None:
    source = "{{ 'a' * 5000 }}"
    with pytest.raises(ValueError, match="longer than"):
        _render(ChatTemplate(source, max_chars=1000))
    assert _render(ChatTemplate(source, max_chars=10_000)) == "a" * 5000


def test_constant_folding_builds_nothing_while_compiling() -> None:
    # Jinja would fold these constants into the compiled code, building them there
    for source in ("{{ 'a' * 1000000000 }}", "{{ 'a'|center(1000000000) }}", "{{ ('a' ~ 'b')|center(999999) }}"):
        tracemalloc.start()
        try:
            ChatTemplate(source)._template()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 10 * 2**20


NORMAL_TEMPLATES = {
    "chatml": CHATML_TEMPLATE,
    # every construct that the limits check, at a normal size
    "checked constructs": (
        "{%- macro show(x) %}[{{ x }}|{{ varargs|length }}]{% endmacro %}"
        "{%- set ns = namespace(text='', n=0) %}"
        "{%- for message in messages %}"
        "{%- set ns.text = ns.text ~ message.role[0] ~ (loop.index * 2) %}"
        "{%- set ns.n = ns.n + message.content|length %}"
        "{{- '%d: %-10s|' % (loop.index, message.role) }}{{ '{:>10}|{}'.format(message.role, loop.last) }}"
        "{{- (message.content + '!') * 2 }}{{ show(message.role, 1, 2) }}{{ cycler('a', 'b').next() }}"
        "{%- if not loop.last %}{{ '\\n' }}{% endif %}"
        "{%- endfor %}\n"
        "{{ ns.text }} {{ ns.n }} {{ 2 ** 70 }} {{ [1, 2] * 2 }} {{ {'a': (1, 2.5, none)} }} {{ ns }}\n"
        "{{ messages|map(attribute='role')|join(', ') }} {{ 'x'|center(7) }}{{ tools|tojson(indent=2) }}\n"
        "{% set block %}{{ ns.n }}-{{ 'y' ~ 'z' }}{% endset %}{{ block|upper }} {{ '%s'|format(block) }}\n"
        "{{ range(3)|list }} {{ messages|selectattr('role', 'equalto', 'user')|list|length }}\n"
        "{{ [1, 2, 3, 4, 5]|batch(2, 0)|list }} {{ messages[0].items()|list }} {{ 'a b'.split() }}\n"
        "{% for a, b in [(1, 2), (3, 4)] if a > 1 %}{{ a + b }}{% else %}none{% endfor %}"
    ),
}


@pytest.mark.parametrize("source", NORMAL_TEMPLATES.values(), ids=NORMAL_TEMPLATES.keys())
def test_normal_template_renders_as_the_bare_sandbox_does(source: str) -> None:
    assert _render(ChatTemplate(source), tools=TOOLS) == _reference(source, tools=TOOLS)


def test_long_inputs_raise_the_limit() -> None:
    # a conversation longer than MAX_RENDER_CHARS is no attack: the limit grows with the inputs
    messages = [{"role": "user", "content": "word " * (MAX_RENDER_CHARS // 2)}] * 3
    prompt = _render(ChatTemplate(CHATML_TEMPLATE), messages)
    assert len(prompt) > 3 * MAX_RENDER_CHARS
    assert prompt == _reference(CHATML_TEMPLATE, messages)


def test_limits_hold_in_a_worker_thread_next_to_a_normal_render() -> None:
    outcome: dict[str, object] = {}

    def render_hostile() -> None:
        start = time.monotonic()
        try:
            _render(ChatTemplate(NESTED_LOOPS))
        except ValueError as error:
            outcome["error"] = str(error)
        outcome["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=render_hostile)
    thread.start()
    normal = ChatTemplate(CHATML_TEMPLATE)
    while thread.is_alive():  # a normal render in this thread, meanwhile, is not bounded by the other's limits
        assert _render(normal) == _reference(CHATML_TEMPLATE)
        thread.join(timeout=0.01)
    assert "took longer than" in str(outcome["error"])
    assert outcome["seconds"] < 2 * RENDER_TIMEOUT_S


def test_a_failed_render_keeps_the_threads_trace_function() -> None:
    def tracer(frame: object, event: str, arg: object) -> None:
        return None

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        for source in (NESTED_LOOPS, HOSTILE["a string times a power"]):
            with pytest.raises(ValueError):
                _render(ChatTemplate(source, timeout_s=0.1))
            assert sys.gettrace() is tracer
    finally:
        sys.settrace(previous)
