"""DirectoryRouter: a Serve ``RequestRouter`` that sends each request where the directory says.

For a generation request it asks the directory (``DirectoryLink.route``:
awaited, never a ``ray.get`` in this event loop) which replica should serve
it, writes the decision into the request (the replica needs
``migrate_from``), and ranks that replica first. A call aimed at one replica
(``PeerCall``: migration, prefetch, admin) goes to that replica only. If the
directory does not answer within ``directory_timeout_s``, or names a replica
this router does not know, the least loaded replica is chosen (Serve's
queue-length cache), so serving continues while the directory restarts.
"""

from __future__ import annotations

import logging
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from actors.directory_link import DirectoryLink
from cluster.protocol import GenerateRequest, RouteDecision, target_of
from serve_app import metrics

log = logging.getLogger("ray.serve")


class DirectoryRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, namespace: str = "prefix-cache", block_tokens: int = 16,
                         directory_timeout_s: float = 0.5, **_: Any) -> None:
        self.directory = DirectoryLink(namespace, block_tokens=block_tokens, route_timeout_s=directory_timeout_s)

    def _least_loaded(self, replicas: list[RunningReplica]) -> list[list[RunningReplica]]:
        cache = self._replica_queue_len_cache
        ordered = sorted(replicas, key=lambda r: cache.get(r.replica_id) or 0)
        return [[r] for r in ordered]

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        message = _first_arg(pending_request)
        if message is None:
            return self._least_loaded(candidate_replicas)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        target = target_of(message)
        if target is not None:
            return [[by_id[target]]] if target in by_id else []
        decision = await self._decide(message)
        if decision is None:
            return self._least_loaded(candidate_replicas)
        chosen = by_id.get(decision.worker_id)
        metrics.router_decisions.inc(tags={"reason": decision.reason})
        ranks = self._least_loaded(candidate_replicas)
        if chosen is None:
            return ranks
        return [[chosen]] + [rank for rank in ranks if rank[0] is not chosen]

    async def _decide(self, message: Any) -> RouteDecision | None:
        """The request's decision, asked once even when Serve retries the choice."""
        if isinstance(message, GenerateRequest):
            if message.routing is None:
                message.routing = await self.directory.route(message.prompt, message.tenant)
            return message.routing
        if isinstance(message, dict) and "prompt" in message:   # the dict form of a GenerateRequest
            if message.get("routing") is None:
                message["routing"] = await self.directory.route(message["prompt"], message.get("tenant"))
            return RouteDecision.from_wire(message["routing"])
        return None


def _first_arg(pending_request: PendingRequest | None) -> Any:
    if pending_request is None or not pending_request.args:
        return None
    return pending_request.args[0]
