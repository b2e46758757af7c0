"""Routing policies: which worker serves a request, given the global index.

Every policy has ``choose(hashes, num_tokens, workers, index) -> Decision``,
with ``hashes`` the request's block-hash chain, ``workers`` the current
``WorkerState`` of each replica and ``index`` a ``GlobalIndex``. Select one by
name with ``make_policy``:

- ``round_robin``: cycles over live workers; the no-locality baseline.
- ``least_loaded``: fewest queued tokens; balance without locality.
- ``prefix``: longest cached prefix, ties to the less loaded; when the best
  holder's queue exceeds the least loaded worker's by more than
  ``imbalance_tokens``, the least loaded worker instead.
- ``cost`` (default): the expected TTFT of every option, cheapest wins (see
  ``CostPolicy``).
- ``approx_tree``: SGLang's cache-aware router / Ray Serve's
  PrefixCacheAffinityRouter: no events from the workers; the router remembers
  what it sent where, in one approximate tree per replica (see
  ``ApproxTreePolicy``).
- ``ideal`` (simulation only): an upper bound. It pretends all replicas read
  one global cache for free, and sends each request to the least loaded one.
  The replay gives it an index holding that single global cache.

Real traces share a first block almost always (a system prompt): pure
longest-prefix routing would send everything to one replica. Every
locality-aware policy here weighs load in.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from operator import attrgetter
from typing import Callable, Sequence

from cluster.errors import CacheError, InvalidInputError
from cluster.routing.index import NO_HIT, GlobalIndex, PrefixHit


class NoLiveWorkerError(CacheError):
    """Every worker is dead (or none was given): there is nowhere to route."""


@dataclass(slots=True)
class WorkerState:
    worker_id: str
    queued_tokens: int     # prefill work waiting or running, in tokens
    running: int = 0       # requests in the worker (queued or in service)
    alive: bool = True


@dataclass(slots=True)
class Decision:
    worker_id: str
    reason: str                      # which rule decided ("prefix", "balance", "migrate", ...)
    expected_ttft_s: float
    cached_tokens: int               # tokens the chosen worker will not prefill (its own + pulled)
    migrate_from: str | None = None  # pull blocks from this worker first
    migrate_blocks: int = 0          # how many (after the chosen worker's own prefix)


@dataclass(frozen=True)
class CostModel:
    """Throughputs of one worker, in tokens per second, and its block size.

    ``decode_step_s``: a worker that is running requests finishes its current
    decode step before a new prefill starts (0 where decode is not modeled).
    """
    prefill_tokens_per_s: float = 10_000.0
    warm_promote_tokens_per_s: float = 150_000.0
    cold_promote_tokens_per_s: float = 20_000.0
    transfer_tokens_per_s: float = 75_000.0
    block_tokens: int = 16
    decode_step_s: float = 0.0

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
        uncached = num_tokens - self.cached_tokens(hit.blocks, num_tokens)
        return self.promote_s(hit.warm, hit.cold) + self.prefill_s(uncached)

    def ttft_s(self, worker: WorkerState, hit: PrefixHit, num_tokens: int) -> float:
        return self.wait_s(worker) + self.service_s(hit, num_tokens)

    def migrate_service_s(self, own: PrefixHit, source: PrefixHit, num_tokens: int) -> float:
        """Service time when the worker pulls ``source``'s blocks beyond its own prefix first."""
        pulled = source.blocks - own.blocks
        pulled_cold = max(0, source.blocks - max(own.blocks, source.hot + source.warm))
        return (self.promote_s(own.warm, own.cold) + self.transfer_s(pulled, pulled_cold)
                + self.prefill_s(num_tokens - self.cached_tokens(source.blocks, num_tokens)))

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


def _alive(workers: Sequence[WorkerState]) -> list[WorkerState]:
    alive = [w for w in workers if w.alive]
    if not alive:
        raise NoLiveWorkerError("no live worker to route to")
    return alive


class Policy:
    name = "policy"

    def __init__(self, cost: CostModel | None = None):
        self.cost = cost if cost is not None else CostModel()
        self._turn = 0   # decisions made: rotates exact ties

    def choose(self, hashes: Sequence[int], num_tokens: int, workers: Sequence[WorkerState],
               index: GlobalIndex) -> Decision:
        raise NotImplementedError

    def _decide(self, worker: WorkerState, reason: str, hit: PrefixHit, num_tokens: int) -> Decision:
        return Decision(worker.worker_id, reason, self.cost.ttft_s(worker, hit, num_tokens),
                        self.cost.cached_tokens(hit.blocks, num_tokens))


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def choose(self, hashes, num_tokens, workers, index):
        alive = _alive(workers)
        worker = alive[self._turn % len(alive)]
        self._turn += 1
        return self._decide(worker, "round_robin", index.hit(hashes, worker.worker_id), num_tokens)


class LeastLoadedPolicy(Policy):
    name = "least_loaded"

    def choose(self, hashes, num_tokens, workers, index):
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

    def choose(self, hashes, num_tokens, workers, index):
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


class _BranchMemory:
    """Which blocks are shared prefixes: a block seen followed by two different
    blocks is a branch point (a system prompt, a few-shot header), so every
    block up to a request's last branch point is shared by several requests.

    Bounded: two generations of ``max_entries`` each; when the current one is
    full the older is forgotten (a prefix unused that long is likely gone from
    the caches too).
    """
    __slots__ = ("max_entries", "_cur", "_old")
    BRANCH = -1

    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self._cur: dict[int, int] = {}
        self._old: dict[int, int] = {}

    def observe(self, hashes: Sequence[int], full_blocks: int) -> int:
        """Record the chain's first ``full_blocks`` blocks; returns how many
        leading blocks are shared (up to the last branch point). A partial
        last block is left out: its id changes with every turn of a
        conversation, which would make every turn look like a branch."""
        cur, old, branch = self._cur, self._old, self.BRANCH
        shared = 0
        for i in range(min(len(hashes), full_blocks) - 1):
            h, nxt = hashes[i], hashes[i + 1]
            seen = cur.get(h)
            if seen is None:
                seen = old.get(h)
            if seen == branch:
                shared = i + 1
                if h not in cur:
                    cur[h] = branch
            elif seen is None:
                cur[h] = nxt
            elif seen != nxt:
                cur[h] = branch
                shared = i + 1
            elif h not in cur:
                cur[h] = seen
        if len(cur) > self.max_entries:
            self._old, self._cur = cur, {}
        return shared


class CostPolicy(Policy):
    """Cheapest expected TTFT over every option, with the future priced in.

    For each candidate worker (every holder of a prefix, and the least loaded
    worker): queue wait + promotion of its WARM/COLD hit blocks + prefill of
    the tokens it lacks. And for each candidate that holds less than the best
    holder: the same worker pulling the best holder's extra blocks at the
    transfer rate (reason "migrate"). Workers with the same hit differ only by
    load, so only the least loaded of each such group is priced.

    What an option costs the requests that come after it:

    - ``dup_weight`` x the prefill time of the *private* blocks it copies.
      Pulling or recomputing a conversation's history elsewhere leaves two
      copies: the new one evicts a block on the target, the old one sits dead
      on the holder until it ages out, and either would likely have been hit
      again; on top comes the work of the copy itself. Blocks up to the
      request's last *branch point* (a prefix the router has seen continued
      in two different ways, e.g. a system prompt) are exempt: a second copy
      of a shared prefix is replication that later requests use, not waste.
      Default 3, from a sweep over {0, 1, 2, 3, 4} on the replay's synthetic
      trace (README): the hit rate rises with it (0.71, 0.82, 0.83, 0.836,
      0.838 against 0.849 for one ideal global cache) while p99 TTFT creeps up
      (1.85 s at 1, 2.07 s at 4); 0 is pure TTFT greed that migrates half the
      requests and fills the cluster with copies.
    - ``work_weight`` x the option's service time: the capacity it takes from
      the requests queued behind it (default 0: the queue wait prices load).
    - Placement: options that copy no private block and cost within ``tie_s``
      of the cheapest are equally good for this request; among them the worker
      this router sent the least work lately (decayed, ``half_life``
      decisions) wins. A new conversation keeps coming back where it is first
      placed, so balancing placements by recent work, not by the momentary
      queue (zero on most workers at moderate load), is what keeps sticky
      routing balanced.
    """
    name = "cost"

    def __init__(self, cost: CostModel | None = None, work_weight: float = 0.0, dup_weight: float = 3.0,
                 tie_s: float = 0.05, half_life: int = 2000, branch_memory: int = 1 << 20):
        super().__init__(cost)
        if work_weight < 0 or dup_weight < 0 or tie_s < 0:
            raise InvalidInputError(f"work_weight, dup_weight and tie_s must be >= 0, got "
                                    f"{work_weight!r}, {dup_weight!r}, {tie_s!r}")
        if branch_memory <= 0 or half_life <= 0:
            raise InvalidInputError(
                f"branch_memory and half_life must be positive, got {branch_memory!r}, {half_life!r}")
        self.work_weight = work_weight
        self.dup_weight = dup_weight
        self.tie_s = tie_s
        self._branches = _BranchMemory(branch_memory)
        self._recent = _DecayedWork(half_life)

    def recent_work_s(self, worker_id: str) -> float:
        """Service seconds this router sent to ``worker_id`` lately (decayed)."""
        return self._recent.get(worker_id)

    @staticmethod
    def _least(ws: list[WorkerState], recent: dict[str, float]) -> tuple[tuple, WorkerState]:
        """(load key, worker) of the least loaded: fewest queued tokens, then
        least recent work, then list order. Both cuts run in C (``min`` with
        an attrgetter, ``list.index``): at R=64 this is much of a decision."""
        if len(ws) > 1:
            q = min(ws, key=_QUEUED).queued_tokens
            ws = [w for w in ws if w.queued_tokens == q]
        if len(ws) > 1:
            work = [recent.get(w.worker_id, 0.0) for w in ws]
            w = ws[work.index(min(work))]
        else:
            w = ws[0]
        return (w.queued_tokens, recent.get(w.worker_id, 0.0)), w

    def choose(self, hashes, num_tokens, workers, index):
        alive = _alive(workers)
        cost, ww = self.cost, self.work_weight
        cohorts = index.match_cohorts(hashes)
        shared = self._branches.observe(hashes, num_tokens // cost.block_tokens)
        recent = self._recent.scaled   # one scale for all: compares without unscaling
        self._turn += 1
        # Workers with the same hit differ only by their load: price only the
        # least loaded of each cohort (and of the workers holding nothing), so
        # the options are few even when every worker holds the system prompt.
        by_id = {w.worker_id: w for w in alive}
        groups: dict[PrefixHit, tuple] = {}
        for hit, ws in cohorts:
            members = [by_id[w] for w in ws if w in by_id]
            if members:
                least = self._least(members, recent)
                if hit not in groups or least[0] < groups[hit][0]:   # equal counts, different tier order
                    groups[hit] = least
                for w in members:
                    del by_id[w.worker_id]
        if by_id:
            groups[NO_HIT] = self._least(list(by_id.values()), recent)
        source = max(groups, key=lambda h: (h.hot + h.warm + h.cold, h.hot))
        source_w = groups[source][1]
        source_blocks = source.hot + source.warm + source.cold
        # Prefill seconds per private block copied away from the best holder.
        dup_s = self.dup_weight * cost.prefill_s(cost.cached_tokens(1, num_tokens))
        options = []   # (score, tie, worker, reason, blocks, ttft, source id, pulled, duplication cost)
        for h, (tie, w) in groups.items():
            blocks = h.hot + h.warm + h.cold
            wait = cost.wait_s(w)
            dup = dup_s * max(0, source_blocks - max(blocks, shared))
            service = cost.service_s(h, num_tokens)
            options.append((wait + service * (1.0 + ww) + dup, tie, w, "local" if blocks else "recompute",
                            blocks, wait + service, None, 0, dup))
            if blocks < source_blocks:
                service = cost.migrate_service_s(h, source, num_tokens)
                options.append((wait + service * (1.0 + ww) + dup, tie, w, "migrate", source_blocks, wait + service,
                                source_w.worker_id, source_blocks - blocks, dup))
        # Options that copy no private block and cost within tie_s of the
        # cheapest are equally good for this request; among them the worker
        # sent the least work lately wins: the conversation will keep coming
        # back there, so this is where its future load is placed.
        best = min(options, key=lambda o: (o[0], o[1]))
        ties = [o for o in options if o[0] <= best[0] + self.tie_s and not o[8]]
        if len(ties) > 1:
            best = min(ties, key=lambda o: (o[1][1], o[0], o[1]))
        elif ties:
            best = ties[0]
        _, _, w, reason, blocks, ttft, source_id, pulled, _ = best
        self._recent.add(w.worker_id, ttft - cost.wait_s(w))
        return Decision(w.worker_id, reason, ttft, cost.cached_tokens(blocks, num_tokens), source_id, pulled)


class _DecayedWork:
    """Per-worker sum of service seconds, halved every ``half_life`` decisions.

    Stored scaled up by a factor that grows each decision, so a decision costs
    O(1), and ``scaled`` values of different workers compare directly.
    """
    __slots__ = ("_gain", "_scale", "scaled")

    def __init__(self, half_life: int):
        self._gain = 2.0 ** (1.0 / half_life)
        self._scale = 1.0
        self.scaled: dict[str, float] = {}

    def get(self, worker_id: str) -> float:
        return self.scaled.get(worker_id, 0.0) / self._scale

    def add(self, worker_id: str, seconds: float) -> None:
        self._scale *= self._gain            # one decision passed: everything decays
        self.scaled[worker_id] = self.scaled.get(worker_id, 0.0) + seconds * self._scale
        if self._scale > 1e150:
            self.scaled = {w: v / self._scale for w, v in self.scaled.items()}
            self._scale = 1.0


class ApproxTreePolicy(Policy):
    """Route from the router's own memory of what it sent where (no events).

    One approximate prefix tree per replica, over hash ids: since the hashes
    are chained, a hash names its whole prefix, so the tree is a map
    ``hash -> replicas`` plus a per-replica LRU bounded by ``max_blocks_per_worker``
    (the replica's capacity; leaves go first). Like SGLang's cache-aware router:

    1. if the load is imbalanced (max - min queued tokens > ``balance_abs_tokens``
       and max > ``balance_rel`` x min), the least loaded replica;
    2. else, if the best replica's match covers at least ``match_rate_threshold``
       of the request's blocks, that replica (ties to the less loaded);
    3. else the replica with the smallest tree (most free cache), ties by load.

    The request is then recorded in the chosen replica's tree.
    """
    name = "approx_tree"

    def __init__(self, cost: CostModel | None = None, match_rate_threshold: float = 0.1,
                 balance_abs_tokens: int = 16384, balance_rel: float = 1.5,
                 max_blocks_per_worker: int = 1 << 20):
        super().__init__(cost)
        if not 0.0 <= match_rate_threshold <= 1.0:
            raise InvalidInputError(f"match_rate_threshold must be in [0, 1], got {match_rate_threshold!r}")
        if max_blocks_per_worker <= 0:
            raise InvalidInputError(f"max_blocks_per_worker must be positive, got {max_blocks_per_worker!r}")
        self.match_rate_threshold = match_rate_threshold
        self.balance_abs_tokens = balance_abs_tokens
        self.balance_rel = balance_rel
        self.max_blocks_per_worker = max_blocks_per_worker
        self._table: dict[int, set[str]] = {}
        self._lru: dict[str, OrderedDict[int, None]] = {}

    def tree_size(self, worker_id: str) -> int:
        lru = self._lru.get(worker_id)
        return 0 if lru is None else len(lru)

    def matched_blocks(self, hashes: Sequence[int]) -> dict[str, int]:
        table = self._table
        out: dict[str, int] = {}
        active: set[str] | None = None
        i = 0
        for i, h in enumerate(hashes):
            holders = table.get(h)
            if not holders:
                break
            if active is None:
                active = set(holders)
            elif not active <= holders:
                for w in active - holders:
                    out[w] = i
                active &= holders
                if not active:
                    break
        else:
            i = len(hashes)
        for w in active or ():
            out[w] = i
        return out

    def choose(self, hashes, num_tokens, workers, index):
        alive = _alive(workers)
        least = _least_loaded(alive, self._turn)
        self._turn += 1
        most = max(alive, key=lambda w: (w.queued_tokens, w.running))
        matched = self.matched_blocks(hashes)
        hi, lo = most.queued_tokens, least.queued_tokens
        if hi - lo > self.balance_abs_tokens and hi > self.balance_rel * lo:
            target, reason = least, "balance"
        else:
            live = [w for w in alive if w.worker_id in matched]
            best = min(live, key=lambda w: (-matched[w.worker_id], w.queued_tokens, w.running), default=None)
            if best is not None and matched[best.worker_id] >= self.match_rate_threshold * len(hashes):
                target, reason = best, "prefix"
            else:
                target = min(alive, key=lambda w: (self.tree_size(w.worker_id), w.queued_tokens, w.running))
                reason = "capacity"
        self._record(target.worker_id, hashes)
        # The router's own guess of the hit: it never sees the real cache.
        return self._decide(target, reason, PrefixHit(hot=matched.get(target.worker_id, 0)), num_tokens)

    def _record(self, worker_id: str, hashes: Sequence[int]) -> None:
        lru = self._lru.setdefault(worker_id, OrderedDict())
        table = self._table
        for h in reversed(hashes):     # leaf first: the root ends up most recent
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                holders = table.get(h)
                if holders is None:
                    table[h] = {worker_id}
                else:
                    holders.add(worker_id)
        while len(lru) > self.max_blocks_per_worker:
            h, _ = lru.popitem(last=False)
            holders = table[h]
            holders.discard(worker_id)
            if not holders:
                del table[h]

    def forget_worker(self, worker_id: str) -> None:
        for h in self._lru.pop(worker_id, {}):
            holders = self._table[h]
            holders.discard(worker_id)
            if not holders:
                del self._table[h]


class IdealPolicy(Policy):
    """Upper bound for simulation: the best hit anywhere, served on the least loaded worker."""
    name = "ideal"

    def choose(self, hashes, num_tokens, workers, index):
        least = _least_loaded(_alive(workers), self._turn)
        self._turn += 1
        hits = index.match(hashes)
        best = max(hits.values(), key=lambda h: (h.blocks, h.hot), default=NO_HIT)
        return self._decide(least, "ideal", best, num_tokens)


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (
    RoundRobinPolicy, LeastLoadedPolicy, PrefixPolicy, ApproxTreePolicy, CostPolicy, IdealPolicy)}
DEFAULT_POLICY = "cost"


def make_policy(name: str = DEFAULT_POLICY, **kw) -> Policy:
    cls = POLICIES.get(name)
    if cls is None:
        raise InvalidInputError(f"unknown routing policy {name!r}; choose from {', '.join(POLICIES)}")
    return cls(**kw)
