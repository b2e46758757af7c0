"""``TierSpace``: the room in each tier, one object shared by every part that takes it.

``TieredCache`` (a lease's KV), ``TierMoves`` (a move's destination), ``HostStaging``
(a migration's blocks) and ``SessionPrefetch`` all take room through it and nothing
else. It holds:

- **allocation**: ``allocate`` (extents in a tier, making room there through the
  mover's ``make_room`` when the tier is full; under quotas within the tenant's cap,
  its own data shed first), ``append_hot`` (a lease's sequence grown), and
  ``allocate_staging`` (whole private WARM blocks, only lower copies reclaimed);
- **watermarks**: ``usage`` and ``enforce_watermarks`` (a tier above its high
  watermark demotes least valuable idle nodes down to its low watermark);
- **reclaim**: ``reclaim_lower`` (WARM's lower copies of HOT nodes go first, free);
- **the pick**: ``pick`` (the next node of a tier to push down: the tree's policy
  order, or the tenant quotas' rules), ``capped``, ``recap``, ``acting``;
- **room in flight**: ``pending_out`` (tokens leaving each tier) and
  ``pending_by_tenant`` (what moves in flight change of each tenant's share; the
  quotas count it), kept by ``TierMoves`` through ``leaving`` and ``coming``.

Making room means moving data, which is the mover's (``TierMoves``): the cache binds
it once (``bind``); this module never imports it. Owner thread only, like the cache.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, Collection, Hashable, Protocol

from cluster.cache.allocator import Extent
from cluster.cache.cache_stats import CacheStats
from cluster.cache.quota_config import QuotaConfig
from cluster.cache.quotas import CURRENT, NOBODY, TenantQuotas
from cluster.cache.radix_tree import RadixTree, TreeNode
from cluster.cache.tier_types import TierConfig
from cluster.errors import PoolExhaustedError
from cluster.names import HOT, WARM


class Mover(Protocol):
    """What the space asks of the one who moves data (``TierMoves``)."""

    def poll(self) -> int: ...

    def make_room(self, tier: int, blocks: int) -> bool: ...

    def shed_own(self, tier: int, over_cap: Callable[[], bool]) -> None: ...

    def fit_below(self, node: TreeNode) -> TreeNode: ...

    def start_demotion(self, nodes: TreeNode | list[TreeNode]) -> Any: ...


class TierSpace:
    def __init__(self, tree: RadixTree, pools: list, config: TierConfig, stats: CacheStats):
        self.tree, self.pools, self.config, self.stats = tree, pools, config, stats
        self.pending_out = [0, 0, 0]   # tokens leaving each tier in flight
        # tier -> namespace -> tokens: + the room a move in flight took there, - a promotion's source
        # (it ends a lower copy, which counts toward nobody, or freed)
        self.pending_by_tenant: list[dict] = [{}, {}, {}]
        # Per-tenant shares of each tier (``cluster.cache.quotas``): who is pushed out for whom.
        self.quotas: TenantQuotas | None = None
        if config.tenant_quotas is not None:
            self.quotas = TenantQuotas(tree, QuotaConfig.parse(config.tenant_quotas),
                                       in_flight=self.pending_by_tenant)
        self._mover: Mover | None = None

    def bind(self, mover: Mover) -> None:
        """The one who makes room by moving data (the cache's ``TierMoves``)."""
        self._mover = mover

    @property
    def mover(self) -> Mover:
        assert self._mover is not None, "a TierSpace makes room only once its mover is bound"
        return self._mover

    @property
    def num_tiers(self) -> int:
        return len(self.pools)

    # ---------------------------------------------------------------- the pick
    def acting(self, tenant: Any, asked: int = 0):
        """Room made inside is made for ``tenant`` under the quotas (``NOBODY``: background;
        a no-op without quotas)."""
        return self.quotas.acting(tenant, asked) if self.quotas is not None else nullcontext()

    def pick(self, tier: int, *, leaves_only: bool) -> TreeNode | None:
        """The next node of ``tier`` to push down (or drop): the tree's policy order, or,
        under quotas, their rules for whoever is acting."""
        if self.quotas is not None:
            return self.quotas.pick(tier, leaves_only=leaves_only)
        return self.tree.pop_candidate(tier, leaves_only=leaves_only)

    def capped(self, namespace: Hashable, tier: int, tokens: int) -> bool:
        """Whether ``tokens`` more of ``namespace`` in ``tier`` would pass its cap there."""
        return self.quotas is not None and self.quotas.at_cap(namespace, tier, tokens)

    def recap(self, namespaces: Collection[Hashable]) -> None:
        """Bring tenants back under their caps below HOT (a promotion counted its nodes out of
        their tier, its tenant shed into that room, and the promotion did not start)."""
        if self.quotas is not None:
            self.quotas.shed_over_caps(namespaces, self.mover.shed_own)

    # -------------------------------------------------------------- in flight
    def leaving(self, tier: int, tokens: int) -> None:
        """``tokens`` more (or fewer) on their way out of ``tier`` by a demotion in flight."""
        self.pending_out[tier] += tokens

    def coming(self, tier: int, node: TreeNode, tokens: int) -> None:
        """``tokens`` more (or fewer) of ``node``'s tenant in ``tier`` once a move in flight lands."""
        into, ns = self.pending_by_tenant[tier], self.tree.namespace_of(node)
        left = into.get(ns, 0) + tokens
        if left:
            into[ns] = left
        else:
            del into[ns]

    # -------------------------------------------------------------- allocation
    def allocate(self, tier: int, num_tokens: int, *, private_tail: bool, tenant: Any = CURRENT,
                 make_room: bool = True) -> list[Extent]:
        """Extents in ``tier``, making room (``make_room=False``: only free blocks, nothing pushed
        out); ``tenant`` (default: whoever is acting) is whose data it will be: within its cap."""
        if self.quotas is None:
            return self._allocate_room(tier, num_tokens, private_tail, make_room)
        with self.quotas.within_cap(tenant, tier, num_tokens, self.mover.shed_own if make_room else None):
            return self._allocate_room(tier, num_tokens, private_tail, make_room)

    def _allocate_room(self, tier: int, num_tokens: int, private_tail: bool, make_room: bool) -> list[Extent]:
        alloc = self.pools[tier].allocator
        if not make_room:
            return alloc.allocate(num_tokens, private_tail=private_tail)
        while True:
            try:
                ext = alloc.allocate(num_tokens, private_tail=private_tail)
                if tier == HOT:
                    self.enforce_watermarks()
                return ext
            except PoolExhaustedError as exc:
                if not self.mover.make_room(tier, max(1, exc.needed_blocks - exc.free_blocks)):
                    raise

    def append_hot(self, extents: list[Extent], num_tokens: int,
                   tenant: Hashable) -> tuple[list[Extent], list[Extent]]:
        """Grow a private HOT sequence (copy-on-write of a shared tail), making room as
        ``allocate`` does, within ``tenant``'s HOT cap."""
        if self.quotas is None:
            return self._append_hot_room(extents, num_tokens)
        with self.quotas.within_cap(tenant, HOT, num_tokens, self.mover.shed_own):
            return self._append_hot_room(extents, num_tokens)

    def _append_hot_room(self, extents: list[Extent], num_tokens: int) -> tuple[list[Extent], list[Extent]]:
        hot = self.pools[HOT]
        while True:
            try:
                out = hot.append(extents, num_tokens)
                self.enforce_watermarks()
                return out
            except PoolExhaustedError as exc:
                if not self.mover.make_room(HOT, max(1, exc.needed_blocks - exc.free_blocks)):
                    raise

    def allocate_staging(self, num_tokens: int) -> list[Extent]:
        """Whole private WARM blocks for ``num_tokens`` (a migration's); evicts nothing cached
        (a pool full of cached prefixes raises), only redundant lower copies."""
        alloc = self.pools[WARM].allocator
        try:
            return alloc.allocate(num_tokens, private_tail=True)
        except PoolExhaustedError as exc:
            if not self.reclaim_lower(exc.needed_blocks):
                raise
            return alloc.allocate(num_tokens, private_tail=True)

    # ----------------------------------------------------------------- reclaim
    def reclaim_lower(self, blocks: int) -> int:
        """Free lower copies until WARM has ``blocks`` more free blocks; tokens freed."""
        return self.reclaim_lower_to(self.pools[WARM].allocator.free_blocks + blocks)

    def reclaim_lower_to(self, free_blocks: int) -> int:
        """Free lower copies, oldest first, until WARM has ``free_blocks`` free; tokens freed."""
        freed = self.tree.reclaim_lower(free_blocks)
        self.stats.lower_copies_reclaimed_tokens += freed
        return freed

    # -------------------------------------------------------------- watermarks
    def usage(self, tier: int) -> float:
        """The share of ``tier`` held, less what is leaving and the lower copies (free to reclaim)."""
        alloc = self.pools[tier].allocator
        return self._held_tokens(tier) / alloc.capacity_tokens

    def _held_tokens(self, tier: int) -> int:
        lower = self.tree.lower_tokens if tier == WARM else 0
        return self.pools[tier].allocator.used_tokens - self.pending_out[tier] - lower

    def enforce_watermarks(self) -> None:
        """Demote frontier nodes of each tier above the high watermark until its usage falls
        below the low watermark (asynchronously): background work, so under quotas only
        tenants over their guarantee give."""
        self.mover.poll()
        with self.acting(NOBODY):
            for tier in range(self.num_tiers - 1):
                if self.usage(tier) > self.config.high_watermark:
                    self._demote_to_low_watermark(tier)

    def _demote_to_low_watermark(self, tier: int) -> None:
        self._demote_down_to(tier, self.config.low_watermark * self.pools[tier].allocator.capacity_tokens)

    def _demote_down_to(self, tier: int, target: float) -> None:
        """Start demotions out of ``tier`` until what it holds, less what leaves, is at most
        ``target`` tokens. Background work never waits for a copy (a promotion's wait for
        room, stalling every running stream, came mostly from here: a demotion into a full
        WARM waited for WARM's own demotion to the disk): what finds no free room below stays
        and is offered again later, while the tier below drains for it, asynchronously too."""
        batch, leaving = [], self._held_tokens(tier)
        while leaving > target:
            node = self.pick(tier, leaves_only=False)
            if node is None:
                break
            node = self.mover.fit_below(node)
            batch.append(node)
            leaving -= len(node.key)
        if not batch:
            return
        self.mover.start_demotion(batch, wait_below=False)
        refused = 0
        for node in batch:
            if not node.busy:  # no room below for it: offer it again later
                self.tree.requeue(node)
                refused += len(node.key) if node.alive and node.tier == tier else 0
        if refused and tier + 2 < self.num_tiers:   # room below for them once its copies in flight land
            below = tier + 1
            self._demote_down_to(below, self.pools[below].allocator.capacity_tokens - refused)
