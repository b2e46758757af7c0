"""CacheReplica: the cache worker as a Ray Serve deployment (one replica per GPU).

A thin shell, like the ``CacheWorker`` actor: a ``WorkerCore`` does the work
and a ``DirectoryLink`` reaches the directory, under the Serve replica id, so
the ingress's decisions name replicas and ``DirectoryRouter`` sends each
request to the one chosen. Serve carries only the requests (``generate``,
``generate_all``: one ``GenerateRequest`` each); everything aimed at one
replica (a peer's migration pull, the ingress's admin calls) reaches it over
its peer channel (``actors.peer``), which it registers with the directory.
Metrics are reported here.
"""

from __future__ import annotations

import logging

import ray
from ray import serve

from actors.config import WorkerConfig
from actors.core import WorkerCore
from actors.directory_link import DirectoryLink
from actors.peer import PeerClient, PeerDirectory
from cluster.protocol import GenerateRequest, MigrationResult, StreamItem
from serve_app import metrics

log = logging.getLogger("ray.serve")


def _report_metrics(core: WorkerCore) -> None:
    # On the engine thread, just before each report to the directory.
    metrics.report_tiers(core.worker_id, core.cache.tier_summary())
    metrics.report_moves(core.worker_id, core.cache.stats)
    metrics.report_engine(core.worker_id, core.engine.stats)


class CacheReplica:
    def __init__(self, worker_config: dict | None = None, namespace: str = "prefix-cache",
                 policy: str = "cost", policy_args: dict | None = None, peer_secret: str | None = None):
        self.worker_id = serve.get_replica_context().replica_id.unique_id
        cfg = WorkerConfig.from_dict(worker_config)
        self.directory = DirectoryLink(namespace, create=True, policy=policy, block_tokens=cfg.block_tokens,
                                       policy_kwargs=policy_args)
        self._timeouts_seen = 0
        metrics.replica_started(self.worker_id)
        self.peers = PeerDirectory(self.directory.peer_address, secret=peer_secret,
                                   timeout_s=cfg.migration_timeout_s)
        self.core = WorkerCore(self.worker_id, cfg, directory=self.directory, on_report=_report_metrics,
                               on_migration=self._count_migration,
                               on_trip=lambda _reason: metrics.watchdog_trips.inc(tags={"worker": self.worker_id}),
                               peer_host=ray.util.get_node_ip_address(), peer_secret=peer_secret)

    def _count_migration(self, result: MigrationResult) -> None:
        if result.transport is not None:
            metrics.migrations.inc(tags={"transport": result.transport.value})
            metrics.migrated_bytes.inc(result.bytes, tags={"transport": result.transport.value})
        timeouts = self.core.migration.stats["migration_timeouts"]
        if timeouts > self._timeouts_seen:
            metrics.migration_timeouts.inc(timeouts - self._timeouts_seen)
            self._timeouts_seen = timeouts

    async def _link(self, holder_id: str) -> PeerClient | None:
        return await self.peers.client(holder_id)

    # ---------------------------------------------------------------- requests
    async def generate(self, request: GenerateRequest):
        """Stream ``StreamItem``s for one request (sent here by ``DirectoryRouter``)."""
        async for item in self.core.generate(request, self._link):
            yield item

    async def generate_all(self, request: GenerateRequest) -> list[StreamItem]:
        """The whole answer of one request in one reply (the ingress's non-streamed path)."""
        return [item async for item in self.core.generate(request, self._link)]

    def check_health(self) -> None:
        # Serve calls this every health_check_period_s; raising makes it replace the replica.
        self.core.health()

    def __del__(self):
        # Serve calls this when it stops the replica: finish in-flight copies, free the disk file.
        try:
            self.core.close()
        except Exception as exc:   # the process is going anyway; say what was left behind
            log.warning("cache replica close failed (in-flight copies or the disk file may be left): %s", exc)
