"""The request bodies of ``/v1/completions`` and ``/v1/chat/completions`` as typed models.

One pydantic model per endpoint declares every field a client may send: its
type, its range (the sampling ranges come from ``cluster.protocol.SAMPLING_RANGES``,
the engine's own check), its default. The model validates each field once,
generates the OpenAPI schema (``serve_app.openapi``) and builds the request's
``SamplingParams`` (``sampling_params``). A field that is not declared, or that
this server does not implement, gets a 400 naming it (never a silent success
that answers something other than what was asked); fields that change nothing
about the answer (``user``, ``metadata``, ...) are accepted. Every error is a 400
naming the parameter (``validate_body``).

The prompt, the messages and the tools keep their own checks (``serve_app.parse``,
``serve_app.structured``): their fields are declared here as JSON values with the
schema they document.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Union

from annotated_types import Ge, Gt, Le, MaxLen, MinLen
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from cluster.protocol import (LOGIT_BIAS_RANGE, PRIORITY_MAX, PRIORITY_MIN, SAMPLING_RANGES, SEED_MAX, SEED_MIN, Range,
                              SamplingParams)
from serve_app.errors import APIError

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
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
MAX_SESSION_ID_CHARS = 128
MAX_COMPLETION_LOGPROBS = 5          # OpenAI's completions limit
MAX_CHAT_TOP_LOGPROBS = 20           # OpenAI's chat limit


@dataclass(frozen=True)
class BodyContext:
    """What a body is checked against beyond its own fields: the served model, the
    limits and the tokenizer's vocabulary."""

    served_model: str
    max_tokens: int
    vocab_size: int


def _ranged(default: float, name: str) -> Any:
    """A float field in its ``SAMPLING_RANGES`` range (the schema says it too)."""
    allowed = SAMPLING_RANGES[name]
    bound = {"gt": allowed.lo} if allowed.lo_open else {"ge": allowed.lo}
    return Field(default, le=allowed.hi, **bound)


def _json(schema: dict) -> Any:
    """A field checked by its own code, documented with ``schema`` (which replaces
    what pydantic would say of it)."""
    def replace(generated: dict) -> None:
        generated.clear()
        generated.update(schema)
    return Field(None, json_schema_extra=replace)


_STOP_STRING = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}


class GenerationBody(BaseModel):
    """The fields both generation endpoints take. ``None`` (JSON null) is a field's default."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid", frozen=True)
    endpoint: ClassVar[str] = ""

    model: str
    max_tokens: int = Field(16, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = _ranged(0.0, "temperature")     # default greedy: reproducible
    top_p: float = _ranged(1.0, "top_p")
    seed: Optional[int] = Field(None, ge=SEED_MIN, le=SEED_MAX)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: Optional[dict] = _json({"type": "object", "properties": {"include_usage": {"type": "boolean"}}})
    stop: Any = _json({"oneOf": [_STOP_STRING, {"type": "array", "maxItems": MAX_STOP_STRINGS,
                                                "items": _STOP_STRING}]})
    stop_token_ids: list[int] = Field(default_factory=list,
                                      json_schema_extra={"items": {"type": "integer", "minimum": 0}})
    ignore_eos: bool = False
    session_id: Optional[str] = Field(None, min_length=1, max_length=MAX_SESSION_ID_CHARS)
    presence_penalty: float = _ranged(0.0, "presence_penalty")
    frequency_penalty: float = _ranged(0.0, "frequency_penalty")
    repetition_penalty: float = _ranged(1.0, "repetition_penalty")
    top_k: int = Field(0, ge=-1)                          # 0 and -1 both mean off (vLLM takes -1)
    min_p: float = _ranged(0.0, "min_p")
    logit_bias: Optional[dict] = _json({"type": "object", "additionalProperties": {
        "type": "number", "minimum": LOGIT_BIAS_RANGE.lo, "maximum": LOGIT_BIAS_RANGE.hi}})
    min_tokens: int = Field(0, ge=0)
    # The engine's ``priority`` scheduling policy (vLLM's field): lower is served first.
    priority: int = Field(0, ge=PRIORITY_MIN, le=PRIORITY_MAX)
    # Accepted and ignored: they change nothing about the answer.
    user: Any = _json({"type": "string"})
    metadata: Any = _json({"type": "object"})
    store: Any = None
    service_tier: Any = None
    parallel_tool_calls: Any = _json({"type": "boolean"})

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, value: dict) -> dict:
        if not isinstance(value.get("include_usage", True), bool):
            raise APIError(400, f"'stream_options.include_usage' must be a boolean, got "
                                f"{type(value['include_usage']).__name__}", param="stream_options.include_usage")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: Any) -> tuple[str, ...]:
        """OpenAI's ``stop``: a string or up to 4 strings; generation ends before the first match."""
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise APIError(400, "'stop' must be a string or a list of strings", param="stop")
        if len(stops) > MAX_STOP_STRINGS:
            raise APIError(400, f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}", param="stop")
        for s in stops:
            if not 0 < len(s) <= MAX_STOP_CHARS:
                raise APIError(400, f"each 'stop' string must have 1 to {MAX_STOP_CHARS} characters", param="stop")
            valid_text(s, "stop")
        return tuple(dict.fromkeys(stops))

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict, info: ValidationInfo) -> tuple[tuple[int, float], ...]:
        """OpenAI's ``logit_bias``: token id (a string of digits in JSON) -> bias in [-100, 100]."""
        if len(value) > MAX_LOGIT_BIAS:
            raise APIError(400, f"'logit_bias' takes at most {MAX_LOGIT_BIAS} entries, got {len(value)}",
                           param="logit_bias")
        vocab_size = _context(info).vocab_size
        out = {}
        for key, bias in value.items():
            try:
                token = int(key)
            except (TypeError, ValueError):
                raise APIError(400, f"'logit_bias' keys must be token ids, got {key!r:.40}",
                               param="logit_bias") from None
            if not 0 <= token < vocab_size:
                raise APIError(400, f"'logit_bias' token id {token} outside [0, {vocab_size})", param="logit_bias")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not LOGIT_BIAS_RANGE.holds(bias):
                raise APIError(400, f"'logit_bias' values must be numbers in {LOGIT_BIAS_RANGE.text()}, got "
                                    f"{bias!r:.40}", param="logit_bias")
            out[token] = float(bias)
        return tuple(sorted(out.items()))

    @model_validator(mode="after")
    def _in_context(self, info: ValidationInfo) -> "GenerationBody":
        """The checks that depend on the deployment: the model it serves, its limits, the vocabulary."""
        context = _context(info)
        if self.model != context.served_model:
            raise APIError(404, f"model '{self.model}' does not exist; this server serves '{context.served_model}'",
                           param="model", code="model_not_found")
        for name in ("max_tokens", "max_completion_tokens"):
            value = getattr(self, name)
            if value is not None and value > context.max_tokens:
                raise APIError(400, f"'{name}' must be <= {context.max_tokens}, got {value}", param=name,
                               code="limit_exceeded")
        _at_most(self.top_k, "top_k", Range(-1, context.vocab_size))
        _at_most(self.min_tokens, "min_tokens", Range(0, self.answer_tokens))
        for i, token in enumerate(self.stop_token_ids):   # an id no model emits would be a stop never met
            if not 0 <= token < context.vocab_size:
                raise APIError(400, f"'stop_token_ids[{i}]' token id {token} outside [0, {context.vocab_size})",
                               param=f"stop_token_ids[{i}]")
        return self

    # ---------------------------------------------------------------- derived
    @property
    def answer_tokens(self) -> int:
        """``max_tokens``, or ``max_completion_tokens`` (OpenAI's newer name) when given."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def include_usage(self) -> bool:
        return (self.stream_options or {}).get("include_usage", True)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self.stop if self.stop is not None else ()

    def sampling_params(self, stop_token_ids: tuple[int, ...], grammar: Any = None) -> SamplingParams:
        """The engine's parameters for this body (one choice's; ``serve_app.choices``
        varies the seed and the logprobs per choice)."""
        return SamplingParams(
            max_tokens=self.answer_tokens, temperature=self.temperature, top_p=self.top_p, seed=self.seed,
            stop_token_ids=stop_token_ids, top_k=max(self.top_k, 0), min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=self.logit_bias or (),
            min_tokens=self.min_tokens, grammar=grammar, priority=self.priority)


class CompletionBody(GenerationBody):
    endpoint: ClassVar[str] = "/v1/completions"

    prompt: Any = Field(json_schema_extra={"description": "a string, token ids, or a list of either"})   # openapi
    echo: bool = False
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    best_of: Optional[int] = Field(None, ge=1, le=MAX_N)

    @model_validator(mode="after")
    def _best_of(self) -> "CompletionBody":
        if self.best_of is not None:
            if self.best_of < self.n:
                raise APIError(400, f"'best_of' ({self.best_of}) must be >= 'n' ({self.n})", param="best_of")
            if self.stream and self.best_of > self.n:
                raise APIError(400, "'best_of' > 'n' cannot be streamed: the best ones are known only at the end",
                               param="best_of")
        return self

    @property
    def candidates(self) -> int | None:
        """How many candidates ``best_of`` ranks (None: just the ``n`` choices)."""
        return self.best_of if self.best_of is not None and self.best_of > self.n else None

    @property
    def logprobs_k(self) -> int | None:
        return self.logprobs


_MESSAGE = {"type": "object", "required": ["role", "content"], "properties": {
    "role": {"type": "string", "enum": ["system", "user", "assistant", "tool"]},
    "content": {"type": ["string", "null"]}, "tool_call_id": {"type": "string"},
    "tool_calls": {"type": "array", "items": {"type": "object"}}}}
_FUNCTION = {"type": "object", "required": ["name"], "properties": {
    "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}, "description": {"type": "string"},
    "parameters": {"type": "object"}}}


class ChatBody(GenerationBody):
    endpoint: ClassVar[str] = "/v1/chat/completions"

    messages: Any = Field(json_schema_extra={"type": "array", "minItems": 1, "items": _MESSAGE})
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    tools: Any = _json({"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["type", "function"],
        "properties": {"type": {"enum": ["function"]}, "function": _FUNCTION}}})
    tool_choice: Any = _json({"oneOf": [{"enum": ["auto", "none", "required"]},
                                        {"type": "object", "properties": {"type": {"enum": ["function"]},
                                                                          "function": {"type": "object"}}}]})
    response_format: Any = _json({"type": "object", "properties": {
        "type": {"enum": ["text", "json_object", "json_schema"]},
        "json_schema": {"type": "object", "properties": {"name": {"type": "string"}, "schema": {"type": "object"},
                                                         "strict": {"type": "boolean"}}}}})
    structured_outputs: Any = _json({"type": "object", "properties": {
        "json": {"type": "object"}, "regex": {"type": "string"}, "grammar": {"type": "string"},
        "choice": {"type": "array", "items": {"type": "string"}}}})

    @model_validator(mode="after")
    def _top_logprobs(self) -> "ChatBody":
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return self

    @property
    def candidates(self) -> int | None:
        return None

    @property
    def echo(self) -> bool:
        return False

    @property
    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def validate_body(model: type[GenerationBody], body: dict, context: BodyContext) -> Union[CompletionBody, ChatBody]:
    """``body`` as ``model``: the first unknown field, or the first bad value, is a 400 naming it."""
    for name in body:
        if name in model.model_fields:
            continue
        if name in NOT_IMPLEMENTED:
            raise APIError(400, f"'{name}' is not supported: {NOT_IMPLEMENTED[name]}", param=name,
                           code="unsupported_parameter")
        raise APIError(400, f"unknown parameter '{name}' for {model.endpoint}", param=name,
                       code="unsupported_parameter")
    try:
        return model.model_validate(body, strict=True, context=context)
    except ValidationError as exc:
        raise _client_error(model, exc.errors(include_url=False)[0]) from None


_KINDS = {"int_type": "an integer", "float_type": "a number", "finite_number": "a number", "bool_type": "a boolean",
          "string_type": "a string", "dict_type": "an object", "list_type": "a list"}
_BOUNDS = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}


def _client_error(model: type[GenerationBody], error: dict) -> APIError:
    """pydantic's error as the OpenAI-shaped 400 the API has always answered."""
    loc = error["loc"]
    name = str(loc[0]) if loc else None
    param = name + "".join(f"[{part}]" for part in loc[1:]) if name else None
    kind, value = error["type"], error.get("input")
    if kind == "missing":
        return APIError(400, f"'{param}' is required", param=param)
    if kind in _KINDS:
        return APIError(400, f"'{param}' must be {_KINDS[kind]}, got {type(value).__name__}", param=param)
    if kind in _BOUNDS:
        allowed = _declared_range(model, name)
        if allowed is not None:
            return APIError(400, f"'{param}' must be in {allowed.text()}, got {value}", param=param)
        bound = next(iter(error["ctx"].values()))
        return APIError(400, f"'{param}' must be {_BOUNDS[kind]} {bound}, got {value}", param=param)
    if kind in ("string_too_short", "string_too_long"):
        lengths = {type(m): m for m in model.model_fields[name].metadata}
        return APIError(400, f"'{param}' must be a string of {lengths[MinLen].min_length} to "
                             f"{lengths[MaxLen].max_length} characters", param=param)
    return APIError(400, f"'{param}': {error['msg']}", param=param)


# Bounded on both sides, but the side it broke says more than the range would (the
# int64/uint64 limits).
_ONE_SIDED = frozenset({"seed", "priority"})


def _declared_range(model: type[GenerationBody], name: str | None) -> Range | None:
    """The [lo, hi] or (lo, hi] a field declares, when it declares both ends."""
    field = model.model_fields.get(name) if name not in _ONE_SIDED else None
    if field is None:
        return None
    low = next((m for m in field.metadata if isinstance(m, (Ge, Gt))), None)
    high = next((m for m in field.metadata if isinstance(m, Le)), None)
    if low is None or high is None:
        return None
    return Range(low.gt, high.le, lo_open=True) if isinstance(low, Gt) else Range(low.ge, high.le)


def _at_most(value: int, name: str, allowed: Range) -> None:
    if not allowed.holds(value):
        raise APIError(400, f"'{name}' must be in [{allowed.lo:g}, {allowed.hi:g}], got {value}", param=name)


def _context(info: ValidationInfo) -> BodyContext:
    if not isinstance(info.context, BodyContext):
        raise TypeError("request bodies are validated with a BodyContext (validate_body)")
    return info.context


def valid_text(value: str, param: str) -> str:
    """A string the tokenizer can take: valid Unicode, no lone surrogate (JSON's
    \\ud800 escapes decode to one)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, f"'{param}' contains an invalid Unicode character (a lone surrogate)",
                       param=param, code="invalid_unicode") from None
    return value
