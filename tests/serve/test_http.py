"""End to end over HTTP: the Serve app on the loopback multi-node Ray cluster."""

import json
import time

import httpx
import pytest
import ray

from tests.serve.http_app import KEYS, MODEL, TOOL, post, serve_test_app, sse_events, tokens

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def base_url(ray_loopback_cluster):
    yield from serve_test_app()


def test_completion_text_and_tokens(base_url):
    r = post(base_url, "/v1/completions", {"model": MODEL, "prompt": "hello there", "max_tokens": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and len(body["choices"][0]["token_ids"]) == 5
    assert body["usage"]["prompt_tokens"] == 11 and body["usage"]["completion_tokens"] == 5
    assert body["choices"][0]["finish_reason"] == "length"
    r = post(base_url, "/v1/completions", {"model": MODEL, "prompt": tokens(1, 40), "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 40
    r = post(base_url, "/v1/completions", {"model": MODEL, "prompt": tokens(1, 40), "max_tokens": 3, "priority": -5})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3   # taken; fcfs ignores it


def test_streaming_completion_equals_non_streaming(base_url):
    prompt = tokens(2, 64)
    plain = post(base_url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 6}).json()
    headers = {"Authorization": f"Bearer {KEYS['a']}"}
    with httpx.stream("POST", base_url + "/v1/completions", headers=headers, timeout=60,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": 6, "stream": True}) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    streamed = [t for e in events for c in e["choices"] for t in c.get("token_ids", [])]
    assert streamed == plain["choices"][0]["token_ids"]
    assert events[-1]["usage"]["completion_tokens"] == 6


def test_chat_streamed_and_not(base_url):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}]
    r = post(base_url, "/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 4})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
    headers = {"Authorization": f"Bearer {KEYS['a']}"}
    with httpx.stream("POST", base_url + "/v1/chat/completions", headers=headers, timeout=60,
                      json={"model": MODEL, "messages": msgs, "max_tokens": 4, "stream": True}) as resp:
        events = sse_events(resp)
    assert events[0]["object"] == "chat.completion.chunk" and events[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["delta"].get("content", "") for e in events for c in e["choices"])
    assert text == body["choices"][0]["message"]["content"]


def test_follow_up_turn_hits_and_matches_a_cold_run(base_url):
    first_prompt = tokens(3, 300)
    first = post(base_url, "/v1/completions", {"model": MODEL, "prompt": first_prompt, "max_tokens": 4}).json()
    follow_prompt = first_prompt + first["choices"][0]["token_ids"] + tokens(4, 20)
    time.sleep(0.5)  # let the KV events reach the directory
    follow = post(base_url, "/v1/completions", {"model": MODEL, "prompt": follow_prompt, "max_tokens": 4}).json()
    assert follow["usage"]["prompt_tokens_details"]["cached_tokens"] >= 300
    cold = post(base_url, "/v1/completions", {"model": MODEL, "prompt": follow_prompt, "max_tokens": 4},
                key="b").json()   # another tenant: nothing cached for it
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert follow["choices"][0]["token_ids"] == cold["choices"][0]["token_ids"]


@pytest.fixture(scope="module")
def one_replica_url(base_url):
    """The same app with a single cache replica (its own namespace, under /one): every
    request reaches the one replica, whoever sends it."""
    from ray import serve

    from actors.pytest_plugin import TEST_MODEL
    from serve_app.app import build_app

    args = {"num_replicas": 1, "namespace": "prefix-cache-serve-test-one",
            "api_keys": f"{KEYS['a']}=tenant-a,{KEYS['b']}=tenant-b",
            "limits": {"max_prompt_tokens": 2048, "max_tokens": 64},
            "worker": {"model": TEST_MODEL, "hot_blocks": 256, "warm_blocks": 256, "block_tokens": 16}}
    serve.run(build_app(args), name="prefix-cache-one", route_prefix="/one")
    yield base_url + "/one"
    serve.delete("prefix-cache-one")


def test_deleting_the_whole_app_hands_off_to_l3_only(base_url):
    """Two replicas, then the app deleted: neither offers its prefixes to the other (both
    are leaving), each says so in its hand-off report, which the directory keeps."""
    from ray import serve

    from actors.pytest_plugin import TEST_MODEL
    from cluster.names import DIRECTORY_NAME
    from serve_app.app import build_app

    namespace = "prefix-cache-serve-test-delete"
    args = {"num_replicas": 2, "namespace": namespace, "api_keys": f"{KEYS['a']}=tenant-a",
            "worker": {"model": TEST_MODEL, "hot_blocks": 128, "block_tokens": 16, "handoff_s": 5.0}}
    serve.run(build_app(args), name="prefix-cache-delete", route_prefix="/delete")
    for i in range(4):   # something cached on the replicas, to be handed on
        r = post(base_url + "/delete", "/v1/completions", {"model": MODEL, "prompt": tokens(40 + i, 48),
                                                          "max_tokens": 2})
        assert r.status_code == 200, r.text
    directory = ray.get_actor(DIRECTORY_NAME, namespace=namespace)
    serve.delete("prefix-cache-delete")
    notes = [n for n in ray.get(directory.get_stats.remote(), timeout=30)["lifecycle"] if n["kind"] == "handoff"]
    assert len(notes) == 2, notes
    assert all(n["to_peers"] is False and n["peer_prefixes"] == 0 and n["drained"] for n in notes), notes
    ray.kill(directory, no_restart=True)


def test_tenants_never_share_cached_prefixes(one_replica_url):
    """Both tenants' requests reach the same replica, which holds tenant a's KV for the very
    prompt tenant b sends: b finds none of it, then finds its own."""
    prompt = tokens(5, 200)

    def complete(key):
        r = post(one_replica_url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2}, key=key)
        assert r.status_code == 200, r.text
        body = r.json()
        return body["prefix_cache"]["worker_id"], body["usage"]["prompt_tokens_details"]["cached_tokens"]

    first_a = complete("a")
    first_b = complete("b")
    again_a = complete("a")
    again_b = complete("b")
    assert len({worker for worker, _ in (first_a, first_b, again_a, again_b)}) == 1   # one replica served all
    assert (first_a[1], first_b[1]) == (0, 0)          # a's KV of the same tokens is not b's
    assert again_a[1] == again_b[1] == 199             # each tenant then finds its own (all but the last token)


def test_auth(base_url):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEYS["a"]}):
        r = httpx.post(base_url + "/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert "tenant" not in r.text
    assert httpx.get(base_url + "/v1/models", timeout=30).status_code == 401
    assert httpx.get(base_url + "/healthz", timeout=30).json() == {"status": "ok"}
    r = httpx.get(base_url + "/v1/cache/stats", headers={"Authorization": f"Bearer {KEYS['a']}"}, timeout=30)
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_required"
    r = httpx.get(base_url + "/v1/cache/stats", headers={"Authorization": f"Bearer {KEYS['admin']}"}, timeout=30)
    assert r.status_code == 200 and len(r.json()["workers"]) == 2
    r = httpx.get(base_url + "/v1/models", headers={"Authorization": f"Bearer {KEYS['b']}"}, timeout=30)
    assert r.json()["data"][0]["id"] == MODEL


BAD = [
    # (body or raw bytes, path, status, message fragment)
    (b"{not json", "/v1/completions", 400, "malformed JSON"),
    (b"[1, 2]", "/v1/completions", 400, "must be a JSON object"),
    ({"prompt": "x"}, "/v1/completions", 400, "'model' is required"),
    ({"model": 7, "prompt": "x"}, "/v1/completions", 400, "'model' must be a string"),
    ({"model": "gpt-4", "prompt": "x"}, "/v1/completions", 404, "does not exist"),
    ({"model": MODEL}, "/v1/completions", 400, "'prompt' is required"),
    ({"model": MODEL, "prompt": ""}, "/v1/completions", 400, "must not be empty"),
    ({"model": MODEL, "prompt": []}, "/v1/completions", 400, "must not be empty"),
    ({"model": MODEL, "prompt": [1, 999]}, "/v1/completions", 400, "token id 999 outside [0, 259)"),
    ({"model": MODEL, "prompt": [-1]}, "/v1/completions", 400, "token id -1 outside"),
    ({"model": MODEL, "prompt": 12}, "/v1/completions", 400, "'prompt' must be a string or a list"),
    ({"model": MODEL, "prompt": [1.5]}, "/v1/completions", 400, "list of integer token ids"),
    ({"model": MODEL, "prompt": "x", "max_tokens": -3}, "/v1/completions", 400, "'max_tokens' must be >= 1"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 10**9}, "/v1/completions", 400, "'max_tokens' must be <= 64"),
    ({"model": MODEL, "prompt": "x", "max_tokens": "5"}, "/v1/completions", 400, "'max_tokens' must be an integer"),
    ({"model": MODEL, "prompt": "x", "temperature": 5}, "/v1/completions", 400, "'temperature' must be in"),
    ({"model": MODEL, "prompt": "x", "temperature": "hot"}, "/v1/completions", 400, "'temperature' must be a number"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, "/v1/completions", 400, "'top_p' must be in"),
    ({"model": MODEL, "prompt": "x", "stream": "yes"}, "/v1/completions", 400, "'stream' must be a boolean"),
    ({"model": MODEL, "prompt": "x", "n": 17}, "/v1/completions", 400, "'n' must be in [1, 16]"),
    ({"model": MODEL, "prompt": "x", "suffix": "y"}, "/v1/completions", 400, "'suffix' is not supported"),
    ({"model": MODEL, "prompt": "x", "frobnicate": 1}, "/v1/completions", 400, "unknown parameter 'frobnicate'"),
    ({"model": MODEL, "prompt": "x", "top_k": 1.5}, "/v1/completions", 400, "'top_k' must be an integer"),
    ({"model": MODEL, "prompt": "x", "min_p": 2}, "/v1/completions", 400, "'min_p' must be in [0, 1]"),
    ({"model": MODEL, "prompt": "x", "presence_penalty": -3}, "/v1/completions", 400, "'presence_penalty'"),
    ({"model": MODEL, "prompt": "x", "frequency_penalty": "a"}, "/v1/completions", 400, "'frequency_penalty'"),
    ({"model": MODEL, "prompt": "x", "repetition_penalty": 0}, "/v1/completions", 400, "'repetition_penalty'"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"x": 1}}, "/v1/completions", 400, "'logit_bias' keys"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"5": 101}}, "/v1/completions", 400, "'logit_bias' values"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"999": 1}}, "/v1/completions", 400, "'logit_bias' token id"),
    ({"model": MODEL, "prompt": "x", "min_tokens": -1}, "/v1/completions", 400, "'min_tokens'"),
    ({"model": MODEL, "prompt": "x", "priority": "high"}, "/v1/completions", 400, "'priority' must be an integer"),
    ({"model": MODEL, "prompt": "x", "priority": 2 ** 40}, "/v1/completions", 400, "'priority' must be <="),
    ({"model": MODEL, "prompt": "x", "logprobs": 6}, "/v1/completions", 400, "'logprobs' must be in [0, 5]"),
    ({"model": MODEL, "prompt": "x", "echo": "yes"}, "/v1/completions", 400, "'echo' must be a boolean"),
    ({"model": MODEL, "prompt": "x", "best_of": 1, "n": 2}, "/v1/completions", 400, "'best_of' (1) must be >="),
    ({"model": MODEL, "prompt": "x", "best_of": 3, "stream": True}, "/v1/completions", 400, "cannot be streamed"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "/v1/chat/completions",
     400, "'top_logprobs' needs 'logprobs': true"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": 3}, "/v1/chat/completions",
     400, "'logprobs' must be a boolean"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "functions": []}, "/v1/chat/completions",
     400, "'functions' is not supported"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "structured_outputs": {"regex": "("}},
     "/v1/chat/completions", 400, "'structured_outputs.regex'"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
     "/v1/chat/completions", 400, "'response_format.type'"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [TOOL],
      "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "/v1/chat/completions", 400,
     "'tool_choice' must name one of"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
     "/v1/chat/completions", 400, "'tool_choice' needs 'tools'"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     "/v1/chat/completions", 400, "'tools[0]'"),
    ({"model": MODEL, "prompt": "x", "stop_token_ids": "x"}, "/v1/completions", 400, "'stop_token_ids'"),
    ({"model": MODEL, "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "/v1/completions", 400,
     "'stop' takes at most 4 strings"),
    ({"model": MODEL, "prompt": "x", "stop": [""]}, "/v1/completions", 400, "each 'stop' string must have"),
    ({"model": MODEL, "prompt": "x", "stop": 5}, "/v1/completions", 400, "'stop' must be a string or a list"),
    ({"model": MODEL, "prompt": "x", "seed": 1 << 64}, "/v1/completions", 400, "'seed' must be <="),
    (b'{"model": "prefix-cache-byte", "prompt": "x", "temperature": NaN}', "/v1/completions", 400,
     "NaN is not a JSON value"),
    (b'{"model": "prefix-cache-byte", "prompt": "\\ud800x"}', "/v1/completions", 400, "lone surrogate"),
    (b'{"model": "prefix-cache-byte", "messages": [{"role": "user", "content": "\\udfff"}]}',
     "/v1/chat/completions", 400, "lone surrogate"),
    (b'{"model": "prefix-cache-byte", "prompt": ' + b"[" * 30000 + b"]" * 30000 + b"}", "/v1/completions", 400,
     "nested too deeply"),
    ({"model": MODEL, "prompt": [1] * 3000}, "/v1/completions", 413, "prompt has 3000 tokens; the limit is 2048"),
    ({"model": MODEL, "prompt": "y" * 70000}, "/v1/completions", 413, "exceeds the limit of 65536"),
    ({"model": MODEL, "prompt": "x", "session_id": "s" * 500}, "/v1/completions", 400, "'session_id'"),
    ({"model": MODEL, "prompt": "x", "stream": True, "stream_options": {"include_usage": "no"}}, "/v1/completions",
     400, "'stream_options.include_usage' must be a boolean"),
    ({"model": MODEL}, "/v1/chat/completions", 400, "'messages' is required"),
    ({"model": MODEL, "messages": []}, "/v1/chat/completions", 400, "non-empty list"),
    ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, "/v1/chat/completions", 400,
     "'messages[0].role' must be one of"),
    ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "/v1/chat/completions", 400,
     "'messages[0].content' must be a string"),
    ({"model": MODEL, "messages": ["hi"]}, "/v1/chat/completions", 400, "'messages[0]' must be an object"),
    ({"model": MODEL, "prompt": ["a", [1]]}, "/v1/completions", 400, "(not a mix)"),
    ({"model": MODEL, "prompt": ["a", "b"], "stream": True}, "/v1/completions", 400, "cannot be streamed"),
    ({"model": MODEL, "prompt": ["a"] * 65}, "/v1/completions", 400, "at most 64 per request"),
    ({"model": MODEL, "prompt": ["a"] * 5, "n": 16}, "/v1/completions", 400, "are 80 sequences"),
    ({"model": MODEL, "prompt": [[1], [999]]}, "/v1/completions", 400, "token id 999 outside"),
    ({"prompt": "x", "messages": []}, "/tokenize", 400, "exactly one of 'prompt'"),
    ({}, "/tokenize", 400, "exactly one of 'prompt'"),
    ({"prompt": 5}, "/tokenize", 400, "'prompt' must be a string"),
    ({"model": "gpt-4", "prompt": "x"}, "/tokenize", 404, "does not exist"),
    ({"prompt": "x", "add_special_tokens": 1}, "/tokenize", 400, "'add_special_tokens' must be a boolean"),
    ({"prompt": "x", "foo": 1}, "/tokenize", 400, "unknown parameter 'foo' for /tokenize"),
    ({"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, "/tokenize", 400,
     "'continue_final_message' is not supported"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "/tokenize", 400, "'messages[0].role'"),
    ({}, "/detokenize", 400, "'tokens' is required"),
    ({"tokens": [1, 999]}, "/detokenize", 400, "token id 999 outside [0, 259)"),
    ({"tokens": "abc"}, "/detokenize", 400, "list of integer token ids"),
    ({"tokens": [1], "prompt": "x"}, "/detokenize", 400, "unknown parameter 'prompt' for /detokenize"),
]


@pytest.mark.parametrize("body, path, status, fragment", BAD, ids=[f"{i}-{b[3][:24]}" for i, b in enumerate(BAD)])
def test_malformed_requests_get_the_right_4xx(base_url, body, path, status, fragment):
    headers = {"Authorization": f"Bearer {KEYS['a']}", "content-type": "application/json"}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(base_url + path, content=data, headers=headers, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert fragment in err["message"] and set(err) == {"message", "type", "param", "code"}


def test_client_disconnect_stops_generation_and_releases_locks(base_url):
    admin = {"Authorization": f"Bearer {KEYS['admin']}"}
    before = httpx.get(base_url + "/v1/cache/stats", headers=admin, timeout=30).json()
    cancelled_before = sum(w["engine"]["requests_cancelled"] for w in before["workers"].values())
    headers = {"Authorization": f"Bearer {KEYS['a']}"}
    with httpx.stream("POST", base_url + "/v1/completions", headers=headers, timeout=60,
                      json={"model": MODEL, "prompt": tokens(6, 1500), "max_tokens": 64, "stream": True}) as resp:
        lines = resp.iter_lines()
        next(lines)
    deadline = time.monotonic() + 15
    while True:
        stats = httpx.get(base_url + "/v1/cache/stats", headers=admin, timeout=30).json()["workers"]
        cancelled = sum(w["engine"]["requests_cancelled"] for w in stats.values())
        running = sum(w["load"]["running"] for w in stats.values())
        protected = sum(w["protected_tokens"] for w in stats.values())
        if cancelled > cancelled_before and running == 0 and protected == 0:
            break
        assert time.monotonic() < deadline, f"generation not stopped: {stats}"
        time.sleep(0.2)


def test_prefetch_endpoint(base_url):
    prompt = tokens(7, 100)
    r = post(base_url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2, "session_id": "chat-1"})
    assert r.status_code == 200
    r = post(base_url, "/v1/sessions/chat-1/prefetch", {})
    assert r.status_code == 200 and r.json()["prefetching_tokens"] == 0   # still HOT: nothing to bring up
    r = post(base_url, "/v1/sessions/nope/prefetch", {})
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    r = post(base_url, "/v1/sessions/chat-1/prefetch", {}, key="b")   # another tenant's session
    assert r.status_code == 404


def test_metrics_are_exported(base_url):
    post(base_url, "/v1/completions", {"model": MODEL, "prompt": "metrics", "max_tokens": 1})
    ports = {n["MetricsExportPort"] for n in ray.nodes() if n["Alive"]}
    deadline = time.monotonic() + 40
    wanted = ("prefix_cache_requests_total", "prefix_cache_ttft_seconds", "prefix_cache_tier_used_tokens")
    while True:
        text = ""
        for port in ports:
            try:
                text += httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            except httpx.HTTPError:
                pass
        if all(name in text for name in wanted):
            break
        assert time.monotonic() < deadline, f"metrics not exported: {[w for w in wanted if w not in text]}"
        time.sleep(1)


def test_routing_goes_on_while_the_directory_is_gone_and_recovers(base_url):
    directory = ray.get_actor("prefix-cache-directory", namespace="prefix-cache-serve-test")
    prompt = tokens(8, 120)
    deadline = time.monotonic() + 30
    while True:   # until the router's copy knows where the prompt is (its KV events arrive after the reply)
        r = post(base_url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1})
        if (r.json()["prefix_cache"]["routed_by"], r.json()["prefix_cache"]["reason"]) == ("router_view", "local"):
            break
        assert time.monotonic() < deadline, r.json()["prefix_cache"]
        time.sleep(0.1)
    old_epoch = ray.get(directory.subscribe.remote(None, 0, 0), timeout=30).epoch
    ray.kill(directory, no_restart=True)   # gone for good: the router cannot ask it
    # Served at once: on the router's copy of the table while it is fresh, else on the least
    # loaded replica (the router's fallback when neither the copy nor the directory may decide).
    r = post(base_url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert (r.json()["prefix_cache"]["routed_by"], r.json()["prefix_cache"]["reason"]) in (
        ("router_view", "local"), ("fallback", "fallback_least_loaded"))
    # A replica recreates the directory and every replica re-feeds it: prefix routing resumes,
    # decided again on the router's copy, now of the new directory's table.
    deadline = time.monotonic() + 60
    while True:
        time.sleep(0.5)
        r = post(base_url, "/v1/completions", {"model": MODEL, "prompt": prompt + [1], "max_tokens": 1})
        assert r.status_code == 200, r.text
        info = r.json()["prefix_cache"]
        if (info["reason"], info["routed_by"]) == ("local", "router_view") \
                and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 112:
            break
        assert time.monotonic() < deadline, f"routing did not recover: {info}"
    new = ray.get_actor("prefix-cache-directory", namespace="prefix-cache-serve-test")
    assert ray.get(new.subscribe.remote(None, 0, 0), timeout=30).epoch != old_epoch
    # Every replica registered again with its peer address (admin calls, session prefetch
    # and pulls reach a replica through it), not only as a name its reports carry.
    while len(ray.get(new.peer_addresses.remote(), timeout=30)) < 2:
        assert time.monotonic() < deadline, (ray.get(new.peer_addresses.remote(), timeout=30),
                                             ray.get(new.live_workers.remote(), timeout=30),
                                             ray.get(new.get_stats.remote(), timeout=30))
        time.sleep(0.2)
    assert sorted(ray.get(new.peer_addresses.remote(), timeout=30)) == sorted(ray.get(new.live_workers.remote()))


def test_policy_args_reach_the_directory_and_its_routers(base_url):
    post(base_url, "/v1/completions", {"model": MODEL, "prompt": tokens(10, 40), "max_tokens": 1})
    directory = ray.get_actor("prefix-cache-directory", namespace="prefix-cache-serve-test")
    state = ray.get(directory.subscribe.remote(None, 0, 0), timeout=30).state   # what every router copies
    assert (state.policy, state.policy_kwargs) == ("cost", {"tie_s": 0.05})


@pytest.mark.parametrize("temperature", [1e-40, 1e-320, 5e-324])
def test_tiny_temperature_is_greedy_and_the_replica_lives(base_url, temperature):
    prompt = tokens(9, 30)
    greedy = post(base_url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 4}).json()
    r = post(base_url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 4,
                                            "temperature": temperature, "seed": 3})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == greedy["choices"][0]["token_ids"]


def test_json_bodies_only(base_url):
    admin = {"Authorization": f"Bearer {KEYS['admin']}", "content-type": "text/plain"}
    # A cross-site form or text/plain POST never reaches an endpoint, admin ones included.
    r = httpx.post(base_url + "/v1/cache/flush", content=b"{}", headers=admin, timeout=30)
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    r = httpx.post(base_url + "/v1/completions", content=json.dumps({"model": MODEL, "prompt": "x"}).encode(),
                   headers={**admin, "Authorization": f"Bearer {KEYS['a']}"}, timeout=30)
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]


def test_unknown_path_and_method_are_openai_shaped(base_url):
    r = httpx.get(base_url + "/v1/nope", timeout=30)
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert r.json()["error"]["code"] == "not_found"
    r = httpx.get(base_url + "/v1/completions", timeout=30)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


# ------------------------------------------------------------ n, best_of, logprobs, echo, controls
def stats_of(base_url):
    admin = {"Authorization": f"Bearer {KEYS['admin']}"}
    return httpx.get(base_url + "/v1/cache/stats", headers=admin, timeout=30).json()["workers"]


def computed_tokens(base_url):
    return sum(w["engine"]["computed_tokens"] for w in stats_of(base_url).values())


def test_n_choices_are_forks_of_one_prefill(base_url):
    prompt = tokens(40, 400)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 1.0, "seed": 11}
    before = computed_tokens(base_url)
    r = post(base_url, "/v1/completions", {**body, "n": 4})
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert out["usage"]["prompt_tokens"] == 400 and out["usage"]["completion_tokens"] == 16
    # The prompt was computed once (and each fork its last prompt token and its own tokens).
    assert computed_tokens(base_url) - before <= 400 + 4 * 5
    assert len({tuple(c["token_ids"]) for c in out["choices"]}) > 1        # each with its own seed
    single = post(base_url, "/v1/completions", {**body, "n": 1}).json()
    assert single["choices"][0]["token_ids"] == out["choices"][0]["token_ids"]   # choice 0: the request's seed


def test_best_of_returns_the_most_likely_candidates(base_url):
    prompt = tokens(41, 60)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 5, "temperature": 1.0, "seed": 5}
    every = post(base_url, "/v1/completions", {**body, "n": 4, "logprobs": 0}).json()["choices"]
    ranked = sorted(every, key=lambda c: -sum(c["logprobs"]["token_logprobs"]))
    best = post(base_url, "/v1/completions", {**body, "n": 2, "best_of": 4}).json()
    assert [c["token_ids"] for c in best["choices"]] == [ranked[0]["token_ids"], ranked[1]["token_ids"]]
    assert best["choices"][0]["logprobs"] is None and best["usage"]["completion_tokens"] == 20


def test_completion_logprobs_and_echo(base_url):
    prompt = tokens(42, 50)
    r = post(base_url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 3, "logprobs": 2})
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 3
    for chosen, top in zip(lp["token_logprobs"], lp["top_logprobs"]):
        assert chosen <= 0 and len(top) == 2
        assert max(top.values()) == pytest.approx(chosen)    # greedy: the sampled token is the top one
    echoed = post(base_url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1, "logprobs": 1,
                                                "echo": True}).json()["choices"][0]
    elp = echoed["logprobs"]
    assert len(elp["token_logprobs"]) == 51 and elp["token_logprobs"][0] is None and elp["top_logprobs"][0] is None
    assert all(v <= 0 for v in elp["token_logprobs"][1:])
    assert elp["text_offset"][0] == 0 and elp["text_offset"] == sorted(elp["text_offset"])
    again = post(base_url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1, "logprobs": 1,
                                               "echo": True}).json()
    assert again["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(elp["token_logprobs"][:1] and
                                                                               elp["token_logprobs"], abs=1e-5)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32   # the prompt's logprobs came cached too


def test_chat_logprobs_shape(base_url):
    r = post(base_url, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                "max_tokens": 3, "logprobs": True, "top_logprobs": 2})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"} and len(entry["top_logprobs"]) == 2
        assert isinstance(entry["bytes"], list)


def test_streamed_n_choices_each_end_and_usage_comes_last(base_url):
    body = {"model": MODEL, "prompt": tokens(43, 80), "max_tokens": 3, "n": 2, "stream": True, "temperature": 0.8,
            "seed": 3}
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEYS['a']}"}) as resp:
        events = sse_events(resp)
    ids = {0: [], 1: []}
    finished = set()
    for ev in events[:-1]:
        (choice,) = ev["choices"]
        ids[choice["index"]] += choice["token_ids"]
        if choice["finish_reason"]:
            finished.add(choice["index"])
    assert finished == {0, 1} and events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 6
    whole = post(base_url, "/v1/completions", {**body, "stream": False}).json()
    assert [c["token_ids"] for c in whole["choices"]] == [ids[0], ids[1]]


def test_logit_bias_and_min_tokens_change_the_answer_as_asked(base_url):
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 8}
    forced = post(base_url, "/v1/completions", {**body, "logit_bias": {"120": 100}}).json()["choices"][0]
    assert forced["token_ids"] == [120] * 8
    # EOS (257) made certain: without min_tokens it stops at once, with it after 3 tokens.
    eos = {"257": 100}
    quick = post(base_url, "/v1/completions", {**body, "logit_bias": eos}).json()["choices"][0]
    assert quick["token_ids"] == [257] and quick["finish_reason"] == "stop"
    held = post(base_url, "/v1/completions", {**body, "logit_bias": eos, "min_tokens": 3}).json()["choices"][0]
    assert len(held["token_ids"]) == 4 and held["token_ids"][-1] == 257 and 257 not in held["token_ids"][:3]
