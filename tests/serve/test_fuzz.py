"""Fuzzing the HTTP API: no input makes the service answer 5xx, hang or fall over.

Two generators against the real app (built-in model, two replicas, API keys
configured) on the loopback cluster:

- Schemathesis reads the app's own OpenAPI document (``GET /openapi.json``,
  request bodies from ``serve_app.openapi``) and generates valid and invalid
  requests for every operation (positive and negative modes);
- Hypothesis strategies build request bodies from arbitrary JSON: known
  fields with values of any type, unknown fields, deep nesting.

After every case: the status is not 5xx, an error body is OpenAI-shaped, a
stream ends with ``[DONE]``, and the service still answers a plain request.
Bounded: a fixed number of examples per operation, no deadline.
"""

from __future__ import annotations

import itertools
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import schemathesis  # noqa: E402  (the test extra installs it)
from schemathesis.config import SchemathesisConfig

pytestmark = pytest.mark.distributed

MODEL = "prefix-cache-byte"
KEY, ADMIN = "fuzz-tenant-key", "fuzz-admin-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}
EXAMPLES = 20


@pytest.fixture(scope="module")
def app_url(ray_loopback_cluster):
    from ray import serve

    from actors.pytest_plugin import TEST_MODEL
    from serve_app.app import build_app
    from serve_app.local import free_port

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {"num_replicas": 2, "namespace": "prefix-cache-fuzz-test", "api_keys": f"{KEY}=fuzz",
            "admin_keys": ADMIN, "limits": {"max_prompt_tokens": 512, "max_tokens": 8, "max_body_bytes": 65536},
            "worker": {"model": TEST_MODEL, "hot_blocks": 128, "warm_blocks": 64, "block_tokens": 16}}
    serve.run(build_app(args), name="prefix-cache-fuzz", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()   # the next module starts Serve on a port of its own


# /tokenize and /detokenize run no model: their boundary cases (the coverage phase,
# about 250) add little to the Hypothesis test of arbitrary bodies below.
SCHEMATHESIS_CONFIG = SchemathesisConfig.from_dict(
    {"operations": [{"include-path-regex": "^/(de)?tokenize$", "phases": {"coverage": {"enabled": False}}}]})


@pytest.fixture(scope="module")
def api_schema(app_url):
    return schemathesis.openapi.from_url(app_url + "/openapi.json", config=SCHEMATHESIS_CONFIG)


def assert_well_behaved(status: int, body: bytes, content_type: str) -> None:
    assert status < 500, (status, body[:500])
    if status >= 400:
        error = json.loads(body)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    elif content_type.startswith("text/event-stream"):
        lines = [line for line in body.decode().splitlines() if line.startswith("data: ")]
        assert lines and lines[-1] == "data: [DONE]", lines[-3:]


def assert_healthy(url: str) -> None:
    r = httpx.post(url + "/v1/completions", headers=HEADERS, timeout=60,
                   json={"model": MODEL, "prompt": "still there?", "max_tokens": 1})
    assert r.status_code == 200, r.text


HEALTH_EVERY = 8   # cases between two full checks (a replica round trip each): most cases are 4xx
_cases = itertools.count(1)


def check_health(url: str) -> None:
    """A plain request answered, every ``HEALTH_EVERY`` cases (a case that broke a
    replica also shows as a 5xx on the cases after it, which every case asserts
    against; the module's last test checks every replica by name)."""
    if next(_cases) % HEALTH_EVERY == 0:
        assert_healthy(url)


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_schemathesis_no_5xx(case, app_url):
    case.headers = {**(case.headers or {}), **HEADERS}
    response = case.call(base_url=app_url, timeout=60)
    content_type = response.headers.get("content-type") or ""
    if isinstance(content_type, list):   # schemathesis' transport keeps every value of a header
        content_type = content_type[0] if content_type else ""
    assert_well_behaved(response.status_code, response.content, content_type)
    check_health(app_url)


FIELDS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "seed", "stream",
          "stream_options", "stop", "stop_token_ids", "ignore_eos", "session_id", "n", "max_completion_tokens",
          "best_of", "echo", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty",
          "top_k", "min_p", "logit_bias", "min_tokens", "response_format", "structured_outputs", "tools",
          "tool_choice", "parallel_tool_calls", "user", "metadata"]
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {
    "q": {"type": "string", "maxLength": 4}}, "required": ["q"]}}}
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12)
valid_messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                                 "content": st.text(max_size=60)}), min_size=1, max_size=3)
bodies = st.fixed_dictionaries(
    {"model": st.just(MODEL) | json_values},
    optional={**{name: json_values for name in FIELDS if name != "model"},
              "prompt": st.text(max_size=80) | st.lists(st.integers(-5, 300), max_size=20) | json_values,
              "messages": valid_messages | json_values,
              "max_tokens": st.integers(-3, 12) | json_values,
              "temperature": st.floats(min_value=0, max_value=3) | st.sampled_from([1e-40, 5e-324]),
              "stop": st.text(min_size=0, max_size=5) | st.lists(st.text(max_size=5), max_size=6),
              "n": st.integers(-1, 18) | json_values, "best_of": st.integers(0, 18) | json_values,
              "logprobs": st.integers(-1, 7) | st.booleans() | json_values,
              "logit_bias": st.dictionaries(st.sampled_from(["1", "258", "999", "x"]), st.floats(-150, 150),
                                            max_size=3) | json_values,
              "response_format": st.sampled_from([{"type": "json_object"}, {"type": "text"}, {"type": "xml"},
                                                 {"type": "json_schema", "json_schema": {"schema": {"type": "integer"}}}])
              | json_values,
              "structured_outputs": st.sampled_from([{"regex": "[ab]{2}"}, {"choice": ["x", "y"]}, {"regex": "("},
                                                    {"grammar": "start: \"z\""}, {"json": {"type": "bool"}}])
              | json_values,
              "tools": st.just([TOOL]) | json_values,
              "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function",
                                                                            "function": {"name": "lookup"}}])
              | json_values})


@given(body=bodies, chat=st.booleans())
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_hypothesis_bodies_no_5xx(app_url, body, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    r = httpx.post(app_url + path, headers=HEADERS, json=body, timeout=60)
    assert_well_behaved(r.status_code, r.content, r.headers.get("content-type", ""))
    check_health(app_url)


TOKEN_FIELDS = ["model", "prompt", "messages", "tools", "tool_choice", "add_special_tokens", "add_generation_prompt",
                "return_token_strs", "tokens", "continue_final_message", "chat_template"]
token_bodies = st.fixed_dictionaries({}, optional={
    **{name: json_values for name in TOKEN_FIELDS},
    "model": st.just(MODEL) | json_values, "prompt": st.text(max_size=60) | json_values,
    "messages": valid_messages | json_values, "tools": st.just([TOOL]) | json_values,
    "tokens": st.lists(st.integers(-5, 300), max_size=20) | json_values,
    "add_special_tokens": st.booleans() | json_values, "return_token_strs": st.booleans() | json_values})


@given(body=token_bodies, path=st.sampled_from(["/tokenize", "/detokenize"]))
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_hypothesis_tokenize_bodies_no_5xx(app_url, body, path):
    r = httpx.post(app_url + path, headers=HEADERS, json=body, timeout=60)
    assert_well_behaved(r.status_code, r.content, r.headers.get("content-type", ""))


def test_every_replica_is_alive_and_answers_after_the_fuzzing(app_url):
    assert_healthy(app_url)
    r = httpx.get(app_url + "/v1/cache/stats", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
    workers = r.json()["workers"]
    assert len(workers) == 2 and all("error" not in w for w in workers.values()), workers
