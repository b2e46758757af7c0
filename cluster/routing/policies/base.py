"""Shared vocabulary of the routing policies and the simple ones.

``WorkerState`` (what the directory knows of a replica's load), ``RouteDecision``
(what a policy answers), ``CostModel`` (throughputs that turn blocks into
seconds), the ``Policy`` base class and the policies that need no memory of
their own: ``round_robin``, ``least_loaded``, ``prefix`` and ``ideal``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from operator import attrgetter
from typing import Callable, Sequence

from cluster.errors import CacheError, InvalidInputError
from cluster.protocol import RATE_FIELDS, RouteDecision
from cluster.routing.index import NO_HIT, GlobalIndex, PrefixHit


class NoLiveWorkerError(CacheError):
    """Every worker is dead (or none was given): there is nowhere to route."""


@dataclass(slots=True)
class WorkerState:
    worker_id: str
    queued_tokens: int     # prefill work waiting or running, in tokens
    running: int = 0       # requests in the worker (queued or in service)
    alive: bool = True


@dataclass(frozen=True)
class CostModel:
    """Throughputs of one worker, in tokens per second, and its block size.

    ``decode_step_s``: a worker that is running requests finishes its current
    decode step before a new prefill starts (0 where decode is not modeled).
    ``l3_fetch_tokens_per_s``: reading blocks from L3 into a worker (0: no L3);
    an L3 fetch is priced only where it beats prefill (``l3_pays``).
    """
    prefill_tokens_per_s: float = 10_000.0
    warm_promote_tokens_per_s: float = 150_000.0
    cold_promote_tokens_per_s: float = 20_000.0
    transfer_tokens_per_s: float = 75_000.0
    block_tokens: int = 16
    decode_step_s: float = 0.0
    l3_fetch_tokens_per_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("prefill_tokens_per_s", "warm_promote_tokens_per_s", "cold_promote_tokens_per_s",
                     "transfer_tokens_per_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not v > 0:
                raise InvalidInputError(f"{name} must be a positive number, got {v!r}")
        if not isinstance(self.block_tokens, int) or self.block_tokens <= 0:
            raise InvalidInputError(f"block_tokens must be a positive integer, got {self.block_tokens!r}")
        if not isinstance(self.decode_step_s, (int, float)) or self.decode_step_s < 0:
            raise InvalidInputError(f"decode_step_s must be >= 0, got {self.decode_step_s!r}")
        if not isinstance(self.l3_fetch_tokens_per_s, (int, float)) or self.l3_fetch_tokens_per_s < 0:
            raise InvalidInputError(f"l3_fetch_tokens_per_s must be >= 0, got {self.l3_fetch_tokens_per_s!r}")

    @property
    def l3_pays(self) -> bool:
        """Whether reading a block from L3 is faster than computing it."""
        return self.l3_fetch_tokens_per_s > self.prefill_tokens_per_s

    # ------------------------------------------------------------ components
    def wait_s(self, worker: WorkerState) -> float:
        wait = worker.queued_tokens / self.prefill_tokens_per_s
        return wait + self.decode_step_s if worker.running else wait

    def prefill_s(self, tokens: int) -> float:
        return max(tokens, 0) / self.prefill_tokens_per_s

    def promote_s(self, warm_blocks: int, cold_blocks: int = 0) -> float:
        bt = self.block_tokens
        return warm_blocks * bt / self.warm_promote_tokens_per_s + cold_blocks * bt / self.cold_promote_tokens_per_s

    def transfer_s(self, blocks: int, cold_blocks: int = 0) -> float:
        """Pull ``blocks`` from another worker; ``cold_blocks`` of them are read from its disk first."""
        bt = self.block_tokens
        return blocks * bt / self.transfer_tokens_per_s + cold_blocks * bt / self.cold_promote_tokens_per_s

    def cached_tokens(self, blocks: int, num_tokens: int) -> int:
        return min(blocks * self.block_tokens, num_tokens)

    # ---------------------------------------------------------------- totals
    def service_s(self, hit: PrefixHit, num_tokens: int) -> float:
        """Time the worker spends on the request once it starts: promotion + prefill."""
        # The component formulas inlined (a decision prices a few options per request).
        bt, hot, warm, cold = self.block_tokens, *hit
        uncached = num_tokens - min((hot + warm + cold) * bt, num_tokens)
        return (warm * bt / self.warm_promote_tokens_per_s + cold * bt / self.cold_promote_tokens_per_s
                + max(uncached, 0) / self.prefill_tokens_per_s)

    def l3_service_s(self, hit: PrefixHit, l3_blocks: int, num_tokens: int) -> float:
        """Service time when the worker reads blocks ``[hit.blocks, l3_blocks)`` from
        L3 before its prefill (its own WARM/COLD blocks promoted as usual)."""
        bt, hot, warm, cold = self.block_tokens, *hit
        fetched = max(0, l3_blocks - (hot + warm + cold))
        uncached = num_tokens - min(max(l3_blocks, hot + warm + cold) * bt, num_tokens)
        return (warm * bt / self.warm_promote_tokens_per_s + cold * bt / self.cold_promote_tokens_per_s
                + fetched * bt / self.l3_fetch_tokens_per_s + max(uncached, 0) / self.prefill_tokens_per_s)

    def ttft_s(self, worker: WorkerState, hit: PrefixHit, num_tokens: int) -> float:
        return self.wait_s(worker) + self.service_s(hit, num_tokens)

    def stage_s(self, hot_blocks: int) -> float:
        """The holder copying ``hot_blocks`` from the device into host staging
        blocks before a peer can pull them (device -> host at the promotion rate)."""
        return hot_blocks * self.block_tokens / self.warm_promote_tokens_per_s

    def migrate_service_s(self, own: PrefixHit, source: PrefixHit, num_tokens: int) -> float:
        """Service time when the worker pulls ``source``'s blocks beyond its own prefix
        first: the holder stages its HOT ones, COLD ones are read from its disk."""
        # promote_s + stage_s + transfer_s + prefill_s, inlined (the same arithmetic).
        bt, warm_rate, cold_rate = self.block_tokens, self.warm_promote_tokens_per_s, self.cold_promote_tokens_per_s
        o_hot, o_warm, o_cold = own
        s_hot, s_warm, s_cold = source
        own_blocks, source_blocks = o_hot + o_warm + o_cold, s_hot + s_warm + s_cold
        pulled = source_blocks - own_blocks
        pulled_cold = max(0, source_blocks - max(own_blocks, s_hot + s_warm))
        uncached = num_tokens - min(source_blocks * bt, num_tokens)
        return ((o_warm * bt / warm_rate + o_cold * bt / cold_rate) + max(0, s_hot - own_blocks) * bt / warm_rate
                + (pulled * bt / self.transfer_tokens_per_s + pulled_cold * bt / cold_rate)
                + max(uncached, 0) / self.prefill_tokens_per_s)

    def scaled(self, **factors: float) -> "CostModel":
        """This model with some throughputs multiplied (a misestimate, for robustness sweeps)."""
        kw = {f: getattr(self, f) * factors.get(f, 1.0) for f in RATE_FIELDS}
        return CostModel(**kw, block_tokens=self.block_tokens, decode_step_s=self.decode_step_s,
                         l3_fetch_tokens_per_s=self.l3_fetch_tokens_per_s * factors.get("l3_fetch_tokens_per_s", 1.0))

    def migrate_ttft_s(self, worker: WorkerState, own: PrefixHit, source: PrefixHit, num_tokens: int) -> float:
        return self.wait_s(worker) + self.migrate_service_s(own, source, num_tokens)

    # ------------------------------------------------------------- measuring
    @classmethod
    def measure(cls, *, block_tokens: int, prefill: Callable[[], int],
                warm_promote: Callable[[], int] | None = None, cold_promote: Callable[[], int] | None = None,
                transfer: Callable[[], int] | None = None, repeats: int = 3, decode_step_s: float = 0.0,
                clock: Callable[[], float] = time.perf_counter) -> "CostModel":
        """Measure throughputs on the real thing.

        Each callable performs the operation once (a prefill of N tokens, a
        promotion, a pull from a peer) and returns the tokens it processed.
        One warm-up call, then the best of ``repeats`` timed calls. Operations
        not given keep this class's default rate.
        """
        if not isinstance(repeats, int) or repeats < 1:
            raise InvalidInputError(f"repeats must be a positive integer, got {repeats!r}")
        defaults = cls(block_tokens=block_tokens)

        def rate(fn: Callable[[], int] | None, default: float, what: str) -> float:
            if fn is None:
                return default
            fn()
            best = None
            for _ in range(repeats):
                t0 = clock()
                tokens = fn()
                dt = clock() - t0
                if not isinstance(tokens, int) or tokens <= 0:
                    raise InvalidInputError(
                        f"{what} callable must return the tokens it processed (> 0), got {tokens!r}")
                if dt <= 0:
                    raise InvalidInputError(f"{what} took no measurable time; give it more tokens")
                r = tokens / dt
                best = r if best is None else max(best, r)
            return best

        return cls(prefill_tokens_per_s=rate(prefill, defaults.prefill_tokens_per_s, "prefill"),
                   warm_promote_tokens_per_s=rate(warm_promote, defaults.warm_promote_tokens_per_s, "warm_promote"),
                   cold_promote_tokens_per_s=rate(cold_promote, defaults.cold_promote_tokens_per_s, "cold_promote"),
                   transfer_tokens_per_s=rate(transfer, defaults.transfer_tokens_per_s, "transfer"),
                   block_tokens=block_tokens, decode_step_s=decode_step_s)


_QUEUED = attrgetter("queued_tokens")


def _least_loaded(alive: list[WorkerState], turn: int) -> WorkerState:
    """Fewest queued tokens, then fewest running; exact ties rotate with ``turn``
    (an idle cluster must not send every request to the first worker)."""
    n = len(alive)
    i = min(range(n), key=lambda i: (alive[i].queued_tokens, alive[i].running, (i - turn) % n))
    return alive[i]


_ALIVE = attrgetter("alive")


def _alive(workers: Sequence[WorkerState]) -> list[WorkerState]:
    if workers and all(map(_ALIVE, workers)):     # the common case, without a Python-level loop
        return workers if isinstance(workers, list) else list(workers)
    alive = [w for w in workers if w.alive]
    if not alive:
        raise NoLiveWorkerError("no live worker to route to")
    return alive


class Policy:
    name = "policy"

    def __init__(self, cost: CostModel | None = None):
        self.cost = cost if cost is not None else CostModel()
        self._turn = 0   # decisions made: rotates exact ties
        # Where this router starts looking among workers that tie exactly (0: the
        # first). Independent routers with the same tables would otherwise all
        # break ties the same way and herd onto the same worker.
        self.tie_salt = 0

    def choose(self, hashes: Sequence[int], num_tokens: int, workers: Sequence[WorkerState],
               index: GlobalIndex, sent: bool = True) -> RouteDecision:
        """The worker for one request. ``sent`` is False for a what-if query: no
        request follows the decision, so nothing may count it as in flight."""
        raise NotImplementedError

    def set_cost(self, cost: CostModel) -> None:
        """New throughputs (a worker measured again): what the policy learned stays."""
        if not isinstance(cost, CostModel):
            raise InvalidInputError(f"cost must be a CostModel, got {type(cost).__name__}")
        self.cost = cost

    def forget_worker(self, worker_id: str) -> None:
        """A worker left (or restarted): drop what the policy remembers of it, nothing else."""

    def _decide(self, worker: WorkerState, reason: str, hit: PrefixHit, num_tokens: int) -> RouteDecision:
        return RouteDecision(worker.worker_id, reason, self.cost.ttft_s(worker, hit, num_tokens),
                        self.cost.cached_tokens(hit.blocks, num_tokens))


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def choose(self, hashes, num_tokens, workers, index, sent=True):
        alive = _alive(workers)
        worker = alive[self._turn % len(alive)]
        self._turn += 1
        return self._decide(worker, "round_robin", index.hit(hashes, worker.worker_id), num_tokens)


class LeastLoadedPolicy(Policy):
    name = "least_loaded"

    def choose(self, hashes, num_tokens, workers, index, sent=True):
        worker = _least_loaded(_alive(workers), self._turn)
        self._turn += 1
        return self._decide(worker, "load", index.hit(hashes, worker.worker_id), num_tokens)


class PrefixPolicy(Policy):
    name = "prefix"

    def __init__(self, cost: CostModel | None = None, imbalance_tokens: int = 8192):
        super().__init__(cost)
        if imbalance_tokens < 0:
            raise InvalidInputError(f"imbalance_tokens must be >= 0, got {imbalance_tokens!r}")
        self.imbalance_tokens = imbalance_tokens

    def choose(self, hashes, num_tokens, workers, index, sent=True):
        alive = _alive(workers)
        hits = index.match(hashes)
        least = _least_loaded(alive, self._turn)
        self._turn += 1
        best = min(alive, key=lambda w: (-hits.get(w.worker_id, NO_HIT).blocks, w.queued_tokens, w.running))
        best_hit = hits.get(best.worker_id, NO_HIT)
        if not best_hit.blocks:
            return self._decide(least, "load", NO_HIT, num_tokens)
        if best.queued_tokens - least.queued_tokens > self.imbalance_tokens:
            return self._decide(least, "balance", hits.get(least.worker_id, NO_HIT), num_tokens)
        return self._decide(best, "prefix", best_hit, num_tokens)


class IdealPolicy(Policy):
    """Upper bound for simulation: the best hit anywhere, served on the least loaded worker."""
    name = "ideal"

    def choose(self, hashes, num_tokens, workers, index, sent=True):
        least = _least_loaded(_alive(workers), self._turn)
        self._turn += 1
        hits = index.match(hashes)
        best = max(hits.values(), key=lambda h: (h.blocks, h.hot), default=NO_HIT)
        return self._decide(least, "ideal", best, num_tokens)
