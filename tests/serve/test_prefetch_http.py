"""Predictive swap-in end to end over HTTP: the Serve app on the loopback Ray cluster.

A session's prefix is pushed down to WARM (or COLD) by other sessions' requests
through a small HOT pool; its next request sends its headers, with
``X-Session-Id``, and holds its body back, as a client whose body is still on
the wire. While the body is held back the worker must have counted a prefetch
of the session and brought it up to HOT; the request then reports its cached
tokens as HOT hits. Without the header (the session named in the body only) or
with another tenant's header, nothing is prefetched and the same request finds
its prefix in the tier it was pushed down to.
"""

import http.client
import json
import random
import time
from urllib.parse import urlparse

import httpx
import pytest

pytestmark = pytest.mark.distributed

KEYS = {"a": "key-prefetch-a", "b": "key-prefetch-b", "admin": "key-prefetch-admin"}
MODEL = "prefix-cache-byte"
PROMPT_TOKENS = 160
# Pools: 512 HOT tokens (demotes past 460), 1,024 WARM (past 921), 4,096 COLD.
# Each request caches 161 tokens; fillers start with a token no session prompt
# starts with, so they share no node with it. After a session's first turn, 3
# fillers push it (the least recently used) from HOT to WARM, where it stays; 10
# push it on to COLD.
WORKER = {"hot_blocks": 32, "warm_blocks": 64, "cold_blocks": 256, "block_tokens": 16}
FILLERS = {"warm": 3, "cold": 10}


@pytest.fixture(scope="module")
def base_url(ray_loopback_cluster, tmp_path_factory):
    from ray import serve

    from actors.pytest_plugin import TEST_MODEL
    from serve_app.app import build_app
    from serve_app.local import free_port

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    disk = tmp_path_factory.mktemp("cold-tier")
    args = {"num_replicas": 1, "namespace": "prefix-cache-prefetch-http-test",
            "api_keys": f"{KEYS['a']}=tenant-a,{KEYS['b']}=tenant-b", "admin_keys": KEYS["admin"],
            "limits": {"max_prompt_tokens": 1024, "max_tokens": 16, "max_body_bytes": 65536},
            "worker": {"model": TEST_MODEL, **WORKER, "disk_dir": str(disk), "torch_threads": 1}}
    serve.run(build_app(args), name="prefix-cache", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


def post(url, path, body, key="a", headers=None):
    h = {"Authorization": f"Bearer {KEYS[key]}", **(headers or {})}
    r = httpx.post(url + path, json=body, headers=h, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def worker_stats(url) -> dict:
    workers = httpx.get(url + "/v1/cache/stats", headers={"Authorization": f"Bearer {KEYS['admin']}"},
                        timeout=30).json()["workers"]
    assert len(workers) == 1, workers
    return next(iter(workers.values()))


def settled_stats(url) -> dict:
    """The worker's stats once its background moves have landed (two reads alike)."""
    def state(s):
        return s["tiers"], s["cache"]["demoted_to_warm"], s["cache"]["demoted_to_cold"], s["load"]
    last = worker_stats(url)
    for _ in range(100):
        time.sleep(0.05)
        now = worker_stats(url)
        if state(now) == state(last):
            return now
        last = now
    raise AssertionError(f"the worker's tiers did not settle: {last['tiers']}")


def wait_for(url, what, condition, timeout_s=30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = worker_stats(url)
        if condition(stats):
            return stats
        assert time.monotonic() < deadline, f"{what}: {stats['cache']}"
        time.sleep(0.05)


class HeldBackRequest:
    """An HTTP/1.1 POST whose headers go out now and whose body only on ``finish``."""

    def __init__(self, url, path, body, key="a", headers=None):
        u = urlparse(url)
        self.raw = json.dumps(body).encode()
        self.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        self.conn.putrequest("POST", path)
        for name, value in {"Authorization": f"Bearer {KEYS[key]}", "Content-Type": "application/json",
                            "Content-Length": str(len(self.raw)), **(headers or {})}.items():
            self.conn.putheader(name, value)
        self.conn.endheaders()   # sent: the body is still on the client's side

    def finish(self) -> dict:
        self.conn.send(self.raw)
        resp = self.conn.getresponse()
        data = resp.read()
        self.conn.close()
        assert resp.status == 200, data
        return json.loads(data)


def session_prompt(seed):
    rng = random.Random(seed)
    return [rng.randrange(200) for _ in range(PROMPT_TOKENS)]


def filler(seed, i):
    rng = random.Random(seed * 1000 + i)
    return [200 + i % 56] + [rng.randrange(256) for _ in range(PROMPT_TOKENS - 1)]


def demoted_session(url, tier, seed, session_id, header_on_first_turn):
    """A session's first turn, then the fillers that push it down to ``tier``: the next turn's prompt."""
    httpx.post(url + "/v1/cache/flush", headers={"Authorization": f"Bearer {KEYS['admin']}"}, json={},
               timeout=30).raise_for_status()
    prompt = session_prompt(seed)
    if header_on_first_turn:
        first = post(url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2},
                     headers={"X-Session-Id": session_id})
    else:
        first = post(url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2,
                                              "session_id": session_id})
    for i in range(FILLERS[tier]):
        post(url, "/v1/completions", {"model": MODEL, "prompt": filler(seed, i), "max_tokens": 2})
    return prompt + first["choices"][0]["token_ids"] + [7, 8, 9, 10]


@pytest.mark.parametrize("tier", ["warm", "cold"])
def test_the_header_brings_a_demoted_session_back_to_hot_before_its_prefill(base_url, tier):
    seed = {"warm": 11, "cold": 12}[tier]
    session = f"chat-{tier}"
    next_prompt = demoted_session(base_url, tier, seed, session, header_on_first_turn=True)
    before = settled_stats(base_url)
    request = HeldBackRequest(base_url, "/v1/completions", {"model": MODEL, "prompt": next_prompt, "max_tokens": 2},
                              headers={"X-Session-Id": session})
    # The body is still held back: the request cannot have been admitted, yet the
    # worker has counted a prefetch of this session and brought it up to HOT.
    during = wait_for(base_url, "no prefetch while the body was held back",
                      lambda s: s["cache"]["prefetches"] > before["cache"]["prefetches"])
    during = wait_for(base_url, "the prefetch's promotion did not land",
                      lambda s: s["cache"]["promoted_tokens"] - before["cache"]["promoted_tokens"] >= PROMPT_TOKENS)
    assert during["engine"]["prompt_tokens"] == before["engine"]["prompt_tokens"]   # not admitted yet
    assert during["cache"]["prefetches"] == before["cache"]["prefetches"] + 1
    answer = request.finish()
    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= PROMPT_TOKENS
    assert answer["prefix_cache"]["cached_tokens_by_tier"] == {"hot": cached, "warm": 0, "cold": 0, "l3": 0}
    after = worker_stats(base_url)
    assert after["cache"]["prefetches"] == before["cache"]["prefetches"] + 1   # one prefetch for the request
    assert after["engine"]["prompt_tokens"] == before["engine"]["prompt_tokens"] + len(next_prompt)


@pytest.mark.parametrize("tier", ["warm", "cold"])
def test_without_the_header_or_with_another_tenants_nothing_is_prefetched(base_url, tier):
    seed = {"warm": 21, "cold": 22}[tier]
    session = f"body-only-{tier}"
    next_prompt = demoted_session(base_url, tier, seed, session, header_on_first_turn=False)
    before = settled_stats(base_url)
    # Another tenant naming this session in its header: its key is its own, nothing is found.
    post(base_url, "/v1/completions", {"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 1}, key="b",
         headers={"X-Session-Id": session})
    wait_for(base_url, "the other tenant's prefetch was never asked",
             lambda s: s["cache"]["prefetch_unknown_session"] > before["cache"]["prefetch_unknown_session"])
    request = HeldBackRequest(base_url, "/v1/completions", {"model": MODEL, "prompt": next_prompt, "max_tokens": 2,
                                                            "session_id": session})
    for _ in range(5):   # while the body is held back, nothing is brought up
        held = worker_stats(base_url)
        assert held["cache"]["prefetches"] == before["cache"]["prefetches"]
        assert held["cache"]["promoted_tokens"] == before["cache"]["promoted_tokens"]
        time.sleep(0.05)
    answer = request.finish()
    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= PROMPT_TOKENS
    assert answer["prefix_cache"]["cached_tokens_by_tier"] == {"hot": 0, "warm": 0, "cold": 0, "l3": 0, tier: cached}
    assert worker_stats(base_url)["cache"]["prefetches"] == before["cache"]["prefetches"]
