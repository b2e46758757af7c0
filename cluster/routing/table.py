"""RoutingTable: everything one routing decision reads, and the log that copies it.

A table holds the global index (block hash -> workers and tiers), each
worker's load, the cost model and the policy. The directory owns the
primary table. Every change to it is an *op* (a name and its arguments)
applied through ``apply``; the directory writes each op into a
``ChangeLog``, and a router keeps a ``TableReplica`` that replays the same
ops in the same order: state-machine replication. Since the index and the
policies are deterministic, the router's copy answers what the directory
would, without a remote call on the request path. Two things stay local to
each copy, by design: the load reserved by the decisions it made itself
(until the worker's next load report replaces it) and what the policy
remembers of those decisions (in-flight prefixes, recent work). With
several routers, each balances its own share, which balances the sum.

Ops: ``register(worker_id, fresh)``, ``drop(worker_id)``,
``drain(worker_id)`` (a worker leaving: it keeps its entries for migrations
but is never chosen), ``batch(EventBatch)``, ``snapshot(worker_id, seq,
entries)``, ``load(worker_id, queued_tokens, running)``, ``cost(CostModel
fields)``, ``policy(name, kwargs)``, ``l3_clear()`` (L3 was flushed).

A replica that misses an op (its cursor fell out of the log, or the
directory restarted and numbers from 1 again under a new epoch) gets the
whole table (``TableState``) instead, and goes on from there.
"""

from __future__ import annotations

import dataclasses
import random
import time
import uuid
from collections import deque
from itertools import islice
from typing import Any, Callable, Sequence

from cluster.errors import InvalidInputError
from cluster.protocol import TableChange, TableState, TableUpdate
from cluster.routing.events import EventBatch
from cluster.routing.index import GlobalIndex
from cluster.protocol import RouteDecision
from cluster.routing.policies import CostModel, NoLiveWorkerError, WorkerState, make_policy

OPS = ("register", "drop", "drain", "batch", "snapshot", "load", "cost", "policy", "l3_clear")


class RoutingTable:
    def __init__(self, policy: str = "cost", policy_kwargs: dict | None = None, cost: CostModel | None = None,
                 tie_salt: int = 0):
        self.index = GlobalIndex()
        self.workers: dict[str, WorkerState] = {}
        self.cost = cost or CostModel()
        self.tie_salt = tie_salt   # this copy's own place among exact ties (``Policy.tie_salt``)
        self.policy_name = policy
        self.policy_kwargs = dict(policy_kwargs or {})
        self.policy = self._make_policy(policy, self.policy_kwargs)
        self._candidates: list[WorkerState] | None = None   # reused by route() until membership changes
        self.decision_s: deque[float] = deque(maxlen=10_000)   # the latest decisions' thread CPU time

    # ------------------------------------------------------------------ ops
    def apply(self, op: str, args: tuple) -> Any:
        """Apply one op (module docstring); what it returns is the op's own result."""
        handler = getattr(self, f"_op_{op}", None) if op in OPS else None
        if handler is None:
            raise InvalidInputError(f"unknown routing table op {op!r}; expected one of {OPS}")
        return handler(*args)

    def _op_register(self, worker_id: str, fresh: bool = True) -> bool:
        """A worker (re)starting; ``fresh`` forgets what an earlier process of the same
        id held. Returns whether the worker's entries were reset."""
        if not fresh and worker_id in self.workers:
            return False
        self.index.register_worker(worker_id)
        if worker_id in self.workers:       # a restarted process: what the policy knew of it is stale
            self.policy.forget_worker(worker_id)
        self.workers[worker_id] = WorkerState(worker_id, 0, 0)
        self._candidates = None
        return True

    def _op_drop(self, worker_id: str) -> bool:
        if worker_id not in self.workers:
            return False
        self.index.drop_worker(worker_id)
        del self.workers[worker_id]
        self._candidates = None
        self.policy.forget_worker(worker_id)
        return True

    def _op_drain(self, worker_id: str) -> bool:
        st = self.workers.get(worker_id)
        if st is None or not st.alive:
            return False
        st.alive = False   # the policies skip it; its blocks can still be pulled from it
        self._candidates = None
        return True

    @property
    def draining(self) -> list[str]:
        return [w for w, st in self.workers.items() if not st.alive]

    def _op_l3_clear(self) -> int:
        n = self.index.num_l3
        self.index.load_l3(())
        return n

    def _op_batch(self, batch: EventBatch) -> str:
        return self.index.apply(batch)

    def _op_snapshot(self, worker_id: str, seq: int, entries: dict) -> str:
        return self.index.load_snapshot(worker_id, seq, entries)

    def _op_load(self, worker_id: str, queued_tokens: int, running: int) -> None:
        st = self.workers.get(worker_id)
        if st is not None:
            st.queued_tokens, st.running = queued_tokens, running

    def _op_cost(self, fields: dict) -> None:
        """New measured rates: the policy is updated in place, so what it learned survives."""
        self.cost = CostModel(**fields)
        self.policy.set_cost(self.cost)

    def _op_policy(self, name: str, kwargs: dict) -> None:
        self.policy = self._make_policy(name, kwargs)
        self.policy_name, self.policy_kwargs = name, dict(kwargs)

    def _make_policy(self, name: str, kwargs: dict):
        policy = make_policy(name, cost=self.cost, **kwargs)
        policy.tie_salt = self.tie_salt
        return policy

    # -------------------------------------------------------------- routing
    def route(self, hashes: Sequence[int], num_tokens: int, exclude: Sequence[str] | None = None,
              reserve: bool = True) -> RouteDecision:
        """The policy's choice for a request with these block hashes. ``reserve``
        counts its prefill in the chosen worker's queue until that worker's next
        load report (a burst spreads out); a what-if query passes False."""
        if exclude:
            candidates = [w for wid, w in self.workers.items() if wid not in exclude and w.alive]
        else:   # the same list object until membership changes: the policy caches per-list state
            if self._candidates is None:
                self._candidates = [w for w in self.workers.values() if w.alive]   # draining ones never
            candidates = self._candidates
        if not candidates:
            raise NoLiveWorkerError("no live cache workers registered with the directory")
        # Thread CPU time: what the decision costs, not the turns other threads and
        # processes take meanwhile (the route step's wall time is measured around it).
        started = time.thread_time()
        decision = self.policy.choose(hashes, num_tokens, candidates, self.index, sent=reserve)
        self.decision_s.append(time.thread_time() - started)
        if reserve:
            self.workers[decision.worker_id].queued_tokens += num_tokens - decision.cached_tokens
        return decision

    def decision_us(self, q: float) -> float | None:
        """The ``q`` quantile (0..1) of the latest decisions' durations, in microseconds."""
        times = sorted(self.decision_s)
        return round(times[min(len(times) - 1, int(q * len(times)))] * 1e6, 1) if times else None

    # ---------------------------------------------------------------- state
    def state(self, epoch: str, seq: int) -> TableState:
        """The whole table as of log position ``seq`` (for a replica that fell behind)."""
        return TableState(epoch, seq, self.policy_name, dict(self.policy_kwargs), dataclasses.asdict(self.cost),
                          {w: (s.queued_tokens, s.running) for w, s in self.workers.items()},
                          {w: (self.index.last_seq(w), self.index.entries(w)) for w in self.workers},
                          tuple(self.index.l3_entries()), tuple(self.draining))

    @classmethod
    def from_state(cls, state: TableState, tie_salt: int = 0) -> "RoutingTable":
        table = cls(state.policy, state.policy_kwargs, CostModel(**state.cost), tie_salt)
        for worker_id, (queued, running) in state.workers.items():
            table._op_register(worker_id)
            table._op_load(worker_id, queued, running)
            last_seq, entries = state.index.get(worker_id, (0, {}))
            table.index.load_snapshot(worker_id, last_seq, entries)
        table.index.load_l3(state.l3)
        for worker_id in state.draining:
            table._op_drain(worker_id)
        return table


class ChangeLog:
    """The directory's record of table ops, numbered from 1 within an epoch (one
    directory process); keeps the latest ``capacity``."""

    def __init__(self, capacity: int = 4096):
        self.epoch = uuid.uuid4().hex
        self.seq = 0
        self._changes: deque[TableChange] = deque(maxlen=capacity)

    def append(self, op: str, args: tuple) -> None:
        self.seq += 1
        self._changes.append(TableChange(self.seq, op, args))

    def since(self, cursor: int) -> list[TableChange] | None:
        """The changes after ``cursor``, or None when some of them are no longer kept
        (or ``cursor`` is not one of this log's positions)."""
        if cursor == self.seq:
            return []
        if not 0 <= cursor < self.seq or not self._changes or self._changes[0].seq > cursor + 1:
            return None
        first = self._changes[0].seq
        return list(islice(self._changes, cursor + 1 - first, None))

    def update(self, table: RoutingTable, epoch: str | None, cursor: int) -> TableUpdate:
        """What a replica at (``epoch``, ``cursor``) needs: the changes since, or the whole table."""
        changes = self.since(cursor) if epoch == self.epoch else None
        if changes is None:
            return TableUpdate(self.epoch, self.seq, (), table.state(self.epoch, self.seq))
        return TableUpdate(self.epoch, self.seq, tuple(changes), None)


class TableReplica:
    """A router's copy of the directory's table, kept in step by ``TableUpdate``s.

    ``usable()`` while it holds at least one worker and heard from the
    directory within ``max_age_s`` (a long poll answers at least every few
    seconds, with no change if there is none); otherwise the caller asks the
    directory itself."""

    def __init__(self, max_age_s: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 tie_salt: int | None = None):
        self.table: RoutingTable | None = None
        # Each router breaks exact ties from its own place: routers deciding on
        # identical copies would otherwise all pick the same idle worker.
        self.tie_salt = random.SystemRandom().randrange(1, 1 << 30) if tie_salt is None else tie_salt
        self.epoch: str | None = None
        self.seq = 0
        self.max_age_s = max_age_s
        self.clock = clock
        self.heard_at = float("-inf")
        self.stats = {"updates": 0, "changes": 0, "full_states": 0, "out_of_order": 0}

    def apply(self, update: TableUpdate) -> None:
        self.stats["updates"] += 1
        if update.state is not None:
            self.table = RoutingTable.from_state(update.state, self.tie_salt)
            self.epoch, self.seq = update.state.epoch, update.state.seq
            self.stats["full_states"] += 1
        if self.table is None or update.epoch != self.epoch:
            self.epoch = None   # ask for the whole table next time
            return
        for change in update.changes:
            if change.seq <= self.seq:
                continue
            if change.seq != self.seq + 1:   # a change missed: start over from the whole table
                self.stats["out_of_order"] += 1
                self.epoch = None
                return
            self.table.apply(change.op, change.args)
            self.seq = change.seq
            self.stats["changes"] += 1
        self.heard_at = self.clock()

    def usable(self) -> bool:
        return (self.table is not None and self.epoch is not None and bool(self.table.workers)
                and self.clock() - self.heard_at <= self.max_age_s)

    def stale(self) -> None:
        """The directory did not answer: decide remotely until it does again."""
        self.heard_at = float("-inf")
