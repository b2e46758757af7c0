"""Partial promotion (issue 51): ``TieredCache.ready`` brings up the root-ward WARM part of a
prefix and leaves a COLD rest to compute where the measured rates make that soonest
(``TierMoves.tiers_to_promote``)."""

import torch

from cluster.cache.radix_tree import COLD, WARM
from cluster.cache.tiered import TierConfig, TieredCache
from tests.unit.helpers import TickClock
from tests.unit.test_tiered import LAYOUT, demote, kv_for, put


def test_partial_promotion_brings_up_the_warm_part_and_leaves_the_slow_cold_rest_to_compute(tmp_path):
    """A prefix of 24 tokens: the root-ward 12 in WARM (copied at 0.1 ms a token), the
    other 12 in COLD (measured 5 ms a token), against 1 ms a token to compute. Promoting
    all costs 61 ms, computing all 30 ms (with the margin), the WARM part up and the COLD
    rest computed 16 ms: ``ready`` starts a promotion of the WARM node only; once it has
    landed the answer is ready with the 12 COLD tokens to compute, the lease takes the 12
    promoted ones bit-exact, and the COLD copy stays cached (nothing dropped)."""
    cache = TieredCache(TierConfig(hot_blocks=16, warm_blocks=16, cold_blocks=16, block_tokens=4,
                                   disk_dir=str(tmp_path), device="cpu"), LAYOUT, clock=TickClock(),
                        deterministic_io=True)
    toks = list(range(1, 25))
    root_ward = put(cache, toks[:12])
    leaf = put(cache, toks)
    demote(cache, leaf, COLD)
    demote(cache, root_ward, WARM)
    assert cache.lookup(toks).tier_lengths == [0, 12, 12]
    cache.promote_s_per_token[WARM], cache.promote_s_per_token[COLD] = 1e-4, 5e-3
    first = cache.ready(toks + [99], recompute_s_per_token=1e-3)
    assert (first.ready, first.recompute, cache.stats["promotions_partial"]) == (False, 0, 1)
    cache.wait_all()
    cache.poll()
    assert cache.lookup(toks).tier_lengths == [12, 0, 12]
    then = cache.ready(toks + [99], recompute_s_per_token=1e-3)
    assert (then.ready, then.recompute, cache.stats["promotions_recompute_cheaper"]) == (True, 12, 1)
    lease = cache.admit(toks + [99], promote=False)
    try:
        assert (lease.cached_tokens, lease.missed_by_tier) == (12, (0, 0, 12))
        assert torch.equal(lease.read(), kv_for(toks[:12]))
    finally:
        lease.release()
    assert cache.lookup(toks).tier_lengths == [12, 0, 12]
    cache.check_invariants()
    cache.close()


def test_with_every_copy_cheaper_than_computing_the_whole_prefix_comes_up(tmp_path):
    """The same prefix with COLD measured at 0.5 ms a token: promoting all (7.2 ms) beats
    the WARM part alone (16.2 ms) and computing all (30 ms): one promotion of both nodes."""
    cache = TieredCache(TierConfig(hot_blocks=16, warm_blocks=16, cold_blocks=16, block_tokens=4,
                                   disk_dir=str(tmp_path), device="cpu"), LAYOUT, clock=TickClock(),
                        deterministic_io=True)
    toks = list(range(1, 25))
    root_ward = put(cache, toks[:12])
    demote(cache, put(cache, toks), COLD)
    demote(cache, root_ward, WARM)
    cache.promote_s_per_token[WARM], cache.promote_s_per_token[COLD] = 1e-4, 5e-4
    assert cache.ready(toks + [99], recompute_s_per_token=1e-3)[:2] == (False, [0, 12, 12])
    cache.wait_all()
    cache.poll()
    assert cache.lookup(toks).tier_lengths == [24, 0, 0]
    assert (cache.stats["promotions_partial"], cache.stats["promotions_recompute_cheaper"]) == (0, 0)
    cache.close()
