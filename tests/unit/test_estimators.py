"""Measured costs as recent medians (``cluster.estimators``): one outlier does not move them."""

import pytest

from cluster.cache.kv_pool import KVLayout
from cluster.cache.tiered import TierConfig, TieredCache
from cluster.estimators import RecentMedian
from cluster.names import WARM


def test_one_outlier_moves_the_median_by_one_rank_at_most():
    m = RecentMedian(window=5)
    assert m.value() is None
    for x in (1.0, 1.1, 0.9, 1.0):
        m.add(x)
    assert m.add(100.0) == 1.0            # a 100x outlier: the median stays with the steady samples
    assert m.add(1.2) == 1.1 and len(m) == 5
    for _ in range(3):                    # a change that lasts is followed once it is the majority
        m.add(10.0)
    assert m.value() == 10.0
    with pytest.raises(ValueError, match="window must be >= 1"):
        RecentMedian(window=0)


def test_the_caches_copy_rate_is_the_median_of_its_recent_promotions():
    cache = TieredCache(TierConfig(hot_blocks=4, warm_blocks=4, device="cpu"), KVLayout(2, 1, 4))
    try:
        moves = cache.moves
        for per_token in (2e-6, 2e-6, 3e-6):
            moves._copy_samples[WARM].add(per_token)
        rates = cache.promote_s_per_token                       # the list the scheduler reads

        class Move:
            src_tiers = [WARM]
        moves._note_copy_rate(Move(), 100, 0.05)               # one copy 250x slower (0.5 ms a token)
        assert rates[WARM] == pytest.approx(2.5e-6)            # between the steady samples, not near 0.5 ms
        assert rates is cache.promote_s_per_token              # set in place
    finally:
        cache.close()
