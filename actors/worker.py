"""CacheWorker: the one worker shell, around a ``WorkerCore``.

The Serve replica (``serve_app.replica.CacheReplica``) is this class as a
deployment (it adds its replica id, its metrics and Serve's stop); tests,
drills and ``actors.client.ClusterClient`` run the same class as a named Ray
actor (``start_worker``). Either way it is built the same way and reaches
its peers the same way:

- a ``WorkerCore`` does the work; a ``DirectoryLink`` reaches the directory;
- the core's peer channel (``actors.peer``) answers other workers and the
  ingress (migrations, admin calls), and this shell reaches a peer through
  the peer's channel (``PeerDirectory``: the directory knows the addresses),
  both for a migration's pull (``link``) and for the hand-off and warm-up
  (``ChannelPeerOps``);
- Serve (or Ray) carries only the requests: ``generate``, ``generate_all``.

Start-up (``ready``): the core is built off the event loop; on CUDA the
model's Triton kernels and every decode bucket's graph are captured on the
engine thread (``cluster.engine.cuda_graphs.warm_up``; nothing on the CPU);
then the worker warms up on its peers' most valuable shared prefixes
(``actors.elastic.warm_up``) before it takes requests. ``leave`` hands the
cache on (``actors.elastic.hand_off``) and ``close`` frees what it holds.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from typing import Any

import ray

from actors.config import WorkerConfig
from actors.core import WorkerCore
from actors.directory_link import DirectoryLink
from actors.elastic import hand_off, warm_up
from actors.peer import PeerClient, PeerDirectory, PeerUnavailableError
from cluster.engine import cuda_graphs
from cluster.engine.worker_env import cpu_worker_env
from cluster.names import DIRECTORY_NAME, worker_actor_name
from cluster.protocol import GenerateRequest, MigrationResult, PrefixOffer, Snapshot, StreamItem, Tenant

log = logging.getLogger(__name__)

# When this process had imported the worker (torch, the engine, the cache): a start-up note
# tells the process's imports from the time before it (the interpreter, Ray, Serve) and after.
IMPORTED_AT = time.time()


class CacheWorker:
    def __init__(self, worker_id: str, worker_config: dict | None = None, namespace: str = "prefix-cache",
                 routing_policy: str = "cost", policy_args: dict | None = None, peer_secret: str | None = None,
                 directory_name: str = DIRECTORY_NAME):
        """``routing_policy`` and ``policy_args``: the directory's, when this worker is
        the first to need it; ``peer_secret``: what every call on the peer channels
        carries (the app's). Nothing starts until ``ready``."""
        self.worker_id = worker_id
        self.config = cfg = WorkerConfig.from_dict(worker_config)
        self.directory = DirectoryLink(namespace, name=directory_name, create=True, policy=routing_policy,
                                       block_tokens=cfg.block_tokens, policy_kwargs=policy_args)
        self.peer_secret = peer_secret
        self.peers = PeerDirectory(self.directory.peer_address, secret=peer_secret, timeout_s=cfg.migration_timeout_s)
        self.ops = ChannelPeerOps(self)
        self.core: WorkerCore | None = None
        self.compiled: dict | None = None
        self.warmup: dict | None = None
        self.handoff: dict | None = None
        self.startup: dict[str, Any] = {}
        self._starting: asyncio.Future | None = None

    # ------------------------------------------------- hooks (the replica's metrics)
    def _on_report(self, core: WorkerCore) -> None:
        """On the engine thread, just before each report to the directory."""

    def _on_migration(self, result: MigrationResult) -> None:
        """After each migration this worker ran."""

    def _on_trip(self, reason: str) -> None:
        """When the watchdog declared the engine wedged (the directory already dropped it)."""

    def _on_lifecycle(self, kind: str, report: dict) -> None:
        """After the warm-up (``kind`` "warmup") and the hand-off ("handoff")."""

    # --------------------------------------------------------------- start-up
    async def ready(self) -> str | None:
        """Start the worker (the first call does) and return once it takes requests;
        the address of its peer channel."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._start())
        await asyncio.shield(self._starting)
        return self.core.peer.address if self.core.peer is not None else None

    async def _start(self) -> None:
        started_at, t0 = time.time(), time.perf_counter()
        cfg = self.config
        # Loading, calibrating and the directory's blocking lookups: off the event loop.
        self.core = await asyncio.to_thread(
            WorkerCore, self.worker_id, cfg, directory=self.directory, on_report=self._on_report,
            on_migration=self._on_migration, on_trip=self._on_trip, peer_host=ray.util.get_node_ip_address(),
            peer_secret=self.peer_secret)
        self.core.link_for = self.link
        t_core = time.perf_counter()
        self.compiled = await self._build_cuda_steps()
        t_cuda = time.perf_counter()
        self.warmup = (await warm_up(self.core, self.ops, budget_s=cfg.warmup_s, max_bytes=cfg.warmup_mb << 20,
                                     max_prefixes=cfg.warmup_prefixes)).as_dict()
        self._on_lifecycle("warmup", self.warmup)
        # Where a new worker's start-up goes (recovery after a kill waits for all of it).
        t_ready = time.perf_counter()
        self.startup = {"process_started_at": _process_started_at(), "imported_at": IMPORTED_AT,
                        "started_at": started_at,
                        "ready_at": started_at + (t_ready - t0),
                        "core_s": round(t_core - t0, 3), "cuda_steps_s": round(t_cuda - t_core, 3),
                        "warmup_s": round(t_ready - t_cuda, 3), "total_s": round(t_ready - t0, 3),
                        "core_parts": dict(self.core.startup)}
        await self.directory.note_lifecycle(self.worker_id, "startup", self.startup)
        self.core.prepare_grammars()   # after ready: a start waits for none of it
        self.core.prepare_pools()

    async def _build_cuda_steps(self) -> dict:
        """Compile and capture what the model's CUDA steps launch (``cuda_graphs.warm_up``),
        one piece at a time on the engine thread, which owns the model: the watchdog sees
        the engine progress between pieces. Nothing on the CPU."""
        loop = self.core.loop
        done = await asyncio.to_thread(cuda_graphs.warm_up, self.core.model, lambda step: loop.call(step).result())
        if done["steps"]:
            log.info("cache worker %s built its CUDA steps before serving: %s", self.worker_id, done)
        return done

    async def link(self, holder_id: str) -> PeerClient | None:
        """How this worker reaches ``holder_id`` to pull from it (None: gone)."""
        return await self.peers.client(holder_id)

    # ---------------------------------------------------------------- requests
    async def generate(self, request: GenerateRequest):
        """Stream ``StreamItem``s for one request; with ``request.route.migrate_from``,
        first pull that worker's prefix."""
        async for item in self.core.generate(request, self.link):
            yield item

    async def generate_all(self, request: GenerateRequest) -> list[StreamItem]:
        """The whole answer of one request in one reply (the ingress's non-streamed path)."""
        return [item async for item in self.core.generate(request, self.link)]

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray Serve's custom autoscaling metrics hook (the Serve replica inherits it): the
        signals the engine thread published after its last iteration
        (``cluster.routing.autoscale_signals``), read without a call to the engine, so it
        answers at once however long a step runs. Empty until the worker has started."""
        if self.core is None:
            return {}
        return self.core.signals().as_metrics()

    def check_health(self) -> None:
        """Raises when the engine is wedged (watchdog) or its thread died; the directory
        has then already dropped this worker. Serve calls it every health_check_period_s
        and replaces a replica that raises."""
        if self.core is not None:
            self.core.health()

    # --------------------------------------------------------------- leaving
    async def leave(self, budget_s: float | None = None, to_peers: bool = True) -> dict:
        """Drain, hand the cache on to L3 and (unless no worker survives: ``to_peers=False``)
        the peers, leave the directory (``actors.elastic.hand_off``), within ``budget_s``
        (None: the config's ``handoff_s``); the worker can be stopped afterwards."""
        budget = self.config.handoff_s if budget_s is None else budget_s
        self.handoff = (await hand_off(self.core, self.ops, budget, to_peers=to_peers)).as_dict()
        self._on_lifecycle("handoff", self.handoff)
        return self.handoff

    def close(self) -> None:
        """Finish in-flight copies, stop the engine and the peer channel, free the disk file."""
        if self.core is None:
            return
        try:
            self.core.close()
        except Exception as exc:   # the process is going anyway; say what was left behind
            log.warning("cache worker close failed (in-flight copies or the disk file may be left): %s", exc)

    # ---------------------------------------- inspection (tests and drills)
    def lifecycle(self) -> dict:
        """The start-up's parts, the warm-up's and the hand-off's reports (None: not yet)."""
        return {"startup": self.startup, "warmup": self.warmup, "handoff": self.handoff}

    async def snapshot(self) -> Snapshot:
        return await self.core.snapshot()

    def pid(self) -> int:
        """This process's id (fault tests kill it with SIGKILL)."""
        return os.getpid()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    async def nixl_read(self, holder_id: str, tokens: list[int], tenant: Tenant | None = None):
        """Pull a prefix over NIXL only, without installing it: the staged prefix and its KV."""
        link = await self.link(holder_id)
        if link is None:
            raise PeerUnavailableError(f"no peer channel for {holder_id}")
        staged = await link.export_prefix(tokens, tenant)
        try:
            kv = await self.core.migration.pull_nixl(holder_id, link, staged)
        finally:
            link.release(staged.lease)
        return staged, kv


class ChannelPeerOps:
    """``actors.elastic.PeerOps`` over the peer channels: the directory names the
    peers and their addresses."""

    def __init__(self, worker: CacheWorker):
        self.worker = worker

    async def targets(self) -> list[str]:
        return await self.worker.directory.handoff_targets(self.worker.worker_id)

    async def _client(self, worker_id: str) -> PeerClient:
        client = await self.worker.peers.client(worker_id)
        if client is None:
            raise PeerUnavailableError(f"no peer channel for {worker_id}")
        return client

    async def ask_pull(self, target: str, offer: PrefixOffer) -> int:
        # The pull runs a whole migration on the target: bounded by the hand-off's deadline.
        return await (await self._client(target)).pull(offer, timeout_s=self.worker.config.handoff_s)

    async def offers(self, peer: str, limit: int) -> list[PrefixOffer]:
        return await (await self._client(peer)).offers(limit)

    async def link(self, holder: str) -> PeerClient | None:
        return await self.worker.link(holder)


def _process_started_at() -> float | None:
    """When this process started (wall clock), so a start-up note says how long the replica's
    process took to serve, imports included; None where the OS does not say."""
    try:
        import psutil   # a dependency of Ray's

        return psutil.Process().create_time()
    except Exception:
        return None


def start_worker(worker_id: str, config: dict | None = None, *, namespace: str = "prefix-cache",
                 resources: dict | None = None, num_gpus: float | None = None,
                 directory_name: str = DIRECTORY_NAME, peer_secret: str | None = None):
    """Create (or get) ``CacheWorker`` as the named actor of ``worker_id`` (one per GPU
    where there are GPUs); its ``ready`` starts it."""
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
    return _actor_class().options(**opts).remote(worker_id, config, namespace, "cost", None, peer_secret,
                                                 directory_name)


@functools.cache
def _actor_class():
    return ray.remote(CacheWorker)
