"""Request parsing and OpenAI-shaped errors for the HTTP ingress.

Parsing is explicit (not FastAPI's model binding) so every 4xx names the
field at fault, in the OpenAI error body ``{"error": {message, type, param,
code}}``, and nothing malformed reaches a replica.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

from cluster.engine.tokenizer import Tokenizer
from serve_app.errors import APIError
from serve_app.params import parse_generation
from serve_app.structured import Tools, parse_constraint, parse_tools, plain_messages, validate_tool_messages

__all__ = ["APIError", "ApiRequest", "Limits", "parse_json", "parse_completion", "parse_chat", "chat_prompt"]


@dataclass(frozen=True)
class Limits:
    max_prompt_tokens: int = 4096
    max_tokens: int = 1024
    max_body_bytes: int = 1 << 20
    body_timeout_s: float = 10.0     # a body that stalls longer gets 408


@dataclass
class ApiRequest:
    """What a client asked for in one completion or chat request, parsed and
    validated (``parse_completion``/``parse_chat``): the prompt as token ids
    and every parameter the request may set."""

    prompt: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop_token_ids: list[int]
    stop: list[str]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    session_id: str | None
    model: str
    extra: dict = field(default_factory=dict)
    generation: Any = None           # serve_app.params.Generation: n, best_of, echo, logprobs, sampling controls
    prompt_text: str | None = None   # a completion's prompt as the client sent it (echo)
    grammar: Any = None              # cluster.engine.grammar.GrammarSpec: the answer's constraint
    tools: Any = None                # serve_app.structured.Tools: the functions the answer may call
    batched: bool = False            # one of several prompts of one completions request


def parse_json(raw: bytes, limits: Limits) -> dict:
    if len(raw) > limits.max_body_bytes:
        raise APIError(413, f"request body of {len(raw)} bytes exceeds the limit of {limits.max_body_bytes}",
                       code="request_too_large")
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"malformed JSON body: {exc}", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "the JSON body is nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return body


def _reject_constant(name: str):
    # Python's json accepts NaN and Infinity, which are not JSON and which no parameter takes.
    raise APIError(400, f"malformed JSON body: {name} is not a JSON value", code="invalid_json")


def _text(value: str, param: str) -> str:
    """A string the tokenizer can take: valid Unicode, no lone surrogate (JSON's
    \\ud800 escapes decode to one)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, f"'{param}' contains an invalid Unicode character (a lone surrogate)",
                       param=param, code="invalid_unicode") from None
    return value


def _int(body: dict, name: str, default: int | None, lo: int | None = None, hi: int | None = None) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise APIError(400, f"'{name}' must be an integer, got {type(value).__name__}", param=name)
    if lo is not None and value < lo:
        raise APIError(400, f"'{name}' must be >= {lo}, got {value}", param=name)
    if hi is not None and value > hi:
        raise APIError(400, f"'{name}' must be <= {hi}, got {value}", param=name, code="limit_exceeded")
    return value


def _float(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise APIError(400, f"'{name}' must be a number, got {type(value).__name__}", param=name)
    if value > hi or value < lo or (lo_open and value == lo):
        bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise APIError(400, f"'{name}' must be in {bound}, got {value}", param=name)
    return float(value)


def _common(body: dict, prompt: list[int], limits: Limits, served_model: str, tokenizer: Tokenizer,
            chat: bool) -> ApiRequest:
    model = body.get("model")
    if model is None:
        raise APIError(400, "'model' is required", param="model")
    if not isinstance(model, str):
        raise APIError(400, f"'model' must be a string, got {type(model).__name__}", param="model")
    if model != served_model:
        raise APIError(404, f"model '{model}' does not exist; this server serves '{served_model}'",
                       param="model", code="model_not_found")
    _check_prompt_length(len(prompt), limits)
    max_tokens = _int(body, "max_tokens", 16, lo=1, hi=limits.max_tokens)
    if "max_completion_tokens" in body:
        max_tokens = _int(body, "max_completion_tokens", 16, lo=1, hi=limits.max_tokens)
    generation = parse_generation(body, chat, tokenizer.vocab_size, max_tokens)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, f"'stream' must be a boolean, got {type(stream).__name__}", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise APIError(400, "'stream_options' must be an object", param="stream_options")
    include_usage = options.get("include_usage", True)
    if not isinstance(include_usage, bool):
        raise APIError(400, f"'stream_options.include_usage' must be a boolean, got {type(include_usage).__name__}",
                       param="stream_options.include_usage")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise APIError(400, "'stop_token_ids' must be a list of integers", param="stop_token_ids")
    stop = _stop_strings(body.get("stop"))
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise APIError(400, f"'ignore_eos' must be a boolean, got {type(ignore_eos).__name__}", param="ignore_eos")
    session = body.get("session_id")
    if session is not None and (not isinstance(session, str) or not 0 < len(session) <= 128):
        raise APIError(400, "'session_id' must be a string of 1 to 128 characters", param="session_id")
    return ApiRequest(
        prompt=prompt, max_tokens=max_tokens,
        temperature=_float(body, "temperature", 0.0, 0.0, 2.0),   # default greedy: reproducible
        top_p=_float(body, "top_p", 1.0, 0.0, 1.0, lo_open=True), seed=_int(body, "seed", None, lo=-(1 << 63), hi=(1 << 64) - 1),
        stop_token_ids=stop_ids, stop=stop, ignore_eos=ignore_eos, stream=stream, include_usage=include_usage,
        session_id=session, model=model, generation=generation)


MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256


def _stop_strings(value) -> list[str]:
    """OpenAI's ``stop``: a string or up to 4 strings; generation ends before the first match."""
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise APIError(400, "'stop' must be a string or a list of strings", param="stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise APIError(400, f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}", param="stop")
    for s in stops:
        if not 0 < len(s) <= MAX_STOP_CHARS:
            raise APIError(400, f"each 'stop' string must have 1 to {MAX_STOP_CHARS} characters", param="stop")
        _text(s, "stop")
    return list(dict.fromkeys(stops))


def _check_prompt_length(tokens: int, limits: Limits) -> None:
    if tokens > limits.max_prompt_tokens:
        raise APIError(413, f"prompt has {tokens} tokens; the limit is {limits.max_prompt_tokens}",
                       param="prompt", code="context_length_exceeded")


MAX_BATCH_PROMPTS = 64


def batch_prompts(body: dict) -> list | None:
    """The prompts of a completions body that sends several (a list of strings, or a
    list of token-id lists), each to be answered as its own request; None for one
    prompt. A list of one is one prompt."""
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        return None
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        if len(prompt) > MAX_BATCH_PROMPTS:
            raise APIError(400, f"'prompt' has {len(prompt)} prompts; at most {MAX_BATCH_PROMPTS} per request",
                           param="prompt")
        if body.get("stream") is True and len(prompt) > 1:
            raise APIError(400, "several prompts in one request cannot be streamed; send one request per prompt "
                                "or set 'stream' to false", param="stream")
        return prompt
    if any(isinstance(p, (str, list)) for p in prompt):
        raise APIError(400, "'prompt' must be a string, a list of token ids, a list of strings or a list of "
                            "token-id lists (not a mix)", param="prompt")
    return None


def parse_completion(body: dict, limits: Limits, served_model: str, tokenizer: Tokenizer) -> ApiRequest:
    if "prompt" not in body:
        raise APIError(400, "'prompt' is required", param="prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "'prompt' must not be empty", param="prompt")
        ids = tokenizer.encode(_text(prompt, "prompt"))
    elif isinstance(prompt, list):
        if not prompt:
            raise APIError(400, "'prompt' must not be empty", param="prompt")
        _check_prompt_length(len(prompt), limits)   # before looking at every id of an oversized one
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise APIError(400, "'prompt' must be a string or a list of integer token ids", param="prompt")
        bad = next((t for t in prompt if not 0 <= t < tokenizer.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"'prompt' has token id {bad} outside [0, {tokenizer.vocab_size})", param="prompt")
        ids = list(prompt)
    else:
        raise APIError(400, f"'prompt' must be a string or a list of token ids, got {type(prompt).__name__}",
                       param="prompt")
    gen = _common(body, ids, limits, served_model, tokenizer, chat=False)
    gen.prompt_text = prompt if isinstance(prompt, str) else None
    return gen


ROLES = ("system", "user", "assistant", "tool")


def parse_chat(body: dict, limits: Limits, served_model: str, tokenizer: Tokenizer,
               render: Callable[..., list[int]] | None = None) -> ApiRequest:
    """``render(messages, tools=None)`` turns the validated messages into prompt ids
    (default: the tokenizer's chat template; the ingress passes its ChatPromptBuilder)."""
    ids, tools = chat_prompt(body, tokenizer, render)
    constraint = parse_constraint(body)
    forced = tools.constraint() if tools is not None else None
    if forced is not None and constraint is not None:
        raise APIError(400, "a forced 'tool_choice' and 'response_format'/'structured_outputs' cannot both "
                            "constrain one answer", param="tool_choice")
    gen = _common(body, ids, limits, served_model, tokenizer, chat=True)
    gen.grammar = forced or constraint
    gen.tools = tools
    return gen


def chat_prompt(body: dict, tokenizer: Tokenizer,
                render: Callable[..., list[int]] | None = None) -> tuple[list[int], Tools | None]:
    """The prompt ids of a chat body's ``messages`` (and ``tools``), as the chat
    endpoint runs them, and its active tools (None: none, or ``tool_choice`` none)."""
    messages = body.get("messages")
    if messages is None:
        raise APIError(400, "'messages' is required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise APIError(400, f"'messages[{i}]' must be an object", param=f"messages[{i}]")
        if m.get("role") not in ROLES:
            raise APIError(400, f"'messages[{i}].role' must be one of {list(ROLES)}, got {m.get('role')!r}",
                           param=f"messages[{i}].role")
        content = m.get("content")
        if content is None and m["role"] == "assistant" and m.get("tool_calls"):
            continue   # an assistant turn that only called tools
        if not isinstance(content, str):
            raise APIError(400, f"'messages[{i}].content' must be a string", param=f"messages[{i}].content")
        _text(content, f"messages[{i}].content")
    validate_tool_messages(messages)
    tools = parse_tools(body)
    active = tools if tools is not None and tools.active else None
    takes_tools = template_takes_tools(tokenizer)
    plain = plain_messages(messages, tools, takes_tools)
    template_tools = active.template_tools() if active is not None and takes_tools else None
    try:
        if render is not None:
            ids = render(plain, tools=template_tools)
        elif template_tools is not None:
            ids = tokenizer.apply_chat_template(plain, tools=template_tools)
        else:
            ids = tokenizer.apply_chat_template(plain)
    except Exception as exc:   # the template's own checks (jinja's raise_exception), e.g. roles out of order
        raise APIError(400, f"'messages' cannot be rendered with the model's chat template: {exc}",
                       param="messages") from None
    return ids, active


def template_takes_tools(tokenizer: Tokenizer) -> bool:
    """Whether the model's chat template renders a ``tools`` list itself."""
    template = getattr(getattr(tokenizer, "tokenizer", None), "chat_template", None)
    return isinstance(template, str) and "tools" in template
