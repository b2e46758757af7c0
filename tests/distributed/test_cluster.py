"""The cluster on a real multi-node Ray cluster on loopback (fixtures: actors.pytest_plugin)."""

import asyncio
import os
import time

import pytest
import ray
import torch

from actors.pytest_plugin import TEST_MODEL
from cluster.engine.model import DecoderModel, ModelConfig
from cluster.hashing import block_hashes
from cluster.protocol import GenerateRequest, RouteDecision, SamplingParams
from tests.unit.reference_forward import forward_one

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def reference():
    model = DecoderModel(ModelConfig(**TEST_MODEL))
    torch.set_num_threads(1)

    def greedy(prompt, n):
        toks = list(prompt)
        for _ in range(n):
            toks.append(int(forward_one(model, torch.tensor(toks), 0, None)[0][-1].argmax()))
        return toks[len(prompt):]

    greedy.model = model
    return greedy


def prompt_of(seed, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def complete(cc, prompt, max_tokens=4, **kw):
    client = cc.client()
    return asyncio.run(client.complete(prompt, SamplingParams(max_tokens=max_tokens), **kw))


def wait_for_route(cc, prompt, predicate, timeout_s=20.0):
    hashes = block_hashes(prompt, cc.config["block_tokens"])
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            d = ray.get(cc.directory.route.remote(hashes, len(prompt), None, False))
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
            d = exc   # restarting, or no worker registered yet
        if not isinstance(d, Exception) and predicate(d):
            return d
        if time.monotonic() > deadline:
            raise AssertionError(f"directory never converged: last decision {d}")
        time.sleep(0.1)


def test_follow_up_lands_on_the_worker_holding_its_prefix(cache_cluster, reference):
    cc = cache_cluster
    prompt = prompt_of(1, 300)
    first = complete(cc, prompt)
    holder = first.worker_id
    assert first.tokens == reference(prompt, 4)
    # The holder's KV events reach the directory, which now sends the prefix there.
    wait_for_route(cc, prompt, lambda d: d.worker_id == holder and d.cached_tokens >= 288)
    follow_prompt = prompt + first.tokens + prompt_of(2, 40)
    follow = complete(cc, follow_prompt)
    assert (follow.worker_id, follow.reason) == (holder, "local"), ray.get(cc.directory.get_stats.remote())
    assert follow.cached_tokens == len(prompt) + 3   # the reply but its last token (never computed)
    assert follow.tokens == reference(follow_prompt, 4)


def test_migration_output_equals_full_prefill(cache_cluster, reference):
    cc = cache_cluster
    holder, target = cc.worker_ids[0], cc.worker_ids[1]
    prompt = prompt_of(3, 400)
    complete(cc, prompt, worker_id=holder)
    follow_prompt = prompt + prompt_of(4, 30)
    items = []

    async def run():
        request = GenerateRequest(follow_prompt, SamplingParams(max_tokens=5),
                                  route=RouteDecision(target, "migrate", migrate_from=holder))
        stream = cc.workers[target].generate.options(num_returns="streaming").remote(request)
        async for ref in stream:
            items.append(await ref)

    asyncio.run(run())
    tokens = [i.token for i in items if i.token is not None]
    assert items[0].migration.transport == "nixl"
    assert items[0].migration.tokens >= 400
    assert items[0].cached_tokens >= 400
    assert tokens == reference(follow_prompt, 5)


def test_saturated_holder_leads_to_a_migration_decision(cache_cluster):
    cc = cache_cluster
    holder = cc.worker_ids[0]
    prompt = prompt_of(5, 640)
    complete(cc, prompt, worker_id=holder)
    wait_for_route(cc, prompt, lambda d: d.worker_id == holder)
    # Saturate the holder with a long queue of long requests it has never seen.

    async def hog():
        client = cc.client()
        await asyncio.gather(*[client.complete(prompt_of(100 + i, 1500), SamplingParams(max_tokens=64), worker_id=holder)
                               for i in range(6)])

    import threading
    t = threading.Thread(target=lambda: asyncio.run(hog()))
    t.start()
    try:
        d = wait_for_route(cc, prompt, lambda d: d.migrate_from == holder, timeout_s=30)
        assert d.worker_id != holder and d.reason == "migrate"
    finally:
        t.join()


def test_nixl_moves_real_bytes_between_nodes(cache_cluster, reference):
    cc = cache_cluster
    holder, target = cc.worker_ids[0], cc.worker_ids[2]
    nodes = ray.get([cc.workers[holder].node_id.remote(), cc.workers[target].node_id.remote()])
    assert nodes[0] != nodes[1]
    prompt = prompt_of(6, 256)
    complete(cc, prompt, max_tokens=1, worker_id=holder)
    staged, got = ray.get(cc.workers[target].nixl_read.remote(holder, prompt))
    assert staged.tokens == 256
    _, kv = forward_one(reference.model, torch.tensor(prompt), 0, None)
    assert torch.allclose(got[:, :, :256], kv, atol=1e-5)
    stats = cc.on_peer(target, lambda peer: peer.stats())
    assert stats["worker"]["migration_bytes"] > 0


def test_forced_nixl_failure_falls_back_to_the_peer_channel(cache_cluster, reference):
    cc = cache_cluster
    holder, target = cc.worker_ids[1], cc.worker_ids[2]
    prompt = prompt_of(7, 200)
    complete(cc, prompt, worker_id=holder)
    cc.on_peer(target, lambda peer: peer.inject_fault("nixl"))
    try:
        items = []

        async def run():
            request = GenerateRequest(prompt + [1, 2, 3], SamplingParams(max_tokens=3),
                                      route=RouteDecision(target, "migrate", migrate_from=holder))
            stream = cc.workers[target].generate.options(num_returns="streaming").remote(request)
            async for ref in stream:
                items.append(await ref)

        asyncio.run(run())
    finally:
        cc.on_peer(target, lambda peer: peer.inject_fault("nixl", False))
    assert items[0].migration.transport == "peer"   # the staged blocks over the holder's peer channel
    assert [i.token for i in items] == reference(prompt + [1, 2, 3], 3)
    stats = cc.on_peer(target, lambda peer: peer.stats())
    assert stats["worker"]["fallback_pulls"] >= 1 and stats["worker"]["nixl_failures"] >= 1


def test_killing_a_worker_mid_request_loses_no_request(cache_cluster, reference):
    cc = cache_cluster
    victim = cc.worker_ids[1]
    prompt = prompt_of(8, 100)
    received = []

    async def run():
        client = cc.client()
        async for item, attempt in client.generate(prompt, SamplingParams(max_tokens=40), worker_id=victim):
            received.append((item, attempt))
            if len(received) == 5:
                ray.kill(cc.workers[victim], no_restart=True)

    asyncio.run(run())
    tokens = [i.token for i, _ in received if i.token is not None]
    assert tokens == reference(prompt, 40)
    last, attempt = received[-1]
    assert last.worker_id != victim and attempt >= 1
    deadline = time.monotonic() + 20
    while victim in ray.get(cc.directory.live_workers.remote()):
        assert time.monotonic() < deadline, "directory never dropped the dead worker"
        time.sleep(0.1)
    cc.restart_worker(victim)   # for the rest of the session


def test_directory_restart_rebuilds_the_index(cache_cluster):
    cc = cache_cluster
    holder = cc.worker_ids[2]
    prompt = prompt_of(9, 320)
    served = complete(cc, prompt, worker_id=holder)
    assert served.worker_id == holder, served
    wait_for_route(cc, prompt, lambda d: d.worker_id == holder and d.cached_tokens >= 320)
    started = ray.get(cc.directory.get_stats.remote())["started_at"]
    ray.kill(cc.directory, no_restart=False)   # Ray restarts it, empty
    deadline = time.monotonic() + 60
    while True:   # the new instance hears from every worker, which push their snapshots
        try:
            stats = ray.get(cc.directory.get_stats.remote())
        except ray.exceptions.RayActorError:
            stats = None
        if stats and stats["started_at"] != started and sorted(stats["workers"]) == cc.worker_ids \
                and stats["snapshots"] >= len(cc.worker_ids):
            break
        assert time.monotonic() < deadline, f"directory not rebuilt: {stats}"
        time.sleep(0.2)
    # The rebuilt index knows the holder: the decision serves from it, or (when the
    # load reports make the holder look busy) pulls the prefix from it.
    d = wait_for_route(cc, prompt, lambda d: holder in (d.worker_id, d.migrate_from)
                       and d.cached_tokens >= 320)
    assert holder in (d.worker_id, d.migrate_from)


def test_malformed_and_unknown_batches_are_counted(cache_cluster):
    cc = cache_cluster
    before = ray.get(cc.directory.get_stats.remote())
    assert ray.get(cc.directory.publish.remote(cc.worker_ids[0], b"\xc1garbage")) == "malformed"
    # A batch from a worker the directory does not know: it registers it and asks for a snapshot.
    try:
        assert ray.get(cc.directory.publish.remote("w-unknown", None)) == "unknown_worker"
        assert "w-unknown" in ray.get(cc.directory.live_workers.remote())
    finally:   # no request may be routed to a worker that does not exist
        ray.get(cc.directory.drop_worker.remote("w-unknown"))
    stats = ray.get(cc.directory.get_stats.remote())
    assert (stats["malformed_batches"], stats["unknown_worker_batches"]) == (
        before["malformed_batches"] + 1, before["unknown_worker_batches"] + 1)
    assert ray.get(cc.directory.live_workers.remote()) == cc.worker_ids


def test_engine_state_stayed_on_the_engine_threads(cache_cluster):
    """The thread-ownership check is on in every worker process (the plugin sets
    it before Ray starts) and nothing touched engine state from another thread."""
    cc = cache_cluster
    for wid in cc.workers:
        assert cc.on_peer(wid, lambda peer: peer.info()).ownership_checks, wid
        assert cc.on_peer(wid, lambda peer: peer.stats())["worker"]["ownership_violations"] == 0, wid


def test_workers_run_at_normal_priority(cache_cluster):
    """Ray starts worker processes at nice 15 unless told otherwise; the cluster's run at 0
    (``actors.config.prepare_serving_env``), beside the raylet, not below it."""
    for wid in cache_cluster.workers:
        pid = cache_cluster.on_peer(wid, lambda peer: peer.stats())["worker"]["pid"]
        assert os.getpriority(os.PRIO_PROCESS, pid) == 0, wid


def test_workers_start_with_the_serving_environment(cache_cluster):
    """Every process the cluster's raylets start inherits ``actors.config.SERVING_ENV`` (Serve
    reads its settings when its modules load, in each replica and in the proxy)."""
    from actors.config import SERVING_ENV

    for wid in cache_cluster.workers:
        pid = cache_cluster.on_peer(wid, lambda peer: peer.stats())["worker"]["pid"]
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        assert {name: env.get(name.encode(), b"").decode() for name in SERVING_ENV} == SERVING_ENV, wid


def test_cpu_workers_run_their_threads_on_intel_openmp(cache_cluster):
    """Every CPU worker process was started with Intel's OpenMP preloaded
    (``cluster.engine.openmp``) and runs the torch threads it was configured with."""
    from tests.requirements import require_intel_openmp

    require_intel_openmp()   # fails under CI where the project ships it, skips elsewhere
    for wid in cache_cluster.workers:
        worker = cache_cluster.on_peer(wid, lambda peer: peer.stats())["worker"]
        assert worker["openmp"] == "intel", wid
