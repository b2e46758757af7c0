"""The scheduling policies, by the name a config gives (``SchedulerConfig.policy``,
``WorkerConfig.scheduling_policy``): a new policy is one file and one line here."""

from cluster.engine.policies.base import ANY, SchedulingPolicy
from cluster.engine.policies.fair import FairSharePolicy
from cluster.engine.policies.fcfs import FcfsPolicy
from cluster.engine.policies.priority import PriorityPolicy

POLICIES: dict[str, type[SchedulingPolicy]] = {
    "fcfs": FcfsPolicy,
    "fair": FairSharePolicy,
    "priority": PriorityPolicy,
}

__all__ = ["ANY", "POLICIES", "SchedulingPolicy"]
