"""Routing policies: which worker serves a request, given the global index.

Every policy has ``choose(hashes, num_tokens, workers, index) -> RouteDecision``,
with ``hashes`` the request's block-hash chain, ``workers`` the current
``WorkerState`` of each replica and ``index`` a ``GlobalIndex``; and
``set_cost`` / ``forget_worker`` so that the directory updates it in place
(what it learned survives a worker joining or a rate changing). Select one
by name with ``make_policy``:

- ``round_robin``, ``least_loaded``: no locality (``base``).
- ``prefix``: longest cached prefix in the index, load-capped (``base``).
- ``approx_tree``: SGLang's ``cache_aware`` router, ported (``baselines``).
- ``ray_prefix``: Ray Serve's ``PrefixCacheAffinityRouter``, ported (``baselines``).
- ``cost`` (default): expected TTFT plus what each option costs later (``cost``).
- ``ideal`` (simulation only): one free global cache, least loaded replica (``base``).
"""

import inspect

from cluster.errors import InvalidInputError
from cluster.routing.policies.base import (RATE_FIELDS, CostModel, IdealPolicy, LeastLoadedPolicy,
                                           NoLiveWorkerError, Policy, PrefixPolicy, RoundRobinPolicy, WorkerState)
from cluster.routing.policies.baselines import ApproxPrefixTree, ApproxTreePolicy, RayPrefixPolicy
from cluster.routing.policies.cost import CostOptions, CostPolicy

POLICIES: dict[str, type[Policy]] = {p.name: p for p in (
    RoundRobinPolicy, LeastLoadedPolicy, PrefixPolicy, ApproxTreePolicy, RayPrefixPolicy, CostPolicy, IdealPolicy)}
DEFAULT_POLICY = "cost"


def make_policy(name: str = DEFAULT_POLICY, **kw) -> Policy:
    cls = POLICIES.get(name)
    if cls is None:
        raise InvalidInputError(f"unknown routing policy {name!r}; choose from {', '.join(POLICIES)}")
    params = inspect.signature(cls).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        unknown = sorted(set(kw) - set(params))
        if unknown:
            raise InvalidInputError(f"routing policy {name!r} takes no option(s) {', '.join(unknown)}; "
                                    f"its options: {', '.join(params) or 'none'}")
    return cls(**kw)


__all__ = ["RATE_FIELDS", "POLICIES", "DEFAULT_POLICY", "make_policy", "ApproxPrefixTree", "ApproxTreePolicy",
           "CostModel", "CostOptions", "CostPolicy", "IdealPolicy", "LeastLoadedPolicy",
           "NoLiveWorkerError", "Policy", "PrefixPolicy", "RayPrefixPolicy", "RoundRobinPolicy", "WorkerState"]
