"""CacheReplica: the cache worker as a Ray Serve deployment (one replica per GPU).

A thin shell, like the ``CacheWorker`` actor: a ``WorkerCore`` does the work
and a ``DirectoryLink`` reaches the directory, under the Serve replica id, so
the ingress's decisions name replicas and ``DirectoryRouter`` sends each
request to the one chosen. Serve carries only the requests (``generate``,
``generate_all``: one ``GenerateRequest`` each); everything aimed at one
replica (a peer's migration pull, the ingress's admin calls) reaches it over
its peer channel (``actors.peer``), which it registers with the directory.
Metrics are reported here.

Start-up: on CUDA a replica compiles Triton's kernels and captures the CUDA graph
of every decode batch-size bucket on its engine thread before it reports ready
(``cluster.engine.cuda_graphs.warm_up``), so nothing compiles on the serving path
(on the CPU its kernels were built with the engine, and this does nothing).

Lifetime (``actors.elastic``): before it reports ready, a new replica warms up
on its peers' most valuable shared prefixes (from L3 or from them); when Serve
stops it (scale-in, a redeploy), its destructor drains it in the directory and
hands its cache on to L3 and to the surviving replicas, within ``handoff_s``
(keep it under the deployment's ``graceful_shutdown_timeout_s``). When the
whole app is being deleted (or Serve shut down) there are no survivors: every
replica writes to L3 only (``_app_leaving``).
"""

from __future__ import annotations

import asyncio
import logging
import time

import ray
from ray import serve

from actors.config import WorkerConfig
from actors.core import WorkerCore
from actors.directory_link import DirectoryLink
from actors.elastic import hand_off, warm_up
from actors.peer import PeerClient, PeerDirectory, PeerUnavailableError
from cluster.engine import cuda_graphs
from cluster.protocol import GenerateRequest, MigrationResult, PrefixOffer, StreamItem
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


class CacheReplica:
    async def __init__(self, worker_config: dict | None = None, namespace: str = "prefix-cache",
                       policy: str = "cost", policy_args: dict | None = None, peer_secret: str | None = None):
        started_at, t0 = time.time(), time.perf_counter()
        self.worker_id = serve.get_replica_context().replica_id.unique_id
        cfg = WorkerConfig.from_dict(worker_config)
        self.directory = DirectoryLink(namespace, create=True, policy=policy, block_tokens=cfg.block_tokens,
                                       policy_kwargs=policy_args)
        self._timeouts_seen = 0
        metrics.replica_started(self.worker_id)
        self.peers = PeerDirectory(self.directory.peer_address, secret=peer_secret,
                                   timeout_s=cfg.migration_timeout_s)
        # Loading, calibrating and the directory's blocking lookups: off the replica's event loop.
        self.core = await asyncio.to_thread(
            WorkerCore, self.worker_id, cfg, directory=self.directory, on_report=_report_metrics,
            on_migration=self._count_migration,
            on_trip=lambda _reason: metrics.watchdog_trips.inc(tags={"worker": self.worker_id}),
            peer_host=ray.util.get_node_ip_address(), peer_secret=peer_secret)
        self.core.link_for = self._link
        t_core = time.perf_counter()
        self.compiled = await self._build_cuda_steps()
        t_cuda = time.perf_counter()
        self.ops = ServePeerOps(self)
        self.handoff: dict | None = None
        self.warmup = (await warm_up(self.core, self.ops, budget_s=cfg.warmup_s, max_bytes=cfg.warmup_mb << 20,
                                     max_prefixes=cfg.warmup_prefixes)).as_dict()
        metrics.report_warmup(self.worker_id, self.warmup)
        # Where a new replica's start-up goes (recovery after a kill waits for all of it).
        t_ready = time.perf_counter()
        self.startup = {"started_at": started_at, "ready_at": started_at + (t_ready - t0),
                        "core_s": round(t_core - t0, 3), "cuda_steps_s": round(t_cuda - t_core, 3),
                        "warmup_s": round(t_ready - t_cuda, 3), "total_s": round(t_ready - t0, 3),
                        "core_parts": dict(self.core.startup)}
        await self.directory.note_lifecycle(self.worker_id, "startup", self.startup)

    async def _build_cuda_steps(self) -> dict:
        """Compile and capture what the model's CUDA steps launch (``cuda_graphs.warm_up``),
        one piece at a time on the engine thread, which owns the model: the watchdog sees
        the engine progress between pieces. Nothing on the CPU."""
        loop = self.core.loop
        done = await asyncio.to_thread(cuda_graphs.warm_up, self.core.model, lambda step: loop.call(step).result())
        if done["steps"]:
            log.info("cache replica %s built its CUDA steps before serving: %s", self.worker_id, done)
        return done

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

    async def __del__(self):
        # Serve awaits this when it stops the replica, after its requests drained:
        # hand the cache on, then finish in-flight copies and free the disk file.
        core = getattr(self, "core", None)
        if core is None:   # the constructor never finished: nothing to hand on
            return
        try:
            to_peers = core.config.handoff_s > 0 and not await _app_leaving()
            self.handoff = (await hand_off(core, self.ops, core.config.handoff_s, to_peers=to_peers)).as_dict()
            metrics.report_handoff(self.worker_id, self.handoff, core.config.block_tokens)
        except Exception as exc:   # what L3 already has stays; the peers recompute the rest
            log.warning("hand-off of %s failed: %s", self.worker_id, exc)
        try:
            core.close()
        except Exception as exc:   # the process is going anyway; say what was left behind
            log.warning("cache replica close failed (in-flight copies or the disk file may be left): %s", exc)


class ServePeerOps:
    """``actors.elastic.PeerOps`` between Serve replicas: the directory names the
    peers, their peer channels reach them."""

    def __init__(self, replica: CacheReplica):
        self.replica = replica

    async def targets(self) -> list[str]:
        return await self.replica.directory.handoff_targets(self.replica.worker_id)

    async def _client(self, worker_id: str) -> PeerClient:
        client = await self.replica.peers.client(worker_id)
        if client is None:
            raise PeerUnavailableError(f"no peer channel for {worker_id}")
        return client

    async def ask_pull(self, target: str, offer: PrefixOffer) -> int:
        # The pull runs a whole migration on the target: bounded by the hand-off's deadline.
        return int(await (await self._client(target)).call("pull", timeout_s=self.replica.core.config.handoff_s,
                                                            offer=offer.to_fields()))

    async def offers(self, peer: str, limit: int) -> list[PrefixOffer]:
        got = await (await self._client(peer)).call("offers", limit=limit)
        return [PrefixOffer.from_fields(o) for o in got]

    async def link(self, holder: str) -> PeerClient | None:
        return await self.replica._link(holder)
