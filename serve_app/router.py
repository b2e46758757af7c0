"""DirectoryRouter: a Serve ``RequestRouter`` that sends each request where the directory says.

For a generation request it asks the directory actor (awaiting the object
ref: no ``ray.get`` in this event loop) which replica should serve it, writes
the decision into the request (the replica needs ``migrate_from``), and ranks
that replica first. A request that names ``target_worker`` (migration and
admin calls) goes to that replica. If the directory does not answer within
``directory_timeout_s``, or names a replica this router does not know, the
least loaded replica is chosen (Serve's queue-length cache), so serving
continues while the directory restarts.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray
from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from actors.naming import DIRECTORY_NAME
from cluster.hashing import block_hashes
from serve_app import metrics

log = logging.getLogger("ray.serve")


class DirectoryRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, namespace: str = "prefix-cache", block_tokens: int = 16,
                         directory_timeout_s: float = 0.5, **_: Any) -> None:
        self.pc_namespace = namespace
        self.block_tokens = block_tokens
        self.directory_timeout_s = directory_timeout_s
        self._directory = None

    async def _get_directory(self):
        if self._directory is None:
            # get_actor talks to the GCS: keep it off the event loop.
            self._directory = await asyncio.to_thread(ray.get_actor, DIRECTORY_NAME, namespace=self.pc_namespace)
        return self._directory

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
        request = _request_dict(pending_request)
        if request is None:
            return self._least_loaded(candidate_replicas)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        target = request.get("target_worker")
        if target is not None:
            return [[by_id[target]]] if target in by_id else []
        if "prompt" not in request:
            return self._least_loaded(candidate_replicas)
        if "routing" not in request:  # decide once, even when Serve retries the choice
            try:
                directory = await self._get_directory()
                hashes = block_hashes(request["prompt"], self.block_tokens, request.get("tenant"))
                decision = await asyncio.wait_for(directory.route.remote(hashes, len(request["prompt"])),
                                                  timeout=self.directory_timeout_s)
                request["routing"] = decision
            except Exception as exc:  # unreachable, restarting, or no workers registered yet
                self._directory = None
                request["routing"] = {"worker_id": None, "reason": "fallback_least_loaded",
                                      "migrate_from": None}
                log.warning("directory unavailable (%s); routing to the least loaded replica",
                            type(exc).__name__)
        decision = request["routing"]
        chosen = by_id.get(decision.get("worker_id"))
        metrics.router_decisions.inc(tags={"reason": decision.get("reason", "unknown")})
        ranks = self._least_loaded(candidate_replicas)
        if chosen is None:
            return ranks
        return [[chosen]] + [rank for rank in ranks if rank[0] is not chosen]


def _request_dict(pending_request: PendingRequest | None) -> dict | None:
    if pending_request is None or not pending_request.args:
        return None
    first = pending_request.args[0]
    return first if isinstance(first, dict) else None
