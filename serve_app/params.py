"""The generation parameters beyond the basics: sampling controls, ``n``/``best_of``,
logprobs and ``echo``, and which request fields are known at all.

Every field a client may send is listed here per endpoint. A field that is not
listed, or that this server does not implement, gets a 400 naming it (never a
silent success that answers something other than what was asked); fields that
change nothing about the answer (``user``, ``metadata``, ...) are accepted.
Values are checked here, each error a 400 naming the parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from serve_app.errors import APIError

# Accepted and ignored: they change nothing about the answer.
NO_EFFECT = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls"})
COMMON = frozenset({"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream",
                    "stream_options", "stop", "stop_token_ids", "seed", "ignore_eos", "session_id",
                    "presence_penalty", "frequency_penalty", "repetition_penalty", "top_k", "min_p", "logit_bias",
                    "min_tokens"})
COMPLETIONS = COMMON | {"prompt", "echo", "logprobs", "best_of"}
CHAT = COMMON | {"messages", "logprobs", "top_logprobs", "response_format", "structured_outputs", "tools",
                 "tool_choice"}
# Known to OpenAI-compatible clients, not implemented here: named in the 400 with why.
NOT_IMPLEMENTED = {
    "suffix": "insertion (suffix) is not supported by this model",
    "functions": "use 'tools' (the deprecated 'functions' is not supported)",
    "function_call": "use 'tool_choice' (the deprecated 'function_call' is not supported)",
    "audio": "audio output is not supported", "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported", "web_search_options": "web search is not supported",
    "reasoning_effort": "this model does not reason in a separate channel",
}
MAX_N = 16
MAX_LOGIT_BIAS = 300


def check_fields(body: dict, chat: bool) -> None:
    """A 400 for the first field this endpoint does not know or does not implement."""
    known = CHAT if chat else COMPLETIONS
    for name in body:
        if name in known or name in NO_EFFECT:
            continue
        if name in NOT_IMPLEMENTED:
            raise APIError(400, f"'{name}' is not supported: {NOT_IMPLEMENTED[name]}", param=name,
                           code="unsupported_parameter")
        raise APIError(400, f"unknown parameter '{name}' for {'/v1/chat/completions' if chat else '/v1/completions'}",
                       param=name, code="unsupported_parameter")


def _number(body: dict, name: str, default: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise APIError(400, f"'{name}' must be a number, got {value!r:.40}", param=name)
    if value > hi or value < lo or (lo_open and value == lo):
        raise APIError(400, f"'{name}' must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {value}", param=name)
    return float(value)


def _integer(body: dict, name: str, default: int | None, lo: int, hi: int) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise APIError(400, f"'{name}' must be an integer, got {value!r:.40}", param=name)
    if not lo <= value <= hi:
        raise APIError(400, f"'{name}' must be in [{lo}, {hi}], got {value}", param=name)
    return value


@dataclass
class Generation:
    """The parameters of one request beyond ``ApiRequest``'s basics."""
    n: int = 1
    best_of: int | None = None
    echo: bool = False
    logprobs: int | None = None          # top-k of each sampled token (None: no logprobs)
    sampling: dict = field(default_factory=dict)   # SamplingParams keyword arguments

    @property
    def choices_to_run(self) -> int:
        return self.best_of or self.n


def parse_generation(body: dict, chat: bool, vocab_size: int, max_tokens: int) -> Generation:
    """``n``, ``best_of``, ``echo``, logprobs and the sampling controls, validated."""
    check_fields(body, chat)
    gen = Generation()
    gen.n = _integer(body, "n", 1, 1, MAX_N)
    stream = body.get("stream") is True
    if not chat:
        gen.best_of = _integer(body, "best_of", None, 1, MAX_N)
        if gen.best_of is not None:
            if gen.best_of < gen.n:
                raise APIError(400, f"'best_of' ({gen.best_of}) must be >= 'n' ({gen.n})", param="best_of")
            if stream and gen.best_of > gen.n:
                raise APIError(400, "'best_of' > 'n' cannot be streamed: the best ones are known only at the end",
                               param="best_of")
            if gen.best_of == gen.n:
                gen.best_of = None
        echo = body.get("echo", False)
        if not isinstance(echo, bool):
            raise APIError(400, f"'echo' must be a boolean, got {echo!r:.40}", param="echo")
        gen.echo = echo
        gen.logprobs = _integer(body, "logprobs", None, 0, 5)
    else:
        want = body.get("logprobs", False)
        if want is None:
            want = False
        if not isinstance(want, bool):
            raise APIError(400, f"'logprobs' must be a boolean for chat, got {want!r:.40}", param="logprobs")
        top = _integer(body, "top_logprobs", None, 0, 20)
        if top is not None and not want:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        gen.logprobs = (top or 0) if want else None
    s = gen.sampling
    for name, lo, hi in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0)):
        value = _number(body, name, 0.0, lo, hi)
        if value:
            s[name] = value
    rep = _number(body, "repetition_penalty", 1.0, 0.0, 2.0, lo_open=True)
    if rep != 1.0:
        s["repetition_penalty"] = rep
    top_k = _integer(body, "top_k", 0, -1, vocab_size)
    if top_k > 0:   # 0 and -1 both mean off (vLLM takes -1)
        s["top_k"] = top_k
    min_p = _number(body, "min_p", 0.0, 0.0, 1.0)
    if min_p:
        s["min_p"] = min_p
    min_tokens = _integer(body, "min_tokens", 0, 0, max_tokens)
    if min_tokens:
        s["min_tokens"] = min_tokens
    bias = body.get("logit_bias")
    if bias is not None:
        s["logit_bias"] = _logit_bias(bias, vocab_size)
    return gen


def _logit_bias(value: Any, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: token id (a string of digits in JSON) -> bias in [-100, 100]."""
    if not isinstance(value, dict):
        raise APIError(400, "'logit_bias' must be an object of token id -> bias", param="logit_bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise APIError(400, f"'logit_bias' takes at most {MAX_LOGIT_BIAS} entries, got {len(value)}",
                       param="logit_bias")
    out = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise APIError(400, f"'logit_bias' keys must be token ids, got {key!r:.40}", param="logit_bias") from None
        if not 0 <= token < vocab_size:
            raise APIError(400, f"'logit_bias' token id {token} outside [0, {vocab_size})", param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias) \
                or not -100 <= bias <= 100:
            raise APIError(400, f"'logit_bias' values must be numbers in [-100, 100], got {bias!r:.40}",
                           param="logit_bias")
        out[token] = float(bias)
    return tuple(sorted(out.items()))
