"""The OpenAPI description of the request bodies the ingress parses by hand.

The endpoints read raw JSON (``serve_app.protocol`` names the field at fault
in every 4xx), so FastAPI cannot infer their bodies; these schemas say what
each endpoint takes. They document the API (``GET /openapi.json``) and drive
the property-based fuzz suite (Schemathesis, ``tests/serve/test_fuzz.py``).
"""

from __future__ import annotations

from typing import Any

_SAMPLING = {
    "max_tokens": {"type": "integer", "minimum": 1},
    "max_completion_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "seed": {"type": "integer"},
    "n": {"type": "integer", "minimum": 1, "maximum": 16},
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "stop": {"oneOf": [{"type": "string", "minLength": 1, "maxLength": 256},
                       {"type": "array", "maxItems": 4, "items": {"type": "string", "minLength": 1, "maxLength": 256}}]},
    "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}},
    "ignore_eos": {"type": "boolean"},
    "session_id": {"type": "string", "minLength": 1, "maxLength": 128},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 2},
    "top_k": {"type": "integer", "minimum": -1},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "logit_bias": {"type": "object", "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
    "min_tokens": {"type": "integer", "minimum": 0},
    "user": {"type": "string"},
    "metadata": {"type": "object"},
}
_FUNCTION = {"type": "object", "required": ["name"], "properties": {
    "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}, "description": {"type": "string"},
    "parameters": {"type": "object"}}}
_TOOLS = {
    "tools": {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["type", "function"],
                                                         "properties": {"type": {"enum": ["function"]},
                                                                        "function": _FUNCTION}}},
    "tool_choice": {"oneOf": [{"enum": ["auto", "none", "required"]},
                              {"type": "object", "properties": {"type": {"enum": ["function"]},
                                                                "function": {"type": "object"}}}]},
    "parallel_tool_calls": {"type": "boolean"},
    "response_format": {"type": "object", "properties": {
        "type": {"enum": ["text", "json_object", "json_schema"]},
        "json_schema": {"type": "object", "properties": {"name": {"type": "string"}, "schema": {"type": "object"},
                                                         "strict": {"type": "boolean"}}}}},
    "structured_outputs": {"type": "object", "properties": {
        "json": {"type": "object"}, "regex": {"type": "string"}, "grammar": {"type": "string"},
        "choice": {"type": "array", "items": {"type": "string"}}}},
}


def completion_schema(model: str, vocab_size: int) -> dict:
    ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}}
    return {"type": "object", "required": ["model", "prompt"], "properties": {
        "model": {"type": "string", "enum": [model]},
        "prompt": {"oneOf": [{"type": "string", "minLength": 1}, ids,
                             {"type": "array", "minItems": 1, "maxItems": 64,
                              "items": {"type": "string", "minLength": 1}},
                             {"type": "array", "minItems": 1, "maxItems": 64, "items": ids}]},
        "echo": {"type": "boolean"}, "logprobs": {"type": "integer", "minimum": 0, "maximum": 5},
        "best_of": {"type": "integer", "minimum": 1, "maximum": 16},
        **_SAMPLING}}


def chat_schema(model: str) -> dict:
    message = {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"type": "string", "enum": ["system", "user", "assistant", "tool"]},
        "content": {"type": ["string", "null"]}, "tool_call_id": {"type": "string"},
        "tool_calls": {"type": "array", "items": {"type": "object"}}}}
    return {"type": "object", "required": ["model", "messages"], "properties": {
        "model": {"type": "string", "enum": [model]},
        "messages": {"type": "array", "minItems": 1, "items": message},
        "logprobs": {"type": "boolean"}, "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
        **_SAMPLING, **_TOOLS}}


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
    bodies = {"/v1/completions": completion_schema(model, vocab_size), "/v1/chat/completions": chat_schema(model),
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
