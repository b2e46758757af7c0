import pytest

from cluster.cache.radix_tree import COLD, HOT, WARM
from cluster.errors import InvalidInputError
from cluster.routing.events import EventBatch, KVEvent
from cluster.routing.index import GlobalIndex, PrefixHit


def batch(worker, seq, *events, resync=False):
    return EventBatch(worker, seq, [KVEvent(kind, hashes, tier) for kind, hashes, tier in events], resync)


@pytest.fixture
def index():
    ix = GlobalIndex()
    ix.register_worker("a")
    ix.register_worker("b")
    return ix


def test_stored_then_match_counts_leading_blocks(index):
    assert index.apply(batch("a", 1, ("stored", [1, 2, 3], HOT))) == "ok"
    assert index.match([1, 2, 3, 4]) == {"a": PrefixHit(3, 0, 0)}
    assert index.match([1, 2]) == {"a": PrefixHit(2, 0, 0)}
    assert index.match([9, 1, 2]) == {}
    assert index.match([]) == {}
    index.check_invariants()


def test_match_splits_by_tier_per_worker(index):
    index.apply(batch("a", 1, ("stored", [1, 2, 3, 4], HOT), ("tier", [3], WARM), ("tier", [4], COLD)))
    index.apply(batch("b", 1, ("stored", [1, 2], WARM)))
    assert index.match([1, 2, 3, 4, 5]) == {"a": PrefixHit(2, 1, 1), "b": PrefixHit(0, 2, 0)}
    index.check_invariants()


def test_match_stops_at_the_first_block_a_worker_lacks(index):
    index.apply(batch("a", 1, ("stored", [1, 3, 4], HOT)))
    index.apply(batch("b", 1, ("stored", [1, 2, 3], HOT), ("tier", [3], WARM)))
    assert index.match([1, 2, 3, 4]) == {"a": PrefixHit(1, 0, 0), "b": PrefixHit(2, 1, 0)}
    assert index.hit([1, 2, 3, 4], "a") == PrefixHit(1, 0, 0)
    assert index.hit([1, 2, 3, 4], "b") == PrefixHit(2, 1, 0)
    assert index.hit([1, 2, 3, 4], "zz") == PrefixHit() == (0, 0, 0)


def test_removed_and_tier_events(index):
    index.apply(batch("a", 1, ("stored", [1, 2, 3], HOT)))
    assert index.apply(batch("a", 2, ("tier", [2, 3], WARM))) == "ok"
    assert index.match([1, 2, 3]) == {"a": PrefixHit(1, 2, 0)}
    assert index.apply(batch("a", 3, ("removed", [3], WARM), ("removed", [99], HOT))) == "ok"
    assert index.match([1, 2, 3]) == {"a": PrefixHit(1, 1, 0)}
    assert index.entries("a") == {1: HOT, 2: WARM}
    assert index.num_hashes == 2
    assert index.stats["events"] == 4 and index.stats["batches"] == 3
    index.check_invariants()


def test_gap_is_not_applied_and_asks_for_a_snapshot(index):
    index.apply(batch("a", 1, ("stored", [1], HOT)))
    assert index.apply(batch("a", 3, ("stored", [2], HOT))) == "gap"
    assert index.match([1, 2]) == {"a": PrefixHit(1, 0, 0)}
    assert index.needs_snapshot("a") and index.last_seq("a") == 1
    assert index.stats["gaps"] == 1
    assert index.load_snapshot("a", 3, {1: HOT, 2: WARM}) == "ok"
    assert not index.needs_snapshot("a")
    assert index.match([1, 2]) == {"a": PrefixHit(1, 1, 0)}
    assert index.apply(batch("a", 4, ("removed", [2], WARM))) == "ok"
    assert index.entries("a") == {1: HOT}
    index.check_invariants()


def test_duplicate_is_ignored(index):
    index.apply(batch("a", 1, ("stored", [1], HOT)))
    index.apply(batch("a", 2, ("removed", [1], HOT)))
    assert index.apply(batch("a", 1, ("stored", [1], HOT))) == "duplicate"
    assert index.apply(batch("a", 2, ("stored", [1], HOT))) == "duplicate"
    assert index.match([1]) == {}
    assert index.stats["duplicates"] == 2


def test_unknown_worker(index):
    assert index.apply(batch("zz", 1, ("stored", [1], HOT))) == "unknown_worker"
    assert index.load_snapshot("zz", 1, {1: HOT}) == "unknown_worker"
    assert index.match([1]) == {}
    assert index.stats["unknown_worker"] == 2


def test_resync_batch_asks_for_a_snapshot(index):
    index.apply(batch("a", 1, ("stored", [1, 2], HOT)))
    assert index.apply(batch("a", 2, resync=True)) == "resync"
    assert index.needs_snapshot("a") and index.last_seq("a") == 2
    assert index.match([1, 2]) == {"a": PrefixHit(2, 0, 0)}      # stale entries kept meanwhile
    assert index.load_snapshot("a", 2, {7: COLD}) == "ok"
    assert index.match([1, 2]) == {} and index.match([7]) == {"a": PrefixHit(0, 0, 1)}
    index.check_invariants()


def test_stale_snapshot_is_refused(index):
    for seq in (1, 2, 3):
        index.apply(batch("a", seq, ("stored", [seq], HOT)))
    assert index.load_snapshot("a", 2, {1: HOT, 2: HOT}) == "stale"
    assert index.entries("a") == {1: HOT, 2: HOT, 3: HOT}
    with pytest.raises(InvalidInputError):
        index.load_snapshot("a", 5, {1: 7})


def test_drop_worker_removes_all_its_entries_at_once(index):
    index.apply(batch("a", 1, ("stored", [1, 2, 3], HOT)))
    index.apply(batch("b", 1, ("stored", [1, 2], WARM)))
    assert index.drop_worker("a") == 3
    assert index.match([1, 2, 3]) == {"b": PrefixHit(0, 2, 0)}
    assert index.num_hashes == 2
    assert index.apply(batch("a", 2, ("stored", [5], HOT))) == "unknown_worker"
    assert index.drop_worker("a") == 0
    index.check_invariants()


def test_reregistering_starts_the_worker_over(index):
    index.apply(batch("a", 1, ("stored", [1], HOT)))
    index.register_worker("a")                  # a restarted process numbers its batches from 1 again
    assert index.match([1]) == {}
    assert index.apply(batch("a", 1, ("stored", [2], HOT))) == "ok"


def test_encoded_batches_and_malformed_bytes(index):
    good = batch("a", 1, ("stored", [1, 2], HOT)).encode()
    assert index.apply_encoded(good) == "ok"
    assert index.apply_encoded(b"\xc1garbage") == "malformed"
    assert index.stats["malformed"] == 1 and "not msgpack" in index.last_error
    assert index.match([1, 2]) == {"a": PrefixHit(2, 0, 0)}


def test_long_shared_prefix_with_many_holders():
    ix = GlobalIndex()
    chain = list(range(1000, 1100))
    for w in range(16):
        ix.register_worker(f"w{w}")
        # worker w holds the first 50 + w blocks, the last w of them WARM
        held = chain[:50 + w]
        events = [("stored", held, HOT)] + ([("tier", held[50:], WARM)] if w else [])
        ix.apply(batch(f"w{w}", 1, *events))
    hits = ix.match(chain)
    assert hits == {f"w{w}": PrefixHit(50, w, 0) for w in range(16)}
    ix.check_invariants()


def test_a_reused_bit_never_reports_the_worker_that_held_it_before(index):
    index.apply(batch("a", 1, ("stored", [1, 2], HOT)))
    assert index.match_cohorts([1, 2]) == [(PrefixHit(2, 0, 0), ["a"])]
    index.drop_worker("a")
    index.register_worker("c")                            # takes the freed bit
    assert index.bit_of("c") == 1 and index.bit_of("a") is None
    assert index.match([1, 2]) == {}
    index.apply(batch("c", 1, ("stored", [1, 2], WARM)))
    assert index.match_cohorts([1, 2]) == [(PrefixHit(0, 2, 0), ["c"])]
    index.check_invariants()


def test_cohorts_split_where_holders_drop_out_or_change_tier(index):
    index.register_worker("c")
    index.apply(batch("a", 1, ("stored", [1, 2, 3], HOT)))
    index.apply(batch("b", 1, ("stored", [1, 2], HOT), ("stored", [3], WARM)))
    index.apply(batch("c", 1, ("stored", [1], HOT)))
    got = {hit: sorted(ws) for hit, ws in index.match_cohorts([1, 2, 3, 4])}
    assert got == {PrefixHit(3, 0, 0): ["a"], PrefixHit(2, 1, 0): ["b"], PrefixHit(1, 0, 0): ["c"]}
    index.apply(batch("b", 2, ("removed", [3], WARM)))
    assert index.match([1, 2, 3]) == {"a": PrefixHit(3, 0, 0), "b": PrefixHit(2, 0, 0), "c": PrefixHit(1, 0, 0)}
    index.check_invariants()
