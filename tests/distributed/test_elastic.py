"""The cache outlives its replicas (issue 23), on a real loopback Ray cluster and a
real ``mooncake_master``: a crash recovered from L3, a scale-in that hands the
cache on, a scale-out that starts warm. Exact cached-token counts throughout."""

import asyncio
import os
import signal
import time

import pytest
import ray

from cluster.protocol import SamplingParams

pytestmark = pytest.mark.distributed

BT = 16


@pytest.fixture(autouse=True)
def needs_l3(l3_master):
    from tests.requirements import MOONCAKE, require

    require(MOONCAKE, l3_master is not None, "mooncake is not installed: pip install -e '.[l3]' (and libibverbs1)")


def prompt_of(seed, n):
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def complete(cc, prompt, max_tokens=4, worker_id=None):
    return asyncio.run(cc.client().complete(prompt, SamplingParams(max_tokens=max_tokens), worker_id=worker_id))


def l3_stats(cc, worker_id):
    return cc.on_peer(worker_id, lambda peer: peer.stats())["l3"]


def wait_until(predicate, what, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_a_killed_replicas_sessions_continue_from_l3(cache_cluster):
    cc = cache_cluster
    victim = cc.worker_ids[1]
    prompt = prompt_of(31, 100)
    first = complete(cc, prompt, worker_id=victim)
    assert first.worker_id == victim
    # 100 prompt + 3 computed output tokens committed (the last one is never computed): 6 full
    # blocks and a partial last block of 7 tokens (its own tail key: docs/l3.md).
    wait_until(lambda: l3_stats(cc, victim)["blocks_written"] >= 6 and l3_stats(cc, victim)["tails_written"] >= 1,
               "the turn's blocks in L3")
    pid = ray.get(cc.workers[victim].pid.remote())
    os.kill(pid, signal.SIGKILL)   # kill -9: no hand-off, nothing flushed
    wait_until(lambda: victim not in ray.get(cc.directory.live_workers.remote()), "the directory dropping it")
    try:
        follow = prompt + first.tokens + prompt_of(32, 10)
        second = complete(cc, follow)
        assert second.worker_id != victim
        assert second.cached_tokens == 103 and second.tier_hits == (0, 0, 0, 103)   # every token from L3
    finally:
        cc.restart_worker(victim)


def test_scale_in_hands_the_cache_to_l3_and_a_peer(cache_cluster):
    cc = cache_cluster
    leaving = cc.worker_ids[2]
    cc.flush_all()   # only this test's sequence to hand on, nothing of it anywhere yet
    prompt = prompt_of(41, 90)
    first = complete(cc, prompt, worker_id=leaving)
    assert first.worker_id == leaving
    cc_stats = cc.on_peer(leaving, lambda peer: peer.stats())
    report = ray.get(cc.workers[leaving].leave.remote(10.0))
    assert report["drained"] and report["left"] and report["l3_flushed"], report
    assert report["peer_prefixes"] == 1 and report["peer_tokens"] == 93   # 90 + 3 computed tokens
    # Nothing was cut by the 10 s deadline: the one sequence it held was queued for L3 whole
    # (l3_prefixes, before the L3 part's deadline) and those writes finished (l3_flushed).
    assert report["of_prefixes"] == 1 and report["l3_prefixes"] == 1 and report["budget_s"] == 10.0
    assert leaving not in ray.get(cc.directory.live_workers.remote())
    try:
        # The peer that pulled it has all 93 tokens in HOT; the other one reads them from L3:
        # the five whole blocks and the 13-token last block the hand-off and write-behind put there.
        got = {}
        for i, w in enumerate(w for w in cc.worker_ids if w != leaving):
            follow = prompt + first.tokens + prompt_of(42 + i, 8)   # the continuations differ from token 94
            turn = complete(cc, follow, worker_id=w)
            assert turn.worker_id == w
            got[w] = (turn.cached_tokens, turn.tier_hits)
        assert sorted(got.values()) == [(93, (0, 0, 0, 93)), (93, (93, 0, 0, 0))], got
        assert cc_stats["l3"]["state"] == "on"
    finally:
        cc.restart_worker(leaving)


def test_when_every_worker_leaves_the_hand_off_goes_to_l3_only(cache_cluster):
    cc = cache_cluster
    leaving = cc.worker_ids[2]
    cc.flush_all()
    prompt = prompt_of(45, 90)
    first = complete(cc, prompt, worker_id=leaving)
    report = ray.get(cc.workers[leaving].leave.remote(10.0, False))
    assert report["to_peers"] is False and report["peer_prefixes"] == 0 and report["l3_prefixes"] == 1
    assert report["drained"] and report["left"] and report["l3_flushed"], report
    try:   # no peer pulled it: every other worker reads the five whole blocks and the last one from L3
        for i, w in enumerate(w for w in cc.worker_ids if w != leaving):
            turn = complete(cc, prompt + first.tokens + prompt_of(46 + i, 8), worker_id=w)
            assert (turn.worker_id, turn.cached_tokens, turn.tier_hits) == (w, 93, (0, 0, 0, 93))
    finally:
        cc.restart_worker(leaving)


def test_a_new_replica_starts_warm_on_the_shared_prefixes(cache_cluster):
    cc = cache_cluster
    cc.flush_all()
    holder = cc.worker_ids[0]
    system = prompt_of(51, 64)   # a shared system prompt: 4 blocks
    for i in range(3):
        complete(cc, system + prompt_of(52 + i, 20), worker_id=holder)
    newcomer = cc.worker_ids[1]
    cc.restart_worker(newcomer)   # a fresh process: an empty cache, warmed up before it was ready
    report = ray.get(cc.workers[newcomer].lifecycle.remote())["warmup"]
    assert report["prefixes"] >= 1 and report["tokens"] >= 64
    turn = complete(cc, system + prompt_of(60, 20), worker_id=newcomer)
    assert turn.worker_id == newcomer and turn.cached_tokens == 64 and turn.tier_hits[0] == 64


def test_the_whole_app_restarted_against_a_running_master_finds_its_prefixes_in_l3(cache_cluster):
    """Every worker and the directory go (a redeploy, a new RayCluster); the master and its
    pool stay. The new processes start with empty trees and an empty index, and the next
    turn still reads its prefix from L3 (what survives: L3's blocks; what does not: every
    HOT/WARM/COLD copy, the directory's index, session memory)."""
    cc = cache_cluster
    prompt = prompt_of(71, 120)
    first = complete(cc, prompt)
    wait_until(lambda: l3_stats(cc, first.worker_id)["blocks_written"] >= 7
               and l3_stats(cc, first.worker_id)["tails_written"] >= 1, "the turn's blocks in L3")
    for h in cc.workers.values():
        ray.kill(h, no_restart=True)
    ray.kill(cc.directory, no_restart=True)
    time.sleep(1.0)
    cc.start_directory()
    for i in range(len(cc.workers)):
        cc.workers[f"w{i}"] = cc.start_worker(i)
    cc.wait_registered()
    # A new directory learns what L3 holds from the workers' inventories (a listing of
    # the store at their start), before it prices the l3 option.
    wait_until(lambda: ray.get(cc.directory.get_stats.remote())["l3_inventory_s"] is not None, "an L3 inventory")
    assert ray.get(cc.directory.get_stats.remote())["l3_blocks_known"] >= 7
    follow = prompt + first.tokens + prompt_of(72, 6)
    second = complete(cc, follow)
    assert second.cached_tokens == 123 and second.tier_hits == (0, 0, 0, 123)   # 7 blocks and 11 of 120 + 3
