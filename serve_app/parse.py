"""The one parse step: a request body becomes the engine's request here, and only here.

``parse_generation`` takes a ``/v1/completions`` or ``/v1/chat/completions`` body (read
as JSON by ``parse_json``: size, NaN, depth) and returns what the ingress sends on: one
``ApiRequest`` per prompt, each with its prompt as token ids, its body validated once by
its endpoint's typed model (``serve_app.params``), its constraint (``serve_app.structured``:
``response_format``, forced tools), the engine's ``SamplingParams``, a seed and a session.
Every 4xx names the field at fault in the OpenAI error body ``{"error": {message, type,
param, code}}``, so nothing malformed reaches a replica. The modules it calls (params,
structured, the tokenizer) never call back into it.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from dataclasses import dataclass
from typing import Callable, Union

from cluster.engine.tokenizer import Tokenizer
from cluster.protocol import SamplingParams
from serve_app.errors import APIError
from serve_app.params import BodyContext, ChatBody, CompletionBody, valid_text, validate_body
from serve_app.structured import Tools, parse_constraint, parse_tools, plain_messages, validate_tool_messages

__all__ = ["ApiRequest", "Limits", "ParseContext", "parse_json", "parse_generation", "parse_completion", "parse_chat",
           "chat_prompt"]


@dataclass(frozen=True)
class Limits:
    max_prompt_tokens: int = 4096
    max_tokens: int = 1024
    max_body_bytes: int = 1 << 20
    body_timeout_s: float = 10.0     # a body that stalls longer gets 408


@dataclass(frozen=True)
class ParseContext:
    """What parsing a body needs besides the body: the server's limits and model, the
    tokenizer, the chat renderer (None: the tokenizer's template) and the request's
    ``X-Session-Id`` header (a body's ``session_id`` wins over it)."""

    limits: Limits
    served_model: str
    tokenizer: Tokenizer
    render: Callable[..., list[int]] | None = None
    header_session: str | None = None


MAX_BATCH_SEQUENCES = 64  # prompts x (n or best_of) of one completions request


def parse_generation(body: dict, chat: bool, ctx: ParseContext) -> list[ApiRequest]:
    """``body`` as the engine's requests: one for a chat or a single prompt, one per prompt
    of a completions body that sends several (``batched``, sharing one seed). Each has a
    seed (sampling is a function of seed and position, so a request resumed on another
    replica continues exactly where it stopped) and its session."""
    if chat:
        gens = [parse_chat(body, ctx.limits, ctx.served_model, ctx.tokenizer, ctx.render)]
    else:
        prompts = batch_prompts(body)
        if prompts is None or len(prompts) == 1:
            gens = [parse_completion(body, ctx.limits, ctx.served_model, ctx.tokenizer)]
        else:
            gens = [parse_completion({**body, "prompt": p}, ctx.limits, ctx.served_model, ctx.tokenizer)
                    for p in prompts]
            _check_batch(gens)
    seed = gens[0].seed if gens[0].seed is not None else secrets.randbits(63)
    for gen in gens:
        gen.with_seed(seed)
        gen.batched = len(gens) > 1
        if gen.session_id is None:   # the body's field first, then the header
            gen.session_id = ctx.header_session
    return gens


def _check_batch(gens: list[ApiRequest]) -> None:
    runs = sum(g.body.candidates or g.body.n for g in gens)
    if runs > MAX_BATCH_SEQUENCES:
        raise APIError(400, f"{len(gens)} prompts with {runs // len(gens)} sequences each are {runs} sequences; "
                            f"at most {MAX_BATCH_SEQUENCES} per request", param="prompt")


@dataclass
class ApiRequest:
    """What a client asked for in one completion or chat request, parsed and
    validated (``parse_completion``/``parse_chat``): the prompt as token ids, the
    validated body, and the engine's ``SamplingParams`` built from it."""

    prompt: list[int]
    body: Union[CompletionBody, ChatBody]
    params: SamplingParams           # the first choice's (``serve_app.choices`` varies seed and logprobs)
    session_id: str | None = None    # the body's, else the request's X-Session-Id header
    prompt_text: str | None = None   # a completion's prompt as the client sent it (echo)
    tools: Tools | None = None       # the functions the answer may call
    batched: bool = False            # one of several prompts of one completions request

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens

    @property
    def seed(self) -> int | None:
        return self.params.seed

    def with_seed(self, seed: int) -> None:
        """Every request gets a seed: sampling is a function of (seed, position), so a
        request resumed on another replica continues exactly where the first one stopped."""
        self.params = dataclasses.replace(self.params, seed=seed)

    @property
    def stream(self) -> bool:
        return self.body.stream

    @property
    def include_usage(self) -> bool:
        return self.body.include_usage

    @property
    def stop(self) -> tuple[str, ...]:
        return self.body.stop_strings


def _request(body: dict, model: type, prompt: list[int], limits: Limits, served_model: str,
             tokenizer: Tokenizer, grammar=None) -> ApiRequest:
    """The validated ``body`` and ``prompt`` as one ``ApiRequest``."""
    _check_prompt_length(len(prompt), limits)
    fields = validate_body(model, body, BodyContext(served_model, limits.max_tokens, tokenizer.vocab_size))
    own = () if fields.ignore_eos else tuple(tokenizer.stop_token_ids)
    stop_ids = tuple(dict.fromkeys((*fields.stop_token_ids, *own)))   # the client's, then EOS and the model's
    return ApiRequest(prompt, fields, fields.sampling_params(stop_ids, grammar), fields.session_id)


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
        ids = tokenizer.encode(valid_text(prompt, "prompt"))
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
    gen = _request(body, CompletionBody, ids, limits, served_model, tokenizer)
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
    gen = _request(body, ChatBody, ids, limits, served_model, tokenizer, forced or constraint)
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
        valid_text(content, f"messages[{i}].content")
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
