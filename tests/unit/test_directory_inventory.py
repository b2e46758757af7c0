"""The directory's inventory across restarts: worker epochs (events of a previous
life never credit a replica) and L3's content rebuilt from an inventory before
the ``l3`` option is priced again."""

import asyncio

from tests.requirements import require_module

require_module("ray")

from actors.directory import DirectoryImpl  # noqa: E402
from cluster.cache.radix_tree import HOT  # noqa: E402
from cluster.hashing import block_hashes  # noqa: E402
from cluster.names import L3  # noqa: E402
from cluster.protocol import MeasuredRates, Snapshot  # noqa: E402
from cluster.routing.events import EventBatch, KVEvent  # noqa: E402

BT = 4
RATES = MeasuredRates(prefill_tokens_per_s=1000.0, warm_promote_tokens_per_s=10_000.0,
                      cold_promote_tokens_per_s=1000.0, transfer_tokens_per_s=5000.0, block_tokens=BT,
                      l3_fetch_tokens_per_s=8000.0)
H = block_hashes(list(range(32)), BT)   # 8 chained hashes


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def directory(clock=None) -> DirectoryImpl:
    return DirectoryImpl(policy="cost", block_tokens=BT, heartbeat_timeout_s=0, clock=clock or Clock())


def batch(worker, seq, events, epoch):
    return EventBatch(worker, seq, events, epoch=epoch).encode()


def test_events_and_snapshots_of_an_older_epoch_never_credit_the_worker():
    async def go():
        d = directory()
        await d.register_worker("w", rates=RATES)
        assert await d.publish("w", batch("w", 1, [KVEvent("stored", H[:4], HOT)], epoch=10)) == "ok"
        assert d.index.entries("w") == {h: HOT for h in H[:4]}
        # The worker restarts (same id, a later epoch): its first batch drops the old life's
        # entries and asks for a snapshot instead of applying on top of them.
        assert await d.publish("w", batch("w", 1, [KVEvent("stored", H[4:6], HOT)], epoch=20)) == "resync"
        assert d.index.entries("w") == {} and d.stats["new_epochs"] == 1
        assert await d.load_snapshot("w", Snapshot(1, {H[4]: HOT, H[5]: HOT}, 20)) == "ok"
        # A late batch and a late snapshot of the old life are refused and change nothing.
        assert await d.publish("w", batch("w", 2, [KVEvent("stored", H[:4], HOT)], epoch=10)) == "stale_epoch"
        assert await d.load_snapshot("w", Snapshot(9, {h: HOT for h in H[:4]}, 10)) == "stale_epoch"
        assert d.index.entries("w") == {H[4]: HOT, H[5]: HOT}
        assert (d.stats["stale_epoch_batches"], d.stats["stale_epoch_snapshots"]) == (1, 1)
        # The new life goes on as usual.
        assert await d.publish("w", batch("w", 2, [KVEvent("stored", H[6:7], HOT)], epoch=20)) == "ok"
        assert d.index.entries("w") == {H[4]: HOT, H[5]: HOT, H[6]: HOT}
        # A dropped worker's epoch is remembered: its old life cannot come back either.
        await d.drop_worker("w")
        assert await d.publish("w", batch("w", 3, [KVEvent("stored", H[:1], HOT)], epoch=10)) == "stale_epoch"
        assert await d.load_snapshot("w", Snapshot(3, {H[0]: HOT}, 10)) == "stale_epoch"
        assert "w" not in d.live_workers()                     # not even registered as a bare name
    asyncio.run(go())


class WallNs:
    def __init__(self, now: int):
        self.now = now

    def __call__(self) -> int:
        return self.now


def test_a_worker_restarted_on_a_clock_behind_its_last_life_is_accepted():
    async def go():
        wall = WallNs(50_000)
        d = DirectoryImpl(policy="cost", block_tokens=BT, heartbeat_timeout_s=0, clock=Clock(), wall_clock_ns=wall)
        first = (await d.publisher_epoch("w")).epoch
        await d.register_worker("w", rates=RATES)
        assert await d.publish("w", batch("w", 1, [KVEvent("stored", H[:4], HOT)], epoch=first)) == "ok"
        # Restarted on a node 40 us behind (and the directory's own clock stepped back too):
        # its own start would be older than its last life's; the issued epoch is newer.
        wall.now = 10_000
        issued = await d.publisher_epoch("w")
        assert issued.worker_id == "w" and issued.epoch == first + 1
        assert d.index.entries("w") == {} and d.stats["new_epochs"] == 1   # the old life's entries went
        assert await d.publish("w", batch("w", 1, [KVEvent("stored", H[4:6], HOT)], epoch=issued.epoch)) == "ok"
        assert d.index.entries("w") == {H[4]: HOT, H[5]: HOT}
        # The old life, still talking, is refused from the moment the new epoch was issued.
        assert await d.publish("w", batch("w", 2, [KVEvent("stored", H[:4], HOT)], epoch=first)) == "stale_epoch"
        assert await d.load_snapshot("w", Snapshot(2, {h: HOT for h in H[:4]}, first)) == "stale_epoch"
        assert d.index.entries("w") == {H[4]: HOT, H[5]: HOT}
        # A worker that took its own clock's epoch (the directory did not answer at its
        # start) and lost to its last life's is refused; the epoch it then asks for wins.
        wall.now = 0
        assert await d.publish("w", batch("w", 2, [], epoch=9_999)) == "stale_epoch"
        renewed = (await d.publisher_epoch("w")).epoch
        assert renewed == issued.epoch + 1 and d.stats["issued_epochs"] == 3
        assert await d.publish("w", batch("w", 1, [], epoch=renewed)) == "ok"
        assert await d.load_snapshot("w", Snapshot(1, {H[7]: HOT}, renewed)) == "ok"
        assert d.index.entries("w") == {H[7]: HOT}
    asyncio.run(go())


def test_a_restarted_directory_prices_l3_only_after_an_inventory_and_says_when():
    async def go():
        clock = Clock()
        d = directory(clock)    # a fresh process: L3 unknown
        await d.register_worker("w", rates=RATES)
        assert d.table.cost.l3_fetch_tokens_per_s == 0.0 and d.stats["l3_inventory_s"] is None
        # Ordinary L3 events alone do not make the set complete.
        assert await d.publish("w", batch("w", 1, [KVEvent("stored", H[:2], L3)], epoch=5)) == "ok"
        assert d.table.cost.l3_fetch_tokens_per_s == 0.0
        clock.t += 0.75
        inventory = [KVEvent("inventory", H[:6], L3)]
        assert await d.publish("w", batch("w", 2, inventory, epoch=5)) == "ok"
        assert d.index.l3_entries() and set(d.index.l3_entries()) == set(H[:6])
        assert d.index.l3_blocks(H) == 6
        assert d.table.cost.l3_fetch_tokens_per_s == 8000.0
        assert d.stats["l3_inventory_s"] == 0.75 and d.stats["l3_inventories"] == 1
        # A later one (another worker's, or after a snapshot) merges; the time stays the first.
        clock.t += 5
        assert await d.publish("w", batch("w", 3, [KVEvent("inventory", H[6:], L3)], epoch=5)) == "ok"
        assert d.index.l3_blocks(H) == 8 and d.stats["l3_inventory_s"] == 0.75
        # An empty store is an inventory too.
        e = directory()
        await e.register_worker("v", rates=RATES)
        assert await e.publish("v", batch("v", 1, [KVEvent("inventory", [], L3)], epoch=1)) == "ok"
        assert e.table.cost.l3_fetch_tokens_per_s == 8000.0 and e.index.num_l3 == 0
    asyncio.run(go())


def test_the_directory_counts_tenants_l3_blocks_across_workers_and_answers_each_without_its_own():
    from cluster.protocol import L3ShareCounts, PublishReply

    async def go():
        d = directory()
        for w in ("a", "b"):
            await d.register_worker(w, rates=RATES)
        assert await d.publish("a", batch("a", 1, [KVEvent("stored", H[:3], L3, "t")], epoch=1)) == "ok"
        reply = await d.publish("b", batch("b", 1, [KVEvent("stored", H[3:5], L3, "t"),
                                                    KVEvent("stored", H[5:6], L3, None)], epoch=1),
                                want_l3_shares=True)
        assert reply == PublishReply("ok", L3ShareCounts((("t", 3),)))
        assert (await d.publish("a", None, want_l3_shares=True)).l3_shares.as_dict() == {"t": 2, None: 1}
        assert d.get_stats()["l3_tenant_blocks"] == {"t": 5, "": 1}
        # A fetch found one missing; then b starts again: its blocks stay, counted as another's.
        assert await d.publish("a", batch("a", 2, [KVEvent("removed", H[4:5], L3)], epoch=1)) == "ok"
        assert await d.publish("b", batch("b", 1, [], epoch=2), want_l3_shares=True) == \
            PublishReply("resync", L3ShareCounts((("t", 4), (None, 1))))
        old = await d.publish("b", batch("b", 2, [KVEvent("stored", H[6:8], L3, "t")], epoch=1), want_l3_shares=True)
        assert old == PublishReply("stale_epoch", None) and d.l3_shares.totals() == {"t": 4, None: 1}
        await d.clear_l3()
        assert (await d.publish("a", None, want_l3_shares=True)).l3_shares == L3ShareCounts(())
    asyncio.run(go())
