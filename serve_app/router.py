"""DirectoryRouter: a Serve ``RequestRouter`` that sends each request where the directory says.

For a generation request it decides on its own copy of the directory's
routing table (``TableFollower``: kept in step by a long poll, so no remote
call on the request path), or, while that copy is stale, asks the directory
(``DirectoryLink.route``: awaited, never a ``ray.get`` in this event loop);
it writes the decision into the request (the replica needs
``migrate_from``; the ingress reads its time and source), and ranks that
replica first. A call aimed at one replica
(``PeerCall``: migration, prefetch, admin) goes to that replica only, and to
no other: when the router does not know the target (gone, or not yet
started) the call fails at once with ``TargetGoneError`` instead of waiting.
If the directory does not answer within ``directory_timeout_s``, or names a
replica this router does not know, the least loaded replica is chosen
(Serve's queue-length cache), so serving continues while the directory
restarts. A resumed request names the replicas it already failed on
(``GenerateRequest.exclude``): they are never chosen again for it.

A replica goes to exactly the request it was chosen for
(``_fulfill_next_pending_request``). Serve's ``FIFOMixin`` hands it to the
oldest waiting request instead, so a targeted call could land on a replica
it did not name (3% of calls under load); Serve's default matches by
internal request id, which the calls one HTTP request makes (the ingress's
per-replica stats, flush) share, so all but one of them would wait forever.
Here the match is the pending request itself.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from actors.directory_link import DirectoryLink
from actors.table_follower import TableFollower
from cluster.protocol import GenerateRequest, RouteDecision, target_of
from serve_app import metrics

log = logging.getLogger("ray.serve")


class TargetGoneError(RuntimeError):
    """A targeted call named a replica this router does not know (dead or not started)."""


class DirectoryRouter(RequestRouter):
    def initialize_state(self, namespace: str = "prefix-cache", block_tokens: int = 16,
                         directory_timeout_s: float = 0.5, local_table: bool = True, **_: Any) -> None:
        self.directory = DirectoryLink(namespace, block_tokens=block_tokens, route_timeout_s=directory_timeout_s)
        # A copy of the directory's routing table, followed in the background through the
        # same link: decisions without a remote call (``local_table=False``: ask every time).
        self.table = TableFollower(self.directory) if local_table else None

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
            if target in by_id:
                return [[by_id[target]]]
            return self._fail(pending_request, candidate_replicas, target)
        excluded = set(_excluded(message))
        if excluded:
            kept = [r for r in candidate_replicas if r.replica_id.unique_id not in excluded]
            candidate_replicas = kept or candidate_replicas   # the last replica standing may have restarted
        decision = await self._decide(message)
        if decision is None:
            return self._least_loaded(candidate_replicas)
        chosen = by_id.get(decision.worker_id)
        if chosen is not None and chosen not in candidate_replicas:
            chosen = None
        metrics.router_decisions.inc(tags={"reason": decision.reason, "source": decision.source})
        ranks = self._least_loaded(candidate_replicas)
        if chosen is None:
            return ranks
        return [[chosen]] + [rank for rank in ranks if rank[0] is not chosen]

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata: Any = None) -> None:
        """Give ``replica`` to the pending request it was chosen for, and to no
        other (Serve passes that request's own metadata object)."""
        for pending in self._pending_requests_to_fulfill:
            if pending.metadata is request_metadata and not pending.future.done():
                self._record_queue_wait_time(pending)
                pending.future.set_result(replica)
                index = self._pending_requests_by_id
                if index.get(request_metadata.internal_request_id) is pending:
                    del index[request_metadata.internal_request_id]
                return

    @staticmethod
    def _fail(pending_request: PendingRequest | None, candidates: list[RunningReplica],
              target: str) -> list[list[RunningReplica]]:
        """Fail a targeted call now. Serve only gives up on a request whose future
        is done, and only looks after a non-empty answer: the candidate returned
        is never used (no other request can be handed it: no FIFO hand-off)."""
        metrics.router_decisions.inc(tags={"reason": "target_gone", "source": "target"})
        if pending_request is None:
            return []
        if not pending_request.future.done():
            pending_request.future.set_exception(TargetGoneError(f"replica {target} is not running"))
        return [candidates[:1]]

    async def _decide(self, message: Any) -> RouteDecision | None:
        """The request's decision, asked once even when Serve retries the choice."""
        if isinstance(message, GenerateRequest):
            if message.routing is None:
                started = time.perf_counter()
                message.routing = await self._route(message.prompt, message.tenant, list(message.exclude) or None)
                message.route_s = time.perf_counter() - started
            return message.routing
        if isinstance(message, dict) and "prompt" in message:   # the dict form of a GenerateRequest
            if message.get("routing") is None:
                message["routing"] = await self._route(message["prompt"], message.get("tenant"),
                                                       list(message.get("exclude") or ()) or None)
            return RouteDecision.from_wire(message["routing"])
        return None

    async def _route(self, prompt, tenant, exclude) -> RouteDecision:
        """On the local table copy when it may decide, else by asking the directory."""
        if self.table is not None:
            self.table.ensure_started()
            decision = self.table.route(prompt, tenant, exclude)
            if decision is not None:
                return decision
        return await self.directory.route(prompt, tenant, exclude)


def _excluded(message: Any) -> tuple:
    if isinstance(message, GenerateRequest):
        return tuple(message.exclude)
    if isinstance(message, dict):
        return tuple(message.get("exclude") or ())
    return ()


def _first_arg(pending_request: PendingRequest | None) -> Any:
    if pending_request is None or not pending_request.args:
        return None
    return pending_request.args[0]
