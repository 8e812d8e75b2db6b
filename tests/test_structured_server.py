"""Structured output through HTTP, with the bundled model and the official openai client: OpenAI's
response_format (json_schema, json_object), vLLM's structured_outputs and guided_* fields, SGLang's
regex and ebnf; schemas the code was not written against; grammars that do not compile get a 400
naming the field."""

from __future__ import annotations

import json
import re

import pytest

from ferry.assets import default_model_path
from test_server import serving

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "maxLength": 40}}, "required": ["name", "age"], "additionalProperties": False},
    "order": {"type": "object", "properties": {
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{3}$"}, "qty": {"type": "integer", "minimum": 1,
                                                                             "maximum": 99}},
            "required": ["sku", "qty"], "additionalProperties": False}, "minItems": 1, "maxItems": 3},
        "express": {"type": "boolean"}}, "required": ["items", "express"], "additionalProperties": False},
    "reading": {"type": "object", "properties": {
        "sensor": {"enum": ["t1", "t2", "h1"]}, "value": {"type": "number", "minimum": -50, "maximum": 50},
        "unit": {"const": "C"}, "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 12}]}},
        "required": ["sensor", "value", "unit", "note"], "additionalProperties": False},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(default_model_path(), tmp_path_factory.mktemp("logs") / "server.log",
                 "--served-model-name", "ferry-default") as proc:
        yield proc


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_json_schema_replies_validate(client, name, temperature):
    schema = SCHEMAS[name]
    reply = client.chat.completions.create(
        model="ferry-default", messages=[{"role": "user", "content": f"Give me a {name} as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}},
        temperature=temperature, seed=1, n=3, max_tokens=300,
    )
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_schema_streamed(client):
    schema = SCHEMAS["person"]
    stream = client.chat.completions.create(
        model="ferry-default", messages=[{"role": "user", "content": "A person, please."}], stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}, max_tokens=200,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), schema)


def test_json_object_mode(client):
    reply = client.chat.completions.create(
        model="ferry-default", messages=[{"role": "user", "content": "Some JSON."}],
        response_format={"type": "json_object"}, temperature=0.7, seed=3, n=4, max_tokens=400,
    )
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(json.loads(choice.message.content), dict)


def test_vllm_and_sglang_forms(http):
    def complete(route, **fields):
        body = {"model": "ferry-default", "max_tokens": 40, "temperature": 0.9, "seed": 4, **fields}
        if route == "chat":
            body["messages"] = [{"role": "user", "content": "Answer."}]
            r = http.post("/v1/chat/completions", json=body)
            return r, (r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else None)
        body["prompt"] = "The answer is"
        r = http.post("/v1/completions", json=body)
        return r, (r.json()["choices"][0]["text"] if r.status_code == 200 else None)

    cases = [
        ("chat", {"structured_outputs": {"choice": ["alpha", "beta", "gamma"]}}, lambda t: t in ("alpha", "beta", "gamma")),
        ("completions", {"structured_outputs": {"regex": r"[0-9]{2}\.[0-9]"}}, lambda t: re.fullmatch(r"[0-9]{2}\.[0-9]", t)),
        ("chat", {"structured_outputs": {"json": SCHEMAS["reading"]}},
         lambda t: jsonschema.validate(json.loads(t), SCHEMAS["reading"]) is None),
        ("completions", {"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ("chat", {"guided_regex": r"(red|green)-[0-9]"}, lambda t: re.fullmatch(r"(red|green)-[0-9]", t)),
        ("completions", {"guided_json": json.dumps(SCHEMAS["person"]), "max_tokens": 200},
         lambda t: jsonschema.validate(json.loads(t), SCHEMAS["person"]) is None),
        ("chat", {"guided_grammar": 'root ::= "on" | "off"'}, lambda t: t in ("on", "off")),
        ("completions", {"regex": "[a-c]{4}"}, lambda t: re.fullmatch("[a-c]{4}", t)),
        ("chat", {"ebnf": 'root ::= ("x" | "y") ("x" | "y")? "!"'}, lambda t: re.fullmatch(r"[xy]{1,2}!", t)),
        ("chat", {"response_format": {"type": "text"}}, lambda t: isinstance(t, str)),
    ]
    for route, fields, ok in cases:
        response, text = complete(route, **fields)
        assert response.status_code == 200, (fields, response.text)
        assert ok(text), (fields, text)


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_regex": "a", "regex": "b"}, "regex"),
    ({"structural_tag": {"structures": []}}, "structural_tag"),
])
def test_a_grammar_that_does_not_compile_is_a_400_naming_it(http, fields, param):
    body = {"model": "ferry-default", "messages": [{"role": "user", "content": "x"}], **fields}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert http.get("/health").status_code == 200
