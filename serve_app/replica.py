"""CacheReplica: the cache worker as a Ray Serve deployment (one replica per GPU).

A thin shell, like the ``CacheWorker`` actor: a ``WorkerCore`` does the work
and a ``DirectoryLink`` reaches the directory, under the Serve replica id, so
the directory's decisions name replicas and ``DirectoryRouter`` sends each
request to the one chosen. What is particular to Serve: every call takes one
message (``GenerateRequest`` or ``PeerCall``), which is what the router reads,
and a peer is reached through this deployment's own handle with a
``PeerCall`` aimed at it (``ReplicaLink``). Metrics are reported here.
"""

from __future__ import annotations

import asyncio
import logging

from ray import serve

from actors.config import WorkerConfig
from actors.core import WorkerCore
from actors.directory_link import DirectoryLink
from cluster.protocol import GenerateRequest, MigrationResult, PeerCall
from serve_app import metrics

log = logging.getLogger("ray.serve")


class ReplicaLink:
    """``PeerLink`` to one replica, through the deployment handle: ``PeerCall``
    makes ``DirectoryRouter`` send the call to that replica."""

    def __init__(self, handle, worker_id: str):
        self.handle, self.worker_id = handle, worker_id

    async def export_prefix(self, tokens, tenant):
        return await self.handle.export_prefix.remote(PeerCall(self.worker_id, tokens=tokens, tenant=tenant))

    async def info(self):
        return await self.handle.info.remote(PeerCall(self.worker_id))

    async def export_array(self, lease):
        return await self.handle.export_array.remote(PeerCall(self.worker_id, lease=lease))

    def release(self, lease):
        self.handle.release.remote(PeerCall(self.worker_id, lease=lease))


def _count_migration(result: MigrationResult) -> None:
    if result.transport is not None:
        metrics.migrations.inc(tags={"transport": result.transport.value})
        metrics.migrated_bytes.inc(result.bytes, tags={"transport": result.transport.value})


def _report_metrics(core: WorkerCore) -> None:
    # On the engine thread, just before each report to the directory.
    metrics.report_tiers(core.worker_id, core.cache.tier_summary())
    metrics.report_moves(core.worker_id, core.cache.stats)


class CacheReplica:
    def __init__(self, worker_config: dict | None = None, namespace: str = "prefix-cache",
                 policy: str = "cost", app_name: str = "prefix-cache", policy_args: dict | None = None):
        self.worker_id = serve.get_replica_context().replica_id.unique_id
        self.app_name = app_name
        cfg = WorkerConfig.from_dict(worker_config)
        self.directory = DirectoryLink(namespace, create=True, policy=policy, block_tokens=cfg.block_tokens,
                                       policy_kwargs=policy_args)
        self._self_handle = None
        self._timeouts_seen = 0
        metrics.replica_started(self.worker_id)
        self.core = WorkerCore(self.worker_id, cfg, directory=self.directory, on_report=_report_metrics,
                               on_migration=self._count_migration,
                               on_trip=lambda _reason: metrics.watchdog_trips.inc(tags={"worker": self.worker_id}))

    def _count_migration(self, result: MigrationResult) -> None:
        _count_migration(result)
        timeouts = self.core.migration.stats["migration_timeouts"]
        if timeouts > self._timeouts_seen:
            metrics.migration_timeouts.inc(timeouts - self._timeouts_seen)
            self._timeouts_seen = timeouts

    def _link(self, holder_id: str) -> ReplicaLink:
        if self._self_handle is None:
            self._self_handle = serve.get_deployment_handle("CacheReplica", self.app_name)
        return ReplicaLink(self._self_handle, holder_id)

    # ---------------------------------------------------------------- requests
    async def generate(self, request: GenerateRequest | dict):
        """Stream ``StreamItem``s for one request (routed by ``DirectoryRouter``)."""
        async for item in self.core.generate(GenerateRequest.from_wire(request), self._link):
            yield item

    async def generate_all(self, request: GenerateRequest | dict) -> list:
        """The whole answer of one request in one reply (the ingress's non-streamed path)."""
        return [item async for item in self.core.generate(GenerateRequest.from_wire(request), self._link)]

    async def prefetch(self, call: PeerCall | dict) -> int:
        call = PeerCall.from_wire(call)
        return await self.core.prefetch(call.session_id, call.tokens, call.tenant)

    # --------------------------------------------------------------- migration
    async def export_prefix(self, call: PeerCall) -> dict:
        return await self.core.export_prefix(call.tokens, call.tenant)

    async def export_array(self, call: PeerCall):
        return await self.core.export_array(call.lease)

    async def release(self, call: PeerCall) -> None:
        await self.core.release(call.lease)

    async def info(self, call: PeerCall | None = None) -> dict:
        return self.core.info()

    # ------------------------------------------------------------------- admin
    async def stats(self, call: PeerCall | None = None) -> dict:
        return await self.core.stats()

    async def flush(self, call: PeerCall | None = None) -> int:
        return await self.core.flush()

    def check_health(self) -> None:
        # Serve calls this every health_check_period_s; raising makes it replace the replica.
        self.core.health()

    async def inject_fault(self, call: PeerCall, kind: str, on: bool = True) -> None:
        """Drills and tests: 'wedge', 'nixl' or 'object_store' on the targeted replica."""
        await asyncio.to_thread(self.core.inject_fault, kind, on)   # 'wedge' waits until the engine is in it

    def __del__(self):
        # Serve calls this when it stops the replica: finish in-flight copies, free the disk file.
        try:
            self.core.close()
        except Exception as exc:   # the process is going anyway; say what was left behind
            log.warning("cache replica close failed (in-flight copies or the disk file may be left): %s", exc)
