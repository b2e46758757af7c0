"""The tenants' fair share (``fair``): the policy tenant quotas select (``cluster.engine.fair_share``).

- **Budget split**: every decode first, then the rest of the step shared among the
  tenants with prompt work, least served recently first, each an equal part of what
  is left for its own prefills and then its own waiting requests, and a last pass
  for what is still left (``TenantShares``). One tenant alone with the whole budget
  is planned first come, first served. While tenants share the engine the step is
  ``tenant_quotas.step_tokens`` long.
- **Running slots**: each tenant with work has a share of ``max_running``
  (``max_running`` over the tenants with work, at least 1). When every slot is
  taken and a tenant with waiting work has no running request, the tenant most
  over its slot share yields one slot to it before the step is planned
  (``slot_yields``: its newest request not preempted often, into the cache, back
  after the request it yielded to): a tenant's short request does not wait behind
  another's long decodes. This yield is not gated by time slicing's measured gain
  and cost: it happens only for a tenant with no running slot, once per free
  slot it needs. A slot freed while the step is planned (a preemption for room)
  goes to a tenant already running a request only where that leaves no tenant
  over its share, or a slot for every tenant with none (``takes_slot``).
- **A quiet tenant's later turn**: within a tenant, a new prompt that ends in the
  step (a later turn after its cached history) goes before that tenant's own
  running prefill fills (``ending_first``): beside A's flood, B's later turns
  otherwise sat unreached behind B's own new session's 600-token fill for 28-42
  steps (``bench tenants``).
- **A quiet tenant's first token**: a step in which the least-served tenant's
  prompt ends carries no chunk of another tenant's longer prompt (``after_first``;
  decodes and prompts that end in the step stay): the
  flood's chunk, beside a quiet tenant's later turn, about doubled the step its
  first token came from (``bench tenants``' step counts).
- **Promotions**: a waiting request whose prefix is partly in WARM is admitted in
  the step that starts its promotion, the step's planning waiting for the copy where
  it is measured short (one a step, the first in the tenants' order: ``promotes_inline``,
  ``cluster.engine.waiting_checks``; first come, first served does the same in its
  order); every other request is passed over while its copy runs.
- **Victims**: a time slice for a waiting request takes room only from its own
  tenant or one served at least as much recently (from its own tenant only once
  that tenant holds its slot share), and only where the quotas
  allow (``slice_candidates``, ``may_preempt``); for room (and for a time slice, still gated by its measured gain
  and cost) the tenant most over its slot share yields first, then the tenant
  served most recently; a waiting request that finds no room may take it from
  another tenant's running request that the quotas allow (``may_preempt``), and
  from one already in that step's plan (every decode is planned first) before the
  next step is planned (``claim_victim``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Hashable, Iterable

from cluster.engine.fair_share import TenantShares
from cluster.engine.policies.base import ANY, SchedulingPolicy
from cluster.engine.preemption import spare_repeated


class FairSharePolicy(SchedulingPolicy):
    name = "fair"
    preempts_across_tenants = True
    ending_first = True   # see the module docstring's "a quiet tenant's later turn"
    first_token_alone = True   # see ``after_first``

    def __init__(self, max_running: int, quotas: Any = None):
        super().__init__(max_running, quotas)
        self.shares = TenantShares(quotas.step_tokens if quotas else None,
                                   quotas.active_window_s if quotas else 30.0)
        self.tenants: list = []   # this step's tenants with work, oldest request first
        self.full_budget = True   # this step has the whole max_batch_tokens

    def step_budget(self, max_batch_tokens: int, running: list, waiting: Iterable, clock: Callable) -> int:
        self.tenants = list(dict.fromkeys(r.namespace for r in (*running, *waiting)))
        budget = self.shares.budget(max_batch_tokens, self.tenants, clock())
        self.full_budget = budget >= max_batch_tokens
        return budget

    def groups(self, running: list, waiting: Iterable, planned: set[int]) -> tuple[list, bool]:
        if len(self.tenants) <= 1 and self.full_budget:   # one tenant: first come, first served
            return [ANY], False
        prompting = {r.namespace for r in (*running, *waiting) if id(r) not in planned}
        return self.shares.order([t for t in self.tenants if t in prompting]), True

    def share(self, left: int, groups_to_go: int) -> int:
        return self.shares.allot(left, groups_to_go)

    def reach(self, left: int, share: int, first: bool, spare: int) -> int:
        """The tenant served least recently (first in the order) may end a waiting request's
        prompt in this step past the shortened step (``step_tokens``) by at most one more
        shortened step (``spare``, given for waiting requests only): a quiet tenant's later
        turn is not cut into two or three short chunks beside a flood, while no step grows
        long (a running fill, the flood's, never gets it)."""
        return left - share + (spare if first else 0)

    def after_first(self, items: list, groups: int) -> bool:
        """A step in which the tenant served least recently (first in the order) ends a prompt,
        its next token due, carries no chunk of another tenant's longer prompt
        (``first_token_alone``; the decodes and other prompts that end in the step stay): a quiet
        tenant's first token comes from a short step, not one as long as its tokens and the
        flood's chunk together. The flood's chunk waits a step; the order turns as the quiet
        tenant counts as served."""
        return self.first_token_alone and groups > 1 and any(item.samples for item in items)

    def slot_share(self, tenants: int, max_running: int) -> int:
        return max(1, max_running // max(1, tenants))

    def over_share_key(self, running: list):
        """A running request's rank as a victim: its tenant's running requests past the
        tenant's slot share, then the tenant's recent service (higher yields first)."""
        counts = Counter(r.namespace for r in running)
        share = self.slot_share(len(self.tenants) or len(counts), self.max_running)
        served = self.shares.served
        return lambda r: (counts[r.namespace] - share, served.get(r.namespace, 0.0))

    def room_victim(self, candidates: list):
        return max(candidates, key=lambda r: self.shares.served.get(r.namespace, 0.0), default=None)

    def slice_victim(self, running: list):
        key = self.over_share_key(running)
        return lambda candidates: max(candidates, key=key, default=None)

    def slice_candidates(self, head: Any, running: list) -> list:
        """A time slice for ``head`` takes room only from its own tenant or a tenant served at
        least as much recently: a flood's request does not slice a quieter tenant's decode (which
        would then wait behind the flood's backlog, ``yielded_to``). A tenant already at its slot
        share takes room from its own requests only: another tenant's slot, freed for it, went to
        its tenant's next request while a third tenant had none (the tenant state machine)."""
        served = self.shares.served
        mine = served.get(head.namespace, 0.0)
        counts = Counter(r.namespace for r in running)
        own_only = counts[head.namespace] >= self.slot_share(len(self.tenants) or len(counts), self.max_running)
        return [r for r in running if r.namespace == head.namespace
                or (not own_only and served.get(r.namespace, 0.0) >= mine)]

    def claim_victim(self, head: Any, running: list, may_preempt: Callable) -> Any:
        """The room a waiting request found none of last step (``head``), claimed before the next
        step is planned: from a running request of another tenant that the quotas allow
        (``may_preempt``: further over its HOT guarantee than ``head``'s would be), the tenant
        served most first, newest first, not one preempted often. Where it found no room, every
        such request was already in that step's plan (decodes and running prompts go first)."""
        return self.room_victim(spare_repeated(
            r for r in reversed(running) if r.namespace != head.namespace and may_preempt(head.namespace, r.namespace)))

    def slot_yields(self, running: list, waiting: Iterable) -> list[tuple[Any, Any]]:
        max_running = self.max_running
        waiting = list(waiting)
        tenants = list(dict.fromkeys(r.namespace for r in (*running, *waiting)))
        if len(running) < max_running or len(tenants) < 2:
            return []
        counts = Counter(r.namespace for r in running)
        share = self.slot_share(len(tenants), max_running)
        out, taken = [], set()
        heads = {}
        for req in waiting:   # each slot-less tenant's oldest request that may run now
            if counts[req.namespace] == 0 and req.yielded_to is None:
                heads.setdefault(req.namespace, req)
        for tenant in self.shares.order(list(heads)):
            over = [r for r in reversed(running) if counts[r.namespace] > share and id(r) not in taken]
            if not over:
                break
            victim = max(spare_repeated(over), key=lambda r: (counts[r.namespace] - share,
                                                              self.shares.served.get(r.namespace, 0.0)))
            taken.add(id(victim))
            counts[victim.namespace] -= 1
            counts[tenant] += 1
            out.append((victim, heads[tenant]))
        return out

    def takes_slot(self, req: Any, free: int, running: list, waiting: Iterable, owed: list) -> bool:
        """A tenant that already runs a request takes a free slot only where, after it, no tenant
        is over its slot share, or a free slot is left for every other tenant with waiting work
        (a request not yielded to another), none running and none owed: a slot freed while the
        step was planned (a preemption for room) went to a tenant at its share, filled the slots
        and left a slotless tenant waiting that no yield had served (the tenant state machine's
        slot invariant). A tenant without a running request, or a request owed its slot, takes
        it. ``waiting``: the queue (read twice at most)."""
        counts = Counter(r.namespace for r in running)
        if not counts[req.namespace] or any(r is req for r in owed):
            return True
        counts[req.namespace] += 1
        tenants = self.tenants or list(dict.fromkeys(r.namespace for r in (*running, *waiting)))
        share = self.slot_share(len(tenants), self.max_running)
        if all(n <= share for n in counts.values()) or free >= len(tenants):   # a slot left for each
            return True
        kept, slotless = {r.namespace for r in owed}, set()
        if self.tenants and all(counts[t] or t in kept for t in self.tenants):
            return True   # every tenant with work this step runs or is owed a slot: no queue scan
        for r in waiting:
            if r.yielded_to is None and not counts[r.namespace] and r.namespace not in kept:
                slotless.add(r.namespace)
                if len(slotless) >= free:   # the slots left would not serve every slotless tenant
                    return False
        return True

    def charge(self, used: dict[Hashable, int]) -> None:
        self.shares.charge(used)
