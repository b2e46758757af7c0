"""``CacheStats``: the cache's counters as named fields, read under the names the worker's
stats, the metrics and the benchmarks use."""

import pytest

from cluster.cache.cache_stats import CacheStats
from cluster.cache.tiered import TierConfig, TieredCache
from cluster.names import COLD, HOT


def test_drops_are_read_by_tier_and_reason_and_a_snapshot_puts_the_counters_back():
    s = CacheStats()
    s.count_drop(COLD, "last_tier", 40)
    s.count_drop(HOT, "lower_full", 8)
    s.stalls += 2
    assert (s["dropped_tokens"], s["dropped_cold_last_tier_tokens"], s["dropped_hot_lower_full_tokens"]) == (48, 40, 8)
    assert s.get("dropped_warm_flush_tokens") is None and "dropped_by" not in s
    snapshot = s.as_dict()
    assert dict(s) == snapshot and len(s) == len(snapshot) and snapshot["stalls"] == 2
    s.count_drop(HOT, "flush", 5)
    s.promotions += 1
    s.clear()
    s.update(snapshot)   # what the worker's calibration does around its own requests
    assert s.as_dict() == snapshot
    with pytest.raises(KeyError):
        s.update({"no_such_counter": 1})


def test_the_cache_counts_into_one_object_its_parts_share():
    cache = TieredCache(TierConfig(hot_blocks=8, warm_blocks=8, block_tokens=4), None)
    assert cache.space.stats is cache.stats and cache.moves.stats is cache.stats
    assert cache.sessions.stats is cache.stats
    lease = cache.admit(list(range(12)), compute_last=False)
    lease.reserve(12)
    lease.written(12)
    lease.commit(list(range(12)))
    lease.release()
    assert cache.demote_path(list(range(12))) == 12 and cache.stats["demoted_to_warm"] == 1
