"""The inline promotion's own measure (``cluster.engine.waiting_checks.InlinePromotions``):
the wall time per token of the waits it made decides the next one, not the copy thread's
rate measured beside forward passes; waits of a few tokens are not measured. A fake cache
and clock: exact decisions and samples."""

from __future__ import annotations

from types import SimpleNamespace

from cluster.cache.tier_types import Readiness
from cluster.engine.waiting_checks import (INLINE_PROBE_STEP_SHARE, INLINE_SAMPLE_MIN_TOKENS, INLINE_STEP_SHARE,
                                           InlinePromotions)
from tests.unit.test_fair_share import Clock as FakeClock

STEP_S = 0.040   # the median step: an inline wait may take INLINE_STEP_SHARE of it (10 ms)


class FakeCache:
    """A WARM copy rate as the copy thread measured it, and a promotion that takes
    ``wait_s`` of the clock when awaited; then the prefix is all HOT."""

    def __init__(self, clock: FakeClock, copy_rate: float, wait_s: float):
        self.promote_s_per_token = [None, copy_rate, None]
        self.clock, self.wait_s, self.awaited = clock, wait_s, 0

    def await_promotion(self, tokens, namespace=None):
        self.awaited += 1
        self.clock.now += self.wait_s

    def ready(self, tokens, namespace=None, *, make_room=True, recompute_s_per_token=None):
        return Readiness(True, [len(tokens), 0, 0])


def waiting(warm: int, hot: int = 97) -> tuple[SimpleNamespace, Readiness]:
    req = SimpleNamespace(tokens=list(range(hot + warm)), namespace="B")
    return req, Readiness(False, [hot, warm, 0])


def test_the_measured_inline_wait_decides_not_the_copy_threads_rate():
    """The copy thread's rate beside a forward (2e-5 s a token, as measured on 2 cores) puts a
    2,100-token promotion at 42 ms, over a whole 40 ms step: even the first one (the probe) is
    declined. A 690-token one (13.8 ms, over a quarter of the step but under a whole one) is the
    probe: waited for and measured (0.69 ms: 1e-6 s a token). From then on the measured waits
    decide, against a quarter of the step: the 2,100 tokens are estimated at 2.1 ms."""
    clock = FakeClock()
    inline = InlinePromotions(clock)
    cache = FakeCache(clock, copy_rate=2e-5, wait_s=0.00069)
    big, big_readiness = waiting(2100)
    assert 2100 * 2e-5 > INLINE_PROBE_STEP_SHARE * STEP_S
    assert inline.promote(cache, big, big_readiness, STEP_S, None) is None and cache.awaited == 0
    req, readiness = waiting(690)
    assert INLINE_STEP_SHARE * STEP_S < 690 * 2e-5 <= INLINE_PROBE_STEP_SHARE * STEP_S
    assert inline.promote(cache, req, readiness, STEP_S, None).ready
    assert list(inline.waits.recent) == [0.00069 / 690] and cache.awaited == 1
    assert inline.rate(cache) == 0.00069 / 690   # the copy thread's rate no longer decides
    again = inline.promote(cache, big, big_readiness, STEP_S, None)
    assert again.ready and again.tiers == [2197, 0, 0] and cache.awaited == 2
    inline.waits.recent.clear()   # waits measured slow (1e-4 s a token): a quarter of the step, not a whole one
    inline.waits.add(1e-4)
    assert inline.promote(cache, req, readiness, STEP_S, None) is None and cache.awaited == 2


def test_a_wait_of_a_few_tokens_is_not_measured():
    """A 1-token promotion whose wait took 1 ms (the hand-off's fixed part: 1e-3 s a token)
    is waited for but not sampled; a later 690-token promotion is still decided by the
    cache's rate (2e-6 s a token: 1.4 ms) and waited for."""
    clock = FakeClock()
    inline = InlinePromotions(clock)
    cache = FakeCache(clock, copy_rate=2e-6, wait_s=0.001)
    tiny, tiny_readiness = waiting(1)
    assert inline.promote(cache, tiny, tiny_readiness, STEP_S, None).ready
    assert len(inline.waits) == 0 and inline.rate(cache) == 2e-6
    req, readiness = waiting(INLINE_SAMPLE_MIN_TOKENS)
    assert inline.promote(cache, req, readiness, STEP_S, None).ready
    assert list(inline.waits.recent) == [0.001 / INLINE_SAMPLE_MIN_TOKENS]


def test_no_inline_wait_without_a_rate_a_step_or_for_cold_and_l3():
    """Nothing measured yet, no step measured, or part of the prefix in COLD or coming from L3:
    the request is passed over while its copy runs, as before."""
    clock = FakeClock()
    inline = InlinePromotions(clock)
    cache = FakeCache(clock, copy_rate=None, wait_s=0.0)
    req, readiness = waiting(100)
    assert inline.promote(cache, req, readiness, STEP_S, None) is None
    cache.promote_s_per_token[1] = 1e-6
    assert inline.promote(cache, req, readiness, None, None) is None
    assert inline.promote(cache, req, Readiness(False, [97, 100, 5]), STEP_S, None) is None
    assert inline.promote(cache, req, Readiness(False, [97, 100, 0, 40]), STEP_S, None) is None
    assert cache.awaited == 0
