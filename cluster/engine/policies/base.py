"""``SchedulingPolicy``: what the scheduler asks a policy (``cluster.engine.scheduler``).

The scheduler owns the queues, the leases and the room rules (HOT room reserved
before a forward, preemption into the cache, no admission below what the tiers
hold). A policy owns three choices, each a method here:

- **the waiting order** (``waiting_order``): in which order waiting requests are
  looked at, within a group;
- **the budget split** (``step_budget``, ``groups``, ``share``, ``reach``,
  ``after_first``, ``charge``): after
  every decode has its token, who shares what is left of the step's token
  budget: one group (``ANY``: every request) or one group per tenant, each its
  share, in the policy's order;
- **the victim choice** (``room_victim``, ``slice_victim``, ``slot_yields``,
  ``preempts_across_tenants``): which running request gives up its room when a
  running request needs room, when a time slice fires
  (``cluster.engine.preemption``), and when a waiting tenant has no running slot;
  and who may take a free running slot (``takes_slot``).

The defaults here are first come, first served (``fcfs.py``). A policy is one
file with a subclass and one line in ``cluster.engine.policies.POLICIES``.
Engine thread only.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Iterable

ANY = object()   # the group of every request (a policy that does not split the budget by tenant)


class SchedulingPolicy:
    """First come, first served: one group, the waiting queue in its order, the newest running
    request yields. ``max_running``: the scheduler's; ``quotas``: the cache's ``QuotaConfig``
    (None: no tenant quotas)."""

    name = "fcfs"
    preempts_across_tenants = False   # a waiting request may take another tenant's room (fair share)
    promotes_inline = True    # a short promotion from WARM may be waited for in the step (waiting_checks)
    ending_first = False      # a tenant's new prompts that end in the step go before its own running fills

    def __init__(self, max_running: int, quotas: Any = None):
        self.max_running = max_running
        self.quotas = quotas

    def step_budget(self, max_batch_tokens: int, running: list, waiting: Iterable, clock: Callable) -> int:
        """This step's token budget (decodes and prompt chunks together; ``clock``: the engine's)."""
        return max_batch_tokens

    def groups(self, running: list, waiting: Iterable, planned: set[int]) -> tuple[list, bool]:
        """Who shares the budget left after the decodes, in order (``ANY`` or tenants), and
        whether a last pass gives what is still left to anyone not yet in the step."""
        return [ANY], False

    def share(self, left: int, groups_to_go: int) -> int:
        """The next group's part of ``left`` (``groups_to_go``: it and the ones after it)."""
        return left

    def reach(self, left: int, share: int, first: bool, spare: int) -> int:
        """How far past its ``share`` a group's prompt that can end in this step may go: what is
        left of the step (``left``), and for a policy that shortens steps, where it says
        (``spare``: the tokens the shortening kept out of this step, ``first``: the group that
        comes first in the step's first pass)."""
        return left - share

    def after_first(self, items: list, groups: int) -> bool:
        """Once the first of ``groups`` groups is planned (``items``: what it put in the step),
        whether the rest of the step takes only prompts that end in it, no chunk of a longer
        one (no by default)."""
        return False

    def waiting_order(self, waiting: Iterable) -> list:
        """The waiting requests in the order they are looked at (first come, first served)."""
        return list(waiting)

    def room_victim(self, candidates: list) -> Any:
        """Of ``candidates`` (running requests, newest first), the one that yields its room."""
        return next(iter(candidates), None)

    def slice_victim(self, running: list) -> Any:
        """How a time slice picks among the decodes past their slice: a function of those
        candidates (newest first), or None for the slicer's own pick (fewest tokens to swap)."""
        return None

    def slice_candidates(self, head: Any, running: list) -> list:
        """The running requests a time slice for ``head`` may take room from (every one)."""
        return running

    def claim_victim(self, head: Any, running: list, may_preempt: Callable) -> Any:
        """A running request of another tenant to preempt, before the step is planned, for the
        waiting request ``head`` that found no room last step (None: no claim; the fair share's)."""
        return None

    def slot_yields(self, running: list, waiting: Iterable) -> list[tuple[Any, Any]]:
        """(victim, waiting request) pairs: running requests that yield their slot before
        this step is planned, each to the waiting request it yields to (none by default)."""
        return []

    def takes_slot(self, req: Any, free: int, running: list, waiting: Iterable, owed: list) -> bool:
        """Whether ``req`` may take one of the ``free`` running slots (``free`` > 0: neither taken
        nor owed to another waiting request, ``owed``): yes by default."""
        return True

    def charge(self, used: dict[Hashable, int]) -> None:
        """This step's planned tokens per tenant (for a policy that keeps recent service)."""
