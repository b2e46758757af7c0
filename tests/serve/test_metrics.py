"""serve_app/metrics.py turns the engine's and the cache's cumulative counters into counter increments."""

from serve_app import metrics


class _Recorder:
    def __init__(self):
        self.calls = []

    def inc(self, value, tags):
        self.calls.append((value, tags))


def test_engine_counters_are_reported_as_increments_once(monkeypatch):
    for name in ("preemptions", "preempted_tokens", "swap_in_bytes"):
        monkeypatch.setattr(metrics, name, _Recorder())
    metrics.replica_started("w0")
    metrics.report_engine("w0", {"preemptions": 2, "swap_in_bytes": 4096, "resumed_warm_tokens": 64,
                                 "recomputed_tokens": 0})
    metrics.report_engine("w0", {"preemptions": 3, "swap_in_bytes": 4096, "resumed_warm_tokens": 64,
                                 "recomputed_tokens": 16})
    assert metrics.preemptions.calls == [(2, {"worker": "w0"}), (1, {"worker": "w0"})]
    assert metrics.swap_in_bytes.calls == [(4096, {"worker": "w0"})]
    assert metrics.preempted_tokens.calls == [
        (64, {"worker": "w0", "outcome": "resumed_warm"}),
        (16, {"worker": "w0", "outcome": "recomputed"}),
    ]


def test_tier_moves_are_reported_as_increments(monkeypatch):
    monkeypatch.setattr(metrics, "tier_moves", _Recorder())
    metrics.replica_started("w1")
    metrics.report_moves("w1", {"demoted_to_warm": 5, "promotions": 0})
    metrics.report_moves("w1", {"demoted_to_warm": 7, "promotions": 1})
    assert metrics.tier_moves.calls == [
        (5, {"worker": "w1", "kind": "demoted_to_warm"}),
        (2, {"worker": "w1", "kind": "demoted_to_warm"}),
        (1, {"worker": "w1", "kind": "promoted"}),
    ]


def test_recomputed_held_and_dropped_tokens_are_reported_by_tier_and_reason(monkeypatch):
    for name in ("recomputed_held", "recompute_chosen", "dropped_tokens", "dropped_with_room", "tail_discarded",
                 "preemptions", "preempted_tokens", "swap_in_bytes", "tier_moves"):
        monkeypatch.setattr(metrics, name, _Recorder())
    metrics.replica_started("w2")
    metrics.report_engine("w2", {"recomputed_held_warm_tokens": 0, "recompute_chosen_tokens": 32})
    metrics.report_engine("w2", {"recomputed_held_warm_tokens": 5, "recompute_chosen_tokens": 32})
    assert metrics.recomputed_held.calls == [(5, {"worker": "w2", "tier": "warm"})]
    assert metrics.recompute_chosen.calls == [(32, {"worker": "w2"})]
    metrics.report_moves("w2", {"dropped_tokens": 48, "dropped_cold_last_tier_tokens": 40,
                                "dropped_hot_lower_full_tokens": 8, "dropped_with_room_tokens": 0,
                                "commit_tail_discarded_tokens": 0})
    metrics.report_moves("w2", {"dropped_tokens": 60, "dropped_cold_last_tier_tokens": 52,
                                "dropped_hot_lower_full_tokens": 8, "dropped_with_room_tokens": 3,
                                "commit_tail_discarded_tokens": 0})
    assert metrics.dropped_tokens.calls == [
        (40, {"worker": "w2", "tier": "cold", "reason": "last_tier"}),
        (8, {"worker": "w2", "tier": "hot", "reason": "lower_full"}),
        (12, {"worker": "w2", "tier": "cold", "reason": "last_tier"}),
    ]
    assert metrics.dropped_with_room.calls == [(3, {"worker": "w2"})]
    assert metrics.tail_discarded.calls == []


class _GaugeRecorder:
    def __init__(self):
        self.calls = []

    def set(self, value, tags):
        self.calls.append((value, tags))


def test_tenant_metrics_are_gauges_and_increments(monkeypatch):
    """What ``TieredCache.tenant_stats`` reports per tenant, from a real cache under quotas."""
    from tests.unit.test_tenant_quotas import B_HALF, make, put

    for name in ("tenant_hits", "tenant_lookups", "tenant_evictions"):
        monkeypatch.setattr(metrics, name, _Recorder())
    monkeypatch.setattr(metrics, "tenant_resident", _GaugeRecorder())
    metrics.replica_started("w3")
    cache = make(B_HALF)
    put(cache, 1, "B"), put(cache, 2, "B"), put(cache, 10, "A"), put(cache, 11, "A")
    metrics.report_tenants("w3", cache.tenant_stats())
    put(cache, 12, "A")   # A pushes its own 10 down: caused and suffered by A, none from others
    metrics.report_tenants("w3", cache.tenant_stats())
    a = {"worker": "w3", "tenant": "A"}
    assert metrics.tenant_evictions.calls == [(8, {**a, "tier": "hot", "role": "caused"}),
                                              (8, {**a, "tier": "hot", "role": "suffered"})]
    assert metrics.tenant_lookups.calls == [(2, a), (2, {"worker": "w3", "tenant": "B"}), (1, a)]
    assert metrics.tenant_hits.calls == []
    last = {(t["tenant"], t["tier"]): v for v, t in metrics.tenant_resident.calls[-8:]}
    assert last == {("B", "hot"): 16, ("B", "warm"): 0, ("B", "cold"): 0, ("B", "l3"): 0,
                    ("A", "hot"): 16, ("A", "warm"): 8, ("A", "cold"): 0, ("A", "l3"): 0}
