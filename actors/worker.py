"""CacheWorker: the Ray actor holding one GPU's tiered radix cache and model runner.

Thin: it owns a ``WorkerCore`` and exposes it, plus the two things that need
Ray: publishing KV events to the directory and pulling a prefix from another
worker (NIXL READ first, the Ray object store if that fails, recompute last).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray
from ray.exceptions import RayActorError

from actors.core import WorkerConfig, WorkerCore
from actors.directory import get_or_create_directory
from actors.naming import DIRECTORY_NAME, worker_actor_name

log = logging.getLogger(__name__)


class CacheWorkerImpl:
    """The actor body; kept as a plain class so it can also run in-process."""

    def __init__(self, worker_id: str, config: dict | None = None, namespace: str = "prefix-cache",
                 directory_name: str = DIRECTORY_NAME):
        self.worker_id = worker_id
        self.namespace = namespace
        self.directory_name = directory_name
        self._directory = None
        self.core = WorkerCore(worker_id, WorkerConfig.from_dict(config), publish=self._publish,
                               push_snapshot=self._push_snapshot)
        self._register()

    # -------------------------------------------------------------- directory
    def _dir(self):
        if self._directory is None:
            # Get it, or recreate it if it is gone for good (killed without restart).
            self._directory = get_or_create_directory(self.namespace, name=self.directory_name)
        return self._directory

    def _watch(self, fut) -> None:
        if isinstance(fut.exception(), RayActorError):
            self._directory = None

    def _register(self) -> None:
        self._dir().register_worker.remote(self.worker_id, self.core.info()["cost"])

    def _publish(self, batch: bytes | None, load: dict):
        # Never blocks the engine thread: the status comes back as a future.
        fut = self._dir().publish.remote(self.worker_id, batch, load).future()
        fut.add_done_callback(self._watch)
        return fut

    def _push_snapshot(self, seq: int, entries: dict) -> None:
        self._dir().load_snapshot.remote(self.worker_id, seq, entries)

    # --------------------------------------------------------------- serving
    async def generate(self, prompt: list[int], params: dict | None = None, namespace: Any = None,
                       session_id: Any = None, migrate_from: str | None = None):
        """Stream result dicts; with ``migrate_from``, first pull that worker's prefix."""
        migrated = None
        if migrate_from and migrate_from != self.worker_id:
            migrated = await self._migrate(migrate_from, prompt, namespace)
        async for item in self.core.generate(prompt, params, namespace, session_id):
            if migrated is not None:
                item["migration"] = migrated
            yield item

    async def prefetch(self, session_id: Any = None, tokens: list[int] | None = None, namespace: Any = None) -> int:
        return await self.core.prefetch(session_id, tokens, namespace)

    # ------------------------------------------------------------- migration
    async def export_prefix(self, tokens: list[int], namespace: Any = None, max_tokens: int | None = None) -> dict:
        return await asyncio.wrap_future(self.core.call(lambda: self.core.export_prefix(tokens, namespace, max_tokens)))

    async def export_array(self, lease: int):
        return await asyncio.wrap_future(self.core.call(lambda: self.core.export_array(lease)))

    async def release(self, lease: int) -> None:
        await asyncio.wrap_future(self.core.call(lambda: self.core.release(lease)))

    def _link(self, holder_id: str) -> "ActorLink":
        return ActorLink(ray.get_actor(worker_actor_name(holder_id), namespace=self.namespace))

    async def _migrate(self, holder_id: str, tokens: list[int], namespace: Any) -> dict:
        try:
            link = self._link(holder_id)
        except ValueError:  # the holder is gone: recompute
            self.core.stats["recomputed_after_failed_migration"] += 1
            return {"from": holder_id, "transport": None, "tokens": 0}
        return await self.core.migrate_from(holder_id, link, tokens, namespace)

    async def nixl_read(self, holder_id: str, tokens: list[int], namespace: Any = None) -> dict:
        """Pull a prefix over NIXL only, without installing it (tests and drills)."""
        link = self._link(holder_id)
        staged = await link.export_prefix(tokens, namespace)
        try:
            kv = await self.core.pull_nixl(holder_id, link, staged)
        finally:
            link.release(staged["lease"])
        return {"tokens": staged["tokens"], "checksums": staged["checksums"], "kv": kv}

    # ------------------------------------------------------------ inspection
    def inject_fault(self, kind: str, on: bool = True) -> None:
        """Fault injection for drills and tests: 'nixl' or 'object_store'."""
        if kind not in ("nixl", "object_store"):
            raise ValueError(f"unknown fault {kind!r}")
        (self.core.faults.add if on else self.core.faults.discard)(kind)

    def info(self) -> dict:
        return self.core.info()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    async def snapshot(self) -> tuple[int, dict]:
        return await asyncio.wrap_future(self.core.call(self.core.publisher.snapshot))

    async def stats(self) -> dict:
        return await asyncio.wrap_future(self.core.call(self.core.collect_stats))

    def load(self) -> dict:
        return self.core.load()

    async def flush(self) -> int:
        return await asyncio.wrap_future(self.core.call(self.core.drop_all))

    def ping(self) -> str:
        return self.worker_id


class ActorLink:
    """``actors.core.PeerLink`` over another CacheWorker actor."""

    def __init__(self, handle):
        self.handle = handle

    async def export_prefix(self, tokens, tenant):
        return await self.handle.export_prefix.remote(tokens, tenant)

    async def info(self):
        return await self.handle.info.remote()

    async def export_array(self, lease):
        return await self.handle.export_array.remote(lease)

    def release(self, lease):
        self.handle.release.remote(lease)


CacheWorker = ray.remote(CacheWorkerImpl)


def start_worker(worker_id: str, config: dict | None = None, *, namespace: str = "prefix-cache",
                 resources: dict | None = None, num_gpus: float | None = None,
                 directory_name: str = DIRECTORY_NAME):
    """Create (or get) the named worker actor; one per GPU where there are GPUs."""
    opts: dict[str, Any] = {"name": worker_actor_name(worker_id), "namespace": namespace,
                            "get_if_exists": True, "max_concurrency": 64, "lifetime": None}
    if num_gpus is None:
        num_gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
    opts["num_gpus"] = num_gpus
    opts["num_cpus"] = 0 if num_gpus else 1
    if resources:
        opts["resources"] = resources
    return CacheWorker.options(**opts).remote(worker_id, config, namespace, directory_name)
