"""Tool calling through /v1/chat/completions, as OpenAI and vLLM clients expect it: tool_choice
"required" and named constrain the output to calls whose arguments follow the function's schema;
"auto" (with --enable-auto-tool-choice --tool-call-parser) reads calls out of the text; streamed
deltas reassemble to the same calls as the plain reply; bad tools and tool_choice are 400s naming
the field.

A real `ferry serve` of the bundled model, with the official openai client, for the generation;
the in-process app on a scripted engine (test_request_fields) for the server flags and the auto
parser on a known reply.
"""

from __future__ import annotations

import json

import pytest

from ferry.assets import default_model_path
from test_server import serving

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "book_flight", "description": "Book a flight",
        "parameters": {"type": "object", "properties": {
            "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
            "required": ["origin", "destination", "date"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "place_order", "description": "Order items to an address",
        "parameters": {"type": "object", "properties": {
            "address": {"type": "object", "properties": {
                "street": {"type": "string", "maxLength": 30}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["street", "zip"], "additionalProperties": False},
            "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "object", "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
                "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["sku", "qty"], "additionalProperties": False}}},
            "required": ["address", "items"], "additionalProperties": False}}},
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris? Then book me a flight, and order socks."}]
NAMED = [{"type": "function", "function": {"name": name}} for name in PARAMETERS]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(default_model_path(), tmp_path_factory.mktemp("logs") / "server.log",
                 "--served-model-name", "ferry-default", "--enable-auto-tool-choice",
                 "--tool-call-parser", "hermes") as proc:
        yield proc


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def ask(client, tool_choice, **kwargs):
    return client.chat.completions.create(model="ferry-default", messages=MESSAGES, tools=TOOLS,
                                          tool_choice=tool_choice, max_tokens=kwargs.pop("max_tokens", 250), **kwargs)


def check_calls(message, tool_choice) -> list[tuple[str, dict]]:
    assert message.content is None and message.tool_calls, message
    calls = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        if isinstance(tool_choice, dict):
            assert call.function.name == tool_choice["function"]["name"]
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, PARAMETERS[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


@pytest.mark.parametrize("tool_choice", ["required", *NAMED],
                         ids=["required", *(f"named-{n}" for n in PARAMETERS)])
@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_constrained_calls_validate(client, tool_choice, temperature):
    reply = ask(client, tool_choice, temperature=temperature, seed=3, n=2)
    assert len(reply.choices) == 2
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls", choice
        check_calls(choice.message, tool_choice)


def reassemble(stream) -> dict[int, dict]:
    """choice index -> {"content", "calls": [(id, name, arguments)], "finish_reason"} from the chunks."""
    choices: dict[int, dict] = {}
    for chunk in stream:
        for c in chunk.choices:
            got = choices.setdefault(c.index, {"content": "", "calls": {}, "finish_reason": None})
            got["content"] += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                if d.index not in got["calls"]:
                    assert d.id and d.type == "function" and d.function.name, d  # the first delta of a call
                    got["calls"][d.index] = [d.id, d.function.name, d.function.arguments or ""]
                else:
                    assert d.id is None and d.function.name is None, d
                    got["calls"][d.index][2] += d.function.arguments or ""
            if c.finish_reason is not None:
                got["finish_reason"] = c.finish_reason
    for got in choices.values():
        got["calls"] = [tuple(call) for _, call in sorted(got["calls"].items())]
    return choices


@pytest.mark.parametrize("tool_choice", ["required", NAMED[2]], ids=["required", "named"])
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.9, "seed": 11}], ids=["greedy", "seed"])
def test_streamed_deltas_reassemble_to_the_reply(client, tool_choice, sampling):
    reply = ask(client, tool_choice, n=2, **sampling)
    streamed = reassemble(ask(client, tool_choice, n=2, stream=True, **sampling))
    assert sorted(streamed) == [0, 1]
    for choice in reply.choices:
        got = streamed[choice.index]
        assert got["finish_reason"] == "tool_calls" and got["content"] == ""
        plain = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert [(name, arguments) for _, name, arguments in got["calls"]] == plain


def test_parallel_tool_calls_false_gives_one_call(client):
    for seed in range(3):
        reply = ask(client, "required", parallel_tool_calls=False, temperature=1.0, seed=seed, n=2)
        for choice in reply.choices:
            assert choice.finish_reason == "tool_calls" and len(check_calls(choice.message, "required")) == 1


def test_cut_short_keeps_length_and_the_text(client):
    reply = ask(client, NAMED[2], max_tokens=3)
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content


def test_a_follow_up_turn_with_the_calls_and_their_results(client):
    reply = ask(client, NAMED[0], temperature=0.0)
    call = reply.choices[0].message.tool_calls[0]
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}]
    follow = client.chat.completions.create(model="ferry-default", messages=messages, tools=TOOLS,
                                            tool_choice="none", max_tokens=20)
    assert follow.choices[0].finish_reason in ("stop", "length") and follow.choices[0].message.tool_calls is None
    again = client.chat.completions.create(model="ferry-default", messages=messages, tools=TOOLS,
                                           tool_choice="required", max_tokens=250)
    check_calls(again.choices[0].message, "required")


def test_auto_with_the_server_flags_answers(client):
    for stream in (False, True):
        reply = ask(client, "auto", max_tokens=30, stream=stream)
        if stream:
            got = reassemble(reply)[0]
            assert got["finish_reason"] in ("stop", "length", "tool_calls")
        else:
            assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("fields, param, words", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch"}}}, "tool_choice",
     ("'launch'", "not in tools")),
    ({"tool_choice": "required"}, "tool_choice", ("needs tools",)),
    ({"tool_choice": NAMED[0]}, "tool_choice", ("needs tools",)),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", ("unknown tool_choice",)),
    ({"tools": [{"type": "function", "function": {"description": "nameless"}}]}, "tools", ("no name",)),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     ("response_format",)),
])
def test_bad_tool_requests_are_400s_naming_the_field(server, fields, param, words):
    response = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                          json={"messages": MESSAGES, "max_tokens": 5, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and all(w in error["message"] for w in words), error


def test_tool_choice_none_without_tools_is_fine(server):
    response = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                          json={"messages": MESSAGES, "max_tokens": 3, "tool_choice": "none"})
    assert response.status_code == 200, response.text


# ---- in-process: the server's flags, and the auto parser on a scripted reply ----


def scripted_app(tokenizer, reply: str, **config):
    from ferry.server.app import build_app
    from ferry.server.config import ServerConfig
    from starlette.testclient import TestClient
    from test_request_fields import ScriptedEngine

    async def never():
        raise AssertionError("the engine is attached by hand")

    from ferry.engine.messages import EngineInfo

    engine = ScriptedEngine(tokenizer, reply, tokens_per_output=3)
    engine.info = EngineInfo(max_model_len=4096, vocab_size=tokenizer.vocab_size, kv_cache_tokens=8192)
    app = build_app(ServerConfig(served_model_name="tiny", **config), never)
    app.state.ferry.attach(engine)
    return TestClient(app), engine


@pytest.fixture(scope="module")
def tokenizer():
    from ferry.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(default_model_path())


HERMES_REPLY = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n' \
               '</tool_call>'


def test_auto_without_the_flags_is_a_400(tokenizer):
    http, engine = scripted_app(tokenizer, HERMES_REPLY)
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 60}
    response = http.post("/v1/chat/completions", json={**body, "tool_choice": "auto"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in response.json()["error"]["message"]
    # No tool_choice: "none" here (the tools are shown to the model, the reply is all content).
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    assert message["content"] == HERMES_REPLY and "tool_calls" not in message
    assert "get_weather" in tokenizer.decode(engine.prompts[-1])


@pytest.mark.parametrize("tool_choice", [None, "auto"])
def test_auto_parses_the_reply(tokenizer, tool_choice):
    http, engine = scripted_app(tokenizer, HERMES_REPLY, tool_call_parser="hermes", enable_auto_tool_choice=True)
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 60, "n": 2}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    reply = http.post("/v1/chat/completions", json=body).json()
    expected = ("get_weather", {"city": "Paris", "unit": "celsius"})
    for choice in reply["choices"]:
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me check."
        [call] = choice["message"]["tool_calls"]
        assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == expected
    events = [e[len("data: "):] for e in http.post("/v1/chat/completions", json={**body, "stream": True})
              .text.strip().split("\n\n")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    for index in (0, 1):
        deltas = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        content = "".join(d["delta"].get("content") or "" for d in deltas)
        calls = [t for d in deltas for t in d["delta"].get("tool_calls") or []]
        assert content == "Let me check." and deltas[-1]["finish_reason"] == "tool_calls"
        assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
        assert (calls[0]["function"]["name"], json.loads("".join(c["function"]["arguments"] for c in calls))) \
            == expected


@pytest.mark.parametrize("config, words", [
    ({"tool_call_parser": "nope"}, ("'nope'", "hermes", "llama3_json", "mistral", "pythonic")),
    ({"enable_auto_tool_choice": True}, ("needs --tool-call-parser",)),
])
def test_bad_server_flags_are_startup_errors(config, words):
    from ferry.server.config import ServerConfig

    with pytest.raises(ValueError) as e:
        ServerConfig(served_model_name="x", **config)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_cli_refuses_an_unknown_parser(capsys):
    from ferry.cli import main

    assert main(["serve", "--tool-call-parser", "nope"]) == 2
    err = capsys.readouterr().err
    assert "--tool-call-parser 'nope'" in err and "hermes" in err
