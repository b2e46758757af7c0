"""Each tenant's fair share of an engine step's token budget (``TenantShares``).

A tenant is a cache namespace (an API key's tenant). Served first come, first
served, one tenant's flood of long prompts fills every step's budget with its
prefill chunks, and another tenant's short request, whose prefix is cached,
queues behind the whole backlog and then shares a step as long as the flood's
chunk. Under the ``fair`` scheduling policy (``cluster.engine.policies.fair``:
what ``tenant_quotas`` select; without quotas, one shared LRU HOT pool, a quiet
tenant put ahead of the flood's prefills lost its prefix to them, so the
default there stays first come, first served) the scheduler plans a step this
way as soon as more than one tenant has work in the engine:

1. every running request that decodes gets its token (all tenants: one token
   each, and what keeps every stream going);
2. the rest of the budget goes to the tenants with prompt work (a prefill to
   continue, a waiting request), least served recently first (``order``):
   each in turn gets an equal share of what is left among the tenants still to
   go (``allot``), for its own running prefills and then its own waiting
   requests, first come, first served within the tenant; a prompt that can
   end within what is left of the step ends in it, past the tenant's equal
   part (a quiet tenant's short request runs whole in the next step, its
   first token a step sooner; the tenant then counts as served more); what a
   tenant leaves unused goes to the tenants after it, and a last pass gives
   what is still left to any request not yet in the step. Once the first
   tenant ends a prompt in the step, the rest of the step takes only prompts
   that end in it (``FairSharePolicy.after_first``): its first token comes from
   a short step, not one with the flood's chunk in it.

"Served recently": the tokens each tenant had planned, decayed by ``DECAY``
per step (deficit round robin's counter, kept across steps, so the tenant
that flooded the last steps goes last).

**Steps while tenants share the engine** (``step_tokens``, from
``tenant_quotas.step_tokens``): where a step's time grows with its tokens (a
CPU, or a GPU past its flat region), the other tenant's request that arrives
mid-step waits for that step, and the step it joins is as long as its tokens
and the flood's chunk together. While more than one tenant had work within
``window_s``, a step computes at most ``step_tokens`` tokens (Sarathi-Serve's
budget chosen from the latency target): the flood's prompts are split into
short chunks, and a short request waits for and rides in short steps. A
tenant alone keeps the whole ``max_batch_tokens``. Engine thread only.
"""

from __future__ import annotations

from typing import Hashable, Iterable

DECAY = 0.9   # per step: a tenant's recent service counts for about the last ten steps


def chunk_tokens(need: int, budget: int, extra: int) -> int:
    """The tokens a request computes this step: ``need`` whole where it fits in ``budget`` plus
    ``extra`` (under the fair share, a tenant's prompt that can end in this step's budget ends
    in it, past the tenant's equal part: its first token a step sooner, and the tenant then
    counts as served more, so the next step's order turns), else a chunk of ``budget``."""
    return need if need <= budget + max(0, extra) else min(need, budget)


class TenantShares:
    """Recent service and last activity per tenant; the step budget and each tenant's part of it."""

    def __init__(self, step_tokens: int | None = None, window_s: float = 30.0):
        self.step_tokens = step_tokens
        self.window_s = window_s
        self.served: dict[Hashable, float] = {}
        self.seen: dict[Hashable, float] = {}   # tenant -> when it last had work in the engine

    def budget(self, max_batch_tokens: int, tenants_now: Iterable[Hashable], now: float) -> int:
        """This step's token budget: ``step_tokens`` while more than one tenant had work
        within ``window_s`` (the ones with work now included), else ``max_batch_tokens``."""
        for tenant in tenants_now:
            self.seen[tenant] = now
        for tenant in [t for t, at in self.seen.items() if now - at > self.window_s]:
            del self.seen[tenant]
        if self.step_tokens is None or len(self.seen) < 2:
            return max_batch_tokens
        return min(max_batch_tokens, self.step_tokens)

    def order(self, tenants: list[Hashable]) -> list[Hashable]:
        """``tenants`` (given oldest request first), least served recently first; ties keep
        the given order."""
        rank = {t: i for i, t in enumerate(tenants)}
        return sorted(tenants, key=lambda t: (self.served.get(t, 0.0), rank[t]))

    @staticmethod
    def allot(left: int, tenants_to_go: int) -> int:
        """The next tenant's share: an equal part of what is left among the tenants still
        to go, itself included (rounded up: the earlier tenant gets the odd token)."""
        return -(-left // max(1, tenants_to_go))

    def charge(self, used: dict[Hashable, int]) -> None:
        """One step's planned tokens per tenant into the decayed counters (every tenant's
        counter decays, so one that went quiet comes back first)."""
        for tenant in list(self.served):
            self.served[tenant] *= DECAY
            if self.served[tenant] < 1e-3 and tenant not in used:
                del self.served[tenant]
        for tenant, n in used.items():
            self.served[tenant] = self.served.get(tenant, 0.0) + n
