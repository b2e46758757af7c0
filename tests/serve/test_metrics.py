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
