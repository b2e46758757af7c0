"""Ports of the routers users compare against; they see no KV events.

Both remember what they sent where in an *approximate* prefix tree shared by
all replicas ("tenants"), over the request's chained block hashes instead of
raw text: a chained hash names its whole prefix, so a node of the tree is one
hash, and a block's parent is the hash before it in the chain. Sizes are in
tokens (the originals count characters of text).

- ``approx_tree``: SGLang's router ``cache_aware`` policy
  (``src/policies/cache_aware.rs`` and ``src/policies/tree.rs`` of the router
  crate, ``sgl-router/`` and now ``sgl-model-gateway/`` in sgl-project/sglang):
  load = a worker's in-flight requests; imbalanced when ``max - min >
  balance_abs_threshold`` *and* ``max > balance_rel_threshold x min`` -> the
  least loaded worker; otherwise the longest match anywhere in the tree, and
  if the match rate (matched / request length) is ``> cache_threshold`` the
  first tenant holding the deepest matched node, else (current router) the
  least loaded worker or (legacy router) the tenant with the smallest tree.
  The request is inserted for the chosen worker in both cases; every
  ``eviction_interval_s`` each tenant's oldest leaves are evicted down to
  ``max_tree_size``. Which defaults and which tree rules: ``APPROX_TREE_DEFAULTS``
  (``current`` unless ``defaults="legacy"``).
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

import heapq
import random
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

from cluster.errors import InvalidInputError
from cluster.routing.index import PrefixHit
from cluster.routing.policies.base import CostModel, Policy, WorkerState, _alive


@dataclass(frozen=True)
class CacheAwareDefaults:
    """One release's defaults of SGLang's ``cache_aware`` router, and its rules
    where they changed: what the low-match branch picks (``least_loaded`` or
    ``smallest_tree``) and how the tree keeps time (``leaf_stamps``: the current
    tree, ``LeafStampTree``; else the legacy tree, ``ApproxPrefixTree``)."""
    source: str
    cache_threshold: float
    balance_abs_threshold: int
    balance_rel_threshold: float
    eviction_interval_s: float
    max_tree_size: int
    low_match: str
    leaf_stamps: bool


APPROX_TREE_DEFAULTS: dict[str, CacheAwareDefaults] = {
    # The router crate's own CLI (clap `default_value_t`s of `CliArgs`), read in
    # sgl-project/sglang: sgl-model-gateway/src/main.rs @ 01f6c92a0ae8 (the crate
    # was renamed from sgl-router/, whose src/main.rs @ 0129b029fc78 has the same
    # five values). Rules from sgl-model-gateway/src/policies/cache_aware.rs
    # @ b93974f140de and 053b63ff26df (a low match goes to the least loaded
    # healthy worker) and src/policies/tree.rs @ 03744dbedc69 (leaf-only
    # timestamps). Not taken: the Python launcher's RouterArgs of the same era
    # (bindings/python/src/sglang_router/router_args.py @ 6614f98405b9) says
    # eviction_interval_secs = 60 for the Rust CLI's 120, and the crate's
    # CacheAwareConfig::default() (policies/mod.rs @ 01f6c92a0ae8: 0.5, 32, 1.1,
    # 30 s, 10,000) is what its unit tests use, not what a launched router gets.
    "current": CacheAwareDefaults("sgl-model-gateway, sgl-project/sglang@01f6c92a0ae8", cache_threshold=0.3,
                                  balance_abs_threshold=64, balance_rel_threshold=1.5, eviction_interval_s=120.0,
                                  max_tree_size=1 << 26, low_match="least_loaded", leaf_stamps=True),
    # The sgl-router releases before those defaults changed (what this port had
    # until issue 24): sgl-router/py_src/sglang_router/router.py `Router.__init__`
    # and sgl-router/src/main.rs of that time (0.5, 32, 1.0001, 60 s, 2^24). A
    # low match went to the smallest tree (`tree.get_smallest_tenant()`), and a
    # match refreshed the returned tenant's timestamps from its node up to the
    # root (sgl-router/src/tree.rs `prefix_match`), whichever worker was chosen.
    "legacy": CacheAwareDefaults("sgl-router, sgl-project/sglang sgl-router/ before 0.3/64/1.5", cache_threshold=0.5,
                                 balance_abs_threshold=32, balance_rel_threshold=1.0001, eviction_interval_s=60.0,
                                 max_tree_size=1 << 24, low_match="smallest_tree", leaf_stamps=False),
}
DEFAULT_APPROX_TREE_DEFAULTS = "current"


def _given_or(value, default):
    return default if value is None else value


class ApproxPrefixTree:
    """Tenants' approximate trees over chained hashes, LRU along whole paths (the
    legacy SGLang tree and Ray's): a tenant's part is an LRU-ordered set of
    hashes, and a parent is always touched with its children, so LRU order
    evicts leaves first."""
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


class LeafStampTree:
    """Tenants' approximate trees with the current SGLang tree's timestamps
    (``tree.rs``): an insert stamps only the block it ends at, and the blocks no
    tenant held before (upstream they become one new node, stamped once); a
    block the tenant newly shares with others gets 0. A match stamps the
    deepest matched block of the tenant it returns, only when the epoch it
    draws is a multiple of 8 (upstream's way to touch the maps less; inserts
    draw epochs from the same counter). Eviction takes, per tenant, the leaf
    (a block none of whose children the tenant holds) with the oldest stamp
    until the tenant is within the limit; a parent whose last child went
    becomes a leaf with its own, older, stamp."""
    __slots__ = ("_holders", "_stamp", "_kids", "_parent", "epoch")

    def __init__(self) -> None:
        self._holders: dict[int, dict[str, None]] = {}   # hash -> tenants, in insertion order
        self._stamp: dict[str, dict[int, int]] = {}      # tenant -> hash -> epoch of its last stamp
        self._kids: dict[str, dict[int, int]] = {}       # tenant -> hash -> children the tenant holds
        self._parent: dict[int, int | None] = {}         # hash -> the hash before it in its chain
        self.epoch = 0                                   # upstream's EPOCH_COUNTER (fetch_add)

    def _next_epoch(self) -> int:
        epoch = self.epoch
        self.epoch += 1
        return epoch

    def size(self, tenant: str) -> int:
        stamp = self._stamp.get(tenant)
        return 0 if stamp is None else len(stamp)

    def stamp(self, tenant: str, h: int) -> int | None:
        return self._stamp.get(tenant, {}).get(h)

    def insert(self, tenant: str, hashes: Sequence[int]) -> None:
        stamp = self._stamp.setdefault(tenant, {})
        kids = self._kids.setdefault(tenant, {})
        holders, parent = self._holders, self._parent
        epoch = self._next_epoch()
        vacant, prev = False, None
        for h in hashes:
            d = holders.get(h)
            if d is None:                  # no tenant holds it, nor anything after it
                vacant = True
                d = holders[h] = {}
                parent[h] = prev
            if tenant not in d:
                d[tenant] = None
                stamp[h] = epoch if vacant else 0
                kids[h] = 0
                if prev is not None:
                    kids[prev] += 1
            prev = h
        if prev is not None:
            stamp[prev] = epoch

    def match(self, hashes: Sequence[int]) -> tuple[int, list[str]]:
        """``deepest(hashes)``, stamping as upstream's ``prefix_match`` does."""
        depth, tenants = self.deepest(hashes)
        epoch = self._next_epoch()
        if depth and epoch & 0x7 == 0:
            self._stamp[tenants[0]][hashes[depth - 1]] = epoch
        return depth, tenants

    def deepest(self, hashes: Sequence[int]) -> tuple[int, list[str]]:
        holders = self._holders
        depth, at = 0, []
        for i, h in enumerate(hashes):
            d = holders.get(h)
            if not d:
                break
            depth, at = i + 1, list(d)
        return depth, at

    def matched(self, tenant: str, hashes: Sequence[int]) -> int:
        stamp = self._stamp.get(tenant)
        n = 0
        if stamp is not None:
            for h in hashes:
                if h not in stamp:
                    break
                n += 1
        return n

    def evict(self, max_blocks: int) -> None:
        for tenant, stamp in self._stamp.items():
            if len(stamp) <= max_blocks:
                continue
            kids = self._kids[tenant]
            heap = [(s, h) for h, s in stamp.items() if kids[h] == 0]
            heapq.heapify(heap)
            while len(stamp) > max_blocks and heap:
                _, h = heapq.heappop(heap)
                p = self._parent[h]
                del stamp[h], kids[h]
                self._drop(h, tenant)
                if p is not None:
                    kids[p] -= 1
                    if kids[p] == 0:
                        heapq.heappush(heap, (stamp[p], p))

    def remove_tenant(self, tenant: str) -> None:
        self._kids.pop(tenant, None)
        for h in self._stamp.pop(tenant, {}):
            self._drop(h, tenant)

    def _drop(self, h: int, tenant: str) -> None:
        d = self._holders[h]
        del d[tenant]
        if not d:
            del self._holders[h], self._parent[h]

    def check_invariants(self) -> None:
        for tenant, stamp in self._stamp.items():
            kids = self._kids[tenant]
            assert set(kids) == set(stamp), f"{tenant}: child counts and stamps cover different blocks"
            counted = dict.fromkeys(stamp, 0)
            for h in stamp:
                assert tenant in self._holders.get(h, {}), f"{tenant} holds {h} but is not among its holders"
                p = self._parent[h]
                if p is not None:
                    assert p in stamp, f"{tenant} holds {h} without its parent {p}: a tree must be prefix-closed"
                    counted[p] += 1
            assert counted == kids, f"{tenant}: child counts {kids} but children {counted}"
        for h, d in self._holders.items():
            assert d, f"block {h} is held by nobody but still listed"
            for tenant in d:
                assert h in self._stamp.get(tenant, {}), f"{tenant} is listed as a holder of {h} without it"


class ApproxTreePolicy(Policy):
    """SGLang's ``cache_aware`` router, ported (see the module doc).

    ``defaults`` names a release's defaults and rules in ``APPROX_TREE_DEFAULTS``
    (None: ``current``); a value
    given here overrides that one default."""
    name = "approx_tree"

    def __init__(self, cost: CostModel | None = None, defaults: str | None = None,
                 cache_threshold: float | None = None, balance_abs_threshold: int | None = None,
                 balance_rel_threshold: float | None = None, eviction_interval_s: float | None = None,
                 max_tree_size: int | None = None, clock: Callable[[], float] = time.monotonic):
        super().__init__(cost)
        defaults = DEFAULT_APPROX_TREE_DEFAULTS if defaults is None else defaults
        preset = APPROX_TREE_DEFAULTS.get(defaults)
        if preset is None:
            raise InvalidInputError(f"approx_tree defaults must be one of {', '.join(APPROX_TREE_DEFAULTS)}, "
                                    f"got {defaults!r}")
        cache_threshold = _given_or(cache_threshold, preset.cache_threshold)
        balance_abs_threshold = _given_or(balance_abs_threshold, preset.balance_abs_threshold)
        balance_rel_threshold = _given_or(balance_rel_threshold, preset.balance_rel_threshold)
        eviction_interval_s = _given_or(eviction_interval_s, preset.eviction_interval_s)
        max_tree_size = _given_or(max_tree_size, preset.max_tree_size)
        if not 0.0 <= cache_threshold <= 1.0:
            raise InvalidInputError(f"cache_threshold must be in [0, 1], got {cache_threshold!r}")
        if max_tree_size <= 0 or eviction_interval_s < 0 or balance_abs_threshold < 0:
            raise InvalidInputError("max_tree_size must be positive, eviction_interval_s and "
                                    "balance_abs_threshold >= 0")
        self.defaults, self.source = defaults, preset.source
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.eviction_interval_s = eviction_interval_s
        self.max_tree_size = max_tree_size
        self.low_match = preset.low_match
        self.clock = clock
        self.tree: LeafStampTree | ApproxPrefixTree = LeafStampTree() if preset.leaf_stamps else ApproxPrefixTree()
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

    def _match(self, hashes) -> tuple[int, list[str]]:
        tree = self.tree
        if isinstance(tree, LeafStampTree):
            return tree.match(hashes)
        depth, tenants = tree.deepest(hashes)
        if depth:     # the legacy match refreshed the returned tenant's path, chosen or not
            tree.touch(tenants[0], hashes[:depth])
        return depth, tenants

    def choose(self, hashes, num_tokens, workers, index, sent=True):
        alive = _alive(workers)
        self._turn += 1
        self._maybe_evict()
        loads = [w.running for w in alive]
        hi, lo = max(loads), min(loads)
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            target, reason = alive[loads.index(lo)], "balance"
        else:
            depth, tenants = self._match(hashes)
            rate = min(depth * self.cost.block_tokens, num_tokens) / num_tokens if num_tokens else 0.0
            by_id = {w.worker_id: w for w in alive}
            target = by_id.get(tenants[0]) if rate > self.cache_threshold else None
            if target is not None:
                reason = "prefix"
            elif self.low_match == "least_loaded":
                target, reason = alive[loads.index(lo)], "load"
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
