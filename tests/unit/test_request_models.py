"""The typed request models (``serve_app.params``): one check per field, the
engine's ``SamplingParams`` built from them, the OpenAPI schema generated from
them with the ranges of ``cluster.protocol``; and no import circle in serve_app."""

import ast
import pathlib

import pytest

from cluster.protocol import LOGIT_BIAS_RANGE, SAMPLING_RANGES, SamplingParams
from serve_app.errors import APIError
from serve_app.openapi import chat_schema, completion_schema
from serve_app.params import BodyContext, ChatBody, CompletionBody, validate_body

CONTEXT = BodyContext("m", max_tokens=64, vocab_size=259)


def completion(**fields):
    return validate_body(CompletionBody, {"model": "m", "prompt": "x", **fields}, CONTEXT)


def test_the_body_builds_the_engines_sampling_params():
    body = completion(max_completion_tokens=7, temperature=0.5, top_p=0.9, seed=3, top_k=-1, min_p=0.1,
                      presence_penalty=1, frequency_penalty=-1, repetition_penalty=1.5, min_tokens=2,
                      logit_bias={"12": 5, "3": -1.5}, stop="ab", user=5)
    params = body.sampling_params((9, 2), grammar=None)
    assert params == SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, seed=3, stop_token_ids=(9, 2),
                                    top_k=0, min_p=0.1, presence_penalty=1.0, frequency_penalty=-1.0,
                                    repetition_penalty=1.5, logit_bias=((3, -1.5), (12, 5.0)), min_tokens=2)
    assert body.stop_strings == ("ab",) and body.include_usage is True
    assert completion(priority=-3).sampling_params((), grammar=None).priority == -3   # the engine's priority policy


def test_null_is_the_default_and_best_of_equal_to_n_is_plain_n():
    body = completion(n=2, best_of=2, seed=None, logprobs=None, stop=None, max_tokens=None)
    assert (body.n, body.candidates, body.seed, body.logprobs_k, body.stop_strings, body.answer_tokens) == \
        (2, None, None, None, (), 16)
    assert completion(n=2, best_of=3).candidates == 3


@pytest.mark.parametrize("fields, param, message", [
    ({"temperature": 2.5}, "temperature", "'temperature' must be in [0, 2], got 2.5"),
    ({"top_p": 0}, "top_p", "'top_p' must be in (0, 1], got 0"),
    ({"repetition_penalty": 0.0}, "repetition_penalty", "'repetition_penalty' must be in (0, 2], got 0.0"),
    ({"n": 0}, "n", "'n' must be in [1, 16], got 0"),
    ({"max_tokens": 0}, "max_tokens", "'max_tokens' must be >= 1, got 0"),
    ({"max_tokens": 65}, "max_tokens", "'max_tokens' must be <= 64, got 65"),
    ({"top_k": 260}, "top_k", "'top_k' must be in [-1, 259], got 260"),
    ({"min_tokens": 17}, "min_tokens", "'min_tokens' must be in [0, 16], got 17"),
    ({"seed": True}, "seed", "'seed' must be an integer, got bool"),
    ({"temperature": "1"}, "temperature", "'temperature' must be a number, got str"),
    ({"stop_token_ids": [1, "2"]}, "stop_token_ids[1]", "'stop_token_ids[1]' must be an integer, got str"),
    ({"stop_token_ids": [1, -5]}, "stop_token_ids[1]", "'stop_token_ids[1]' token id -5 outside [0, 259)"),
    ({"stop_token_ids": [259]}, "stop_token_ids[0]", "'stop_token_ids[0]' token id 259 outside [0, 259)"),
    ({"logit_bias": {"300": 1}}, "logit_bias", "'logit_bias' token id 300 outside [0, 259)"),
    ({"best_of": 3, "stream": True}, "best_of", "'best_of' > 'n' cannot be streamed"),
    ({"top_logprobs": 1}, "top_logprobs", "unknown parameter 'top_logprobs' for /v1/completions"),
    ({"suffix": "y"}, "suffix", "'suffix' is not supported"),
    ({"session_id": ""}, "session_id", "'session_id' must be a string of 1 to 128 characters"),
    ({"stop": ["a"] * 5}, "stop", "'stop' takes at most 4 strings, got 5"),
    ({"priority": 1.5}, "priority", "'priority' must be an integer, got float"),
    ({"priority": "1"}, "priority", "'priority' must be an integer, got str"),
    ({"priority": 2 ** 31}, "priority", "'priority' must be <= 2147483647, got 2147483648"),
])
def test_each_bad_field_is_a_400_naming_it(fields, param, message):
    with pytest.raises(APIError) as err:
        completion(**fields)
    assert err.value.status == 400 and err.value.param == param and err.value.message.startswith(message)


def test_the_model_is_checked_against_the_served_one():
    with pytest.raises(APIError) as err:
        validate_body(ChatBody, {"model": "gpt-4", "messages": []}, CONTEXT)
    assert (err.value.status, err.value.code, err.value.param) == (404, "model_not_found", "model")
    chat = validate_body(ChatBody, {"model": "m", "messages": [], "logprobs": True, "top_logprobs": 3}, CONTEXT)
    assert chat.logprobs_k == 3 and chat.candidates is None and chat.echo is False


def test_the_schema_says_the_ranges_the_engine_checks():
    for schema in (completion_schema("m", 259), chat_schema("m", 259)):
        props = schema["properties"]
        for name, allowed in SAMPLING_RANGES.items():
            low = props[name]["exclusiveMinimum" if allowed.lo_open else "minimum"]
            assert (low, props[name]["maximum"]) == (allowed.lo, allowed.hi), name
        bias = props["logit_bias"]["additionalProperties"]
        assert (bias["minimum"], bias["maximum"]) == (LOGIT_BIAS_RANGE.lo, LOGIT_BIAS_RANGE.hi)
        assert props["model"] == {"type": "string", "enum": ["m"]} and props["top_k"]["maximum"] == 259
    assert completion_schema("m", 259)["required"] == ["model", "prompt"]
    assert chat_schema("m")["required"] == ["model", "messages"]


def test_no_import_circle_in_serve_app():
    root = pathlib.Path(__file__).resolve().parents[2] / "serve_app"
    graph: dict[str, set[str]] = {}
    for path in root.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):   # TYPE_CHECKING imports count too
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("serve_app"):
                deps |= {a.name for a in node.names} if node.module == "serve_app" else {node.module.split(".")[1]}
        graph[path.stem] = deps & {p.stem for p in root.glob("*.py")}
    state: dict[str, int] = {}

    def visit(module: str, trail: list[str]) -> None:
        state[module] = 1
        for dep in graph[module]:
            assert state.get(dep) != 1, f"import circle: {' -> '.join(trail + [dep])}"
            if dep not in state:
                visit(dep, trail + [dep])
        state[module] = 2

    for module in graph:
        if module not in state:
            visit(module, [module])
    assert "ingress" not in graph["responses"] and "ingress" not in graph["admin"]
