"""CacheReplica: the cache worker as a Ray Serve deployment (one replica per GPU).

The one worker shell, ``actors.worker.CacheWorker``, under the Serve replica
id, so the ingress's decisions name replicas and ``DirectoryRouter`` sends
each request to the one chosen. Serve carries only the requests
(``generate``, ``generate_all``: one ``GenerateRequest`` each) and asks
``check_health``; everything aimed at one replica (a peer's migration pull,
the ingress's admin calls) reaches it over its peer channel
(``actors.peer``). What this class adds: the replica id, its metrics, and
Serve's stop.

Start-up is the shell's (``CacheWorker.ready``: the core, the CUDA steps on
CUDA, the warm-up on its peers' shared prefixes) and happens before the
replica reports ready. When Serve stops it (scale-in, a redeploy), its
destructor hands its cache on to L3 and to the surviving replicas
(``CacheWorker.leave``), within ``handoff_s`` (keep it under the deployment's
``graceful_shutdown_timeout_s``). When the whole app is being deleted (or
Serve shut down) there are no survivors: every replica writes to L3 only
(``_app_leaving``).
"""

from __future__ import annotations

import asyncio
import logging

from ray import serve

from actors.core import WorkerCore
from actors.worker import CacheWorker
from cluster.protocol import MigrationResult
from serve_app import metrics

log = logging.getLogger("ray.serve")


def _report_metrics(core: WorkerCore) -> None:
    # On the engine thread, just before each report to the directory.
    metrics.report_tiers(core.worker_id, core.cache.tier_summary())
    metrics.report_moves(core.worker_id, core.cache.stats)
    metrics.report_engine(core.worker_id, core.engine.stats)
    if core.cache.quotas is not None:
        metrics.report_tenants(core.worker_id, core.cache.tenant_stats())
    if core.l3 is not None:
        metrics.report_l3(core.worker_id, core.l3.stats)


async def _app_leaving(timeout_s: float = 2.0) -> bool:
    """Whether this replica's whole application is being deleted (its status is
    DELETING, it is gone, or the controller cannot say within ``timeout_s``: Serve
    shutting down): then no replica survives to take a peer hand-off."""
    from ray.serve.schema import ApplicationStatus

    def ask() -> bool:
        app = serve.get_replica_context().replica_id.deployment_id.app_name
        status = serve.status().applications.get(app)
        return status is None or status.status == ApplicationStatus.DELETING

    try:
        return await asyncio.wait_for(asyncio.to_thread(ask), timeout_s)
    except Exception as exc:   # no answer while stopping: assume the app goes (L3 still takes it all)
        log.info("app status unknown at shutdown (%s): hand-off to L3 only", type(exc).__name__)
        return True


class CacheReplica(CacheWorker):
    async def __init__(self, worker_config: dict | None = None, namespace: str = "prefix-cache",
                       routing_policy: str = "cost", policy_args: dict | None = None,
                       peer_secret: str | None = None):
        super().__init__(serve.get_replica_context().replica_id.unique_id, worker_config, namespace,
                         routing_policy, policy_args, peer_secret)
        self._timeouts_seen = 0
        metrics.replica_started(self.worker_id)
        await self.ready()

    # The shell's hooks: this replica's metrics.
    def _on_report(self, core: WorkerCore) -> None:
        _report_metrics(core)

    def _on_migration(self, result: MigrationResult) -> None:
        if result.transport is not None:
            metrics.migrations.inc(tags={"transport": result.transport.value})
            metrics.migrated_bytes.inc(result.bytes, tags={"transport": result.transport.value})
        timeouts = self.core.migration.stats["migration_timeouts"]
        if timeouts > self._timeouts_seen:
            metrics.migration_timeouts.inc(timeouts - self._timeouts_seen)
            self._timeouts_seen = timeouts

    def _on_trip(self, reason: str) -> None:
        metrics.watchdog_trips.inc(tags={"worker": self.worker_id})

    def _on_lifecycle(self, kind: str, report: dict) -> None:
        if kind == "warmup":
            metrics.report_warmup(self.worker_id, report)
        elif kind == "handoff":
            metrics.report_handoff(self.worker_id, report, self.config.block_tokens)

    async def __del__(self):
        # Serve awaits this when it stops the replica, after its requests drained:
        # hand the cache on, then finish in-flight copies and free the disk file.
        if getattr(self, "core", None) is None:   # the constructor never finished: nothing to hand on
            return
        try:
            await self.leave(to_peers=self.config.handoff_s > 0 and not await _app_leaving())
        except Exception as exc:   # what L3 already has stays; the peers recompute the rest
            log.warning("hand-off of %s failed: %s", self.worker_id, exc)
        self.close()
