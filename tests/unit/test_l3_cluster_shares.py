"""Tenants' L3 shares across the cluster (issue 53): the directory counts each tenant's L3
blocks from every replica's L3 events (``L3ShareBook``), each replica enforces the share
against that count plus its own writes (``TenantQuotas.l3_admit``), and stale counts
write nothing. Pure: two replicas' quotas, their event publishers and the book, no Ray."""

from __future__ import annotations

from concurrent.futures import Future

import msgpack
import pytest

from actors.reporter import EventReporter
from cluster.cache.allocator import AllocatorConfig, BlockAllocator
from cluster.cache.quota_config import QuotaConfig
from cluster.cache.quotas import TenantQuotas
from cluster.cache.radix_tree import RadixTree
from cluster.names import HOT, L3
from cluster.protocol import L3ShareCounts, LoadReport, PublishReply
from cluster.routing.events import EventBatch, KVEvent, KVEventPublisher, MalformedBatchError
from cluster.routing.l3_shares import L3ShareBook

L3_INDEX = 3
# 10 L3 blocks in all; tenant "t" may hold at most 5 of them, "u" is guaranteed 4.
CONFIG = {"l3_blocks": 10, "tenants": {"t": {"l3": {"cap": 0.5}}, "u": {"l3": {"guarantee": 0.4}}}}


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Replica:
    """One replica's side: its quotas (over its own tree) and its KV event publisher."""

    def __init__(self, name: str, clock: Clock):
        self.name = name
        self.tree = RadixTree([BlockAllocator(AllocatorConfig(8, 4))], clock=clock, hash_block_tokens=4)
        self.quotas = TenantQuotas(self.tree, QuotaConfig.parse(CONFIG))
        self.publisher = KVEventPublisher(name, self.tree, 4, epoch=1)

    def write(self, tenant, hashes: list[int]) -> list[int]:
        """What ``L3Link`` does with a commit's blocks: admit them under the share, remove
        what makes room, and report both (as ``L3Tier`` does once written)."""
        take, remove = self.quotas.l3_admit(tenant, hashes)
        if remove:
            self.publisher.on_l3_removed(remove)
        written = [hashes[i] for i in take]
        if written:
            self.publisher.on_l3_stored(written, tenant)
        return written

    def report(self, book: L3ShareBook) -> None:
        """One event batch to the directory over the wire, and its counts back."""
        batch = self.publisher.drain()
        if batch is not None:
            book.apply(self.name, EventBatch.decode(batch.encode()))
        self.quotas.set_l3_others(book.counts_for(self.name).as_dict())

    def holds(self, tenant) -> int:
        return self.quotas.holds(tenant, L3_INDEX)


def test_the_book_counts_each_tenants_blocks_by_writer_once_per_block():
    book = L3ShareBook()
    book.apply("A", EventBatch("A", 1, [KVEvent("stored", [1, 2, 3], L3, "t"), KVEvent("stored", [9], HOT)]))
    book.apply("B", EventBatch("B", 1, [KVEvent("stored", [3, 4], L3, "t"), KVEvent("stored", [5], L3, None)]))
    assert book.totals() == {"t": 4, None: 1}   # block 3, written by both, is one block (A's)
    assert book.counts_for("A").as_dict() == {"t": 1, None: 1}
    assert book.counts_for("B").as_dict() == {"t": 3}
    assert book.counts_for("C").as_dict() == {"t": 4, None: 1}
    book.apply("C", EventBatch("C", 1, [KVEvent("removed", [1, 3, 77], L3)]))   # a fetch found them missing
    assert book.totals() == {"t": 2, None: 1} and book.counts_for("A").as_dict() == {"t": 1, None: 1}
    book.forget_writer("B")   # B started again: its blocks are in L3 still, no longer its own
    assert book.counts_for("B").as_dict() == {"t": 2, None: 1}
    book.check_invariants()
    book.clear()
    assert book.totals() == {} and len(book) == 0


def test_a_bounded_book_forgets_its_oldest_blocks_and_their_counts():
    book = L3ShareBook(max_blocks=3)
    book.apply("A", EventBatch("A", 1, [KVEvent("stored", [1, 2], L3, "t"), KVEvent("stored", [3, 4], L3, "u")]))
    assert book.totals() == {"t": 1, "u": 2}
    book.check_invariants()


def test_two_replicas_writes_stay_within_the_tenants_share_across_the_cluster():
    clock, book = Clock(), L3ShareBook()
    a, b = Replica("A", clock), Replica("B", clock)
    assert a.write("t", [1, 2, 3, 4]) == [1, 2, 3, 4]
    a.report(book)
    b.report(book)
    assert b.holds("t") == 4   # A's four, as the directory counts them
    # B may add one more of "t" (cap 5); past it each next block of the write replaces the
    # one before (the write's own, never written), so its last block is the one written.
    assert b.write("t", [5, 6, 7]) == [7]
    assert b.holds("t") == 5 and b.quotas.l3_skipped_blocks == 0
    b.report(book)
    a.report(book)
    assert book.totals() == {"t": 5} and a.holds("t") == 5
    # A at the cap writes a new block by removing its own oldest: the tenant stays at 5.
    assert a.write("t", [8]) == [8]
    a.report(book)
    b.report(book)
    assert book.totals() == {"t": 5} and b.holds("t") == 5 and a.holds("t") == 5
    assert list(a.quotas.l3_written["t"]) == [2, 3, 4, 8]
    book.check_invariants()


def test_a_replica_alone_would_have_passed_the_share():
    """The same writes counted per replica (no directory counts): B never sees A's blocks."""
    clock = Clock()
    a, b = Replica("A", clock), Replica("B", clock)
    a.write("t", [1, 2, 3, 4])
    assert b.write("t", [5, 6, 7]) == [5, 6, 7]   # 7 blocks of "t" in L3: past its 5
    assert a.holds("t") + b.holds("t") == 7


def test_room_past_l3_blocks_comes_from_a_tenant_over_its_guarantee_written_here():
    clock, book = Clock(), L3ShareBook()
    a, b = Replica("A", clock), Replica("B", clock)
    assert a.write("u", list(range(100, 106))) == list(range(100, 106))   # "u" holds 6 (guarantee 4)
    a.report(book)
    b.report(book)
    assert b.write("t", [1, 2, 3, 4]) == [1, 2, 3, 4]   # 10 of 10 blocks in use
    b.report(book)
    a.report(book)
    # A's next block of "t" needs room: "u" is over its guarantee, and A wrote it.
    assert a.write("t", [5]) == [5]
    assert a.holds("u") == 5 and list(a.quotas.l3_written["u"])[0] == 101
    a.report(book)
    assert book.totals() == {"u": 5, "t": 5}
    # B, told of A's block, finds "t" at its cap: its own oldest block makes the room.
    b.report(book)
    assert b.holds("t") == 5
    assert b.write("t", [6]) == [6] and b.holds("t") == 5 and list(b.quotas.l3_written["t"]) == [2, 3, 4, 6]
    b.report(book)
    assert book.totals() == {"u": 5, "t": 5}
    book.check_invariants()


def test_stale_counts_write_nothing_until_fresh_ones_arrive():
    clock, book = Clock(), L3ShareBook()
    a = Replica("A", clock)
    a.quotas.expect_l3_counts(3.0)
    assert a.write("t", [1, 2]) == [] and a.quotas.l3_skipped_stale_blocks == 2   # none yet
    a.report(book)
    assert a.write("t", [1, 2]) == [1, 2]
    clock.t = 3.5   # no answer from the directory for longer than the time-to-live
    assert a.write("t", [3]) == [] and a.quotas.l3_skipped_stale_blocks == 3
    a.report(book)
    assert a.write("t", [3]) == [3]


def test_l3_stored_events_carry_their_tenant_over_the_wire():
    batch = EventBatch("w", 1, [KVEvent("stored", [1, 2], L3, "t"), KVEvent("stored", [3], L3, 7),
                                KVEvent("removed", [1], L3), KVEvent("stored", [4], HOT)], epoch=5)
    back = EventBatch.decode(batch.encode())
    assert [(e.kind, e.hashes, e.tier, e.tenant) for e in back.events] == [
        ("stored", [1, 2], L3, "t"), ("stored", [3], L3, 7), ("removed", [1], L3, None), ("stored", [4], HOT, None)]
    bad = msgpack.packb({"v": 2, "w": "w", "p": 1, "s": 1, "r": False, "e": [["stored", HOT, [1], "t"]]})
    with pytest.raises(MalformedBatchError, match="only an L3 'stored' event names a tenant"):
        EventBatch.decode(bad)


def test_the_reporter_hands_the_directorys_counts_over_on_the_engine_thread():
    got = []

    class Directory:
        def publish(self, worker_id, data, load, want_l3_shares=False):
            assert want_l3_shares
            fut = Future()
            fut.set_result(PublishReply("ok", L3ShareCounts((("t", 3),))))
            return fut

    tree = RadixTree([BlockAllocator(AllocatorConfig(8, 4))], hash_block_tokens=4)
    publisher = KVEventPublisher("w", tree, 4, epoch=1)
    clock = Clock()
    reporter = EventReporter("w", publisher, Directory(), lambda: LoadReport(0, 0), clock=clock,
                             on_l3_shares=got.append)
    clock.t = 1.0
    reporter.flush(force=True)
    assert got == [] and not reporter.snapshot_wanted   # the reply only sets a field
    reporter.tick()
    assert got == [L3ShareCounts((("t", 3),))]


def test_a_malformed_count_is_refused_when_built():
    with pytest.raises(Exception, match="non-negative integer"):
        L3ShareCounts((("t", -1),))
