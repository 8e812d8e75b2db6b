"""Tool calls (ferry/tools): each parser on outputs as models write them, the stream against the
whole-text parse over many splits of the text, text that only looks like calls staying content,
and tool_choice's schemas checked with jsonschema and read back into calls.
"""

from __future__ import annotations

import json
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferry.tools import (
    TOOL_PARSERS,
    ContentDelta,
    ParsedMessage,
    ToolCall,
    ToolCallDelta,
    call_deltas,
    fold,
    get_tool_parser,
    new_call_id,
    tool_calls_from_constrained,
    tool_choice_schema,
)

WEATHER = {"city": "San Francisco, CA", "unit": "celsius"}
UNICODE = {"text": "こんにちは, café ☕", "to": "français"}
NESTED = {"filter": {"and": [{"field": "age", "gt": 30}, {"field": "tags", "in": ["a", "b"]}]}, "limit": 10,
          "exact": None, "desc": True, "ratio": -0.5}


def dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False)


def hermes_block(name, arguments) -> str:
    return f"<tool_call>\n{dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# parser -> [(output, content, [(name, arguments object)])]
CASES = {
    "hermes": [
        (hermes_block("get_weather", WEATHER), None, [("get_weather", WEATHER)]),
        (hermes_block("get_weather", WEATHER) + "\n" + hermes_block("get_time", {}), None,
         [("get_weather", WEATHER), ("get_time", {})]),
        ("I'll check both cities.\n\n" + hermes_block("get_weather", {"city": "Paris"}) + "\n"
         + hermes_block("get_weather", {"city": "Rome"}), "I'll check both cities.",
         [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]),
        ("The capital of France is Paris.", "The capital of France is Paris.", []),
        (hermes_block("translate", UNICODE), None, [("translate", UNICODE)]),
        (hermes_block("search", NESTED), None, [("search", NESTED)]),
        # Text after and between calls is content too; inner whitespace stays as written.
        ("Hi \n" + hermes_block("f", {}) + "\n bye", "Hi \n\n bye", [("f", {})]),
        # No closing tag (a stop string took it): the JSON alone is enough.
        ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}', None, [("f", {"a": 1})]),
        # Broken JSON stays content, markers and all; a good call next to it is still a call.
        ('<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>',
         '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>', []),
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>' + hermes_block("g", {}),
         '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', [("g", {})]),
        ("Use the <tool_call> tag to call a tool.", "Use the <tool_call> tag to call a tool.", []),
        ('<tool_call>\n{"name": "f", "arguments": {"a": 1', '<tool_call>\n{"name": "f", "arguments": {"a": 1', []),
        ("I wrote <tool_ but then </tool_call>", "I wrote <tool_ but then </tool_call>", []),
    ],
    "llama3_json": [
        (dumps({"name": "get_weather", "parameters": WEATHER}), None, [("get_weather", WEATHER)]),
        ("<|python_tag|>" + dumps({"name": "get_weather", "arguments": WEATHER}), None, [("get_weather", WEATHER)]),
        ('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": [1, 2]}}', None,
         [("a", {}), ("b", {"x": [1, 2]})]),
        ("Let me look that up.<|python_tag|>" + dumps({"name": "search", "parameters": NESTED}),
         "Let me look that up.", [("search", NESTED)]),
        ("\n  " + dumps({"name": "translate", "parameters": UNICODE}) + "\n", None, [("translate", UNICODE)]),
        ("The answer is 42.", "The answer is 42.", []),
        ('{"answer": 42}', '{"answer": 42}', []),  # JSON, but not a call
        ('{"name": "f", "parameters": {}}; {"answer": 42}', '{"name": "f", "parameters": {}}; {"answer": 42}', []),
        ('{"name": "f", "parameters": {"a": 1}', '{"name": "f", "parameters": {"a": 1}', []),
        ('{"name": "f", "parameters": {}} and then some', '{"name": "f", "parameters": {}} and then some', []),
        ('{"name": "f", "parameters": {"x": NaN}}', '{"name": "f", "parameters": {"x": NaN}}', []),  # not JSON
    ],
    "mistral": [
        ("[TOOL_CALLS] " + dumps([{"name": "get_weather", "arguments": WEATHER}]), None, [("get_weather", WEATHER)]),
        ("[TOOL_CALLS]" + dumps([{"name": "a", "arguments": UNICODE}, {"name": "b", "arguments": NESTED}]), None,
         [("a", UNICODE), ("b", NESTED)]),
        ("Sure, checking.\n[TOOL_CALLS] " + dumps([{"name": "f", "arguments": {}}]), "Sure, checking.", [("f", {})]),
        ("No tools needed: it is 12 degrees.", "No tools needed: it is 12 degrees.", []),
        ('[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}]', '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}]', []),
        ("[TOOL_CALLS] []", "[TOOL_CALLS] []", []),
        ('[TOOL_CALLS] [{"name": "f", "arguments": {}}, {"oops": 1}]',  # one not a call: none is
         '[TOOL_CALLS] [{"name": "f", "arguments": {}}, {"oops": 1}]', []),
        ("A list: [TOOL_", "A list: [TOOL_", []),
    ],
    "pythonic": [
        ('[get_weather(city="San Francisco, CA", unit="celsius")]', None, [("get_weather", WEATHER)]),
        ("[get_weather(city='Paris'), get_time()]", None, [("get_weather", {"city": "Paris"}), ("get_time", {})]),
        ('[translate(text="こんにちは, café ☕", to="français")]', None, [("translate", UNICODE)]),
        (("\n[search(filter={'and': [{'field': 'age', 'gt': 30}, {'field': 'tags', 'in': ('a', 'b')}]}, "
          "limit=10, exact=None, desc=True, ratio=-0.5)]\n"), None, [("search", NESTED)]),
        ("The answer is [1] below.", "The answer is [1] below.", []),
        ("[1, 2, 3]", "[1, 2, 3]", []),
        ('[get_weather(city="Paris"]', '[get_weather(city="Paris"]', []),
        ('[f(a=os.system("ls"))]', '[f(a=os.system("ls"))]', []),  # literals only
        ("[f(1)]", "[f(1)]", []),  # keyword arguments only
        ("[f(a={1, 2})]", "[f(a={1, 2})]", []),  # a set has no JSON
        ('I will call [f(a=1)] now', 'I will call [f(a=1)] now', []),  # the whole output, or no call
    ],
}
EXAMPLES = [(name, *case) for name, cases in CASES.items() for case in cases]


def expected_calls(calls):
    return [(name, dumps(arguments)) for name, arguments in calls]


def pairs(message: ParsedMessage):
    return [(c.name, c.arguments) for c in message.tool_calls]


@pytest.mark.parametrize("parser_name, text, content, calls", EXAMPLES)
def test_parse(parser_name, text, content, calls):
    message = get_tool_parser(parser_name).parse(text)
    assert message.content == content
    assert pairs(message) == expected_calls(calls)
    for call in message.tool_calls:
        assert re.fullmatch(r"call_[A-Za-z0-9]{24}", call.id)


def stream_pieces(parser_name: str, pieces: list[str]) -> list:
    stream = get_tool_parser(parser_name).stream()
    deltas = [d for piece in pieces for d in stream.feed(piece)]
    return deltas + stream.finish()


def check_stream(parser_name: str, text: str, pieces: list[str]) -> None:
    """The stream's deltas of `pieces` against parse(text): content equal exactly ("" for None),
    each call's arguments equal, id and name in (only) a call's first delta."""
    assert "".join(pieces) == text
    expected = get_tool_parser(parser_name).parse(text)
    deltas = stream_pieces(parser_name, pieces)
    content = [d.text for d in deltas if isinstance(d, ContentDelta)]
    assert all(content)  # no empty deltas
    assert "".join(content) == (expected.content or "")
    by_index: dict[int, list[ToolCallDelta]] = {}
    for d in deltas:
        if isinstance(d, ToolCallDelta):
            by_index.setdefault(d.index, []).append(d)
    assert sorted(by_index) == list(range(len(expected.tool_calls)))
    for index, call in enumerate(expected.tool_calls):
        first, *rest = by_index[index]
        assert first.name == call.name and first.id.startswith("call_")
        assert all(d.id is None and d.name is None for d in rest)
        assert "".join(d.arguments for d in by_index[index]) == call.arguments


def random_split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, min(len(text) + 1, 12))))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("parser_name, text, content, calls", EXAMPLES)
def test_stream_equals_parse_over_random_splits(parser_name, text, content, calls):
    rng = random.Random(text)
    check_stream(parser_name, text, [text])
    check_stream(parser_name, text, list(text))  # a character a delta
    for _ in range(60):
        check_stream(parser_name, text, random_split(text, rng))


# Pieces of every format, so that random texts often come near markers and calls.
FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool_", "[TOOL_CALLS]", "[TOOL", "<|python_tag|>", "<|py",
             '{"name": "f", "arguments": {"a": 1}}', '{"name": "g", "parameters": {}}', "{", "}", "[", "]",
             '"', "\\", ";", "(", ")", "f(a=1)", "=", ",", " ", "\n", "é", "null", "1e999"]
texts = st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=4), max_size=14).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=texts, parser_name=st.sampled_from(sorted(TOOL_PARSERS)), data=st.data())
def test_any_text_parses_and_streams_alike(text, parser_name, data):
    message = get_tool_parser(parser_name).parse(text)
    assert isinstance(message, ParsedMessage)
    assert message.content is None or (message.content and message.content == message.content.strip())
    for call in message.tool_calls:
        assert isinstance(json.loads(call.arguments), dict)
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=8)))
    check_stream(parser_name, text, [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])])


def test_stream_holds_back_only_what_may_be_a_marker():
    stream = get_tool_parser("hermes").stream()
    assert stream.feed("Hi <tool") == [ContentDelta("Hi")]  # the space waits for what follows it
    assert stream.feed("box> and") == [ContentDelta(" <toolbox> and")]
    assert stream.feed(" <tool_call>\n{\"name\": \"f\", ") == []
    [call] = stream.feed('"arguments": {"a": "é"}}\n</tool_call>')
    assert (call.index, call.name, call.arguments) == (0, "f", '{"a": "é"}')
    assert stream.finish() == []

    pythonic = get_tool_parser("pythonic").stream()
    assert pythonic.feed("[") == [] and pythonic.feed("1") == [ContentDelta("[1")]  # not "[f(": let it go
    llama = get_tool_parser("llama3_json").stream()
    assert llama.feed("Sure") == [ContentDelta("Sure")]


def test_ids_and_openai_shapes():
    ids = {new_call_id() for _ in range(100)}
    assert len(ids) == 100 and all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids)
    call = ToolCall("f", '{"a": 1}', id="call_x")
    assert call.to_openai() == {"id": "call_x", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    [first] = call_deltas([call], first_index=2)
    assert first.to_openai() == {"index": 2, "id": "call_x", "type": "function",
                                 "function": {"name": "f", "arguments": '{"a": 1}'}}
    assert ToolCallDelta(2, None, None, "}").to_openai() == {"index": 2, "function": {"arguments": "}"}}
    assert fold([ContentDelta("Hi"), first, ToolCallDelta(2, None, None, "")]) == ParsedMessage("Hi", [call])


def test_unknown_parser_is_named():
    with pytest.raises(ValueError, match="'qwen9'.*hermes"):
        get_tool_parser("qwen9")


# ---- tool_choice --------------------------------------------------------------------------------

def tool(name, parameters=None, **function):
    function = {"name": name, **function}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


POINT = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
         "required": ["x", "y"], "additionalProperties": False}
TOOLS = [
    tool("get_weather", {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"], "additionalProperties": False}, description="The weather now", strict=True),
    tool("get_time"),  # no parameters at all
    tool("move", {"type": "object", "properties": {"to": {"$ref": "#/$defs/point"}}, "required": ["to"],
                  "$defs": {"point": POINT}}),
]


def valid(schema, value) -> bool:
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def test_named_choice_is_the_parameters():
    choice = {"type": "function", "function": {"name": "get_weather"}}
    schema = tool_choice_schema(TOOLS, choice)
    assert schema == TOOLS[0]["function"]["parameters"]
    assert valid(schema, {"city": "Paris", "unit": "celsius"})
    assert not valid(schema, {"unit": "celsius"}) and not valid(schema, {"city": "Paris", "when": "now"})
    [call] = tool_calls_from_constrained('{"city": "Zürich"}', TOOLS, choice)
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Zürich"}')
    time_schema = tool_choice_schema(TOOLS, {"type": "function", "function": {"name": "get_time"}})
    assert valid(time_schema, {}) and not valid(time_schema, [])


def test_required_choice_is_a_list_of_calls():
    schema = tool_choice_schema(TOOLS, "required")
    calls = [{"name": "get_weather", "parameters": {"city": "東京"}}, {"name": "get_time", "parameters": {}},
             {"name": "move", "parameters": {"to": {"x": 1, "y": -2}}}]
    assert valid(schema, calls) and valid(schema, calls[:1])
    for wrong in ([], [{"name": "get_weather", "parameters": {"unit": "celsius"}}],  # city missing
                  [{"name": "launch", "parameters": {}}], [{"name": "get_time"}],
                  [{"name": "move", "parameters": {"to": {"x": 1}}}],  # through the hoisted $ref
                  [{"name": "get_time", "parameters": {}, "why": "because"}], {"name": "get_time", "parameters": {}}):
        assert not valid(schema, wrong), wrong
    got = tool_calls_from_constrained(json.dumps(calls, ensure_ascii=False), TOOLS, "required")
    assert [(c.name, json.loads(c.arguments)) for c in got] == [(c["name"], c["parameters"]) for c in calls]
    assert [c.arguments for c in got] == [dumps(c["parameters"]) for c in calls]

    single = tool_choice_schema(TOOLS, "required", parallel_tool_calls=False)
    assert valid(single, calls[:1]) and not valid(single, calls[:2])


def test_auto_and_none_are_free():
    for choice in ("auto", "none", None):
        assert tool_choice_schema(TOOLS, choice) is None
        with pytest.raises(ValueError, match="does not constrain"):
            tool_calls_from_constrained("[]", TOOLS, choice)
    assert tool_choice_schema(None, "auto") is None


def test_choice_schemas_compile_for_structured_output():
    llguidance = pytest.importorskip("llguidance")
    from ferry.structured.grammar import JSON_LAYOUT

    for choice in ("required", {"type": "function", "function": {"name": "move"}}):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(tool_choice_schema(TOOLS, choice),
                                                                defaults=JSON_LAYOUT)
        assert llguidance.LLMatcher.validate_grammar(grammar) == ""


@pytest.mark.parametrize("tools, choice, message", [
    (TOOLS, {"type": "function", "function": {"name": "launch"}}, "'launch', which is not in tools"),
    (TOOLS, {"type": "function"}, "named tool_choice must be"),
    (TOOLS, {"function": {"name": "get_time"}}, "named tool_choice must be"),
    (TOOLS, "always", "unknown tool_choice 'always'"),
    ([], "required", "'required' needs at least one tool"),
    (None, "required", "'required' needs at least one tool"),
    ([{"type": "function", "function": {"description": "nameless"}}], "auto", r"tools\[0\].function has no name"),
    ([{"type": "function", "function": {"name": ""}}], "auto", "no name"),
    ([tool("f"), {"function": {"name": "g"}}], "auto", r'tools\[1\] must be {"type": "function"'),
    ([tool("f", {"type": "array"})], "required", r"tools\[0\] \('f'\).function.parameters .*type 'object'.*'array'"),
    ([tool("f", ["not", "a", "schema"])], "auto", "must be a JSON schema object, not list"),
    ([tool("f"), tool("f")], "auto", "second function named 'f'"),
    ([tool("f", {"type": "object", "$defs": {"p": POINT}}), tool("g", {"type": "object", "$defs": {"p": {}}})],
     "required", "'g' defines 'p' unlike another"),
    ("get_weather", "auto", "tools must be a list"),
])
def test_choice_problems_are_named(tools, choice, message):
    with pytest.raises(ValueError, match=message):
        tool_choice_schema(tools, choice)


@pytest.mark.parametrize("text, choice, message", [
    ('{"city": "Par', {"type": "function", "function": {"name": "get_weather"}}, "not JSON"),
    ("[1]", {"type": "function", "function": {"name": "get_weather"}}, "not a JSON object"),
    ("[]", "required", "non-empty list"),
    ('[{"name": "launch", "parameters": {}}]', "required", "no call of a tool"),
])
def test_constrained_output_problems_are_named(text, choice, message):
    with pytest.raises(ValueError, match=message):
        tool_calls_from_constrained(text, TOOLS, choice)


def test_the_bundled_template_renders_tools_and_calls_the_hermes_parser_reads():
    """The bundled model's chat template lists the tools and writes an assistant's tool calls as
    <tool_call> blocks (and tool results as their own turns); the hermes parser reads the calls
    back. Without tools it renders exactly as before."""
    from ferry.assets import default_model_path
    from ferry.tokenizer import Tokenizer
    from ferry.tools import get_tool_parser

    tokenizer = Tokenizer.from_pretrained(default_model_path())
    plain = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(plain, True) == "<|bos|><|user|>\nhi<|end|>\n<|assistant|>\n"
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [*plain, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    text = tokenizer.apply_chat_template(messages, True, tools)
    assert '"name": "get_weather"' in text.split("<|user|>")[0]  # the tools, before the conversation
    assert "<|tool|>\nsunny<|end|>" in text
    turn = text.split("<|assistant|>\n")[1].split("<|end|>")[0]
    parsed = get_tool_parser("hermes").parse(turn)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("get_weather", {"city": "Paris"})]
