"""/openapi.json: the API as OpenAPI 3.1, with the real request and response schemas.

The routes parse their bodies themselves (preprocess.parse_body: content type, size, time and
strict JSON come first), so FastAPI cannot see their models; this document names them instead,
from the same pydantic models the routes validate with and reply in. Every status a route can
answer is listed with its body, so a schema fuzzer can hold the server to it. Behind the API key
when one is set, like every route but /health and /version.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from ferry import __version__
from ferry.server.protocol import (
    ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse, DetokenizeRequest,
    DetokenizeResponse, ModelCard, ModelList, TokenizeRequest, TokenizeResponse,
)

_REF = "#/components/schemas/{model}"
_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {
            "message": {"type": "string"},
            "type": {"type": "string"},
            "param": {"type": ["string", "null"]},
            "code": {"type": ["string", "null"]},
        },
    }},
}
# What any route may answer besides its own statuses: no key (401), a foreign web origin (403), and
# a server that cannot serve (503: starting, restarting, draining).
_ANY_ROUTE = (401, 403, 503)
_BODY_ROUTE = (400, 404, 408, 413, 415, 429, 500)  # + what reading and checking a body can answer
_DESCRIPTIONS = {200: "OK", 400: "Bad request", 401: "No valid API key", 403: "Web origin not allowed",
                 404: "Not found", 408: "Body timed out", 413: "Body too large", 415: "Body is not JSON",
                 429: "Queue full (see Retry-After)", 500: "The engine failed on this request",
                 503: "Not ready, restarting or shutting down"}


@cache
def openapi_json() -> bytes:
    models: list[tuple[type[BaseModel], str]] = [
        (CompletionRequest, "validation"), (ChatCompletionRequest, "validation"), (TokenizeRequest, "validation"),
        (DetokenizeRequest, "validation"), (CompletionResponse, "serialization"),
        (ChatCompletionResponse, "serialization"), (TokenizeResponse, "serialization"),
        (DetokenizeResponse, "serialization"), (ModelList, "serialization"), (ModelCard, "serialization"),
    ]
    refs, top = models_json_schema(models, ref_template=_REF)
    schemas = {**top.get("$defs", {}), "ErrorResponse": _ERROR_SCHEMA}

    def ref(model: type[BaseModel], mode: str) -> dict:
        return refs[(model, mode)]

    def post(request: type[BaseModel], reply: type[BaseModel], summary: str, stream: bool = False) -> dict:
        ok: dict[str, Any] = {"application/json": {"schema": ref(reply, "serialization")}}
        if stream:  # each server-sent event: its data is one chunk's JSON, an error's, or [DONE]
            ok["text/event-stream"] = {"schema": {
                "type": "object", "required": ["data"],
                "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}}
        return {"post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": ref(request, "validation")}}},
            "responses": {"200": {"description": "OK", "content": ok}, **_errors(*_BODY_ROUTE)},
        }}

    def get(summary: str, content: dict | None, *statuses: int) -> dict:
        ok = {"description": "OK", **({"content": content} if content is not None else {})}
        return {"get": {"summary": summary, "responses": {"200": ok, **_errors(*statuses)}}}

    paths = {
        "/v1/completions": post(CompletionRequest, CompletionResponse, "Complete prompts", stream=True),
        "/v1/chat/completions": post(ChatCompletionRequest, ChatCompletionResponse, "Answer a chat", stream=True),
        "/tokenize": post(TokenizeRequest, TokenizeResponse, "Text or messages to token ids"),
        "/detokenize": post(DetokenizeRequest, DetokenizeResponse, "Token ids to text"),
        "/v1/models": get("The served model", {"application/json": {"schema": ref(ModelList, "serialization")}}),
        "/v1/models/{model}": _with_model_parameter(get(
            "The served model by name", {"application/json": {"schema": ref(ModelCard, "serialization")}}, 404)),
        "/health": get("200 when requests can be served", None),
        "/ping": {**get("200 when requests can be served (as /health)", None),
                  "post": get("200 when requests can be served (as /health)", None)["get"]},
        "/version": get("The server's version", {"application/json": {"schema": {
            "type": "object", "required": ["version"], "properties": {"version": {"type": "string"}}}}}),
        "/metrics": get("Prometheus metrics", {"text/plain": {"schema": {"type": "string"}}}),
        "/v1/traces": get("Recent requests' Chrome traces", {"application/json": {"schema": {}}}, 404),
        "/openapi.json": get("This document", {"application/json": {"schema": {"type": "object"}}}),
    }
    document = {
        "openapi": "3.1.0",
        "info": {"title": "ferry", "version": __version__},
        "paths": paths,
        "components": {"schemas": schemas},
    }
    return json.dumps(document).encode()


def _with_model_parameter(path: dict) -> dict:
    path["get"]["parameters"] = [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]
    return path


def _errors(*statuses: int) -> dict:
    return {
        str(status): {"description": _DESCRIPTIONS[status],
                      "content": {"application/json": {"schema": {"$ref": _REF.format(model="ErrorResponse")}}}}
        for status in sorted({*statuses, *_ANY_ROUTE})
    }
