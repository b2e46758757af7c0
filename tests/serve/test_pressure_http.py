"""Returning sessions under concurrent memory pressure, end to end over HTTP.

Six sessions, each with a document of its own behind a short shared system
prompt, run their turns concurrently against one replica whose HOT pool holds
about two of them and whose WARM pool holds all. Each later turn sends the
previous turn's prompt, its real reply and a new question: it must find
exactly what the previous turn left in the cache (its prompt and reply, less
the last reply token, whose KV is never computed), wherever the tiers put it
meanwhile; the replica's defect counters stay 0.
"""

import random
import threading

import httpx
import pytest

pytestmark = pytest.mark.distributed

KEYS = {"a": "key-pressure-a", "admin": "key-pressure-admin"}
MODEL = "prefix-cache-byte"
SESSIONS, TURNS, DOC_TOKENS = 6, 3, 300
SYSTEM = [5, 6, 7, 8] * 4
# 512 HOT tokens (about one and a half sessions' contexts), 4,096 WARM (all of them).
WORKER = {"hot_blocks": 32, "warm_blocks": 256, "block_tokens": 16, "torch_threads": 1, "max_batch_tokens": 32}


@pytest.fixture(scope="module")
def base_url(ray_loopback_cluster):
    from ray import serve

    from actors.pytest_plugin import TEST_MODEL
    from serve_app.app import build_app
    from serve_app.local import free_port

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {"num_replicas": 1, "namespace": "prefix-cache-pressure-http-test",
            "api_keys": f"{KEYS['a']}=tenant-a", "admin_keys": KEYS["admin"],
            "limits": {"max_prompt_tokens": 1024, "max_tokens": 16, "max_body_bytes": 65536},
            "worker": {"model": TEST_MODEL, **WORKER}}
    serve.run(build_app(args), name="prefix-cache", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


def post(url, body, session):
    r = httpx.post(url + "/v1/completions", json=body, timeout=120,
                   headers={"Authorization": f"Bearer {KEYS['a']}", "X-Session-Id": session})
    assert r.status_code == 200, r.text
    return r.json()


def run_session(url, i, results):
    rng = random.Random(i)
    # Each document starts with a token of its own: sessions share the system prompt only.
    prompt = SYSTEM + [100 + i] + [rng.randrange(256) for _ in range(DOC_TOKENS - 1)]
    turns = []
    for turn in range(TURNS):
        out = post(url, {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0}, f"s{i}")
        turns.append((prompt, out))
        prompt = prompt + out["choices"][0]["token_ids"] + [rng.randrange(256) for _ in range(8)]
    results[i] = turns


def test_every_later_turn_finds_all_its_previous_turn_left(base_url):
    results: dict[int, list] = {}
    threads = [threading.Thread(target=run_session, args=(base_url, i, results)) for i in range(SESSIONS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert sorted(results) == list(range(SESSIONS)), "a session did not finish"
    for i, turns in sorted(results.items()):
        for n in range(1, TURNS):
            prev_prompt, prev = turns[n - 1]
            _, out = turns[n]
            left = len(prev_prompt) + len(prev["choices"][0]["token_ids"]) - 1
            cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
            found = out["prefix_cache"]["found_tokens_by_tier"]
            assert cached == left, (f"session {i} turn {n + 1}: cached {cached}, its previous turn left {left} "
                                    f"(found {found}, used {out['prefix_cache']['cached_tokens_by_tier']})")
            assert sum(found.values()) == left, found
    stats = httpx.get(base_url + "/v1/cache/stats", headers={"Authorization": f"Bearer {KEYS['admin']}"},
                      timeout=30).json()["workers"]
    (worker,) = stats.values()
    assert worker["engine"]["recomputed_held_tokens"] == 0
    assert worker["cache"]["dropped_tokens"] == 0
    assert worker["cache"]["dropped_with_room_tokens"] == 0
    assert worker["cache"]["commit_tail_discarded_tokens"] == 0
    # The pressure was real: contexts went down to WARM and came back.
    assert worker["cache"]["promoted_tokens"] > 0
