"""DirectoryRouter: a Serve ``RequestRouter`` that sends each request where the ingress decided.

The ingress decides (on its copy of the directory's routing table) before
it calls the replicas, and the decision travels inside the request
(``GenerateRequest.route``). This router only carries it out: the chosen
replica first, then the others from least to most loaded (Serve's queue
length cache), so a request whose replica is full or gone is still served.
A resumed request names the replicas it already failed on
(``GenerateRequest.exclude``): they are never chosen again for it (unless
no other replica is left). It uses Serve's documented router surface only
(``choose_replicas``, ``replica_queue_len_cache``) and writes nothing into
the request.
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from cluster.protocol import GenerateRequest
from serve_app import metrics


class DirectoryRouter(RequestRouter):
    def initialize_state(self, **_: Any) -> None:
        self._random = random.Random()

    def _least_loaded(self, replicas: list[RunningReplica]) -> list[list[RunningReplica]]:
        cache = self.replica_queue_len_cache
        shuffled = list(replicas)
        self._random.shuffle(shuffled)   # ties between equally loaded replicas go either way
        return [[r] for r in sorted(shuffled, key=lambda r: cache.get(r.replica_id) or 0)]

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        message = pending_request.args[0] if pending_request is not None and pending_request.args else None
        if not isinstance(message, GenerateRequest):
            return self._least_loaded(candidate_replicas)
        if message.exclude:
            kept = [r for r in candidate_replicas if r.replica_id.unique_id not in message.exclude]
            candidate_replicas = kept or candidate_replicas   # the last replica standing may have restarted
        route = message.route
        chosen = None
        if route is not None and route.worker_id is not None:
            chosen = next((r for r in candidate_replicas if r.replica_id.unique_id == route.worker_id), None)
        ranks = self._least_loaded(candidate_replicas)
        if chosen is None:
            metrics.router_decisions.inc(tags={"reason": "least_loaded", "source": "serve_router"})
            return ranks
        return [[chosen]] + [rank for rank in ranks if rank[0] is not chosen]
