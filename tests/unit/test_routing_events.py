import random

import msgpack
import pytest

from cluster.cache.radix_tree import COLD, HOT, WARM
from cluster.cache.tiered import TierConfig, TieredCache
from cluster.errors import InvalidInputError
from cluster.hashing import block_hashes
from cluster.routing.events import EpochIssuer, EventBatch, KVEvent, KVEventPublisher, MalformedBatchError
from cluster.routing.index import GlobalIndex
from tests.unit.helpers import TickClock

B = 4




def make(hot=4, warm=4, cold=0, max_buffer_events=10_000):
    cache = TieredCache(TierConfig(hot_blocks=hot, warm_blocks=warm, cold_blocks=cold, block_tokens=B, device="cpu"),
                        None, clock=TickClock())
    pub = KVEventPublisher("w0", cache.tree, B, max_buffer_events=max_buffer_events)
    cache.tree.listeners.append(pub)
    return cache, pub


def put(cache, tokens, namespace=None):
    lease = cache.admit(tokens, namespace, compute_last=False)
    rest = len(tokens) - lease.cached_tokens
    if rest:
        lease.extend(rest)
        lease.commit(tokens)
    lease.release()
    cache.check_invariants()


def events(pub):
    batch = pub.drain()
    return [] if batch is None else [(e.kind, e.tier, e.hashes) for e in batch.events]


A = list(range(1, 9))          # two full blocks
BB = list(range(100, 108))


def test_stored_emits_full_blocks_whose_last_token_is_in_the_node():
    cache, pub = make(hot=8)
    put(cache, list(range(1, 11)))                       # 10 tokens: blocks 0, 1; 2 tokens left over
    assert events(pub) == [("stored", HOT, block_hashes(list(range(1, 9)), B))]
    put(cache, list(range(1, 15)))                       # new leaf holds tokens 10..13: block 2 ends there
    assert events(pub) == [("stored", HOT, block_hashes(list(range(1, 13)), B)[2:])]
    put(cache, list(range(1, 4)))                        # a split, no new content, no full block
    assert events(pub) == []
    assert pub.drain() is None


def test_short_leaf_without_a_full_block_emits_nothing():
    cache, pub = make(hot=8)
    put(cache, [5, 6, 7])
    assert pub.drain() is None


def test_tier_changes_emit_the_new_tier():
    cache, pub = make(hot=4, warm=4)
    put(cache, A)
    put(cache, BB)                                       # HOT over the watermark: A (least recent) goes WARM
    ha, hb = block_hashes(A, B), block_hashes(BB, B)
    assert events(pub) == [("stored", HOT, ha), ("stored", HOT, hb), ("tier", WARM, ha)]
    put(cache, A)                                        # hit on A: B makes room, A comes back
    assert events(pub) == [("tier", WARM, hb), ("tier", HOT, ha)]


def test_removal_emits_the_dropped_blocks():
    cache, pub = make(hot=4, warm=0)
    put(cache, A)
    put(cache, BB)
    events(pub)
    put(cache, list(range(200, 208)))                    # no room: A, the LRU leaf, is dropped
    assert events(pub) == [("removed", HOT, block_hashes(A, B)),
                           ("stored", HOT, block_hashes(list(range(200, 208)), B))]


def test_namespace_salts_the_hashes():
    cache, pub = make(hot=8)
    put(cache, A)
    put(cache, A, namespace="tenant-a")
    (_, _, plain), (_, _, salted) = events(pub)
    assert plain == block_hashes(A, B)
    assert salted == block_hashes(A, B, "tenant-a")
    assert not set(plain) & set(salted)


def test_encode_decode_round_trip():
    batch = EventBatch("worker-7", 42, [KVEvent("stored", [1, 2**64 - 1], HOT), KVEvent("tier", [3], COLD),
                                        KVEvent("removed", [], WARM)], resync=False)
    assert EventBatch.decode(batch.encode()) == batch
    resync = EventBatch("w", 1, [], resync=True)
    assert EventBatch.decode(resync.encode()) == resync


def _wire(**override):
    obj = {"v": 2, "w": "w0", "p": 5, "s": 1, "r": False, "e": [["stored", 0, [1, 2]]]}
    obj.update(override)
    return msgpack.packb(obj)


@pytest.mark.parametrize("data, message", [
    (b"\xc1", "not msgpack"),
    (b"\x93\x01", "not msgpack"),                                  # truncated array
    ("text", "must be bytes"),
    (msgpack.packb([1, 2, 3]), "must be a map"),
    (msgpack.packb({"v": 2, "w": "w0"}), "lacks field(s) p, s, r, e"),
    (_wire(v=1), "version 1 is not supported"),
    (_wire(p=-1), "epoch must be an unsigned 64-bit integer"),
    (_wire(p="x"), "epoch must be an unsigned 64-bit integer"),
    (_wire(e=[["inventory", 1, [1]]]), "an 'inventory' event names L3 only"),
    (_wire(v=9), "version 9"),
    (_wire(w=""), "worker id"),
    (_wire(w=5), "worker id"),
    (_wire(s=-1), "seq must be a non-negative integer"),
    (_wire(s=1.5), "seq must be a non-negative integer"),
    (_wire(r=1), "resync must be a boolean"),
    (_wire(e={"x": 1}), "events must be a list"),
    (_wire(e=[["stored", 0]]), "event 0 must be [kind, tier, hashes(, tenant)]"),
    (_wire(e=[["evicted", 0, [1]]]), "unknown kind 'evicted'"),
    (_wire(e=[["stored", 4, [1]]]), "tier 4 out of range"),
    (_wire(e=[["tier", 3, [1]]]), "a 'tier' event cannot name L3"),
    (_wire(e=[["stored", -1, [1]]]), "tier -1 out of range"),
    (_wire(e=[["stored", 0, 7]]), "hashes must be a list"),
    (_wire(e=[["stored", 0, [1, -5]]]), "hash -5 is not an unsigned 64-bit integer"),
    (_wire(e=[["stored", 0, [1.5]]]), "hash 1.5 is not an unsigned 64-bit integer"),
    (_wire(e=[["tier", 0, ["ab"]]]), "is not an unsigned 64-bit integer"),
])
def test_malformed_batches_are_rejected_with_a_message(data, message):
    with pytest.raises(MalformedBatchError) as info:
        EventBatch.decode(data)
    assert message in str(info.value)
    assert isinstance(info.value, InvalidInputError) and isinstance(info.value, ValueError)


def test_overflow_drops_the_buffer_and_asks_for_a_resync():
    cache, pub = make(hot=16, max_buffer_events=2)
    for start in (10, 20, 30):                            # the third event would pass the bound
        put(cache, list(range(start, start + 4)))
    assert pub.needs_resync and pub.pending == 0
    put(cache, list(range(40, 44)))                       # covered by the snapshot: not buffered
    batch = pub.drain()
    assert (batch.seq, batch.resync, batch.events) == (1, True, [])
    assert not pub.needs_resync
    seq, snap, epoch = pub.snapshot()
    assert seq == 1 and epoch == pub.epoch == batch.epoch
    assert snap == {block_hashes(list(range(s, s + 4)), B)[0]: HOT for s in (10, 20, 30, 40)}
    put(cache, list(range(50, 54)))
    after = pub.drain()
    assert (after.seq, after.resync, len(after.events)) == (2, False, 1)


def test_sequence_numbers_count_batches_from_one():
    cache, pub = make(hot=16)
    assert pub.seq == 0 and pub.snapshot() == (0, {}, pub.epoch)
    put(cache, A)
    assert pub.drain().seq == 1
    put(cache, BB)
    assert pub.drain().seq == 2
    assert pub.seq == 2


def test_snapshot_equals_tree_content_and_what_the_events_built():
    """Random traffic through all three tiers: replaying the batches gives the snapshot."""
    rng = random.Random(7)
    cache, pub = make(hot=6, warm=6, cold=8)
    index = GlobalIndex()
    index.register_worker("w0")
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(1, 9))] for _ in range(6)]
    for step in range(300):
        seq = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(0, 10))]
        put(cache, seq, namespace=rng.choice([None, "t1"]))
        if step % 3 == 0:
            batch = pub.drain()
            if batch is not None:
                assert index.apply(batch) == "ok"
    batch = pub.drain()
    if batch is not None:
        assert index.apply(batch) == "ok"
    index.check_invariants()
    seq, snap, _ = pub.snapshot()
    assert seq == pub.seq
    # Independently: each node's blocks from its full path, at the node's tier.
    expected = {}
    for node in cache.tree.iter_nodes():
        path = cache.tree.path_tokens(node)
        hashes = block_hashes(path, B, cache.tree.namespace_of(node))
        for i in range((len(path) - len(node.key)) // B, len(path) // B):
            expected[hashes[i]] = node.tier
    assert snap == expected
    assert index.entries("w0") == expected
    assert {HOT, WARM, COLD} <= set(expected.values())   # the traffic did reach every tier


def test_publisher_rejects_bad_arguments():
    cache, _ = make()
    with pytest.raises(InvalidInputError):
        KVEventPublisher("", cache.tree, B)
    with pytest.raises(InvalidInputError):
        KVEventPublisher("w", cache.tree, 0)
    with pytest.raises(InvalidInputError):
        KVEventPublisher("w", cache.tree, B, max_buffer_events=0)


class WallNs:
    """A node's wall clock in ns, set by hand (it may go backwards)."""

    def __init__(self, now: int):
        self.now = now

    def __call__(self) -> int:
        return self.now


def test_an_issued_epoch_is_newer_than_the_last_life_whatever_the_clocks_say():
    wall = WallNs(5_000)
    issuer = EpochIssuer(wall)
    first = issuer.issue(None)
    assert first == 5_000                                  # the wall clock is the floor
    wall.now = 1_000                                       # the clock stepped back
    second = issuer.issue(first)
    assert second == 5_001 and issuer.issue(None) == 5_002
    # A restarted directory (a new issuer, nothing issued yet) on a clock behind both:
    # the epoch it saw from the worker's previous life keeps the next one above it.
    again = EpochIssuer(WallNs(10)).issue(second)
    assert again == second + 1
    assert EpochIssuer(WallNs(10)).issue(None) == 10
    with pytest.raises(InvalidInputError, match="exhausted"):
        EpochIssuer(WallNs(10)).issue((1 << 64) - 1)


def test_a_publisher_on_a_clock_behind_its_last_life_publishes_under_the_issued_epoch():
    issuer = EpochIssuer(WallNs(9_000))
    cache, old = make(hot=16)
    old.epoch = issuer.issue(None)
    # Restarted on a node whose clock is 8,000 ns behind: its own start would be older.
    cache2 = TieredCache(TierConfig(hot_blocks=16, warm_blocks=4, block_tokens=B, device="cpu"), None,
                         clock=TickClock())
    issuer._wall_ns = WallNs(1_000)
    new = KVEventPublisher("w0", cache2.tree, B, epoch=issuer.issue(old.epoch))
    cache2.tree.listeners.append(new)
    put(cache2, A)
    batch = new.drain()
    assert batch.epoch == new.epoch == old.epoch + 1 and new.snapshot().epoch == new.epoch


def test_adopting_an_epoch_drops_what_is_pending_and_resyncs():
    cache, pub = make(hot=16)
    put(cache, A)
    assert pub.pending == 1
    pub.adopt_epoch(77)
    assert pub.pending == 0 and pub.stats["dropped_events"] == 1
    batch = pub.drain()
    assert (batch.seq, batch.resync, batch.events, batch.epoch) == (1, True, [], 77)
    assert pub.snapshot().epoch == 77
    with pytest.raises(InvalidInputError, match="epoch"):
        pub.adopt_epoch(-1)
