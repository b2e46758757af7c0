"""Directory: the global, named actor that knows which worker holds which prefix.

It owns a ``cluster.routing.GlobalIndex`` (block hash -> workers and tiers)
and a routing policy, both plain ``cluster/`` code. Workers publish KV event
batches (msgpack, per-worker sequence numbers); a gap, a resync flag or an
unknown worker is answered with a status that makes the worker push a full
snapshot. After a restart (Ray restarts it: ``max_restarts=-1``) the index
starts empty and is rebuilt from the workers' snapshots within one report
interval.
"""

from __future__ import annotations

import asyncio
import logging
import time

import ray

from actors.naming import DIRECTORY_NAME
from cluster.errors import InvalidInputError
from cluster.routing.events import EventBatch, MalformedBatchError
from cluster.routing.index import GlobalIndex
from cluster.routing.policy import CostModel, NoLiveWorkerError, WorkerState, make_policy

log = logging.getLogger(__name__)


class DirectoryImpl:
    """Push-based: workers send event batches with their load (every ~100 ms, so
    they double as heartbeats) and, when told, a full snapshot. The directory
    never calls a worker, so it works the same whether workers are plain actors
    or Serve replicas, and a dead worker costs it nothing but a timeout."""

    def __init__(self, policy: str = "cost", block_tokens: int = 16, namespace: str = "prefix-cache",
                 policy_kwargs: dict | None = None, heartbeat_timeout_s: float = 3.0, clock=time.monotonic):
        self.namespace = namespace
        self.block_tokens = block_tokens
        self.index = GlobalIndex()
        self.policy_name = policy
        self.policy_kwargs = dict(policy_kwargs or {})
        self.workers: dict[str, WorkerState] = {}
        self.costs: dict[str, dict] = {}
        self.last_seen: dict[str, float] = {}
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.clock = clock
        self.policy = self._make_policy()
        self._candidates: list[WorkerState] | None = None   # reused by route() until membership changes
        self._health_task = None
        self.stats = {"decisions": 0, "by_reason": {}, "resyncs": 0, "snapshots": 0, "malformed_batches": 0,
                      "unknown_worker_batches": 0, "gaps": 0, "dropped_workers": 0, "started_at": time.time()}

    def _make_policy(self):
        return make_policy(self.policy_name, cost=self._cost_model(), **self.policy_kwargs)

    def _reprice(self) -> None:
        """New measured rates: the policy is updated in place, so what it learned
        (branch points, recent work, approximate trees) survives."""
        self.policy.set_cost(self._cost_model())

    def _cost_model(self) -> CostModel:
        """Cluster-wide constants from what the workers measured at start-up."""
        if self.costs:
            prefill = min(c["prefill_tokens_per_s"] for c in self.costs.values())
            promote = min(c["promote_tokens_per_s"] for c in self.costs.values())
            # Without NIXL on a worker (object store only), a quarter of its
            # promotion rate stands in until a migration measures the real one.
            transfer = min(c.get("transfer_tokens_per_s", c["promote_tokens_per_s"] / 4) for c in self.costs.values())
            cold = min(c.get("cold_promote_tokens_per_s", c["promote_tokens_per_s"] / 10) for c in self.costs.values())
        else:  # nobody measured yet: conservative placeholders, replaced at the first registration
            prefill, promote, transfer, cold = 5_000.0, 1e6, 2.5e5, 1e5
        return CostModel(prefill_tokens_per_s=prefill, warm_promote_tokens_per_s=promote,
                         cold_promote_tokens_per_s=cold, transfer_tokens_per_s=transfer,
                         block_tokens=self.block_tokens)

    # ---------------------------------------------------------------- workers
    async def register_worker(self, worker_id: str, cost: dict | None = None, fresh: bool = True) -> None:
        """A worker (re)starting: ``fresh`` forgets what an earlier process of the
        same id held, since the new one numbers its batches from 1 again."""
        if not isinstance(worker_id, str) or not worker_id:
            raise InvalidInputError(f"worker_id must be a non-empty string, got {worker_id!r}")
        if fresh or worker_id not in self.workers:
            self.index.register_worker(worker_id)
            if worker_id in self.workers:       # a restarted process: what the policy knew of it is stale
                self.policy.forget_worker(worker_id)
            self.workers[worker_id] = WorkerState(worker_id, 0, 0)
            self._candidates = None
            log.info("worker %s registered", worker_id)
        self.last_seen[worker_id] = self.clock()
        if cost:
            self.costs[worker_id] = cost
            self._reprice()
        self._ensure_health_task()

    async def drop_worker(self, worker_id: str, reason: str = "failed") -> bool:
        """Forget a worker and every block it held, at once."""
        if worker_id not in self.workers:
            return False
        self.index.drop_worker(worker_id)
        for table in (self.workers, self.costs, self.last_seen):
            table.pop(worker_id, None)
        self._candidates = None
        self.policy.forget_worker(worker_id)
        self.stats["dropped_workers"] += 1
        log.warning("worker %s dropped (%s)", worker_id, reason)
        return True

    async def publish(self, worker_id: str, data: bytes | None, load: dict | None = None) -> str:
        """A worker's KV event batch (msgpack) and/or its current load.

        Returns "ok", or what the worker must do: "unknown_worker", "gap",
        "resync" or "malformed" all mean "send a snapshot" (``load_snapshot``).
        """
        if worker_id not in self.workers:  # new, or this directory just restarted
            self.stats["unknown_worker_batches"] += 1
            await self.register_worker(worker_id, fresh=False)
            self._set_load(worker_id, load)
            return "unknown_worker"
        self.last_seen[worker_id] = self.clock()
        self._set_load(worker_id, load)
        if data is None:
            return "ok"
        try:
            batch = EventBatch.decode(data)
            if batch.worker_id != worker_id:
                raise MalformedBatchError(f"batch names worker {batch.worker_id!r}, sent by {worker_id!r}")
        except MalformedBatchError as exc:
            self.stats["malformed_batches"] += 1
            log.warning("malformed event batch from %s: %s", worker_id, exc)
            return "malformed"
        status = self.index.apply(batch)
        if status == "gap":
            self.stats["gaps"] += 1
        if status in ("gap", "resync"):
            self.stats["resyncs"] += 1
        return status

    async def load_snapshot(self, worker_id: str, seq: int, entries: dict) -> str:
        if worker_id not in self.workers:
            await self.register_worker(worker_id, fresh=False)
        self.index.load_snapshot(worker_id, seq, entries)
        self.stats["snapshots"] += 1
        return "ok"

    def _set_load(self, worker_id: str, load: dict | None) -> None:
        if load:
            st = self.workers[worker_id]
            st.queued_tokens, st.running = int(load.get("queued_tokens", 0)), int(load.get("running", 0))
            rate = load.get("transfer_tokens_per_s")
            cost = self.costs.get(worker_id)
            if rate and cost is not None:
                old = cost.get("transfer_tokens_per_s")
                if not old or abs(rate - old) > 0.2 * old:   # re-price only on a real change
                    cost["transfer_tokens_per_s"] = rate
                    self._reprice()

    # ---------------------------------------------------------------- routing
    async def route(self, hashes: list[int], num_tokens: int, exclude: list[str] | None = None,
                    reserve: bool = True) -> dict:
        """Choose a worker for a request whose prompt has these block hashes.

        ``reserve`` counts the request's prefill in the chosen worker's queue
        until that worker's next load report (so a burst spreads out); a
        what-if query passes False."""
        if not isinstance(num_tokens, int) or num_tokens < 0:
            raise InvalidInputError(f"num_tokens must be a non-negative integer, got {num_tokens!r}")
        if exclude:
            candidates = [w for wid, w in self.workers.items() if wid not in exclude]
        else:   # the same list object until membership changes: the policy caches per-list state
            if self._candidates is None:
                self._candidates = list(self.workers.values())
            candidates = self._candidates
        if not candidates:
            raise NoLiveWorkerError("no live cache workers registered with the directory")
        decision = self.policy.choose(hashes, num_tokens, candidates, self.index, sent=reserve)
        self.stats["decisions"] += 1
        reason = decision.reason
        self.stats["by_reason"][reason] = self.stats["by_reason"].get(reason, 0) + 1
        if reserve:
            self.workers[decision.worker_id].queued_tokens += num_tokens - decision.cached_tokens
        return {"worker_id": decision.worker_id, "reason": reason, "expected_ttft_s": decision.expected_ttft_s,
                "cached_tokens": decision.cached_tokens, "migrate_from": decision.migrate_from}

    async def report_failure(self, worker_id: str) -> bool:
        """A client saw this worker fail. Drop it now; if it is in fact alive,
        its next report re-registers it with a fresh snapshot."""
        return await self.drop_worker(worker_id, "reported by a client")

    def live_workers(self) -> list[str]:
        return sorted(self.workers)

    def measured_rates(self, bytes_per_token: int, block_tokens: int) -> dict | None:
        """Rates a live worker of the same KV shape measured (``rates_to_wire``), for a
        replacement worker that would rather not spend seconds measuring them again."""
        for worker_id in sorted(self.costs):
            cost = self.costs[worker_id]
            if cost.get("bytes_per_token") == bytes_per_token and cost.get("block_tokens") == block_tokens:
                return dict(cost)
        return None

    def get_stats(self) -> dict:
        return {**self.stats, "workers": {w: {"queued_tokens": s.queued_tokens, "running": s.running}
                                          for w, s in self.workers.items()},
                "index": dict(getattr(self.index, "stats", {})), "policy": self.policy_name}

    async def set_policy(self, name: str) -> None:
        make_policy(name)  # validate first
        self.policy_name = name
        self.policy = self._make_policy()

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
