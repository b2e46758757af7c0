"""The inventory across restarts, on a real multi-node Ray cluster with a real
Mooncake master: under load, a worker is restarted (a new process, same id:
a new epoch) and the directory is killed (Ray restarts it, empty). Once the
load stops, the directory's index equals every worker's tree exactly, and its
L3 set equals the store's keys for this model exactly; L3 is priced again
within 10 s of the directory's start."""

import asyncio
import threading
import time
import urllib.request

import pytest
import ray

from cluster.protocol import SamplingParams
from tests.requirements import require_mooncake

pytestmark = pytest.mark.distributed
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def prompt_of(seed: int, n: int) -> list[int]:
    return [(seed * 131 + i * 7) % 250 + 1 for i in range(n)]


def store_hashes(master, prefix: str) -> set[int]:
    with _NO_PROXY.open(f"http://{master.http_address}/get_all_keys", timeout=10) as resp:
        names = resp.read().decode().splitlines()
    # Full blocks only: a sequence's partial last block (a ``-t<n>`` tail key) is no KV event
    # and not in the inventory (docs/l3.md).
    return {int(n[len(prefix):], 16) for n in names if n.startswith(prefix) and "-t" not in n[len(prefix):]}


class Load:
    """Requests with distinct prompts to every worker in turn until stopped."""

    def __init__(self, cc):
        self.cc, self.stop, self.done, self.failed = cc, threading.Event(), 0, []
        self.thread = threading.Thread(target=lambda: asyncio.run(self.run()), daemon=True)

    async def run(self) -> None:
        client = self.cc.client()
        seed = 5000
        while not self.stop.is_set():
            seed += 1
            try:
                await asyncio.wait_for(client.complete(prompt_of(seed, 70), SamplingParams(max_tokens=4)), 60)
                self.done += 1
            except Exception as exc:   # counted: the test asserts none was lost
                self.failed.append(repr(exc))


def converged(cc, master) -> tuple[bool, str]:
    dump = ray.get(cc.directory.index_dump.remote(), timeout=30)
    for wid, handle in cc.workers.items():
        snap = ray.get(handle.snapshot.remote(), timeout=30)
        if dump["workers"].get(wid) != snap.entries:
            return False, f"{wid}: index {len(dump['workers'].get(wid) or {})} entries, tree {len(snap.entries)}"
    prefix = next(iter(cc.on_peer(w, lambda peer: peer.stats(), timeout_s=30)["l3"]["key_prefix"] for w in cc.workers))
    stored = store_hashes(master, prefix)
    if set(dump["l3"]) != stored:
        return False, f"L3: index {len(dump['l3'])}, store {len(stored)}, differ by {len(set(dump['l3']) ^ stored)}"
    return True, ""


def test_restarts_under_load_leave_the_index_equal_to_the_trees_and_the_store(cache_cluster, l3_master):
    require_mooncake()
    cc = cache_cluster
    load = Load(cc)
    load.thread.start()
    try:
        time.sleep(3)
        victim = cc.worker_ids[0]
        old_pid = ray.get(cc.workers[victim].pid.remote())
        cc.restart_worker(victim)                       # a new process of the same id: a new epoch
        assert ray.get(cc.workers[victim].pid.remote()) != old_pid
        time.sleep(2)
        started = ray.get(cc.directory.get_stats.remote())["started_at"]
        ray.kill(cc.directory, no_restart=False)         # Ray restarts it, empty
        time.sleep(4)
    finally:
        load.stop.set()
        load.thread.join(120)
    assert load.failed == [] and load.done > 0
    stats = ray.get(cc.directory.get_stats.remote(), timeout=30)
    assert stats["started_at"] != started
    # L3 priced again: an inventory arrived, within 10 s of the new process's start.
    deadline = time.monotonic() + 30
    while stats["l3_inventory_s"] is None and time.monotonic() < deadline:
        time.sleep(0.2)
        stats = ray.get(cc.directory.get_stats.remote(), timeout=30)
    assert stats["l3_inventory_s"] is not None and stats["l3_inventory_s"] < 10, stats
    deadline = time.monotonic() + 60
    ok, why = converged(cc, l3_master)
    while not ok and time.monotonic() < deadline:
        time.sleep(0.5)
        ok, why = converged(cc, l3_master)
    assert ok, why
