"""The Serve app the HTTP end-to-end tests run against (``test_http``, ``test_http_tools``),
and their request helpers: each test module deploys it once (module-scoped ``base_url``)."""

import json

import httpx

KEYS = {"a": "key-tenant-a", "b": "key-tenant-b", "admin": "key-admin"}
MODEL = "prefix-cache-byte"
# Short names: the byte tokenizer spends a token a character, and the app's max_tokens is 64.
TOOL = {"type": "function", "function": {"name": "w", "description": "the weather in a city",
                                         "parameters": {"type": "object", "properties": {
                                             "c": {"enum": ["P", "R", "O"]}},
                                         "required": ["c"], "additionalProperties": False}}}


def serve_test_app():
    """Deploy the app on the running loopback cluster; yields its URL, shuts Serve down after."""
    from ray import serve

    from actors.pytest_plugin import TEST_MODEL
    from serve_app.app import build_app
    from serve_app.local import free_port

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {"num_replicas": 2, "namespace": "prefix-cache-serve-test",
            "api_keys": f"{KEYS['a']}=tenant-a,{KEYS['b']}=tenant-b", "admin_keys": KEYS["admin"],
            "limits": {"max_prompt_tokens": 2048, "max_tokens": 64, "max_body_bytes": 65536},
            "worker": {"model": TEST_MODEL, "hot_blocks": 256, "warm_blocks": 256, "block_tokens": 16},
            "policy_args": {"tie_s": 0.05}}    # the default value: routing as without it
    serve.run(build_app(args), name="prefix-cache", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


def post(url, path, body, key="a", **kw):
    headers = {"Authorization": f"Bearer {KEYS[key]}"} if key else {}
    return httpx.post(url + path, json=body, headers=headers, timeout=60, **kw)


def tokens(seed, n):
    import random
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def sse_events(resp):
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out
