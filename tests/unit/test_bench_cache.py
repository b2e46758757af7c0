"""The cache benchmarks run small and report what they claim (no timings asserted)."""

import argparse

from lab.bench import fragmentation, radix
from lab.bench.sglang_baseline import _CountingAllocator  # noqa: F401 - importable without sglang


def _args(module, argv):
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    return p.parse_args(argv)


def test_radix_replay_locks_and_inserts_every_request_and_counts_the_tree():
    seqs = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9]]
    r = radix.replay(seqs, block_tokens=4, capacity_tokens=0)
    assert r["records"] == 3 and r["tokens"] == 22
    assert r["hit_rate"] == round((8 + 4) / 22, 4)      # a full hit and a 4-token prefix
    assert r["nodes"] == 3 and r["cached_tokens"] == 10   # [1..4] -> {[5..8], [9, 9]}
    assert r["nodes_per_cached_token"] == 0.3


def test_radix_replay_in_a_child_reports_peak_rss():
    r = radix.in_child(radix.replay, [[1, 2, 3]] * 3, 4, 0)
    assert r["records"] == 3 and r["peak_rss_mb"] > 0


def test_radix_replay_with_eviction_stays_within_capacity():
    seqs = [[i] * 8 for i in range(1, 20)]
    r = radix.replay(seqs, block_tokens=4, capacity_tokens=16)
    assert r["cached_tokens"] <= 16 and r["evicted_tokens"] == 19 * 8 - r["cached_tokens"]


def test_fragmentation_churn_repeats_the_same_operations():
    args = _args(fragmentation, ["--steps", "300", "--pool-tokens", "4096"])
    first, second = fragmentation.churn("flat", args), fragmentation.churn("flat", args)
    assert len(first["_alloc_ns"]) == len(second["_alloc_ns"]) == first["allocations"]
    assert first["internal_fragmentation"] == second["internal_fragmentation"]
    assert first["metadata_bytes_per_token"] > 0
