"""Directory: the global, named actor that knows which worker holds which prefix.

It owns a ``cluster.routing.GlobalIndex`` (block hash -> workers and tiers)
and a routing policy, both plain ``cluster/`` code. Workers publish KV event
batches (msgpack, per-worker sequence numbers); a gap, a resync flag or an
unknown worker is answered with a status that makes the worker push a full
snapshot. After a restart (Ray restarts it: ``max_restarts=-1``) the index
starts empty and is rebuilt from the workers' snapshots within one report
interval; L3's part from the inventory (a listing of the store) every worker
sends with its snapshot and at its start. Until the first inventory arrives,
the ``l3`` routing option is not priced (stats: ``l3_inventory_s``, how long
after this process started that took). A starting worker asks it for its
publisher's epoch (``publisher_epoch``: above every epoch issued or seen for
that id, so no node's clock matters); every batch and snapshot carries it, one
of an older epoch than the newest seen for that worker is refused
(``stale_epoch``), and a newer one replaces the worker's entries: events of a
previous life never credit a replica.

It counts each tenant's L3 blocks across the cluster from the replicas' L3
events (``cluster.routing.l3_shares.L3ShareBook``) and, to a worker that asks
with its batch (``want_l3_shares``), answers with them (a ``PublishReply``): the
replicas enforce the tenants' L3 shares against that count.

Routers do not ask it per request: each keeps a copy of its routing table
(``cluster.routing.table.TableReplica``), fed by ``subscribe``, a long poll
on the table's change log, and decides locally; ``route`` answers the
others (the ``ClusterClient`` of plain actors, a router whose copy is stale).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque

import ray

from cluster.errors import InvalidInputError
from cluster.names import DIRECTORY_NAME
from cluster.protocol import (RATE_FIELDS, LoadReport, MeasuredRates, PublisherEpoch, PublishReply, RouteDecision,
                              Snapshot, TableUpdate)
from cluster.routing.events import EpochIssuer, EventBatch, MalformedBatchError
from cluster.routing.l3_shares import L3ShareBook
from cluster.routing.policies import CostModel, make_policy
from cluster.routing.table import ChangeLog, RoutingTable

log = logging.getLogger(__name__)


class DirectoryImpl:
    """Push-based: workers send event batches with their load (every ~100 ms, so
    they double as heartbeats) and, when told, a full snapshot. The directory
    never calls a worker, so it works the same whether workers are plain actors
    or Serve replicas, and a dead worker costs it nothing but a timeout. To see
    a worker's process die at once (``kill -9``, an OOM kill) rather than after
    missed heartbeats, it holds one idle connection to each worker's peer
    channel, which the kernel closes when the process goes.

    Its ``RoutingTable`` (index, loads, cost model, policy) changes only
    through ops that are also written to a ``ChangeLog``; routers follow the
    log with ``subscribe`` (a long poll) and decide locally on their copy."""

    def __init__(self, policy: str = "cost", block_tokens: int = 16, namespace: str = "prefix-cache",
                 policy_kwargs: dict | None = None, heartbeat_timeout_s: float = 3.0, clock=time.monotonic,
                 log_capacity: int = 4096, wall_clock_ns=time.time_ns):
        self.namespace = namespace
        self.block_tokens = block_tokens
        self.costs: dict[str, MeasuredRates] = {}
        self.addresses: dict[str, str] = {}      # worker -> its peer channel's host:port
        self.last_seen: dict[str, float] = {}
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.clock = clock
        make_policy(policy)   # an unknown name fails here, with the list of known ones
        self._policy, self._policy_kwargs = policy, dict(policy_kwargs or {})
        self.table = RoutingTable(policy, policy_kwargs, self._cost_model())
        self.log = ChangeLog(log_capacity)
        self._changed: asyncio.Event | None = None   # set on every change: wakes the long polls
        self._health_task = None
        self.stats = {"decisions": 0, "by_reason": {}, "resyncs": 0, "snapshots": 0, "malformed_batches": 0,
                      "unknown_worker_batches": 0, "gaps": 0, "dropped_workers": 0, "subscribe_polls": 0,
                      "full_states_sent": 0, "drained_workers": 0, "process_exits": 0, "started_at": time.time(),
                      "stale_epoch_batches": 0, "stale_epoch_snapshots": 0, "new_epochs": 0, "issued_epochs": 0,
                      "l3_inventories": 0, "l3_inventory_s": None}
        self.epochs: dict[str, int] = {}   # worker -> the newest epoch seen or issued (kept after a drop)
        self.epoch_issuer = EpochIssuer(wall_clock_ns)
        self._started = clock()
        self.l3_known = False   # an L3 inventory arrived: the l3 option may be priced
        self.l3_shares = L3ShareBook()   # each tenant's L3 blocks across the cluster
        self._watches: dict[str, asyncio.Task] = {}
        self.lifecycle: deque[dict] = deque(maxlen=64)

    # What the table holds, under the names the directory always had.
    @property
    def index(self):
        return self.table.index

    @property
    def workers(self):
        return self.table.workers

    @property
    def policy(self):
        return self.table.policy

    @property
    def policy_name(self) -> str:
        return self.table.policy_name

    def _change(self, op: str, *args):
        """Apply one op to the table and log it for the routers that follow (an op
        that raises, e.g. a malformed snapshot, changes nothing and is not logged)."""
        result = self.table.apply(op, args)
        self.log.append(op, args)
        if self._changed is not None:
            self._changed.set()
        return result

    def _reprice(self) -> None:
        """New measured rates: the policy is updated in place, so what it learned
        (branch points, recent work, approximate trees) survives."""
        self._change("cost", dataclasses.asdict(self._cost_model()))

    def _cost_model(self) -> CostModel:
        """Cluster-wide constants from what the workers measured at start-up:
        the slowest worker's rate of each kind (a decision must hold anywhere)."""
        if self.costs:
            rates = list(self.costs.values())
            kw = {name: min(getattr(r, name) for r in rates) for name in RATE_FIELDS}
            # L3 is priced only when every worker reads it (the slowest one's rate), and
            # only once this directory knows what L3 holds (an inventory arrived).
            l3 = [r.l3_fetch_tokens_per_s for r in rates]
            kw["l3_fetch_tokens_per_s"] = min(l3) if all(l3) and self.l3_known else 0.0
        else:  # nobody measured yet: conservative placeholders, replaced at the first registration
            kw = {"prefill_tokens_per_s": 5_000.0, "warm_promote_tokens_per_s": 1e6,
                  "cold_promote_tokens_per_s": 1e5, "transfer_tokens_per_s": 2.5e5}
        return CostModel(**kw, block_tokens=self.block_tokens)

    # ---------------------------------------------------------------- workers
    async def register_worker(self, worker_id: str, rates: MeasuredRates | None = None,
                              peer_address: str | None = None, fresh: bool = True) -> None:
        """A worker (re)starting: ``fresh`` forgets what an earlier process of the
        same id held, since the new one numbers its batches from 1 again."""
        if not isinstance(worker_id, str) or not worker_id:
            raise InvalidInputError(f"worker_id must be a non-empty string, got {worker_id!r}")
        if rates is not None and not isinstance(rates, MeasuredRates):
            raise InvalidInputError(f"rates must be MeasuredRates, got {type(rates).__name__}")
        if fresh or worker_id not in self.workers:
            self._change("register", worker_id, True)
            log.info("worker %s registered", worker_id)
        self.last_seen[worker_id] = self.clock()
        if peer_address is not None and self.addresses.get(worker_id) != peer_address:
            self.addresses[worker_id] = peer_address
            self._watch_process(worker_id, peer_address)
        if rates is not None:
            self.costs[worker_id] = rates
            self._reprice()
        self._ensure_health_task()

    async def publisher_epoch(self, worker_id: str) -> PublisherEpoch:
        """The epoch of a starting worker's publisher: newer than any life of that id
        this directory issued or saw, so the old life's events are refused from now
        on. An old life still in the table is one: its entries go at once."""
        if not isinstance(worker_id, str) or not worker_id:
            raise InvalidInputError(f"worker_id must be a non-empty string, got {worker_id!r}")
        epoch = self.epoch_issuer.issue(self.epochs.get(worker_id))
        self.epochs[worker_id] = epoch
        self.stats["issued_epochs"] += 1
        if worker_id in self.workers:   # the previous life's entries and load
            self.stats["new_epochs"] += 1
            self._change("register", worker_id, True)
            log.info("worker %s starts again (epoch %d); its old entries are dropped", worker_id, epoch)
        return PublisherEpoch(worker_id, epoch)

    async def drop_worker(self, worker_id: str, reason: str = "failed") -> bool:
        """Forget a worker and every block it held, at once."""
        if worker_id not in self.workers:
            return False
        self._change("drop", worker_id)
        for table in (self.costs, self.last_seen, self.addresses):
            table.pop(worker_id, None)
        watch = self._watches.pop(worker_id, None)
        if watch is not None and watch is not asyncio.current_task():
            watch.cancel()
        self.stats["dropped_workers"] += 1
        log.warning("worker %s dropped (%s)", worker_id, reason)
        return True

    def _watch_process(self, worker_id: str, address: str) -> None:
        try:
            self._watches[worker_id] = asyncio.get_running_loop().create_task(self._watch(worker_id, address))
        except RuntimeError:   # no event loop (in-process use without one): heartbeats decide
            pass

    async def _watch(self, worker_id: str, address: str) -> None:
        """Hold an idle connection to the worker's peer channel: the kernel closes it the
        moment the worker's process dies (``kill -9`` included), and the worker is dropped
        then, not after missed heartbeats. A wedged process keeps it open (heartbeats and
        its watchdog handle that)."""
        host, _, port = address.rpartition(":")
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), 5.0)
        except Exception as exc:   # not reachable from here: heartbeats decide
            log.info("cannot watch %s at %s (%s); relying on heartbeats", worker_id, address, exc)
            return
        try:
            await reader.read()   # b"" once the other end is gone; the worker never writes to it
        except Exception:   # reset: gone as well
            pass
        finally:
            writer.close()
        if self.addresses.get(worker_id) == address and worker_id in self.workers:
            self.stats["process_exits"] += 1
            await self.drop_worker(worker_id, "its process exited (peer channel closed)")

    async def drain_worker(self, worker_id: str) -> bool:
        """A worker is leaving (scale-in): no new request is routed to it from now
        on, by this table or any copy; its entries stay until it ``leave``s, so
        peers can still pull its prefixes."""
        if worker_id not in self.workers:
            return False
        changed = self._change("drain", worker_id)
        if changed:
            self.stats["drained_workers"] += 1
            log.info("worker %s draining", worker_id)
        return changed

    def note_lifecycle(self, worker_id: str, kind: str, report: dict) -> None:
        """A worker's hand-off, warm-up or start-up report (the latest 64 are kept, for stats and benches)."""
        if kind not in ("handoff", "warmup", "startup") or not isinstance(report, dict):
            raise InvalidInputError(f"lifecycle note must be handoff, warmup or startup with a report, got {kind!r}")
        self.lifecycle.append({"worker_id": worker_id, "kind": kind, "at": time.time(), **report})

    async def clear_l3(self) -> int:
        """L3 was flushed: forget which blocks it holds (the entries it had)."""
        self.l3_shares.clear()
        return self._change("l3_clear")

    def handoff_targets(self, worker_id: str) -> list[str]:
        """The other live workers that take requests (not draining), least loaded
        first: where a leaving worker hands its prefixes, whom a new one asks."""
        live = [st for w, st in self.workers.items() if w != worker_id and st.alive]
        live.sort(key=lambda st: (st.queued_tokens, st.running, st.worker_id))
        return [st.worker_id for st in live]

    async def publish(self, worker_id: str, data: bytes | None, load: LoadReport | None = None,
                      want_l3_shares: bool = False) -> str | PublishReply:
        """A worker's KV event batch (msgpack) and/or its current load.

        Returns "ok", or what the worker must do: "unknown_worker", "gap",
        "resync" or "malformed" all mean "send a snapshot" (``load_snapshot``).
        With ``want_l3_shares``, a ``PublishReply`` of that status and the tenants'
        L3 counts less this worker's own (None where the batch was refused)."""
        status = await self._publish(worker_id, data, load)
        if not want_l3_shares:
            return status
        taken = status not in ("malformed", "stale_epoch")
        return PublishReply(status, self.l3_shares.counts_for(worker_id) if taken else None)

    async def _publish(self, worker_id: str, data: bytes | None, load: LoadReport | None) -> str:
        batch = None
        if data is not None:
            try:
                batch = EventBatch.decode(data)
                if batch.worker_id != worker_id:
                    raise MalformedBatchError(f"batch names worker {batch.worker_id!r}, sent by {worker_id!r}")
            except MalformedBatchError as exc:
                self.stats["malformed_batches"] += 1
                log.warning("malformed event batch from %s: %s", worker_id, exc)
                return "malformed"
            if self._stale(worker_id, batch.epoch):   # before anything: an old life registers nothing
                self.stats["stale_epoch_batches"] += 1
                return "stale_epoch"
        if worker_id not in self.workers:  # new, or this directory just restarted
            self.stats["unknown_worker_batches"] += 1
            await self.register_worker(worker_id, fresh=False)
            self._set_load(worker_id, load)
            if batch is not None:
                self.epochs[worker_id] = batch.epoch
                self.l3_shares.apply(worker_id, batch)
            return "unknown_worker"
        self.last_seen[worker_id] = self.clock()
        self._set_load(worker_id, load)
        if batch is None:
            return "ok"
        if self._epoch(worker_id, batch.epoch) == "new":   # a new life: its old entries went; a snapshot follows
            return "resync"
        inventory = any(ev.kind == "inventory" for ev in batch.events)
        self.l3_shares.apply(worker_id, batch)   # L3 events are about L3, whatever the worker's entries
        status = self._change("batch", batch)
        if inventory and status == "ok":
            self._note_inventory()
        if status == "gap":
            self.stats["gaps"] += 1
        if status in ("gap", "resync"):
            self.stats["resyncs"] += 1
        return status

    async def load_snapshot(self, worker_id: str, snapshot: Snapshot) -> str:
        if not isinstance(snapshot, Snapshot):
            raise InvalidInputError(f"snapshot must be a Snapshot, got {type(snapshot).__name__}")
        if self._stale(worker_id, snapshot.epoch):
            self.stats["stale_epoch_snapshots"] += 1
            return "stale_epoch"
        if worker_id not in self.workers:
            await self.register_worker(worker_id, fresh=False)
        self._epoch(worker_id, snapshot.epoch)
        self._change("snapshot", worker_id, snapshot.seq, snapshot.entries)
        self.stats["snapshots"] += 1
        return "ok"

    def _stale(self, worker_id: str, epoch: int) -> bool:
        """Older than the newest epoch seen for this worker id: a previous life's."""
        known = self.epochs.get(worker_id)
        return known is not None and epoch < known

    def _epoch(self, worker_id: str, epoch: int) -> str:
        """Record a (not stale) epoch: "new" (a new life: its old entries are dropped,
        the worker re-registered) or "current"."""
        known = self.epochs.get(worker_id)
        if known is None or epoch > known:
            self.epochs[worker_id] = epoch
            if known is not None:
                self.stats["new_epochs"] += 1
                self._change("register", worker_id, True)   # fresh: forgets the old life's entries
                self.l3_shares.forget_writer(worker_id)     # its L3 blocks stay: another's now
                log.info("worker %s started again (epoch %d); its old entries are dropped", worker_id, epoch)
                return "new"
        return "current"

    def _note_inventory(self) -> None:
        self.stats["l3_inventories"] += 1
        if not self.l3_known:
            self.l3_known = True
            self.stats["l3_inventory_s"] = round(self.clock() - self._started, 3)
            log.info("L3 inventory in %.3f s after start: %d blocks known", self.clock() - self._started,
                     self.index.num_l3)
            self._reprice()

    def _set_load(self, worker_id: str, load: LoadReport | None) -> None:
        if load is None:
            return
        if not isinstance(load, LoadReport):
            raise InvalidInputError(f"load must be a LoadReport, got {type(load).__name__}")
        st = self.workers[worker_id]
        if (st.queued_tokens, st.running) != (load.queued_tokens, load.running):   # idle reports change nothing
            self._change("load", worker_id, load.queued_tokens, load.running)
        rate = load.transfer_tokens_per_s
        rates = self.costs.get(worker_id)
        if rate and rates is not None:
            old = rates.transfer_tokens_per_s
            if abs(rate - old) > 0.2 * old:   # re-price only on a real change
                self.costs[worker_id] = rates.with_transfer(rate)
                self._reprice()

    # ---------------------------------------------------------------- routing
    async def route(self, hashes: list[int], num_tokens: int, exclude: list[str] | None = None,
                    reserve: bool = True) -> RouteDecision:
        """Choose a worker for a request whose prompt has these block hashes.

        ``reserve`` counts the request's prefill in the chosen worker's queue
        until that worker's next load report (so a burst spreads out); a
        what-if query passes False."""
        if not isinstance(num_tokens, int) or num_tokens < 0:
            raise InvalidInputError(f"num_tokens must be a non-negative integer, got {num_tokens!r}")
        decision = self.table.route(hashes, num_tokens, exclude, reserve)
        self.stats["decisions"] += 1
        reason = decision.reason
        self.stats["by_reason"][reason] = self.stats["by_reason"].get(reason, 0) + 1
        return dataclasses.replace(decision, source="directory", decision_us=self.table.decision_s[-1] * 1e6)

    async def subscribe(self, epoch: str | None, cursor: int, wait_s: float = 2.0) -> TableUpdate:
        """A router's long poll: the table changes after (``epoch``, ``cursor``),
        waiting up to ``wait_s`` for one; the whole table when the router is
        new, fell out of the log, or follows an earlier directory process."""
        self.stats["subscribe_polls"] += 1
        if epoch == self.log.epoch and cursor == self.log.seq and wait_s > 0:
            if self._changed is None:
                self._changed = asyncio.Event()
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=min(float(wait_s), 30.0))
            except asyncio.TimeoutError:
                pass   # no change: the answer says so, and that the directory is alive
        update = self.log.update(self.table, epoch, cursor)
        if update.state is not None:
            self.stats["full_states_sent"] += 1
        return update

    async def report_failure(self, worker_id: str) -> bool:
        """A client saw this worker fail. Drop it now; if it is in fact alive,
        its next report re-registers it with a fresh snapshot."""
        return await self.drop_worker(worker_id, "reported by a client")

    def live_workers(self) -> list[str]:
        return sorted(self.workers)

    def peer_addresses(self) -> dict[str, str]:
        """Live workers' peer channels (``actors.peer``): worker id -> host:port."""
        return {w: a for w, a in self.addresses.items() if w in self.workers}

    def measured_rates(self, bytes_per_token: int, block_tokens: int) -> MeasuredRates | None:
        """Rates a live worker of the same KV shape measured, for a replacement
        worker that would rather not spend seconds measuring them again."""
        for worker_id in sorted(self.costs):
            rates = self.costs[worker_id]
            if rates.bytes_per_token == bytes_per_token and rates.block_tokens == block_tokens:
                return rates
        return None

    def get_stats(self) -> dict:
        """Counters, per-worker load, the index's stats, and the routing decision's
        own time (``choose``, thread CPU time) over the latest 10,000 decisions."""
        return {**self.stats, "workers": {w: {"queued_tokens": s.queued_tokens, "running": s.running}
                                          for w, s in self.workers.items()},
                "index": dict(getattr(self.index, "stats", {})), "policy": self.policy_name,
                "log_seq": self.log.seq, "decision_us_p50": self.table.decision_us(0.5),
                "decision_us_p99": self.table.decision_us(0.99), "l3_blocks_known": self.index.num_l3,
                "l3_tenant_blocks": {"" if t is None else str(t): n for t, n in self.l3_shares.totals().items()},
                "draining": self.table.draining, "lifecycle": list(self.lifecycle)}

    def index_dump(self) -> dict:
        """Everything the index holds (checks and tests; large on a big cluster): each
        worker's entries (block hash -> tier), the L3 set, and the epochs."""
        return {"workers": {w: self.index.entries(w) for w in self.workers}, "l3": self.index.l3_entries(),
                "epochs": dict(self.epochs), "l3_known": self.l3_known}

    async def set_policy(self, name: str) -> None:
        """Switch the policy (admin); the configured ``policy_kwargs`` go with the
        configured policy only (they are that policy's options)."""
        make_policy(name)  # validate first
        kwargs = self._policy_kwargs if name == self._policy else {}
        self._change("policy", name, dict(kwargs))

    # ---------------------------------------------------------------- health
    def _ensure_health_task(self) -> None:
        if self._health_task is None and self.heartbeat_timeout_s > 0:
            try:
                self._health_task = asyncio.get_running_loop().create_task(self._health_loop())
            except RuntimeError:
                pass

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_timeout_s / 3)
            await self.expire_silent_workers()

    async def expire_silent_workers(self) -> list[str]:
        now = self.clock()
        silent = [w for w, t in self.last_seen.items() if now - t > self.heartbeat_timeout_s]
        for w in silent:
            await self.drop_worker(w, f"no report for {self.heartbeat_timeout_s:.1f}s")
        return silent


DirectoryActor = ray.remote(DirectoryImpl)


def get_or_create_directory(namespace: str = "prefix-cache", policy: str = "cost", block_tokens: int = 16,
                            name: str = DIRECTORY_NAME, **kwargs):
    """The named directory of a deployment; Ray restarts it if it dies."""
    return DirectoryActor.options(name=name, namespace=namespace, get_if_exists=True, lifetime="detached",
                                  max_restarts=-1, max_task_retries=-1, max_concurrency=1000,
                                  num_cpus=0).remote(policy, block_tokens, namespace, **kwargs)
