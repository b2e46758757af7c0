"""Ports of the routers users compare against; they see no KV events.

Both remember what they sent where in an *approximate* prefix tree shared by
all replicas ("tenants"), over the request's chained block hashes instead of
raw text: a chained hash names its whole prefix, so a node of the tree is one
hash, and a tenant's part of the tree is an LRU-ordered set of hashes (a
parent is always touched with its children, so LRU order evicts leaves first).
Sizes are in tokens (the originals count characters of text).

- ``approx_tree``: SGLang's router ``cache_aware`` policy
  (sgl-router ``src/policies/cache_aware.rs`` and ``src/tree.rs``; defaults
  from its README / ``launch_router``): load = a worker's in-flight requests;
  imbalanced when ``max - min > balance_abs_threshold`` (32) *and*
  ``max > balance_rel_threshold x min`` (1.0001) -> the least loaded worker;
  otherwise the longest match anywhere in the tree, and if the match rate
  (matched / request length) is ``> cache_threshold`` (0.5) the first tenant
  holding the deepest matched node, else the tenant with the smallest tree.
  The request is inserted for the chosen worker in both cases; every
  ``eviction_interval_s`` (60) each tenant's LRU leaves are evicted down to
  ``max_tree_size`` (2**24).
- ``ray_prefix``: Ray Serve LLM's ``PrefixCacheAffinityRouter``
  (``ray.llm._internal.serve.request_router.prefix_aware``): load = queue
  length (in-flight requests); balanced when ``max - min <=
  imbalanced_threshold`` (10); then the tenants holding the longest match
  among the candidates if its rate is ``>= match_rate_threshold`` (0.1), else
  the tenants with the smallest trees; among those, the shortest queue. When
  imbalanced (or nothing chosen): power of two choices (two random replicas,
  the shorter queue). The prompt is inserted after routing; eviction is off
  by default (``do_eviction=False``), as in Ray.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from typing import Callable, Sequence

from cluster.errors import InvalidInputError
from cluster.routing.index import PrefixHit
from cluster.routing.policies.base import CostModel, Policy, WorkerState, _alive


class ApproxPrefixTree:
    """Tenants' approximate trees over chained hashes (see the module doc)."""
    __slots__ = ("_holders", "_lru")

    def __init__(self) -> None:
        self._holders: dict[int, dict[str, None]] = {}     # hash -> tenants, in insertion order
        self._lru: dict[str, OrderedDict[int, None]] = {}   # tenant -> its hashes, oldest first

    def size(self, tenant: str) -> int:
        lru = self._lru.get(tenant)
        return 0 if lru is None else len(lru)

    def insert(self, tenant: str, hashes: Sequence[int]) -> None:
        lru = self._lru.get(tenant)
        if lru is None:
            lru = self._lru[tenant] = OrderedDict()
        holders = self._holders
        for h in reversed(hashes):     # leaf first: the root ends up most recent
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                d = holders.get(h)
                if d is None:
                    holders[h] = {tenant: None}
                else:
                    d[tenant] = None

    def touch(self, tenant: str, hashes: Sequence[int]) -> None:
        """Refresh the tenant's path (SGLang's match updates its timestamps to the root)."""
        lru = self._lru.get(tenant)
        if lru is not None:
            for h in reversed(hashes):
                if h in lru:
                    lru.move_to_end(h)

    def deepest(self, hashes: Sequence[int], tenants: set[str] | None = None) -> tuple[int, list[str]]:
        """Blocks of the longest prefix held by any tenant (of ``tenants``, if
        given) and the tenants holding its deepest node, in insertion order."""
        holders = self._holders
        depth, at = 0, []
        for i, h in enumerate(hashes):
            d = holders.get(h)
            if not d:
                break
            held = list(d) if tenants is None else [t for t in d if t in tenants]
            if not held:
                break
            depth, at = i + 1, held
        return depth, at

    def matched(self, tenant: str, hashes: Sequence[int]) -> int:
        lru = self._lru.get(tenant)
        n = 0
        if lru is not None:
            for h in hashes:
                if h not in lru:
                    break
                n += 1
        return n

    def evict(self, max_blocks: int) -> None:
        for tenant, lru in self._lru.items():
            while len(lru) > max_blocks:
                h, _ = lru.popitem(last=False)
                self._drop(h, tenant)

    def remove_tenant(self, tenant: str) -> None:
        for h in self._lru.pop(tenant, {}):
            self._drop(h, tenant)

    def _drop(self, h: int, tenant: str) -> None:
        d = self._holders[h]
        del d[tenant]
        if not d:
            del self._holders[h]


class ApproxTreePolicy(Policy):
    """SGLang's ``cache_aware`` router, ported (see the module doc)."""
    name = "approx_tree"

    def __init__(self, cost: CostModel | None = None, cache_threshold: float = 0.5,
                 balance_abs_threshold: int = 32, balance_rel_threshold: float = 1.0001,
                 eviction_interval_s: float = 60.0, max_tree_size: int = 1 << 24,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__(cost)
        if not 0.0 <= cache_threshold <= 1.0:
            raise InvalidInputError(f"cache_threshold must be in [0, 1], got {cache_threshold!r}")
        if max_tree_size <= 0 or eviction_interval_s < 0 or balance_abs_threshold < 0:
            raise InvalidInputError("max_tree_size must be positive, eviction_interval_s and "
                                    "balance_abs_threshold >= 0")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.eviction_interval_s = eviction_interval_s
        self.max_tree_size = max_tree_size
        self.clock = clock
        self.tree = ApproxPrefixTree()
        self._next_eviction: float | None = None

    def tree_size(self, worker_id: str) -> int:
        return self.tree.size(worker_id)

    def forget_worker(self, worker_id: str) -> None:
        self.tree.remove_tenant(worker_id)

    def _maybe_evict(self) -> None:
        now = self.clock()
        if self._next_eviction is None:
            self._next_eviction = now + self.eviction_interval_s
        elif now >= self._next_eviction:
            self.tree.evict(max(1, self.max_tree_size // self.cost.block_tokens))
            self._next_eviction = now + self.eviction_interval_s

    def choose(self, hashes, num_tokens, workers, index, sent=True):
        alive = _alive(workers)
        self._turn += 1
        self._maybe_evict()
        loads = [w.running for w in alive]
        hi, lo = max(loads), min(loads)
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            target, reason = alive[loads.index(lo)], "balance"
        else:
            depth, tenants = self.tree.deepest(hashes)
            rate = min(depth * self.cost.block_tokens, num_tokens) / num_tokens if num_tokens else 0.0
            by_id = {w.worker_id: w for w in alive}
            target = by_id.get(tenants[0]) if rate > self.cache_threshold else None
            if target is not None:
                reason = "prefix"
                self.tree.touch(target.worker_id, hashes[:depth])
            else:
                sizes = [self.tree.size(w.worker_id) for w in alive]
                target, reason = alive[sizes.index(min(sizes))], "capacity"
        guess = self.tree.matched(target.worker_id, hashes)   # the router's own guess: it never sees the cache
        self.tree.insert(target.worker_id, hashes)
        return self._decide(target, reason, PrefixHit(hot=guess), num_tokens)


class RayPrefixPolicy(Policy):
    """Ray Serve LLM's ``PrefixCacheAffinityRouter``, ported (see the module doc)."""
    name = "ray_prefix"

    def __init__(self, cost: CostModel | None = None, imbalanced_threshold: int = 10,
                 match_rate_threshold: float = 0.1, do_eviction: bool = False,
                 eviction_threshold_tokens: int = 400_000, eviction_target_tokens: int = 360_000,
                 eviction_interval_s: float = 10.0, seed: int = 0, clock: Callable[[], float] = time.monotonic):
        super().__init__(cost)
        if not 0.0 <= match_rate_threshold <= 1.0:
            raise InvalidInputError(f"match_rate_threshold must be in [0, 1], got {match_rate_threshold!r}")
        if imbalanced_threshold < 0 or eviction_target_tokens <= 0 or eviction_threshold_tokens <= 0:
            raise InvalidInputError("imbalanced_threshold must be >= 0 and the eviction sizes positive")
        self.imbalanced_threshold = imbalanced_threshold
        self.match_rate_threshold = match_rate_threshold
        self.do_eviction = bool(do_eviction)
        self.eviction_threshold_tokens = eviction_threshold_tokens
        self.eviction_target_tokens = eviction_target_tokens
        self.eviction_interval_s = eviction_interval_s
        self.clock = clock
        self.rng = random.Random(seed)
        self.tree = ApproxPrefixTree()
        self._next_eviction: float | None = None

    def forget_worker(self, worker_id: str) -> None:
        self.tree.remove_tenant(worker_id)

    def _maybe_evict(self) -> None:
        if not self.do_eviction:
            return
        now = self.clock()
        if self._next_eviction is None:
            self._next_eviction = now + self.eviction_interval_s
        elif now >= self._next_eviction:
            bt = self.cost.block_tokens
            over = [t for t in list(self.tree._lru) if self.tree.size(t) * bt > self.eviction_threshold_tokens]
            if over:
                self.tree.evict(max(1, self.eviction_target_tokens // bt))
            self._next_eviction = now + self.eviction_interval_s

    @staticmethod
    def _shortest(ws: list[WorkerState]) -> WorkerState:
        return min(ws, key=lambda w: w.running)

    def choose(self, hashes, num_tokens, workers, index, sent=True):
        alive = _alive(workers)
        self._turn += 1
        self._maybe_evict()
        loads = [w.running for w in alive]
        chosen: list[WorkerState] = []
        reason = "pow2"
        if max(loads) - min(loads) <= self.imbalanced_threshold:
            by_id = {w.worker_id: w for w in alive}
            depth, tenants = self.tree.deepest(hashes, set(by_id))
            rate = min(depth * self.cost.block_tokens, num_tokens) / num_tokens if num_tokens else 0.0
            if rate < self.match_rate_threshold:
                sizes = [self.tree.size(w.worker_id) for w in alive]
                smallest = min(sizes)
                chosen = [w for w, s in zip(alive, sizes) if s == smallest]
                reason = "capacity"
            else:
                chosen = [by_id[t] for t in tenants]
                reason = "prefix"
        if not chosen:
            chosen = self.rng.sample(alive, 2) if len(alive) > 1 else alive
            reason = "pow2"
        target = self._shortest(chosen)
        guess = self.tree.matched(target.worker_id, hashes)
        self.tree.insert(target.worker_id, hashes)
        return self._decide(target, reason, PrefixHit(hot=guess), num_tokens)
