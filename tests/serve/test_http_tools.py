"""End to end over HTTP, the API's structured outputs, tools and tokenizer endpoints: the
same app as ``test_http`` (``tests/serve/http_app.py``)."""

import json

import httpx
import pytest

from tests.serve.http_app import KEYS, MODEL, TOOL, post, serve_test_app, sse_events

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def base_url(ray_loopback_cluster):
    yield from serve_test_app()


# ------------------------------------------------------------------ structured output and tools
def chat(base_url, **body):
    r = post(base_url, "/v1/chat/completions", {"model": MODEL, "max_tokens": 64,
                                                "messages": [{"role": "user", "content": "Weather in Paris?"}], **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_structured_outputs_always_follow_their_constraint(base_url):
    import re
    for seed in range(3):
        pick = chat(base_url, structured_outputs={"choice": ["yes", "no", "maybe"]}, temperature=1.0, seed=seed)
        assert pick["choices"][0]["message"]["content"] in ("yes", "no", "maybe")
        code = chat(base_url, structured_outputs={"regex": "[0-9]{3}-[a-z]{2}"}, temperature=1.0, seed=seed)
        assert re.fullmatch("[0-9]{3}-[a-z]{2}", code["choices"][0]["message"]["content"])
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
                  "required": ["ok", "n"], "additionalProperties": False}
        out = chat(base_url, response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
                   temperature=1.0, seed=seed)
        value = json.loads(out["choices"][0]["message"]["content"])
        assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and value["n"] in (1, 2, 3)


def test_a_forced_tool_call_parses_and_the_loop_reuses_its_kv(base_url):
    first = chat(base_url, tools=[TOOL], tool_choice="required", temperature=1.0, seed=4, parallel_tool_calls=False)
    choice = first["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "w" and call["id"].startswith("call_")
    assert json.loads(call["function"]["arguments"]) in ({"c": "P"}, {"c": "R"}, {"c": "O"})
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21C"}]
    second = post(base_url, "/v1/chat/completions", {"model": MODEL, "messages": messages, "tools": [TOOL],
                                                     "max_tokens": 4}).json()
    used = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
    # The first turn's prompt and the call it generated are cached (all but the call's last token).
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= used - 1
    named = chat(base_url, tools=[TOOL], tool_choice={"type": "function", "function": {"name": "w"}})
    assert named["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "w"
    none = chat(base_url, tools=[TOOL], tool_choice="none", max_tokens=3)
    assert "tool_calls" not in none["choices"][0]["message"] and none["choices"][0]["finish_reason"] != "tool_calls"


def test_a_streamed_tool_call_comes_in_a_delta(base_url):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}], "tools": [TOOL],
            "tool_choice": "required", "max_tokens": 64, "stream": True, "parallel_tool_calls": False}
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEYS['a']}"}) as resp:
        events = sse_events(resp)
    deltas = [ev["choices"][0]["delta"] for ev in events if ev["choices"]]
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["function"]["name"] == "w"
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_tokenize_gives_the_ids_the_endpoints_run_and_detokenize_inverts_it(base_url):
    r = post(base_url, "/tokenize", {"model": MODEL, "prompt": "héllo", "return_token_strs": True})
    assert r.status_code == 200, r.text
    ids = list("héllo".encode())
    assert r.json() == {"count": len(ids), "max_model_len": 8192, "tokens": ids,
                        "token_strs": ["h", "bytes:\\xc3", "bytes:\\xa9", "l", "l", "o"]}
    assert post(base_url, "/tokenize", {"prompt": "hi", "add_special_tokens": True}).json()["tokens"] == [256, 104, 105]
    # A completion of the same text runs exactly the ids /tokenize counted.
    done = post(base_url, "/v1/completions", {"model": MODEL, "prompt": "héllo", "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == len(ids)
    # Chat: the template's ids, as the chat endpoint counts them.
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    tok = post(base_url, "/tokenize", {"messages": messages}).json()
    assert tok["tokens"] == [256, *"<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n".encode()]
    reply = chat(base_url, messages=messages, max_tokens=1)
    assert reply["usage"]["prompt_tokens"] == tok["count"]
    assert post(base_url, "/detokenize", {"model": MODEL, "tokens": ids}).json() == {"prompt": "héllo"}
    assert post(base_url, "/tokenize", {"prompt": "x"}, key="").status_code == 401


def test_several_prompts_are_answered_in_order_each_as_alone(base_url):
    prompts = ["one prompt", "another prompt", "a third"]
    alone = [post(base_url, "/v1/completions", {"model": MODEL, "prompt": p, "max_tokens": 4, "n": 2,
                                                "temperature": 1.0, "seed": 5}).json() for p in prompts]
    both = post(base_url, "/v1/completions", {"model": MODEL, "prompt": prompts, "max_tokens": 4, "n": 2,
                                              "temperature": 1.0, "seed": 5})
    assert both.status_code == 200, both.text
    body = both.json()
    assert [c["index"] for c in body["choices"]] == list(range(6))
    assert [c["token_ids"] for c in body["choices"]] == [c["token_ids"] for a in alone for c in a["choices"]]
    assert body["usage"]["prompt_tokens"] == sum(len(p.encode()) for p in prompts)
    assert body["usage"]["completion_tokens"] == sum(a["usage"]["completion_tokens"] for a in alone)
    assert len(body["prefix_cache_by_prompt"]) == 3
    # Token-id lists too (as lm-eval sends them), and a list of one is one prompt.
    ids = post(base_url, "/v1/completions", {"model": MODEL, "prompt": [list(p.encode()) for p in prompts],
                                             "max_tokens": 4, "n": 2, "temperature": 1.0, "seed": 5}).json()
    assert [c["token_ids"] for c in ids["choices"]] == [c["token_ids"] for c in body["choices"]]
    one = post(base_url, "/v1/completions", {"model": MODEL, "prompt": [prompts[0]], "max_tokens": 4, "n": 2,
                                             "temperature": 1.0, "seed": 5}).json()
    assert one["choices"] == alone[0]["choices"] and "prefix_cache_by_prompt" not in one


def test_tokenizer_info_names_the_specials(base_url):
    info = post(base_url, "/tokenize", {"prompt": "x"})   # warm
    info = httpx.get(base_url + "/tokenizer_info", headers={"Authorization": f"Bearer {KEYS['a']}"}, timeout=30)
    assert info.status_code == 200
    assert info.json() == {"tokenizer_class": "ByteTokenizer", "eos_token": None, "bos_token": None,
                           "pad_token": None, "eos_token_id": 257, "bos_token_id": 256,
                           "model_max_length": 8192, "vocab_size": 259}
