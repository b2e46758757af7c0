"""The L3 fetch guard (``l3_fetch: auto``): a round trip plus tokens, fitted robustly, and a
probe a while so a guard that judged L3 slower finds out when that changes."""

import pytest

from cluster.cache.l3.fetch_cost import FetchCost

# A store with a 50 ms round trip and 20 us a token (50,000 tokens/s past the round trip).
TRIP, PER_TOKEN = 0.050, 20e-6


def fitted(sizes, **kw):
    cost = FetchCost(**kw)
    for t in sizes:
        cost.add(t, TRIP + t * PER_TOKEN)
    return cost


def test_the_fit_tells_the_round_trip_from_the_rate():
    cost = fitted([32, 32, 64, 512, 1024, 2048])
    trip, per_token = cost.fit()
    assert trip == pytest.approx(TRIP) and per_token == pytest.approx(PER_TOKEN)
    assert cost.seconds(4096) == pytest.approx(TRIP + 4096 * PER_TOKEN)


def test_small_fetches_do_not_turn_l3_off_for_long_runs():
    """Prefill at 1,000 tokens/s: a 32-token fetch (51 ms) loses to its prefill (32 ms), and
    every fetch's own rate is under 1,000 tokens/s (32 / 0.0506 = 632), which a single rate
    smoothed over them would have read as "L3 slower" for every run. A run of 1,024 tokens
    fetches in 70 ms against 1.02 s of prefill."""
    cost = fitted([32, 32, 32, 48, 48])
    assert all(t / s < 1_000 for t, s in cost.samples)
    assert not cost.beats_recompute(32, 1_000.0)
    assert cost.beats_recompute(1024, 1_000.0)
    assert cost.beats_recompute(64, 1_000.0)   # 51.3 ms against 64 ms


def test_one_slow_fetch_moves_nothing():
    cost = fitted([32, 64, 128, 256, 512, 1024, 2048, 32, 64, 128])
    before = cost.fit()
    cost.add(512, 5.0)   # one fetch behind a stalled store
    assert cost.fit() == pytest.approx(before)
    assert cost.beats_recompute(1024, 1_000.0)


def test_before_enough_fetches_the_given_rate_decides_and_unknown_fetches():
    cost = FetchCost(min_samples=4)
    assert cost.fit() is None and cost.beats_recompute(1024, 1_000.0)   # nothing known: the fetch measures
    cost.rate = 800.0   # a calibration's rate under prefill
    assert not cost.beats_recompute(1024, 1_000.0)
    for t in (32, 1024, 2048):
        cost.add(t, TRIP + t * PER_TOKEN)
    assert not cost.beats_recompute(1024, 1_000.0)   # three samples: still the rate
    cost.add(64, TRIP + 64 * PER_TOKEN)
    assert cost.beats_recompute(1024, 1_000.0)


def test_one_size_only_reads_as_one_rate():
    cost = fitted([32] * 5)
    trip, per_token = cost.fit()
    assert trip == 0.0 and per_token == pytest.approx((TRIP + 32 * PER_TOKEN) / 32)
    assert not cost.beats_recompute(1024, 1_000.0)   # the conservative side until a probe brings a size


def test_a_probe_comes_once_every_probe_s():
    cost = FetchCost(probe_s=30.0, started_at=100.0)
    assert [cost.probe_due(t) for t in (110.0, 129.9, 130.0, 140.0, 159.9, 161.0)] == \
        [False, False, True, False, False, True]
