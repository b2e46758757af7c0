"""CacheWorker: the Ray actor holding one GPU's tiered radix cache and model runner.

A thin shell: a ``WorkerCore`` does the work, a ``DirectoryLink`` reaches the
directory (the same two the Serve replica uses); this file adds what is
particular to a named actor: positional-argument methods, and reaching a peer
worker by its actor name (``ActorLink``).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import ray

from actors.config import WorkerConfig
from actors.core import WorkerCore
from actors.directory_link import DirectoryLink
from actors.elastic import hand_off, warm_up
from actors.migration import PeerLink
from cluster.engine import cuda_graphs
from cluster.engine.worker_env import cpu_worker_env
from cluster.names import DIRECTORY_NAME, worker_actor_name
from cluster.protocol import (GenerateRequest, LoadReport, PrefixOffer, Snapshot, StagedPrefix, Tenant, Transport,
                              WorkerInfo)

log = logging.getLogger(__name__)


class CacheWorkerImpl:
    """The actor body; kept as a plain class so it can also run in-process."""

    def __init__(self, worker_id: str, config: dict | None = None, namespace: str = "prefix-cache",
                 directory_name: str = DIRECTORY_NAME):
        self.worker_id = worker_id
        self.namespace = namespace
        cfg = WorkerConfig.from_dict(config)
        self.directory = DirectoryLink(namespace, name=directory_name, create=True, block_tokens=cfg.block_tokens)
        self.core = WorkerCore(worker_id, cfg, directory=self.directory)
        self.core.link_for = self._link
        # On CUDA, Triton's kernels and every decode bucket's graph before the actor is ready
        # (on its engine thread, a piece at a time); nothing on the CPU (serve_app.replica).
        self.compiled = cuda_graphs.warm_up(self.core.model, lambda step: self.core.loop.call(step).result())
        self.ops = ActorPeerOps(self)

    # ------------------------------------------------------------ elasticity
    async def warm_up(self) -> dict:
        """Pull the peers' most valuable shared prefixes (``actors.elastic.warm_up``)."""
        cfg = self.core.config
        return (await warm_up(self.core, self.ops, budget_s=cfg.warmup_s, max_bytes=cfg.warmup_mb << 20,
                              max_prefixes=cfg.warmup_prefixes)).as_dict()

    async def leave(self, budget_s: float | None = None, to_peers: bool = True) -> dict:
        """Drain, hand the cache on to L3 and (unless every worker is leaving:
        ``to_peers=False``) the peers, leave the directory (``actors.elastic.hand_off``);
        the actor can be killed afterwards."""
        budget = self.core.config.handoff_s if budget_s is None else budget_s
        return (await hand_off(self.core, self.ops, budget, to_peers=to_peers)).as_dict()

    async def pull(self, offer: PrefixOffer) -> int:
        return await self.core.pull(offer)

    async def offers(self, limit: int = 32) -> list[PrefixOffer]:
        return await self.core.offers(limit)

    # --------------------------------------------------------------- serving
    async def generate(self, request: GenerateRequest):
        """Stream ``StreamItem``s; with ``request.route.migrate_from``, first pull that worker's prefix."""
        async for item in self.core.generate(request, self._link):
            yield item

    async def prefetch(self, session_id: str | None = None, tokens: list[int] | None = None,
                       tenant: Tenant | None = None) -> int:
        return await self.core.prefetch(session_id, tokens, tenant)

    # ------------------------------------------------------------- migration
    async def export_prefix(self, tokens: list[int], tenant: Tenant | None = None,
                            max_tokens: int | None = None) -> StagedPrefix:
        return await self.core.export_prefix(tokens, tenant, max_tokens)

    async def fetch_blocks(self, lease: str):
        return await self.core.fetch_blocks(lease)

    async def release(self, lease: str) -> None:
        await self.core.release(lease)

    async def _link(self, holder_id: str) -> PeerLink | None:
        try:   # a GCS lookup: off the event loop
            handle = await asyncio.to_thread(ray.get_actor, worker_actor_name(holder_id), namespace=self.namespace)
        except ValueError:  # the holder is gone: recompute
            return None
        return ActorLink(handle)

    async def nixl_read(self, holder_id: str, tokens: list[int], tenant: Tenant | None = None):
        """Pull a prefix over NIXL only, without installing it (tests and drills):
        the staged prefix and its KV."""
        link = await self._link(holder_id)
        staged = await link.export_prefix(tokens, tenant)
        try:
            kv = await self.core.migration.pull_nixl(holder_id, link, staged)
        finally:
            link.release(staged.lease)
        return staged, kv

    # ------------------------------------------------------------ inspection
    def inject_fault(self, kind: str, on: bool = True) -> None:
        """Fault injection for drills and tests: 'nixl', 'object_store' or 'wedge'."""
        self.core.inject_fault(kind, on)

    def health(self) -> str:
        """Raises when the engine is wedged (watchdog) or its thread died; the
        directory has then already dropped this worker."""
        self.core.health()
        return self.worker_id

    def info(self) -> WorkerInfo:
        return self.core.info()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    async def snapshot(self) -> Snapshot:
        return await self.core.snapshot()

    async def stats(self) -> dict:
        return await self.core.stats()

    def load(self) -> LoadReport:
        return self.core.load()

    async def flush(self) -> int:
        return await self.core.flush()

    def ping(self) -> str:
        return self.worker_id

    def pid(self) -> int:
        """This actor's process id (fault tests kill it with SIGKILL)."""
        return os.getpid()


class ActorPeerOps:
    """``actors.elastic.PeerOps`` between CacheWorker actors: the directory names
    the peers, Ray reaches them by their actor names."""

    def __init__(self, worker: CacheWorkerImpl):
        self.worker = worker

    async def _handle(self, worker_id: str):
        return await asyncio.to_thread(ray.get_actor, worker_actor_name(worker_id), namespace=self.worker.namespace)

    async def targets(self) -> list[str]:
        return await self.worker.directory.handoff_targets(self.worker.worker_id)

    async def ask_pull(self, target: str, offer: PrefixOffer) -> int:
        return await (await self._handle(target)).pull.remote(offer)

    async def offers(self, peer: str, limit: int) -> list[PrefixOffer]:
        return await (await self._handle(peer)).offers.remote(limit)

    async def link(self, holder: str) -> PeerLink | None:
        return await self.worker._link(holder)


class ActorLink:
    """``PeerLink`` over another CacheWorker actor (its fallback: Ray's object store)."""

    transport = Transport.OBJECT_STORE

    def __init__(self, handle):
        self.handle = handle

    async def export_prefix(self, tokens, tenant) -> StagedPrefix:
        return await self.handle.export_prefix.remote(tokens, tenant)

    async def info(self) -> WorkerInfo:
        return await self.handle.info.remote()

    async def fetch_blocks(self, lease):
        return await self.handle.fetch_blocks.remote(lease)

    def release(self, lease):
        if lease is not None:
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
    # A CPU worker's process: its allocator, its OpenMP runtime, whether its linears may run packed.
    if not num_gpus and (env := cpu_worker_env()):
        opts["runtime_env"] = {"env_vars": env}
    if resources:
        opts["resources"] = resources
    return CacheWorker.options(**opts).remote(worker_id, config, namespace, directory_name)
