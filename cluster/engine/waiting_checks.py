"""Checks of a waiting request the scheduler makes before it admits one (``cluster.engine.scheduler``).

- **Shared fills** (``behind_shared_fill``): a waiting request whose part beyond
  the cache a running prompt fill computes waits for that fill's checkpoint.
- **Inline promotion** (``promote_inline``): a waiting request whose cached
  prefix is partly in WARM waits for its promotion to HOT; the scheduler starts
  the copy and passes the request over for the step while it runs. Under the
  fair share (``SchedulingPolicy.promotes_inline``) the least-served tenant's
  request, while tenants share the engine, waits for that copy inside the step's
  planning instead, where the measured copy rate says it takes at most
  ``INLINE_STEP_SHARE`` of the median step: measured beside a flood (``bench
  tenants``), a quiet tenant's later turn was promoted from WARM in most turns
  and each promotion passed it over for one to three whole steps of the flood
  (80-110 ms each on two CPU cores), where the copy itself takes a few
  milliseconds. The step's planning waits those milliseconds and admits it in
  the same step. One such wait a step; a promotion from COLD or L3 (a disk, the
  network) is never waited for inline.
- **Prompt logprobs** (``logprob_cap``): how much cached prefix a request that
  wants its prompt's logprobs may take.

Engine thread only.
"""

from __future__ import annotations

from typing import Any

from cluster.names import COLD, L3, WARM
from cluster.tokens import common_prefix

INLINE_STEP_SHARE = 0.25   # an inline promotion's measured copy time, at most this share of the median step


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


def promote_inline(cache: Any, req: Any, readiness: Any, step_s: float | None,
                   recompute_s_per_token: float | None) -> Any:
    """``req``'s promotion from WARM just started (``readiness``: not ready, not blocked):
    where the measured copy rate says it takes at most ``INLINE_STEP_SHARE`` of ``step_s``
    (the median step), wait for it and look again (the new ``Readiness``); else None."""
    tiers = readiness.tiers
    rate = cache.promote_s_per_token[WARM]
    if not tiers[WARM] or tiers[COLD] or (len(tiers) > L3 and tiers[L3]) or rate is None or not step_s:
        return None
    if tiers[WARM] * rate > INLINE_STEP_SHARE * step_s:
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
