"""``/tokenize`` and ``/detokenize`` in vLLM's shapes, with the served model's tokenizer.

``POST /tokenize`` takes either ``prompt`` (a string: the ids ``/v1/completions``
runs for it) or ``messages`` (and ``tools``: the ids ``/v1/chat/completions``
runs for them, through the same chat template and reply memory) and answers
``{"count", "max_model_len", "tokens"}`` (and ``token_strs`` when
``return_token_strs`` is true). ``POST /detokenize`` takes ``tokens`` and answers
``{"prompt"}``. ``GET /tokenizer_info`` names the special tokens and the chat
template (lm-eval's ``local-completions`` finds the three and tokenizes through
them instead of downloading a tokenizer). ``model`` is optional; when sent it must be the served model.

One difference from vLLM, so a count here is the count the server runs:
``add_special_tokens`` defaults to false for ``prompt`` too, because
``/v1/completions`` adds none to a text prompt (true prepends what the
tokenizer's own ``encode`` would).
"""

from __future__ import annotations

from typing import Any, Callable

from serve_app.errors import APIError
from serve_app.params import valid_text
from serve_app.parse import Limits, chat_prompt

TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "tools", "tool_choice", "add_special_tokens",
                             "add_generation_prompt", "return_token_strs"})
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})
# vLLM fields whose other values change the ids; only these values are served.
_DEFAULT_ONLY = {"continue_final_message": False, "chat_template": None, "chat_template_kwargs": None}


def _check(body: dict, known: frozenset, endpoint: str, served_model: str) -> None:
    for name in body:
        if name in known:
            continue
        if name in _DEFAULT_ONLY and known is TOKENIZE_FIELDS:
            if body[name] == _DEFAULT_ONLY[name]:
                continue
            raise APIError(400, f"'{name}' is not supported: the ids are always those the chat endpoint runs",
                           param=name, code="unsupported_parameter")
        raise APIError(400, f"unknown parameter '{name}' for {endpoint}", param=name, code="unsupported_parameter")
    model = body.get("model")
    if model is not None and model != served_model:
        if not isinstance(model, str):
            raise APIError(400, f"'model' must be a string, got {type(model).__name__}", param="model")
        raise APIError(404, f"model '{model}' does not exist; this server serves '{served_model}'",
                       param="model", code="model_not_found")


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise APIError(400, f"'{name}' must be a boolean, got {type(value).__name__}", param=name)
    return value


def tokenize(body: dict, tokenizer: Any, token_name: Callable[[int], str], served_model: str,
             context: int, limits: Limits, render: Callable[..., list[int]] | None) -> dict:
    _check(body, TOKENIZE_FIELDS, "/tokenize", served_model)
    if _flag(body, "add_generation_prompt", True) is not True:
        raise APIError(400, "'add_generation_prompt' false is not supported", param="add_generation_prompt",
                       code="unsupported_parameter")
    special = _flag(body, "add_special_tokens", False)
    strs = _flag(body, "return_token_strs", False)
    if ("prompt" in body) == ("messages" in body):
        raise APIError(400, "give exactly one of 'prompt' (a string) and 'messages' (a chat)",
                       param="prompt" if "prompt" in body else "messages")
    if "prompt" in body:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise APIError(400, f"'prompt' must be a string, got {type(prompt).__name__}", param="prompt")
        if len(prompt) > limits.max_body_bytes:
            raise APIError(413, "'prompt' is longer than the body limit", param="prompt")
        valid_text(prompt, "prompt")
        hf = getattr(tokenizer, "tokenizer", None)
        if special and hf is not None:
            ids = list(hf.encode(prompt, add_special_tokens=True))
        else:
            ids = tokenizer.encode(prompt)
            if special and getattr(tokenizer, "bos_id", None) is not None:
                ids = [tokenizer.bos_id, *ids]
    else:
        if "tool_choice" in body and "tools" not in body:
            raise APIError(400, "'tool_choice' needs 'tools'", param="tool_choice")
        ids, _ = chat_prompt(body, tokenizer, render)
    out: dict = {"count": len(ids), "max_model_len": context, "tokens": ids}
    if strs:
        out["token_strs"] = [token_name(t) for t in ids]
    return out


def detokenize(body: dict, tokenizer: Any, served_model: str, context: int) -> dict:
    _check(body, DETOKENIZE_FIELDS, "/detokenize", served_model)
    if "tokens" not in body:
        raise APIError(400, "'tokens' is required", param="tokens")
    tokens = body["tokens"]
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise APIError(400, "'tokens' must be a list of integer token ids", param="tokens")
    if len(tokens) > context:
        raise APIError(400, f"'tokens' has {len(tokens)} ids; at most the model's context of {context}",
                       param="tokens")
    bad = next((t for t in tokens if not 0 <= t < tokenizer.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"'tokens' has token id {bad} outside [0, {tokenizer.vocab_size})", param="tokens")
    return {"prompt": tokenizer.decode(tokens)}


def tokenizer_info(tokenizer: Any, context: int) -> dict:
    hf = getattr(tokenizer, "tokenizer", None)
    if hf is None:   # the built-in byte tokenizer: its specials have no text of their own
        return {"tokenizer_class": type(tokenizer).__name__, "eos_token": None, "bos_token": None,
                "pad_token": None, "eos_token_id": tokenizer.eos_id, "bos_token_id": tokenizer.bos_id,
                "model_max_length": context, "vocab_size": tokenizer.vocab_size}
    template = getattr(hf, "chat_template", None)
    return {"tokenizer_class": type(hf).__name__, "eos_token": hf.eos_token, "bos_token": hf.bos_token,
            "pad_token": hf.pad_token, "unk_token": hf.unk_token, "eos_token_id": tokenizer.eos_id,
            "bos_token_id": tokenizer.bos_id, "model_max_length": context, "vocab_size": tokenizer.vocab_size,
            "chat_template": template if isinstance(template, str) else None}
