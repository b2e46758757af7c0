"""WorkerCore: one model, one tiered cache, one NIXL endpoint, one engine thread.

The pieces, each in its own module:

- ``actors.engine_loop.EngineLoop``: the engine thread, its command queue and
  the token streams (it owns the engine and the cache);
- ``actors.migration.Migrator``: leases, NIXL and object-store pulls, installs;
- ``actors.calibration.calibrate``: the ``CostModel`` measured at start-up;
- ``actors.reporter.EventReporter``: KV events, load and snapshots to the directory.

This class wires them and offers the few async methods every shell needs.
It has no Ray dependency of its own: the ``CacheWorker`` actor
(``actors.worker``) and the Serve replica (``serve_app.replica``) are thin
shells around it that differ only in how they are called and how they reach
a peer (``PeerLink``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, AsyncIterator, Callable

import numpy as np
import torch

from actors.calibration import calibrate
from actors.config import WorkerConfig
from actors.engine_loop import EngineLoop, EngineWedgedError, QueueFullError
from actors.migration import Migrator, PeerLink
from actors.reporter import EventReporter
from cluster.cache.kv_pool import KVLayout
from cluster.cache.tiered import TieredCache
from cluster.engine.checkpoint import load_model
from cluster.engine.runner import Engine, Request, SamplingParams
from cluster.protocol import GenerateRequest, LoadReport, MigrationResult, StreamItem, rates_from_wire, rates_to_wire
from cluster.routing.policy import CostModel
from cluster.routing.events import KVEventPublisher
from cluster.transfer.nixl_transport import NixlEndpoint, TransferError, nixl_available, recommended_ucx_env

log = logging.getLogger(__name__)

__all__ = ["WorkerCore", "WorkerConfig", "PeerLink", "QueueFullError", "EngineWedgedError"]


class WorkerCore:
    def __init__(self, worker_id: str, config: WorkerConfig, directory=None,
                 on_report: Callable[["WorkerCore"], None] | None = None,
                 on_migration: Callable[[MigrationResult], None] | None = None,
                 on_trip: Callable[[str], None] | None = None):
        """``directory``: a ``DirectoryLink`` (None: no reports, e.g. in-process
        tests); ``on_report(core)`` runs on the engine thread before each report;
        ``on_migration(result)`` after each migration this worker ran (metrics);
        ``on_trip(reason)`` when the watchdog declares the engine wedged (metrics),
        after the directory was told to drop this worker."""
        self.worker_id = worker_id
        self.config = config
        torch.set_num_threads(config.torch_threads)
        tiers = config.tier_config()
        # A model that cannot load raises here, so the actor or replica never reports ready.
        self.loaded = load_model(config.model_spec(), device=str(tiers.resolved_device()))
        self.model = self.loaded.model
        mc = self.model.config
        self.layout = KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim, mc.dtype)
        self.cache = TieredCache(tiers, self.layout, vocab_size=mc.vocab_size)
        self.engine = Engine(self.model, self.cache, max_batch_tokens=config.max_batch_tokens,
                             max_running=config.max_running, cache_final_token=config.cache_final_token)
        self.nixl = self._open_nixl()
        self.migration = Migrator(worker_id, self.cache, self.nixl, block_tokens=tiers.block_tokens,
                                  bytes_per_token=self.layout.bytes_per_token(),
                                  call_timeout_s=config.migration_timeout_s)
        self.cost = self._peer_cost(directory) or calibrate(self.engine, self.migration)   # before the engine thread owns the cache
        if self.nixl is not None:
            self.migration.transfer_tokens_per_s = self.cost.transfer_tokens_per_s
        self.publisher = KVEventPublisher(worker_id, self.cache.tree, tiers.block_tokens)
        self.cache.add_listener(self.publisher)
        self.directory = directory
        self.on_migration = on_migration
        self.reporter = None
        if directory is not None:
            self.reporter = EventReporter(worker_id, self.publisher, directory, lambda: self.loop.load_report,
                                          on_report=(lambda: on_report(self)) if on_report else None,
                                          wake=lambda: self.loop.wake())
        self._on_trip = on_trip
        self._wedge = threading.Event()
        self.loop = EngineLoop(worker_id, self.engine, max_queued_requests=config.max_queued_requests,
                               on_idle=self._idle, on_tick=self.reporter.tick if self.reporter else None,
                               transfer_rate=lambda: self.migration.transfer_tokens_per_s,
                               watchdog_s=config.watchdog_s, on_trip=self._tripped)
        self.migration.on_engine = lambda fn: self.loop.call(fn).result()
        if directory is not None:
            directory.register(worker_id, self.rates())

    def _peer_cost(self, directory) -> CostModel | None:
        """A registered peer's measured rates, when this worker may reuse them."""
        if directory is None or not self.config.reuse_peer_calibration:
            return None
        wire = directory.measured_rates(self.layout.bytes_per_token(), self.config.block_tokens)
        if wire is None:
            return None
        log.info("worker %s reuses a peer's measured rates instead of calibrating", self.worker_id)
        return CostModel(**rates_from_wire(wire))

    def _open_nixl(self) -> NixlEndpoint | None:
        if not (self.config.use_nixl and self.cache.host_tensor is not None and nixl_available()):
            return None
        try:
            return NixlEndpoint(f"{self.worker_id}-{id(self):x}", self.cache.host_tensor,
                                ucx_env=recommended_ucx_env())
        except TransferError as exc:
            log.warning("NIXL disabled on %s: %s", self.worker_id, exc)
            return None

    def _tripped(self, reason: str) -> None:
        # Watchdog thread: the directory drops this worker now, not after missed heartbeats.
        if self.directory is not None:
            self.directory.report_failure_nowait(self.worker_id)
        if self._on_trip is not None:
            self._on_trip(reason)

    def inject_fault(self, kind: str, on: bool = True) -> None:
        """Drills and tests: 'wedge' blocks the engine thread (until turned off:
        the watchdog trips meanwhile); 'nixl' and 'object_store' break a transport."""
        if kind != "wedge":
            self.migration.inject_fault(kind, on)
        elif on:
            self._wedge.clear()
            started = threading.Event()

            def wedge():
                started.set()
                self._wedge.wait()
            self.loop.call(wedge)
            started.wait(10)   # returns once the engine thread is in it
        else:
            self._wedge.set()

    def _idle(self) -> None:
        self.cache.enforce_watermarks()
        self.cache.compact_idle()

    def rates(self) -> dict:
        """What this worker measured, as it registers with the directory."""
        return rates_to_wire(self.cost, bytes_per_token=self.layout.bytes_per_token())

    # --------------------------------------------------------------- serving
    async def generate(self, request: GenerateRequest, link_for: Callable[[str], PeerLink | None] | None = None
                       ) -> AsyncIterator[StreamItem]:
        """Stream the request's items, each stamped with this worker and the
        routing reason; with ``routing.migrate_from``, pull that worker's prefix
        first (``link_for(holder)`` reaches it; None: it is gone)."""
        received_at, started = time.time(), time.perf_counter()
        routing = request.routing
        migration = None
        holder = routing.migrate_from if routing is not None else None
        if holder and holder != self.worker_id and link_for is not None:
            migration = await self.migrate_from(holder, link_for(holder), request.prompt, request.tenant)
            if self.on_migration is not None:
                self.on_migration(migration)
        migrate_s = time.perf_counter() - started if migration is not None else 0.0
        sp = SamplingParams(**(request.params or {}))
        req = Request(list(request.prompt), sp, namespace=request.tenant, session_id=request.session_id)
        reason = routing.reason if routing is not None else "fallback"
        async for item in self.loop.stream(req):
            item.worker_id, item.reason, item.migration = self.worker_id, reason, migration
            if item.timing is not None:
                item.timing.migrate_s, item.timing.received_at = migrate_s, received_at
            yield item

    async def prefetch(self, session_id: Any = None, tokens: list[int] | None = None, namespace: Any = None) -> int:
        return await self.loop.run(lambda: self.cache.prefetch(session_id, tokens, namespace))

    # ------------------------------------------------------------- migration
    async def migrate_from(self, holder_id: str, link: PeerLink | None, tokens: list[int],
                           tenant: Any) -> MigrationResult:
        return await self.migration.migrate_from(holder_id, link, tokens, tenant, self.loop.run)

    async def export_prefix(self, tokens: list[int], tenant: Any = None, max_tokens: int | None = None) -> dict:
        staged = await self.loop.run(lambda: self.migration.export_prefix(tokens, tenant, max_tokens))
        if staged.get("tokens"):
            self.migration.stats["migrations_out"] += 1
        return staged

    async def export_array(self, lease: str) -> tuple[np.ndarray, str]:
        return await self.loop.run(lambda: self.migration.export_array(lease))

    async def release(self, lease: str) -> None:
        await self.loop.run(lambda: self.migration.release(lease))

    # ------------------------------------------------------------ inspection
    def info(self) -> dict:
        return {"worker_id": self.worker_id, "nixl": self.nixl.metadata() if self.nixl else None,
                "nixl_name": self.nixl.name if self.nixl else None, "block_tokens": self.config.block_tokens,
                "cost": self.rates(), "vocab_size": self.model.config.vocab_size, "model_id": self.loaded.model_id,
                "ownership_checks": self.loop.owner is self.cache.owner}

    def load(self) -> LoadReport:
        """The load as of the engine thread's last iteration (any thread)."""
        return self.loop.load_report

    async def stats(self) -> dict:
        """Tier occupancy, hit counters, migrations, fragmentation."""
        out = await self.loop.run(self._engine_stats)
        out["worker"] = {**out["worker"], **self.migration.stats}
        return out

    def _engine_stats(self) -> dict:
        c = self.cache
        return {"worker_id": self.worker_id, "tiers": c.tier_summary(), "cache": dict(c.stats),
                "tree": dict(c.tree.stats), "engine": dict(self.engine.stats),
                "worker": {**self.loop.stats, "ownership_violations": self.loop.owner.violations,
                           "watchdog_trips": self.loop.watchdog_trips},
                "load": dataclasses.asdict(self.loop.measure_load()), "fragmentation": c.fragmentation(),
                "protected_tokens": c.protected_tokens, "evictable_tokens": c.evictable_tokens}

    async def snapshot(self) -> tuple[int, dict]:
        return await self.loop.run(self.publisher.snapshot)

    async def flush(self) -> int:
        """Drop every unlocked cached prefix, coldest tier first."""
        return await self.loop.run(self.cache.drop_all)

    def healthy(self) -> bool:
        return self.loop.alive()

    def health(self) -> None:
        """Raise ``EngineWedgedError`` (or ``RuntimeError`` if the engine thread
        died) when this worker must not get requests: what health checks call."""
        if self.loop.wedged is not None:
            raise EngineWedgedError(self.loop.wedged)
        if not self.loop.alive():
            raise RuntimeError(f"engine thread of {self.worker_id} died")

    def close(self) -> None:
        self._wedge.set()
        self.loop.close()
        self.cache.close()
        if self.nixl is not None:
            self.nixl.close()
