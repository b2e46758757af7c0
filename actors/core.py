"""WorkerCore: one model, one tiered cache, one NIXL endpoint, one engine thread.

The pieces, each in its own module:

- ``actors.engine_loop.EngineLoop``: the engine thread, its command queue and
  the token streams (it owns the engine and the cache);
- ``actors.migration.Migrator``: leases, NIXL and object-store pulls, installs;
- ``actors.calibration``: the ``CostModel`` it starts on (a peer's, this machine's
  kept ones from ``cluster.engine.machine_rates``, a prior, or a full calibration)
  and its refinement while serving;
- ``actors.reporter.EventReporter``: KV events, load and snapshots to the directory;
- ``actors.peer.PeerServer``: the peer channel other workers and the ingress
  call this worker on (migrations, admin), when the shell gives it a host;
  this class is its ``PeerService`` (one method per operation);
- L3 (``cluster.cache.l3.tier``) on the Mooncake master ``l3_master`` names,
  and ``actors.elastic``: the hand-off when the replica leaves, the warm-up
  before it takes traffic.

This class wires them and offers the few async methods the shell needs.
It has no Ray dependency of its own: the one shell around it is
``actors.worker.CacheWorker`` (the Serve replica, ``serve_app.replica``, is
that class as a deployment; tests run it as a Ray actor).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Awaitable, Callable

import numpy as np
import torch

from actors.calibration import RateRefiner, calibrate, completed_rates, prior_rates, rate_sources
from actors.config import WorkerConfig
from actors.engine_loop import EngineLoop, EngineWedgedError, QueueFullError, StreamContext
from actors.migration import Migrator, PeerLink
from actors.peer import PeerServer
from actors.reporter import EventReporter
from cluster.cache.kv_pool import KVLayout
from cluster.cache.l3 import INSTALL_HINT, L3Config, MooncakeL3Store, mooncake_available
from cluster.cache.l3.tier import L3Tier, L3TierConfig, l3_model_id
from cluster.cache.prefix_value import shared_prefixes
from cluster.cache.tiered import TieredCache
from cluster.engine import machine_rates, malloc, openmp
from cluster.engine.checkpoint import load_model, load_tokenizer
from cluster.engine.engine import Engine, EngineRequest
from cluster.engine.grammar import Grammars, grammar_available
from cluster.names import WARM
from cluster.protocol import (GenerateRequest, L3ShareCounts, LoadReport, MeasuredRates, MigrationResult, PrefixOffer,
                              Snapshot, StagedPrefix, StreamItem, Tenant, WorkerInfo)
from cluster.routing.autoscale_signals import ReplicaSignals
from cluster.routing.events import KVEventPublisher
from cluster.routing.l3_shares import COUNTS_TTL_S as L3_COUNTS_TTL_S
from cluster.routing.policies import CostModel
from cluster.transfer.nixl_transport import NixlEndpoint, TransferError, nixl_available, recommended_ucx_env

log = logging.getLogger(__name__)

SLOW_FAULT_STEP_S = 0.05   # what the 'slow' drill fault adds to every engine iteration
GRAMMARS_AFTER_IDLE_S = 10.0   # the engine idle this long before the grammars' tokenizer is built
POOLS_AFTER_IDLE_S = 0.5       # the engine idle this long before the next chunk of the pools' pages is mapped

__all__ = ["WorkerCore", "WorkerConfig", "PeerLink", "QueueFullError", "EngineWedgedError"]


class WorkerCore:
    def __init__(self, worker_id: str, config: WorkerConfig, directory=None,
                 on_report: Callable[["WorkerCore"], None] | None = None,
                 on_migration: Callable[[MigrationResult], None] | None = None,
                 on_trip: Callable[[str], None] | None = None,
                 peer_host: str | None = None, peer_secret: str | None = None):
        """``directory``: a ``DirectoryLink`` (None: no reports, e.g. in-process
        tests); ``on_report(core)`` runs on the engine thread before each report;
        ``on_migration(result)`` after each migration this worker ran (metrics);
        ``on_trip(reason)`` when the watchdog declares the engine wedged (metrics),
        after the directory was told to drop this worker. ``peer_host``: where
        the peer channel listens (None: no channel, e.g. in-process tests),
        ``peer_secret`` what every call on it must carry."""
        self.worker_id = worker_id
        self.config = config
        # Set before the engine thread starts (its ticks read them): the peer channel, once
        # open, and whether the directory has heard of this process (``_rates_changed``).
        self.peer: PeerServer | None = None
        self.registered = False
        # Seconds of each start-up part (a replacement's recovery waits for all of them).
        self.startup: dict[str, float | str] = {}
        mark = time.perf_counter()
        # The publisher's epoch, asked now: a first replica's directory starts beside it, and
        # waiting for its answer after the engine build took a 2 s timeout out of the start.
        self._epoch_asked = directory.ask_publisher_epoch(worker_id) if directory is not None else None

        def part(name: str) -> None:
            nonlocal mark
            now = time.perf_counter()
            self.startup[name] = round(now - mark, 3)
            mark = now
        torch.set_num_threads(config.torch_threads)
        tiers = config.tier_config()
        # A model that cannot load raises here, so the actor or replica never reports ready.
        self.loaded = load_model(config.model_spec(), device=str(tiers.resolved_device()))
        part("model_s")
        self.startup["weights"] = self.loaded.model.weights_source or "built"
        self.model = self.loaded.model
        mc = self.model.config
        self.layout = KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim, mc.dtype)
        self.cache = TieredCache(tiers, self.layout, vocab_size=mc.vocab_size, prefault=False)
        part("cache_s")
        self._build_engine(peer_host, part)
        part("parallel_wait_s")
        self._configure_engine()
        self.migration = Migrator(worker_id, self.cache, self.nixl, block_tokens=tiers.block_tokens,
                                  bytes_per_token=self.layout.bytes_per_token(),
                                  call_timeout_s=config.migration_timeout_s)
        self._initial_rates(directory)
        part("rates_s")
        self.startup["rates_source"] = self.rates_source
        self._start_reporting(directory, on_report)
        self.on_migration = on_migration
        self._on_trip = on_trip
        self._wedge = threading.Event()
        self._closing = threading.Event()   # set by close: background start-up work stops
        self._slow_step_s = 0.0   # the 'slow' drill fault (inject_fault)
        # How this worker reaches a holder to pull from it (``link_for(holder_id)``), for
        # the pulls a leaving peer asks of it; the shell sets it (None: it cannot pull).
        self.link_for: Callable[[str], Awaitable[PeerLink | None]] | None = None
        self.loop = EngineLoop(worker_id, self.engine, max_queued_requests=config.max_queued_requests,
                               on_idle=self._idle, on_tick=self._tick,
                               transfer_rate=lambda: self.migration.transfer_tokens_per_s,
                               prefill_rate=lambda: self.cost.prefill_tokens_per_s,
                               watchdog_s=config.watchdog_s, on_trip=self._tripped,
                               gather_s=(config.gather_quiet_ms / 1e3, config.gather_max_ms / 1e3))
        self.migration.on_engine = lambda fn: self.loop.call(fn).result()
        if peer_host is not None:
            self.peer = PeerServer(worker_id, self, host=peer_host, secret=peer_secret)
        if directory is not None:
            self._register()
            self.registered = True
            self.reporter.start_heartbeat(alive=self.loop.alive)
        part("loop_s")

    def _configure_engine(self) -> None:
        """What the engine runs on, in the log."""
        log.info("worker %s: OpenMP %s, allocator %s, %d torch threads, linear layouts by row count %s",
                 self.worker_id, openmp.runtime(), malloc.runtime(), torch.get_num_threads(),
                 self.engine.linear_layouts)

    def _initial_rates(self, directory) -> None:
        """Before the engine thread owns the cache: the full calibration where asked, else
        this machine's kept rates (``cluster.engine.machine_rates``), a peer's, or a
        two-prefill prior; either way refined while serving (``RateRefiner``), and what the
        worker measures is kept for the machine's next start (``_keep_rates``)."""
        self.rates_kept = machine_rates.rates_file(self.model, str(self.model.device),
                                                   self.layout.bytes_per_token(), self.config.block_tokens)
        # This machine's own measures first: no remote call (the first replica's directory is
        # still starting, and asking it for a peer's rates waited out its 2 s timeout).
        kept = self.rates_kept.load() if self.rates_kept is not None and not self.config.calibrate_at_start else None
        if kept is not None:
            self.rates_source = "disk"
            self.cost = completed_rates(self.config.block_tokens, kept["prefill_tokens_per_s"],
                                        kept.get("warm_promote_tokens_per_s"), kept.get("cold_promote_tokens_per_s"),
                                        kept.get("transfer_tokens_per_s"), kept.get("l3_fetch_tokens_per_s"))
            if "warm_promote_tokens_per_s" in kept:   # as the prior leaves it: inline promotions and
                # promote-or-recompute read the cache's own WARM copy rate
                self.cache.moves.seed_copy_rate(WARM, 1.0 / kept["warm_promote_tokens_per_s"])
        else:
            self.rates_source = "peer"
            self.cost = self._peer_cost(directory)
        if self.cost is None:
            self.rates_source = "calibrated" if self.config.calibrate_at_start else "prior"
            self.cost = calibrate(self.engine, self.migration) if self.config.calibrate_at_start \
                else prior_rates(self.engine)
        if self.nixl is not None and self.rates_source != "prior":   # a prior is no NIXL measurement
            self.migration.transfer_tokens_per_s = self.cost.transfer_tokens_per_s
        self.refiner = RateRefiner(self.cost, rate_sources(self.engine, self.migration, self.l3),
                                   self._rates_changed)

    def _start_reporting(self, directory, on_report: Callable[["WorkerCore"], None] | None) -> None:
        """The KV events' publisher on the tree (and L3's inventories), and the reporter that
        sends them with the load to ``directory`` (None: nothing is reported). The publisher's
        epoch is the directory's (``cluster.routing.events``); its own clock's when it did not answer."""
        epoch = directory.publisher_epoch(self.worker_id, asked=self._epoch_asked) if directory is not None else None
        self.publisher = KVEventPublisher(self.worker_id, self.cache.tree, self.config.tier_config().block_tokens,
                                          epoch=epoch)
        self.cache.add_listener(self.publisher)
        if self.l3 is not None:
            self.l3.set_rates(self.cost.l3_fetch_tokens_per_s or None, self.cost.prefill_tokens_per_s)
            self.l3.listeners.append(self.publisher)
            self.l3.request_inventory()   # the directory learns what L3 already holds
        self.directory = directory
        self.reporter = None
        if directory is not None:
            self.reporter = EventReporter(self.worker_id, self.publisher, directory, lambda: self.loop.load_report,
                                          on_report=(lambda: on_report(self)) if on_report else None,
                                          wake=lambda: self.loop.wake(),
                                          register=self._reannounce,
                                          renew_epoch=(lambda: directory.publisher_epoch_future(self.worker_id))
                                          if epoch is None else None,
                                          on_l3_shares=self._l3_share_counts())

    def _l3_share_counts(self) -> Callable[[L3ShareCounts], None] | None:
        """Where the directory's count of the tenants' L3 blocks goes (the quotas enforce L3
        shares across the cluster against it), or None without L3 shares."""
        quotas = self.cache.quotas
        if quotas is None or self.l3 is None or not quotas.l3_limited():
            return None
        quotas.expect_l3_counts(L3_COUNTS_TTL_S)
        return lambda counts: quotas.set_l3_others(counts.as_dict())

    def _reannounce(self) -> None:
        """Before every snapshot (engine thread): register again, and list L3 once
        more (a directory that restarted knows nothing of it)."""
        self._register(fresh=False)
        if self.l3 is not None:
            self.l3.request_inventory()
            quotas = self.cache.quotas
            for namespace, held in (quotas.l3_written.items() if quotas is not None else ()):
                if held:   # the tenants' L3 counts: a directory that restarted learns this replica's
                    self.publisher.on_l3_stored(list(held), namespace)

    def _build_engine(self, peer_host: str | None, part: Callable[[str], None]) -> None:
        """The engine, with L3, NIXL and the pools' pages beside it (start-up)."""
        config, mc = self.config, self.model.config
        # L3 and NIXL open on threads while this one builds the engine (the packed weights,
        # the kernels); each is bounded where it calls out (the L3 store's calls, NIXL's local
        # agent). Each part's seconds are its own thread's. The tokenizer's grammars are built
        # after the worker is ready (``prepare_grammars``), or by the first constrained
        # request; the CPU pools' pages are mapped after it too (``prepare_pools``): the pools
        # are zero from the start (``cluster.cache.host_memory``).
        with ThreadPoolExecutor(2, thread_name_prefix=f"start-{self.worker_id}") as pool:
            l3 = pool.submit(self._timed_part, "l3_s", self._open_l3, peer_host)
            nixl = pool.submit(self._timed_part, "nixl_s", self._open_nixl)
            self.grammars = self._timed_part("grammars_s", self._grammars, mc.vocab_size)
            self.engine = Engine(self.model, self.cache, config.scheduler_config(), decode_kernel=config.decode_kernel,
                                 grammars=self.grammars)
            self.startup["packed_weights"] = getattr(self.model, "packed_source", {}).get("source", "none")
            part("engine_s")
            self.l3, self.nixl = l3.result(), nixl.result()
            if self.l3 is not None:   # the cache is this thread's until the engine thread starts
                self.cache.attach_l3(self.l3)

    def _register(self, fresh: bool = True) -> None:
        """Register with the directory: measured rates and the peer channel's address."""
        self.directory.register(self.worker_id, self.rates(), self.peer.address if self.peer else None, fresh)

    def _grammars(self, vocab_size: int) -> Grammars | None:
        """Structured output's matchers for this model's tokenizer (None without llguidance),
        its tokenizer loaded and llguidance's view of it built later (``prepare_grammars``)."""
        if not grammar_available():
            log.warning("structured output off on %s: llguidance is not installed", self.worker_id)
            return None
        loaded = self.loaded
        return Grammars.deferred(lambda: load_tokenizer(loaded), vocab_size, loaded.checkpoint_dir)

    def prepare_grammars(self) -> None:
        """Build the grammars' tokenizer on a thread of its own at the lowest CPU priority, once
        the engine has idled ``GRAMMARS_AFTER_IDLE_S`` (the shell calls it once the worker is
        ready); a constrained request that comes first builds them itself at its own
        priority, off the engine thread (``generate``); one during this build waits for it."""
        grammars = self.grammars
        if grammars is None or grammars.ready:
            return

        def build() -> None:
            with contextlib.suppress(OSError):   # a thread's own nice value (Linux)
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            # Only once the engine has idled a while: the build holds the GIL about 2 s (the
            # tokenizer's load, in Python), whatever its nice value, and steps beside it took
            # 1.5-2.6x as long (docs/engine.md: a replica's first requests after ready).
            while self.loop.idle_s() < GRAMMARS_AFTER_IDLE_S:
                if grammars.ready or self._closing.wait(0.2):
                    return
            if grammars.ready or self._closing.is_set():
                return
            try:
                grammars.prepare()
                log.info("worker %s: grammars ready in %.2f s", self.worker_id, grammars.build_s)
            except Exception as exc:   # the first constrained request tries again and reports it
                log.warning("worker %s: building the grammars failed: %s", self.worker_id, exc)
        threading.Thread(target=build, name=f"grammars-{self.worker_id}", daemon=True).start()

    def prepare_pools(self) -> None:
        """Map the CPU pools' pages, HOT first, on a nice-19 thread once the worker is ready, a chunk
        at a time while the engine has idled ``POOLS_AFTER_IDLE_S`` (docs/engine.md: a burst's first
        turns beside it); the pools are zero from the start and keep what they hold. ``close`` stops it."""
        pools = [p for p in self.cache.pools if hasattr(p, "prefault")]
        stop, pause = self._closing.is_set, lambda: self.loop.idle_s() < POOLS_AFTER_IDLE_S

        def run() -> None:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            done = [r for r in (p.prefault(stop, pause) for p in pools) if r is not None]
            if done:
                log.info("worker %s: KV pools' pages mapped after ready: %.0f MiB in %.2f s%s", self.worker_id,
                         sum(r["bytes"] for r in done) / (1 << 20), sum(r["seconds"] for r in done),
                         "" if all(r["supported"] for r in done) else
                         " (madvise refused MADV_POPULATE_WRITE: the rest are mapped by their first write)")
        threading.Thread(target=run, name=f"pools-{self.worker_id}", daemon=True).start()

    def _open_l3(self, host: str | None) -> L3Tier | None:
        """L3 on the configured master (the caller attaches it to the cache); None (one log line)
        without a master, without Mooncake, or when the master cannot be reached."""
        cfg = self.config
        if not cfg.l3_master:
            return None
        if not mooncake_available():
            log.warning("L3 off on %s: mooncake is not importable (%s)", self.worker_id, INSTALL_HINT)
            return None
        store = MooncakeL3Store(L3Config(master_address=cfg.l3_master, local_hostname=host or "127.0.0.1",
                                         local_buffer_bytes=cfg.l3_buffer_mb << 20, http_address=cfg.l3_master_http))
        state = store.stats()
        if state.state != "on":   # the store logged why, once
            store.close()
            return None
        tier = L3Tier(store, self.layout, cfg.block_tokens,
                      L3TierConfig(model_id=l3_model_id(self.loaded.model_id, self.model),
                                   write=cfg.l3_write, fetch=cfg.l3_fetch,
                                   min_fetch_blocks=cfg.l3_min_fetch_blocks, write_nice=cfg.l3_write_nice),
                      codec=self.cache.codec)
        log.info("worker %s uses L3 at %s (write %s)", self.worker_id, cfg.l3_master, cfg.l3_write)
        return tier

    def _peer_cost(self, directory) -> CostModel | None:
        """A registered peer's measured rates, when this worker may reuse them."""
        if directory is None or not self.config.reuse_peer_calibration:
            return None
        rates = directory.measured_rates(self.layout.bytes_per_token(), self.config.block_tokens)
        if rates is None:
            return None
        log.info("worker %s reuses a peer's measured rates instead of calibrating", self.worker_id)
        return CostModel(**rates.cost_kwargs())

    def _open_nixl(self) -> NixlEndpoint | None:
        if not (self.config.use_nixl and self.cache.staging is not None and nixl_available()):
            return None
        try:
            return NixlEndpoint(f"{self.worker_id}-{id(self):x}", self.cache.staging.tensor,
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
        the watchdog trips meanwhile); 'slow' makes every engine iteration last
        ``SLOW_FAULT_STEP_S`` longer (requests stay in flight long enough for a drill
        to kill a replica under them); 'nixl' and 'fallback' break a transport
        (``actors.migration.FAULTS``)."""
        if kind == "slow":
            self._slow_step_s = SLOW_FAULT_STEP_S if on else 0.0
        elif kind != "wedge":
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
        self.cache.housekeeping()

    def _tick(self) -> None:
        # Engine thread, after every iteration: L3's finished writes become KV events
        # (and its finished fetches land) before the reporter sends what changed.
        if self.l3 is not None:
            self.cache.apply_l3()
        self.refiner.tick()
        if self.reporter is not None:
            self.reporter.tick()
        if self._slow_step_s:
            time.sleep(self._slow_step_s)

    def _rates_changed(self, cost: CostModel) -> None:
        """Engine thread: the refiner measured a rate that moved materially; it is in
        force here now (the engine loop's and L3's reads) and at the directory (from the
        constructor's registration on: a rate measured while the worker starts, before it
        has a peer channel or has registered, goes with that registration)."""
        self.cost = cost
        if self.l3 is not None:
            self.l3.set_rates(cost.l3_fetch_tokens_per_s or None, cost.prefill_tokens_per_s)
        if self.directory is not None and self.registered:   # before that, the first registration carries it
            self._register(fresh=False)
        self._keep_rates()

    def _keep_rates(self) -> None:
        """This machine's next start takes the rates measured here (once the engine measured
        its own prefill: a peer's or the prior's are not kept as this machine's)."""
        if self.rates_kept is not None and "prefill_tokens_per_s" in self.refiner.measured:
            self.rates_kept.save(self.refiner.latest())

    def _timed_part(self, name: str, fn, *args):
        """``fn(*args)``, its seconds as the start-up part ``name`` (a start-up thread's)."""
        began = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.startup[name] = round(time.perf_counter() - began, 3)

    def rates(self) -> MeasuredRates:
        """What this worker measured, as it registers with the directory."""
        return MeasuredRates.of(self.cost, bytes_per_token=self.layout.bytes_per_token())

    # --------------------------------------------------------------- serving
    async def generate(self, request: GenerateRequest,
                       link_for: Callable[[str], Awaitable[PeerLink | None]] | None = None
                       ) -> AsyncIterator[StreamItem]:
        """Stream the request's items; with ``route.migrate_from``, pull that
        worker's prefix first (``await link_for(holder)`` reaches it; None: it is gone)."""
        received_at, started = time.time(), time.perf_counter()
        route = request.route
        migration = None
        holder = route.migrate_from if route is not None else None
        if holder and holder != self.worker_id and link_for is not None:
            migration = await self.migrate_from(holder, await link_for(holder), request.prompt, request.tenant)
            if self.on_migration is not None:
                self.on_migration(migration)
        context = StreamContext(route.reason if route is not None else "fallback", migration,
                                time.perf_counter() - started if migration is not None else 0.0, received_at)
        req = EngineRequest(list(request.prompt), request.params, namespace=request.tenant,
                            session_id=request.session_id)
        if request.params.grammar is not None and self.grammars is not None and not self.grammars.ready:
            await asyncio.to_thread(self.grammars.prepare)   # here, not on the engine thread
        async for item in self.loop.stream(req, context):
            yield item

    async def pull(self, offer: PrefixOffer) -> int:
        """Pull ``offer`` from its holder (a leaving peer hands it on); the tokens installed."""
        if self.link_for is None or offer.holder == self.worker_id:
            return 0
        result = await self.migrate_from(offer.holder, await self.link_for(offer.holder), list(offer.tokens),
                                         offer.tenant)
        return result.tokens if result.transport is not None else 0

    async def offers(self, limit: int) -> list[PrefixOffer]:
        """This worker's most valuable shared prefixes (a new peer warms up with them)."""
        return await self.loop.run(lambda: [PrefixOffer(self.worker_id, p.namespace, p.tokens, p.value)
                                            for p in shared_prefixes(self.cache.tree, limit)])

    async def wait_idle(self, deadline: float) -> bool:
        """Until the engine has no request (True), or ``deadline`` (``time.monotonic``)."""
        while await self.loop.run(self.engine.has_work):
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def publish_now(self, timeout_s: float = 5.0) -> bool:
        """Send what the cache changed (L3's finished writes included) to the directory
        now and wait for its answer; False without a directory or an answer."""
        if self.reporter is None:
            return False

        def send():
            self.cache.apply_l3()
            return self.reporter.flush(force=True)
        fut = await self.loop.run(send)
        if fut is None:
            return False
        try:
            await asyncio.wait_for(asyncio.wrap_future(fut), timeout_s)
            return True
        except Exception as exc:
            log.warning("publish from %s before leaving failed: %s", self.worker_id, exc)
            return False

    async def prefetch(self, session_id: str | None = None, tokens: list[int] | None = None,
                       namespace: Tenant | None = None) -> int:
        return await self.loop.run(lambda: self.cache.prefetch(session_id, tokens, namespace))

    # ------------------------------------------------------------- migration
    async def migrate_from(self, holder_id: str, link: PeerLink | None, tokens: list[int],
                           tenant: Tenant | None) -> MigrationResult:
        return await self.migration.migrate_from(holder_id, link, tokens, tenant, self.loop.run)

    async def export_prefix(self, tokens: list[int], tenant: Tenant | None = None,
                            max_tokens: int | None = None) -> StagedPrefix:
        return await self.loop.run(lambda: self.migration.export_prefix(tokens, tenant, max_tokens))

    async def fetch_blocks(self, lease: str) -> tuple[np.ndarray, str]:
        return await self.loop.run(lambda: self.migration.fetch_blocks(lease))

    async def release(self, lease: str) -> None:
        await self.loop.run(lambda: self.migration.release(lease))

    # ------------------------------------------------------------ inspection
    def info(self) -> WorkerInfo:
        return WorkerInfo(self.worker_id, self.peer.address if self.peer else None,
                          self.nixl.metadata() if self.nixl else None, self.nixl.name if self.nixl else None,
                          self.config.block_tokens, self.rates(), self.model.config.vocab_size,
                          self.loaded.model_id, self.loop.owner is self.cache.owner)

    def load(self) -> LoadReport:
        """The load as of the engine thread's last iteration (any thread)."""
        return self.loop.load_report

    def signals(self) -> ReplicaSignals:
        """The autoscaling signals as of the engine thread's last iteration (any thread)."""
        return self.loop.signals

    async def stats(self) -> dict:
        """Tier occupancy, hit counters, migrations, fragmentation (a JSON document)."""
        out = await self.loop.run(self._engine_stats)
        out["worker"] = {**out["worker"], **self.migration.stats}
        return out

    def _engine_stats(self) -> dict:
        c = self.cache
        return {"worker_id": self.worker_id, "tiers": c.tier_summary(), "cache": dict(c.stats),
                "tree": dict(c.tree.stats), "engine": dict(self.engine.stats),
                "worker": {**self.loop.stats, **self.migration.holder_stats, "pid": os.getpid(),
                           "openmp": openmp.runtime(), "malloc": malloc.runtime(),
                           "torch_threads": torch.get_num_threads(),
                           "linear_layouts": self.engine.linear_layouts, "decode_kernel": self.engine.decode_kernel,
                           "ownership_violations": self.loop.owner.violations,
                           "watchdog_trips": self.loop.watchdog_trips,
                           "grammars_build_s": self.grammars.build_s if self.grammars is not None else None},
                "load": dataclasses.asdict(self.loop.measure_load()), "autoscaling": self.loop.signals.as_metrics(),
                "fragmentation": c.fragmentation(),
                "protected_tokens": c.protected_tokens, "evictable_tokens": c.evictable_tokens,
                "l3": self._l3_stats(), "tenants": c.tenant_stats()}

    def _l3_stats(self) -> dict:
        """The L3 tier's counters (engine thread), the store's, and the hand-off's; state "off" without L3."""
        if self.l3 is None:
            return {"state": "off", "master": self.config.l3_master}
        self.cache.apply_l3()
        store = dataclasses.asdict(self.l3.store.stats())
        stats = self.l3.stats
        # What the same fetches would have cost recomputed, at this worker's measured prefill rate.
        rate = self.cost.prefill_tokens_per_s
        return {"master": self.config.l3_master, "key_prefix": self.l3.key_prefix, **stats.as_dict(), "store": store,
                "state": store["state"], **self.cache.l3.stats,
                "fetch_tokens_per_s": self.l3.fetch_tokens_per_s, "prefill_tokens_per_s": rate,
                "fetch_samples": [[round(s * 1e3, 3), n, round(n / rate * 1e3, 3)]
                                  for s, n in zip(stats.fetch_s[-512:], stats.fetch_tokens[-512:])]}

    async def snapshot(self) -> Snapshot:
        return await self.loop.run(self.publisher.snapshot)

    async def flush(self) -> int:
        """Drop every unlocked cached prefix, coldest tier first, and this model's
        blocks in L3 (the cluster's cache; every replica's flush does the same)."""
        l3 = self.l3

        def drop() -> int:
            freed = self.cache.drop_all()
            if l3 is not None:   # queued writes would store what the removal below removes
                l3.drop_queued_writes()
            return freed
        freed = await self.loop.run(drop)
        if l3 is not None:
            await asyncio.to_thread(l3.flush, 5.0)   # the write in flight, if any
            await asyncio.to_thread(l3.remove_all)
            await self.loop.run(l3.forget)
        return freed

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
        self._closing.set()
        self._wedge.set()
        if self.reporter is not None:
            self.reporter.close()
        if self.peer is not None:
            self.peer.close()
        self.loop.close()
        self._keep_rates()   # the engine thread has stopped: its measures are this thread's to read
        self.cache.close()   # with its L3 thread
        if self.l3 is not None:
            self.l3.store.close()
        if self.nixl is not None:
            self.nixl.close()
