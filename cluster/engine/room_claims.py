"""The fair share's room claims (``RoomClaims``): room taken for a waiting request from a
running request that was already in the step's plan.

Under tenant quotas a waiting request that finds no room takes it from another tenant's
running request that ``TieredCache.may_preempt`` allows, but only from one not yet in
that step's plan (``Scheduler._preempt_for``), and running requests are planned first.
So where every request it may take room from was planned, it is noted (``note``), and
before the next step is planned one such request claims its room (``claim``): the
waiting requests whose tenants are least over their HOT guarantee first, each asking the
policy's ``claim_victim`` for a victim the quotas allow for the HOT tokens it asks
(``TieredCache.hot_asks``). The victim goes back to the queue behind its claimant, back
only after it. Other waiting requests may still take the room first (one that fits):
holding them back for the claimant's step was tried (2026-12-07) and measured no better
in ``bench tenants`` (B's TTFT median of three 1.78x alone, against 1.39x without it).

Found from ``bench tenants`` (2026-12-07, a step log of each room wait): a quiet tenant's
later turn, its prefix in WARM and its tenant under its guarantee, waited 9 steps for its
promotion while the flood's running prompt, planned first each step, grew into HOT's free
blocks 32 tokens a step. Engine thread only, like the scheduler.
"""

from __future__ import annotations

from typing import Any, Callable

from cluster.names import HOT


class RoomClaims:
    """Waiting requests that found no victim out of the plan: one claim a step for them."""

    def __init__(self, stats: dict):
        self.stats = stats
        self.unmet: list = []   # this step's, claimed for before the next one is planned

    def note(self, req: Any) -> None:
        """``req`` found no room and no victim out of the step's plan."""
        self.unmet.append(req)

    def claim(self, cache: Any, policy: Any, waiting: list, running: list,
              preempt: Callable[..., None]) -> bool:
        """At most one claim for last step's unmet requests (see the module); True: made."""
        excess = (lambda ns: 0) if cache.quotas is None else (lambda ns: cache.quotas.excess(ns, HOT))
        heads = sorted((r for r in self.unmet if r in waiting), key=lambda r: excess(r.namespace))
        self.unmet = []
        for head in heads:
            asked = cache.hot_asks(head.tokens, head.namespace)
            victim = policy.claim_victim(head, running, lambda r, v, asked=asked: cache.may_preempt(r, v, asked))
            if victim is not None:
                preempt(victim, at=waiting.index(head) + 1)
                victim.yielded_to = head
                self.stats["room_claims"] += 1
                return True
        return False

    def skip(self) -> None:
        """No claim before this step (a time slice took room for a blocked request instead)."""
        self.unmet = []
