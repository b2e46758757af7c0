"""CacheReplica: the cache worker as a Ray Serve deployment (one replica per GPU).

Each replica owns a ``WorkerCore`` (model runner + tiered radix cache + NIXL
endpoint) and registers with the directory under its Serve replica id, so the
directory's decisions name replicas and ``DirectoryRouter`` can send each
request to the one chosen. Migration between replicas goes through the same
deployment handle with ``target_worker`` set, which the router honours.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ray import serve
from ray.exceptions import RayActorError

from actors.core import WorkerConfig, WorkerCore
from actors.directory import get_or_create_directory
from serve_app import metrics

log = logging.getLogger("ray.serve")


class ReplicaLink:
    """``actors.core.PeerLink`` to one replica, through the deployment handle:
    ``target_worker`` makes ``DirectoryRouter`` send the call to that replica."""

    def __init__(self, handle, worker_id: str):
        self.handle, self.worker_id = handle, worker_id

    async def export_prefix(self, tokens, tenant):
        return await self.handle.export_prefix.remote({"target_worker": self.worker_id, "tokens": tokens,
                                                       "tenant": tenant})

    async def info(self):
        return await self.handle.info.remote({"target_worker": self.worker_id})

    async def export_array(self, lease):
        return await self.handle.export_array.remote({"target_worker": self.worker_id, "lease": lease})

    def release(self, lease):
        self.handle.release.remote({"target_worker": self.worker_id, "lease": lease})


class CacheReplica:
    def __init__(self, worker_config: dict | None = None, namespace: str = "prefix-cache",
                 policy: str = "cost", app_name: str = "prefix-cache"):
        ctx = serve.get_replica_context()
        self.worker_id = ctx.replica_id.unique_id
        self.app_name = app_name
        self.namespace = namespace
        cfg = WorkerConfig.from_dict(worker_config)
        self._directory_args = dict(policy=policy, block_tokens=cfg.block_tokens)
        self.directory = get_or_create_directory(namespace, **self._directory_args)
        self._directory_lost = False
        self.core = WorkerCore(self.worker_id, cfg, publish=self._publish, push_snapshot=self._push_snapshot)
        self._self_handle = None
        self.directory.register_worker.remote(self.worker_id, self.core.cost)
        metrics.replica_started(self.worker_id)

    def _dir(self):
        if self._directory_lost:  # gone for good (not restarting): whoever notices first recreates it
            self._directory_lost = False
            self.directory = get_or_create_directory(self.namespace, **self._directory_args)
        return self.directory

    def _watch(self, fut):
        if isinstance(fut.exception(), RayActorError):
            self._directory_lost = True

    def _publish(self, batch: bytes | None, load: dict):
        metrics.report_tiers(self.worker_id, self.core.cache.tier_summary())
        metrics.report_moves(self.worker_id, self.core.cache.stats)
        fut = self._dir().publish.remote(self.worker_id, batch, load).future()
        fut.add_done_callback(self._watch)
        return fut

    def _push_snapshot(self, seq: int, entries: dict) -> None:
        self._dir().load_snapshot.remote(self.worker_id, seq, entries)

    def _handle(self):
        if self._self_handle is None:
            self._self_handle = serve.get_deployment_handle("CacheReplica", self.app_name)
        return self._self_handle

    # ---------------------------------------------------------------- requests
    async def generate(self, request: dict):
        """Stream result dicts for ``request`` (prompt token ids, params, tenant, session)."""
        routing = request.get("routing") or {}
        migration = None
        holder = routing.get("migrate_from")
        if holder and holder != self.worker_id:
            migration = await self._migrate(holder, request["prompt"], request.get("tenant"))
        async for item in self.core.generate(request["prompt"], request.get("params"), request.get("tenant"),
                                             request.get("session_id")):
            item["worker_id"] = self.worker_id
            item["reason"] = routing.get("reason", "fallback")
            if migration is not None:
                item["migration"] = migration
            yield item

    async def prefetch(self, request: dict) -> int:
        return await self.core.prefetch(request.get("session_id"), request.get("tokens"), request.get("tenant"))

    # --------------------------------------------------------------- migration
    async def export_prefix(self, request: dict) -> dict:
        return await asyncio.wrap_future(self.core.call(
            lambda: self.core.export_prefix(request["tokens"], request.get("tenant"))))

    async def export_array(self, request: dict):
        return await asyncio.wrap_future(self.core.call(lambda: self.core.export_array(request["lease"])))

    async def release(self, request: dict) -> None:
        await asyncio.wrap_future(self.core.call(lambda: self.core.release(request["lease"])))

    async def info(self, request: dict | None = None) -> dict:
        return self.core.info()

    async def _migrate(self, holder: str, tokens: list[int], tenant: Any) -> dict:
        result = await self.core.migrate_from(holder, ReplicaLink(self._handle(), holder), tokens, tenant)
        if result["transport"]:
            metrics.migrations.inc(tags={"transport": result["transport"]})
            metrics.migrated_bytes.inc(result["bytes"], tags={"transport": result["transport"]})
        return result

    # ------------------------------------------------------------------- admin
    async def stats(self, request: dict | None = None) -> dict:
        return await asyncio.wrap_future(self.core.call(self.core.collect_stats))

    async def flush(self, request: dict | None = None) -> int:
        return await asyncio.wrap_future(self.core.call(self.core.drop_all))

    def check_health(self) -> None:
        if not self.core._thread.is_alive():
            raise RuntimeError("engine thread died")

    def __del__(self):
        # Serve calls this when it stops the replica: finish in-flight copies, free the disk file.
        try:
            self.core.close()
        except Exception:
            pass
