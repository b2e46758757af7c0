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

import ray
import torch
from ray import serve

from actors.core import WorkerConfig, WorkerCore
from actors.directory import get_or_create_directory
from cluster.transfer.nixl_transport import TransferError
from serve_app import metrics

log = logging.getLogger("ray.serve")


class CacheReplica:
    def __init__(self, worker_config: dict | None = None, namespace: str = "prefix-cache",
                 policy: str = "cost", app_name: str = "prefix-cache"):
        ctx = serve.get_replica_context()
        self.worker_id = ctx.replica_id.unique_id
        self.app_name = app_name
        self.namespace = namespace
        cfg = WorkerConfig.from_dict(worker_config)
        self.directory = get_or_create_directory(namespace, policy=policy, block_tokens=cfg.block_tokens)
        self.core = WorkerCore(self.worker_id, cfg, publish=self._publish, push_snapshot=self._push_snapshot)
        self._peers: dict[str, str] = {}
        self._self_handle = None
        self.directory.register_worker.remote(self.worker_id, self.core.cost)
        metrics.replica_started(self.worker_id)

    def _publish(self, batch: bytes | None, load: dict):
        metrics.report_tiers(self.worker_id, self.core.cache.tier_summary())
        metrics.report_moves(self.worker_id, self.core.cache.stats)
        return self.directory.publish.remote(self.worker_id, batch, load).future()

    def _push_snapshot(self, seq: int, entries: dict) -> None:
        self.directory.load_snapshot.remote(self.worker_id, seq, entries)

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
        h = self._handle()
        result = {"from": holder, "transport": None, "tokens": 0}
        try:
            staged = await h.export_prefix.remote({"target_worker": holder, "tokens": tokens, "tenant": tenant})
        except Exception as exc:
            log.warning("export from %s failed: %s", holder, exc)
            return result
        if not staged.get("tokens"):  # stale decision: the holder evicted it meanwhile
            self.core.stats["stale_migrations"] += 1
            return result
        kv = None
        try:
            if self.core.nixl is None:
                raise TransferError("NIXL not available")
            if holder not in self._peers:
                info = await h.info.remote({"target_worker": holder})
                if info["nixl"] is None:
                    raise TransferError(f"replica {holder} has no NIXL endpoint")
                self._peers[holder] = self.core.nixl.connect(info["nixl"])
            loop = asyncio.get_running_loop()
            kv = await loop.run_in_executor(None, self.core.pull_blocks_nixl, self._peers[holder], staged)
            result["transport"] = "nixl"
        except Exception as exc:
            self.core.stats["nixl_failures"] += 1
            log.warning("NIXL pull from %s failed (%s); using the object store", holder, exc)
            try:
                array, dtype = await h.export_array.remote({"target_worker": holder, "lease": staged["lease"]})
                kv = torch.from_numpy(array)
                kv = kv.view(torch.bfloat16) if dtype == "bfloat16" else kv
                result["transport"] = "object_store"
                self.core.stats["object_store_fallbacks"] += 1
            except Exception as exc2:
                log.warning("object-store pull failed too (%s); recomputing", exc2)
        finally:
            h.release.remote({"target_worker": holder, "lease": staged["lease"]})
        if kv is not None:
            result["tokens"] = await asyncio.wrap_future(
                self.core.call(lambda: self.core.install_prefix(tokens, tenant, kv)))
            metrics.migrations.inc(tags={"transport": result["transport"]})
            metrics.migrated_bytes.inc(kv.numel() * kv.element_size(), tags={"transport": result["transport"]})
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
        try:
            self.core.close()
            ray.get_actor  # noqa: B018 - keep ray imported for the actor's lifetime
        except Exception:
            pass
