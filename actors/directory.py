"""Directory: the global, named actor that knows which worker holds which prefix.

It owns a ``cluster.routing.GlobalIndex`` (block hash -> workers and tiers)
and a routing policy, both plain ``cluster/`` code. Workers publish KV event
batches (msgpack, per-worker sequence numbers); a gap, a resync flag or an
unknown worker triggers a snapshot pull from that worker. After a restart
(Ray restarts it: ``max_restarts=-1``) the index starts empty and is rebuilt
from the workers' snapshots as their next batches arrive.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError

from actors.naming import DIRECTORY_NAME, WORKER_PREFIX, worker_actor_name
from cluster.errors import InvalidInputError
from cluster.routing.events import EventBatch, MalformedBatchError
from cluster.routing.index import GlobalIndex
from cluster.routing.policy import CostModel, WorkerState, make_policy

log = logging.getLogger(__name__)


class DirectoryImpl:
    def __init__(self, policy: str = "cost", block_tokens: int = 16, namespace: str = "prefix-cache",
                 policy_kwargs: dict | None = None, health_interval_s: float = 1.0):
        self.namespace = namespace
        self.block_tokens = block_tokens
        self.index = GlobalIndex()
        self.policy_name = policy
        self.policy_kwargs = dict(policy_kwargs or {})
        self.workers: dict[str, WorkerState] = {}
        self.costs: dict[str, dict] = {}
        self.handles: dict[str, Any] = {}
        self.policy = self._make_policy()
        self.health_interval_s = health_interval_s
        self._resyncing: set[str] = set()
        self._health_task = None
        self.stats = {"decisions": 0, "by_reason": {}, "resyncs": 0, "malformed_batches": 0,
                      "unknown_worker_batches": 0, "dropped_workers": 0, "stale_decisions": 0,
                      "started_at": time.time()}

    def _make_policy(self):
        cost = self._cost_model()
        return make_policy(self.policy_name, cost=cost, **self.policy_kwargs)

    def _cost_model(self) -> CostModel:
        """Cluster-wide constants from what the workers measured at start-up."""
        if self.costs:
            prefill = min(c["prefill_tokens_per_s"] for c in self.costs.values())
            promote = min(c["promote_tokens_per_s"] for c in self.costs.values())
            transfer = min(c.get("transfer_tokens_per_s", promote / 4) for c in self.costs.values())
        else:
            prefill, promote, transfer = 5_000.0, 1e6, 2.5e5
        return CostModel(prefill_tokens_per_s=prefill, warm_promote_tokens_per_s=promote,
                         cold_promote_tokens_per_s=promote / 10, transfer_tokens_per_s=transfer,
                         block_tokens=self.block_tokens)

    # ---------------------------------------------------------------- workers
    async def register_worker(self, worker_id: str, cost: dict | None = None) -> None:
        first = worker_id not in self.workers
        self.index.register_worker(worker_id)
        self.workers.setdefault(worker_id, WorkerState(worker_id, 0, 0))
        if cost:
            self.costs[worker_id] = cost
            self.policy = self._make_policy()
        if first:
            log.info("worker %s registered", worker_id)
        self._ensure_health_task()

    def _handle(self, worker_id: str):
        h = self.handles.get(worker_id)
        if h is None:
            h = ray.get_actor(worker_actor_name(worker_id), namespace=self.namespace)
            self.handles[worker_id] = h
        return h

    async def drop_worker(self, worker_id: str, reason: str = "failed") -> bool:
        """Forget a worker and every block it held, at once."""
        if worker_id not in self.workers:
            return False
        self.index.drop_worker(worker_id)
        self.workers.pop(worker_id, None)
        self.costs.pop(worker_id, None)
        self.handles.pop(worker_id, None)
        self.stats["dropped_workers"] += 1
        log.warning("worker %s dropped (%s)", worker_id, reason)
        return True

    async def publish(self, worker_id: str, data: bytes | None, load: dict | None = None) -> str:
        """A worker's KV event batch (msgpack) and/or its current load."""
        if data is None:
            return await self._report_load(worker_id, load or {})
        try:
            batch = EventBatch.decode(data)
        except MalformedBatchError as exc:
            self.stats["malformed_batches"] += 1
            log.warning("malformed event batch from %s: %s", worker_id, exc)
            await self._resync(worker_id)
            return "malformed"
        if batch.worker_id != worker_id:
            self.stats["malformed_batches"] += 1
            return "malformed"
        if worker_id not in self.workers:
            self.stats["unknown_worker_batches"] += 1
            await self.register_worker(worker_id)
            await self._resync(worker_id)
            return "unknown_worker"
        if load:
            st = self.workers[worker_id]
            st.queued_tokens, st.running = load.get("queued_tokens", 0), load.get("running", 0)
        status = self.index.apply(batch)
        if status in ("gap", "resync"):
            await self._resync(worker_id)
        return status

    async def _report_load(self, worker_id: str, load: dict) -> str:
        if worker_id not in self.workers:  # e.g. this directory just restarted
            self.stats["unknown_worker_batches"] += 1
            await self.register_worker(worker_id)
            await self._resync(worker_id)
            return "unknown_worker"
        st = self.workers[worker_id]
        st.queued_tokens, st.running = load.get("queued_tokens", 0), load.get("running", 0)
        return "ok"

    async def _resync(self, worker_id: str) -> None:
        if worker_id in self._resyncing:
            return
        self._resyncing.add(worker_id)
        try:
            seq, entries = await self._handle(worker_id).snapshot.remote()
            self.index.load_snapshot(worker_id, seq, entries)
            self.stats["resyncs"] += 1
        except (ActorDiedError, ActorUnavailableError, ValueError) as exc:
            await self.drop_worker(worker_id, f"snapshot failed: {exc}")
        finally:
            self._resyncing.discard(worker_id)

    # ---------------------------------------------------------------- routing
    async def route(self, hashes: list[int], num_tokens: int, exclude: list[str] | None = None,
                    reserve: bool = True) -> dict:
        """Choose a worker for a request whose prompt has these block hashes.

        ``reserve`` counts the request's prefill in the chosen worker's queue
        until that worker's next load report (so a burst spreads out); a
        what-if query passes False."""
        if not isinstance(num_tokens, int) or num_tokens < 0:
            raise InvalidInputError(f"num_tokens must be a non-negative integer, got {num_tokens!r}")
        candidates = [w for wid, w in self.workers.items() if not exclude or wid not in exclude]
        if not candidates:
            raise RuntimeError("no live cache workers registered with the directory")
        decision = self.policy.choose(hashes, num_tokens, candidates, self.index)
        self.stats["decisions"] += 1
        reason = decision.reason
        self.stats["by_reason"][reason] = self.stats["by_reason"].get(reason, 0) + 1
        if reserve:  # counted as queued until the worker's next load report
            self.workers[decision.worker_id].queued_tokens += num_tokens - decision.cached_tokens
        return {"worker_id": decision.worker_id, "reason": reason, "expected_ttft_s": decision.expected_ttft_s,
                "cached_tokens": decision.cached_tokens, "migrate_from": decision.migrate_from}

    async def report_failure(self, worker_id: str) -> bool:
        """A client saw this worker die: drop it now rather than at the next health check."""
        try:
            await asyncio.wait_for(self._handle(worker_id).ping.remote(), timeout=2.0)
            return False
        except Exception:
            return await self.drop_worker(worker_id, "reported dead by a client")

    def live_workers(self) -> list[str]:
        return sorted(self.workers)

    def get_stats(self) -> dict:
        return {**self.stats, "workers": {w: {"queued_tokens": s.queued_tokens, "running": s.running}
                                          for w, s in self.workers.items()},
                "index": dict(getattr(self.index, "stats", {})), "policy": self.policy_name}

    async def set_policy(self, name: str) -> None:
        self.policy_name = name
        self.policy = self._make_policy()

    # ---------------------------------------------------------------- health
    def _ensure_health_task(self) -> None:
        if self._health_task is None and self.health_interval_s > 0:
            try:
                self._health_task = asyncio.get_running_loop().create_task(self._health_loop())
            except RuntimeError:
                pass

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            for wid in list(self.workers):
                try:
                    await asyncio.wait_for(self._handle(wid).ping.remote(), timeout=5 * self.health_interval_s)
                except (ActorDiedError, ActorUnavailableError, ValueError, asyncio.TimeoutError) as exc:
                    await self.drop_worker(wid, f"health check: {type(exc).__name__}")
                except Exception as exc:  # keep the loop alive whatever happens
                    log.warning("health check of %s: %s", wid, exc)

    async def rediscover(self) -> int:
        """After a restart: find live named workers and pull their snapshots."""
        found = 0
        for info in ray.util.list_named_actors(all_namespaces=True):
            name = info["name"] if isinstance(info, dict) else info
            ns = info.get("namespace") if isinstance(info, dict) else self.namespace
            if ns == self.namespace and name.startswith(WORKER_PREFIX):
                wid = name[len(WORKER_PREFIX):]
                await self.register_worker(wid)
                await self._resync(wid)
                found += 1
        return found


DirectoryActor = ray.remote(DirectoryImpl)


def get_or_create_directory(namespace: str = "prefix-cache", policy: str = "cost", block_tokens: int = 16,
                            name: str = DIRECTORY_NAME, **kwargs):
    """The named directory of a deployment; Ray restarts it if it dies."""
    return DirectoryActor.options(name=name, namespace=namespace, get_if_exists=True, lifetime="detached",
                                  max_restarts=-1, max_task_retries=-1, max_concurrency=1000,
                                  num_cpus=0).remote(policy, block_tokens, namespace, **kwargs)
