"""Which tenants have work in the engine, told to the cache each step (``TenantWork``).

Under ``tenant_quotas`` a tenant's HOT, WARM and COLD guarantee holds only
while it has work here (a running or waiting request); an idle tenant's is lent
to the others (``cluster.cache.quotas``). The engine knows its queues, so
before each step it hands the cache the set of tenants with work
(``TieredCache.set_work``); nothing else of the engine reaches the cache.

Guarantees can add up past a tier (every tenant under ``default`` gets the
default's guarantee), so tenants that all only wait can block each other:
each one's request needs room that the others' guarantees keep, and nothing
runs that would ever end. When a step of an otherwise idle engine (nothing
running, no tier move in flight, requests waiting) admits nothing, the waiting
tenants' guarantees are lent too (``lending_waiting``), until a step plans a
request again: the first waiting request the scheduler reaches then makes its
room under its own cap alone (that cap is what ``Engine.submit`` checks), is
promoted if it must be and is admitted a few steps later. Engine thread only.
"""

from __future__ import annotations

from typing import Any


class TenantWork:
    """Before each step: the tenants with work to the cache; after it: whether the engine is stuck."""

    def __init__(self, cache: Any):
        self.cache = cache
        self.lending_waiting = False   # the waiting tenants' guarantees are lent (a stuck idle engine)

    def before_step(self, running: list, waiting: Any) -> None:
        """Tell the cache who has work now, and whose guarantee holds."""
        if self.cache.quotas is None:
            return
        active = {r.namespace for r in running} | {r.namespace for r in waiting}
        self.cache.set_work(active, {r.namespace for r in running} if self.lending_waiting else None)

    def after_step(self, planned: int, running: list, waiting: Any) -> None:
        """``planned`` requests in the step just planned: an otherwise idle engine that planned
        none lends the waiting tenants' guarantees from the next step on, until one is planned."""
        if self.cache.quotas is None:
            return
        if planned or running or not waiting:
            self.lending_waiting = False
        elif not self.cache.in_flight():
            self.lending_waiting = True
