"""Checks of a waiting request the scheduler makes before it admits one (``cluster.engine.scheduler``).

- **Shared fills** (``behind_shared_fill``): a waiting request whose part beyond
  the cache a running prompt fill computes waits for that fill's checkpoint.
- **Inline promotion** (``InlinePromotions``, ``promote_inline``): a waiting
  request whose cached prefix is partly in WARM waits for its promotion to HOT.
  The first such request a step reaches (in the policy's order; under the fair
  share, the tenants') waits for that copy inside the step's planning, where the
  measured copy rate says it takes at most ``INLINE_STEP_SHARE`` of the median
  step (``SchedulingPolicy.promotes_inline``); the others are passed over for the
  step while their copies run. Measured beside a flood (``bench tenants``), a quiet
  tenant's later turn was promoted from WARM in most turns and each promotion
  passed it over for one to three whole steps of the flood (80-110 ms each on two
  CPU cores), where the copy itself takes a few milliseconds; first come, first
  served lost the same step (``bench serving --workload shared-prefix``, R = 1: 10
  of 32 requests, 50-200 ms each), and waits inline too since 2026-12-07. The
  step's planning waits those milliseconds and admits it in the same step. One
  such wait a step; a promotion from COLD or L3 (a disk, the network) is never
  waited for inline. The inline waits are measured on their
  own (``InlinePromotions``): the copy thread's rate beside a forward pass is
  10-35x an inline wait's on two cores.
- **Prompt logprobs** (``logprob_cap``): how much cached prefix a request that
  wants its prompt's logprobs may take.

Engine thread only.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from cluster.estimators import RecentMedian
from cluster.names import COLD, L3, WARM
from cluster.tokens import common_prefix

INLINE_STEP_SHARE = 0.25   # an inline promotion's measured copy time, at most this share of the median step
# Until an inline wait is measured, the first one (a probe) may take, by the copy thread's rate,
# up to this share of the median step: that rate is 10-35x an inline wait's, so with a quarter
# no first wait was ever taken and none was ever measured (first come, first served at R = 1 of
# bench serving's shared prefixes: 0 inline promotions in 31 promotion waits).
INLINE_PROBE_STEP_SHARE = 1.0
# Inline waits of fewer WARM tokens are not measured: a wait's fixed part (the hand-off to the copy
# thread and back) over a token or two read as 1e-3 s a token and stopped every later inline wait.
INLINE_SAMPLE_MIN_TOKENS = 64


def behind_shared_fill(running: list, req: Any, cached: int, block_tokens: int) -> bool:
    """The shared-fills policy: whether a running request still filling its prompt
    computes at least a block of what ``req`` would compute beyond the cache, or all of
    it but ``req``'s last token (an identical prompt); ``req`` then waits for that
    fill's checkpoint (taken even for less than a block once awaited)."""
    seq = req.tokens
    need = min(block_tokens, len(seq) - 1 - cached)
    if need < 1:   # only its last token left: nothing another fill could save it
        return False
    fill = next((o for o in running if o.to_compute > 1 and o.namespace == req.namespace
                 and common_prefix(seq, o.tokens) - cached >= need), None)
    if fill is None:
        return False
    fill.awaited = True
    return True


class InlinePromotions:
    """``promote_inline`` with its own measure: the wall time per token of the inline
    waits of at least ``INLINE_SAMPLE_MIN_TOKENS`` (``rate``). The cache's WARM copy
    rate (``TierMoves.promote_s_per_token``) is the copy thread's time, mostly measured
    beside a forward pass that takes the cores; an inline wait runs while the engine
    thread waits. Measured in ``bench tenants`` on 2 cores: inline waits about 1e-6 s a
    token, the copies beside a forward 1e-5 to 3.5e-5, so the cache's rate alone turned
    down a third of the quiet tenant's inline promotions (a 690-token prefix: 13.5 ms
    against a quarter of a 53 ms step), and each one turned down cost it a step. Until
    an inline wait was measured the cache's rate decides, against a whole median step
    (``INLINE_PROBE_STEP_SHARE``: the first wait is the probe). Engine thread only."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.waits = RecentMedian()   # seconds per token of the inline waits

    def rate(self, cache: Any) -> float | None:
        own = self.waits.value()
        return own if own is not None else cache.promote_s_per_token[WARM]

    def promote(self, cache: Any, req: Any, readiness: Any, step_s: float | None,
                recompute_s_per_token: float | None) -> Any:
        """``promote_inline`` at this measure, and the wait measured."""
        began = self.clock()
        share = INLINE_STEP_SHARE if len(self.waits) else INLINE_PROBE_STEP_SHARE
        again = promote_inline(cache, req, readiness, step_s, recompute_s_per_token, self.rate(cache), share)
        if again is not None and readiness.tiers[WARM] >= INLINE_SAMPLE_MIN_TOKENS:
            self.waits.add((self.clock() - began) / readiness.tiers[WARM])
        return again


def promote_inline(cache: Any, req: Any, readiness: Any, step_s: float | None,
                   recompute_s_per_token: float | None, rate: float | None, share: float = INLINE_STEP_SHARE) -> Any:
    """``req``'s promotion from WARM just started (``readiness``: not ready, not blocked):
    where ``rate`` (seconds per token) says it takes at most ``share`` of ``step_s`` (the
    median step), wait for it and look again (the new ``Readiness``); else None."""
    tiers = readiness.tiers
    if not tiers[WARM] or tiers[COLD] or (len(tiers) > L3 and tiers[L3]) or rate is None or not step_s:
        return None
    if tiers[WARM] * rate > share * step_s:
        return None
    cache.await_promotion(req.tokens, req.namespace)
    return cache.ready(req.tokens, req.namespace, make_room=False, recompute_s_per_token=recompute_s_per_token)


def logprob_cap(req: Any) -> int | None:
    """For a request that wants its prompt's logprobs: the most prefix it may take from
    the cache (positions whose logprobs are unknown are computed, even if their KV is cached;
    the sampler filled in what it kept at submit: ``Sampler.prepare``)."""
    if req.params.prompt_logprobs is None or req.prompt_logprobs is None:
        return None
    known = next((i for i, e in enumerate(req.prompt_logprobs) if e is None and i), len(req.prompt))
    return known - 1 if known < len(req.prompt) else None
