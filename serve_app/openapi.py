"""The OpenAPI description of the request bodies the ingress reads.

The endpoints read raw JSON (``serve_app.parse`` names the field at fault
in every 4xx), so FastAPI cannot infer their bodies: the generation endpoints'
schemas come from their typed models (``serve_app.params``), with what only the
deployment knows filled in (the served model's name, the vocabulary). They
document the API (``GET /openapi.json``) and drive the property-based fuzz suite
(Schemathesis, ``tests/serve/test_fuzz.py``).
"""

from __future__ import annotations

import copy
from functools import cache
from typing import Any

from serve_app.params import ChatBody, CompletionBody, GenerationBody


@cache
def _model_schema(model: type[GenerationBody]) -> dict:
    schema = model.model_json_schema()
    for prop in schema["properties"].values():   # the field names say it; titles add only noise
        prop.pop("title", None)
    return schema


def completion_schema(model: str, vocab_size: int) -> dict:
    schema = copy.deepcopy(_model_schema(CompletionBody))
    ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}}
    schema["properties"]["model"] = {"type": "string", "enum": [model]}
    schema["properties"]["prompt"] = {"oneOf": [
        {"type": "string", "minLength": 1}, ids,
        {"type": "array", "minItems": 1, "maxItems": 64, "items": {"type": "string", "minLength": 1}},
        {"type": "array", "minItems": 1, "maxItems": 64, "items": ids}]}
    schema["properties"]["top_k"]["maximum"] = vocab_size
    return schema


def chat_schema(model: str, vocab_size: int | None = None) -> dict:
    schema = copy.deepcopy(_model_schema(ChatBody))
    schema["properties"]["model"] = {"type": "string", "enum": [model]}
    if vocab_size is not None:
        schema["properties"]["top_k"]["maximum"] = vocab_size
    return schema


def tokenize_schema(model: str) -> dict:
    chat = chat_schema(model)["properties"]
    return {"type": "object", "properties": {
        "model": {"type": "string", "enum": [model]}, "prompt": {"type": "string"},
        "messages": chat["messages"], "tools": chat["tools"], "tool_choice": chat["tool_choice"],
        "add_special_tokens": {"type": "boolean"}, "add_generation_prompt": {"type": "boolean"},
        "return_token_strs": {"type": "boolean"}}}


def detokenize_schema(model: str, vocab_size: int) -> dict:
    return {"type": "object", "required": ["tokens"], "properties": {
        "model": {"type": "string", "enum": [model]},
        "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}}}}


POLICY_SCHEMA = {"type": "object", "required": ["policy"], "properties": {"policy": {"type": "string"}}}
EMPTY_SCHEMA = {"type": "object"}
ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}


def add_request_bodies(schema: dict[str, Any], model: str, vocab_size: int) -> dict[str, Any]:
    """``schema`` (FastAPI's generated OpenAPI) with the request bodies and the
    error response of every POST endpoint, and bearer auth declared."""
    bodies = {"/v1/completions": completion_schema(model, vocab_size), "/v1/chat/completions": chat_schema(model, vocab_size),
              "/v1/admin/policy": POLICY_SCHEMA, "/v1/cache/flush": EMPTY_SCHEMA,
              "/v1/sessions/{session_id}/prefetch": EMPTY_SCHEMA, "/tokenize": tokenize_schema(model),
              "/detokenize": detokenize_schema(model, vocab_size)}
    for path, body in bodies.items():
        operation = schema.get("paths", {}).get(path, {}).get("post")
        if operation is None:
            continue
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
        operation.setdefault("responses", {})["4XX"] = {
            "description": "a client error, naming the parameter",
            "content": {"application/json": {"schema": ERROR_SCHEMA}}}
    schema.setdefault("components", {})["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    schema["security"] = [{"bearer": []}, {}]
    return schema
