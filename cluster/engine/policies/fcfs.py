"""First come, first served (``SchedulingPolicy``'s defaults): the scheduler's order without tenants."""

from __future__ import annotations

from cluster.engine.policies.base import SchedulingPolicy


class FcfsPolicy(SchedulingPolicy):
    """One queue in arrival order (a preempted request back at its front); the newest running
    request yields its room; a time slice takes the decode with the fewest tokens to swap."""

    name = "fcfs"
