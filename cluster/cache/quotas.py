"""Per-tenant quotas of HOT, WARM, COLD and L3: who is evicted for whom (``TenantQuotas``).

The rules, in each tier, for a request of tenant R (``acting``) that needs room:

1. R at its cap (what R holds in the tier plus what it asks for passes its
   cap): R's own colder data goes (policy order within R), nobody else's, even
   when the tier has free room; what still does not fit under the cap is
   refused (``TenantCapError``: a request waits or yields; a node not taken
   below stays, or is dropped, counted as ``over_cap``), so a cap stays a cap.
2. Otherwise the tenants over the guarantee they keep now give first, R among
   them: the one furthest over it first (in tokens; the eviction policy's order
   within it, and across tenants equally far over), then the next.
3. Then R's own data, even below R's guarantee.
4. A tenant at or under the guarantee it keeps is never evicted for another
   tenant: when nothing above is left, the room is not made (the request
   waits, or is preempted by the engine, whose victims ``may_preempt`` allows).

**Guarantees are work-conserving.** The engine tells the cache each step which
tenants have work (a running or waiting request: ``set_work``). A tenant
without work lends its whole guarantee to room made for a tenant with work: its
prefixes count as over its guarantee there and are pushed down like anyone's
(demoted where the tier below takes them, dropped only where none can: no WARM,
or the last tier), and they come back by promotion like any session. When the
owner has work again it keeps its guarantee again, and the room it lent is
reclaimed through rule 2 from the borrowers' unlocked prefixes (a borrower's
running request by preemption, ``may_preempt``). Background work (the
watermarks, no tenant acting) and a tenant without work (a session prefetch)
borrow nothing. One more lender: when an otherwise idle engine's step admitted
nothing (every waiting tenant's request blocked by the others' guarantees,
which can add up past the tier when many tenants fall under ``default``), the
engine lends every waiting tenant's guarantee too, until a request is admitted
(``cluster.engine.tenant_work``). So a request whose prompt fits under its own
tenant's HOT cap is always admitted once the work ahead of it ends, and that
cap is all the engine checks at submit (``hot_room_for``).

"Holds" counts the tree's nodes resident in the tier (kept current from the
tree's listener callbacks) as the tier moves in flight will leave them (room
taken for a move counts at once; a promotion's source no longer), and in HOT
the KV running requests' leases hold beyond their prefix (``note_running``:
written or reserved, not in the tree yet). A WARM lower copy (a duplicate of a HOT node) counts toward nobody: it is
reclaimed first and loses nothing.

L3 (of ``l3_blocks``, across the cluster): a tenant holds the blocks this
replica wrote for it (``l3_written``, oldest first, exact) plus those the other
replicas wrote, as the directory counts them from every replica's L3 KV events
(``set_l3_others``, handed back with the answer to each event batch:
``cluster.routing.l3_shares``). A write past a cap removes the tenant's own oldest
blocks written here, a write past ``l3_blocks`` removes blocks written here of
tenants over their guarantee, and a write that finds neither is skipped and
counted (never lost silently). Once a replica expects the directory's counts
(``expect_l3_counts``) and has none fresh (none yet, or older than their
time-to-live: the directory is away), it writes no new L3 block at all (counted
in ``l3_skipped_stale_blocks``): a share is never passed for want of a count.

Nothing is shared across tenants: each namespace has its own tree root, so a
tenant can match, hold and lose only its own KV (unless an operator gives two
keys one tenant on purpose). Owner thread only, like the tree.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from contextlib import contextmanager
from typing import Any, Callable, Collection, Hashable, Iterator, Mapping, Sequence

from cluster.cache.quota_config import L3_INDEX, QUOTA_TIERS, QuotaConfig
from cluster.cache.radix_tree import RadixTree, TreeNode
from cluster.errors import PoolExhaustedError
from cluster.names import HOT

NOBODY = object()   # no tenant acting (background work)
CURRENT = object()  # whoever is acting now (a default argument)
_TIERS = len(QUOTA_TIERS)


class TenantCapError(PoolExhaustedError):
    """Room in a tier refused because its tenant would pass its cap there (rule 1)."""


def tenant_label(namespace: Hashable) -> str:
    """A namespace as metrics and stats name it (``""`` for the shared one)."""
    return "" if namespace is None else str(namespace)


class TenantQuotas:
    """The quota state of one cache: what each tenant holds per tier, who acts, the counters."""

    def __init__(self, tree: RadixTree, config: QuotaConfig, in_flight: list[dict[Hashable, int]] | None = None):
        """``in_flight``: what tier moves in flight change of each tenant's share of each tier
        (``TierSpace.pending_by_tenant``; None: no moves)."""
        self.tree = tree
        self.config = config
        self.resident: list[dict[Hashable, int]] = [defaultdict(int) for _ in range(_TIERS)]
        self._acting: list[tuple[Any, int]] = []    # (tenant, tokens asked) stack
        self._givers: list[dict[int, list[frozenset]]] = []   # per acting frame: rule 2's order by tier
        self._picked: dict[int, Any] = {}           # id(node) -> the tenant it was picked for
        self.stats: dict[Hashable, dict[str, list[int]]] = {}
        self.l3_written: dict[Hashable, OrderedDict[int, None]] = defaultdict(OrderedDict)
        self.l3_skipped_blocks = 0
        self.l3_skipped_stale_blocks = 0
        # Other replicas' L3 blocks by tenant, as the directory last counted them, and when
        # (the tree's clock); ``l3_counts_ttl_s`` None: no directory counts (one replica).
        self.l3_others: dict[Hashable, int] = {}
        self.l3_counts_at: float | None = None
        self.l3_counts_ttl_s: float | None = None
        self.running: dict[Hashable, int] = defaultdict(int)   # HOT tokens of leases not in the tree yet
        # Counted at once, so moves in flight cannot pass a cap, and a promotion's source,
        # which ends as a lower copy, counts no longer.
        self.in_flight: list[dict[Hashable, int]] = [{}, {}, {}] if in_flight is None else in_flight
        # Who has work in the engine, and whose guarantee holds (``set_work``); None: never
        # told (a cache without an engine), and every guarantee holds always.
        self.active: frozenset | None = None
        self.protected: frozenset = frozenset()
        tree.listeners.append(self)

    # ---------------------------------------------------------------- shares
    def capacity(self, tier: int) -> int:
        if tier == L3_INDEX:
            return self.config.l3_blocks
        return self.tree.allocators[tier].capacity_tokens if tier < len(self.tree.allocators) else 0

    def guarantee(self, namespace: Hashable, tier: int) -> int:
        return int(self.config.quota_of(namespace).shares[tier].guarantee * self.capacity(tier))

    def cap(self, namespace: Hashable, tier: int) -> int:
        return int(self.config.quota_of(namespace).shares[tier].cap * self.capacity(tier))

    def holds(self, namespace: Hashable, tier: int) -> int:
        """What ``namespace`` holds in ``tier``: its resident nodes, as tier moves in flight
        will leave them, and in HOT its running KV."""
        if tier == L3_INDEX:
            return len(self.l3_written.get(namespace, ())) + self.l3_others.get(namespace, 0)
        held = self.resident[tier].get(namespace, 0) + self.in_flight[tier].get(namespace, 0)
        return held + self.running.get(namespace, 0) if tier == HOT else held

    def over_guarantee(self, namespace: Hashable, tier: int) -> bool:
        return self.holds(namespace, tier) > self.guarantee(namespace, tier)

    def at_cap(self, namespace: Hashable, tier: int, asked: int) -> bool:
        return self.holds(namespace, tier) + asked > self.cap(namespace, tier)

    # ------------------------------------------------------------- who works
    def set_work(self, active: Collection[Hashable], protected: Collection[Hashable] | None = None) -> None:
        """The tenants with a running or waiting request (``active``), and those of them whose
        guarantees hold now (``protected``, default all of them): the others' are lent to
        room made for an active tenant (``cluster.engine.tenant_work`` tells it each step)."""
        self.active = frozenset(active)
        self.protected = self.active if protected is None else frozenset(protected)

    def lending(self) -> bool:
        """Whether the room being made now borrows unprotected tenants' guarantees: it is made
        by a tenant (not background work) on behalf of one with work in the engine."""
        if self.active is None or not self._acting or self._acting[-1][0] is NOBODY:
            return False
        return any(t in self.active for t, _ in self._acting)

    def note_running(self, namespace: Hashable, tokens: int) -> None:
        """A lease of ``namespace`` took (``tokens`` > 0) or gave up (< 0) HOT KV outside the tree."""
        left = self.running[namespace] + tokens
        assert left >= 0, f"tenant {namespace!r}'s running KV went negative ({left})"
        if left:
            self.running[namespace] = left
        else:
            del self.running[namespace]

    # ---------------------------------------------------------------- acting
    @contextmanager
    def acting(self, namespace: Any, asked: int = 0) -> Iterator[None]:
        """Room made inside is made for ``namespace`` (``NOBODY``: background)."""
        self._acting.append((namespace, asked))
        self._givers.append({})
        try:
            yield
        finally:
            self._acting.pop()
            self._givers.pop()

    @property
    def actor(self) -> tuple[Any, int]:
        return self._acting[-1] if self._acting else (NOBODY, 0)

    @contextmanager
    def within_cap(self, namespace: Any, tier: int, asked: int,
                   shed: Callable[[int, Callable[[], bool]], Any] | None) -> Iterator[None]:
        """Acting for ``namespace`` (``CURRENT``: whoever acts) for ``asked`` tokens of ``tier``:
        at its cap its own data there goes first (``shed``, the cache's; None: nothing is pushed
        out), and what would still pass the cap (its data locked or moving) is refused."""
        who = self.actor[0] if namespace is CURRENT else namespace
        with self.acting(who, asked):
            if self.must_shed(tier) and shed is not None:
                shed(tier, lambda: self.must_shed(tier))
            if self.must_shed(tier):
                raise TenantCapError(f"tenant {who!r} at its {QUOTA_TIERS[tier]} cap ({self.cap(who, tier)} "
                                     f"tokens): {self.holds(who, tier)} held, {asked} more asked")
            yield

    # --------------------------------------------------------------- victims
    def excess(self, namespace: Hashable, tier: int) -> int:
        """How far ``namespace`` is over the guarantee it keeps in ``tier`` now (negative: under
        it); a tenant lending its guarantee (``lending``, not ``protected``) keeps none."""
        kept = 0 if self.lending() and namespace not in self.protected else self.guarantee(namespace, tier)
        return self.holds(namespace, tier) - kept

    def givers(self, tier: int) -> list[frozenset]:
        """Rule 2's givers in ``tier``, grouped by how far over the guarantee they keep each is,
        the furthest first. Taken once per room asked for (an ``acting`` frame), so one room is
        made from the furthest tenant's data, whole sessions in the policy's order, before the
        next tenant's: not a node from each in turn."""
        frame = self._givers[-1] if self._givers else {}
        if tier not in frame:
            held = set(self.resident[tier]) | set(self.in_flight[tier])
            if tier == HOT:
                held |= set(self.running)
            by_excess: dict[int, set] = defaultdict(set)
            for t in held:
                over = self.excess(t, tier)
                if over > 0:
                    by_excess[over].add(t)
            frame[tier] = [frozenset(ts) for _, ts in sorted(by_excess.items(), key=lambda kv: -kv[0])]
        return frame[tier]

    def allowed(self, tier: int) -> list[Callable[[TreeNode], bool]]:
        """The rules' passes for the acting tenant, in order (each a node filter): rule 2's
        givers (``givers``: the furthest over the guarantee it keeps first, the eviction
        policy's order within it and among tenants equally far over), each while it is still
        over; then the actor's own (rule 3). At its cap, its own only (rule 1)."""
        who, asked = self.actor
        ns = self.tree.namespace_of
        own = lambda n: ns(n) == who   # noqa: E731
        if who is not NOBODY and self.at_cap(who, tier, asked):
            return [own]
        passes = [lambda n, ts=ts: ns(n) in ts and self.excess(ns(n), tier) > 0 for ts in self.givers(tier)]
        return passes if who is NOBODY else passes + [own]

    def pick(self, tier: int, *, leaves_only: bool) -> TreeNode | None:
        """The next node of ``tier`` to push down (or drop) under the rules, or None."""
        for allow in self.allowed(tier):
            node = self.tree.pop_candidate(tier, leaves_only=leaves_only, allow=allow)
            if node is not None:
                if len(self._picked) > 65536:   # picks passed over and never moved: forget them
                    self._picked.clear()
                self._picked[id(node)] = self.actor[0]
                return node
        return None

    def must_shed(self, tier: int) -> bool:
        """Whether the acting tenant is past its cap in ``tier`` (its own data must go first)."""
        who, asked = self.actor
        return who is not NOBODY and self.at_cap(who, tier, asked)

    def shed_over_caps(self, namespaces: Collection[Hashable], shed: Callable[[int, Callable[[], bool]], Any]) -> None:
        """Tenants over a cap below HOT (a promotion counted its nodes out of their tier, its
        tenant shed into that room, and the promotion did not start): their own data there goes."""
        for namespace in namespaces:
            for tier in range(1, _TIERS - 1):
                with self.acting(namespace, 0):
                    if self.must_shed(tier):
                        shed(tier, lambda: self.must_shed(tier))

    def may_preempt(self, requester: Hashable, victim: Hashable, asked: int = 0) -> bool:
        """Whether the engine may preempt a running request of ``victim`` to make HOT room
        for ``asked`` tokens of one of ``requester``: its own; or, the requester under its cap,
        one of a tenant over its HOT guarantee (what it holds, its running requests' KV
        included) and further over it than the requester would be with what it asks (as
        rule 2 orders the givers). So a tenant at or under its guarantee is never preempted
        for another; a flood over its guarantee cannot take a quieter tenant's running turn,
        while the quieter one may take the flood's; and a victim, once preempted, cannot
        take the room straight back (it would be further over than the tenant it took it
        from: the two would preempt each other in turn). A tenant with a running request has
        work, so its guarantee holds."""
        if requester == victim:
            return True
        if self.at_cap(requester, HOT, 0) or not self.over_guarantee(victim, HOT):
            return False
        return self.excess(victim, HOT) > max(0, self.excess(requester, HOT) + asked)

    # ------------------------------------------------------- tree listener
    def on_stored(self, node: TreeNode) -> None:
        self.resident[node.tier][self.tree.namespace_of(node)] += len(node.key)

    def on_tier(self, node: TreeNode, old_tier: int) -> None:
        ns = self.tree.namespace_of(node)
        n = len(node.key)
        self.resident[old_tier][ns] -= n
        self.resident[node.tier][ns] += n
        if node.tier > old_tier:
            self._count_eviction(node, ns, old_tier, n)

    def on_removed(self, node: TreeNode) -> None:
        ns = self.tree.namespace_of(node)
        self.resident[node.tier][ns] -= len(node.key)
        self._count_eviction(node, ns, node.tier, len(node.key))

    def _count_eviction(self, node: TreeNode, victim: Hashable, tier: int, tokens: int) -> None:
        who = self._picked.pop(id(node), NOBODY)
        self._counters(victim)["evictions_suffered"][tier] += tokens
        if who is not NOBODY:
            self._counters(who)["evictions_caused"][tier] += tokens
            if who != victim:
                self._counters(victim)["evictions_suffered_from_others"][tier] += tokens

    def check_invariants(self, hot_used_tokens: int) -> None:
        """What each tenant holds per tier is what the tree holds for it; running KV is
        never negative and fits in what HOT has allocated."""
        counted: list[dict[Hashable, int]] = [defaultdict(int) for _ in range(_TIERS)]
        for node in self.tree.iter_nodes():
            counted[node.tier][self.tree.namespace_of(node)] += len(node.key)
        for tier in range(3):
            kept = {ns: n for ns, n in self.resident[tier].items() if n}
            assert kept == dict(counted[tier]), f"tier {tier} residency drifted: {kept} != {dict(counted[tier])}"
        assert all(n > 0 for n in self.running.values()), f"running KV not positive: {dict(self.running)}"
        assert sum(self.running.values()) <= hot_used_tokens, "more running KV counted than HOT holds"

    # -------------------------------------------------------------- counters
    def _counters(self, namespace: Hashable) -> dict[str, list[int]]:
        c = self.stats.get(namespace)
        if c is None:
            c = self.stats[namespace] = {k: [0] * _TIERS for k in (
                "hit_tokens", "evictions_caused", "evictions_suffered",
                "evictions_suffered_from_others")}
            c["lookups"] = [0]
        return c

    def note_hits(self, namespace: Hashable, hits: Sequence[int]) -> None:
        """A request of ``namespace`` was admitted with ``hits`` tokens cached by tier."""
        c = self._counters(namespace)
        c["lookups"][0] += 1
        for tier, n in enumerate(hits):
            c["hit_tokens"][tier] += n

    def tenant_stats(self) -> dict[str, dict]:
        """Per tenant: resident tokens (L3: blocks), hit tokens by tier, and the evictions
        (tokens pushed down or dropped from a tier; L3: blocks removed) it caused, it
        suffered, and it suffered for another tenant, each by tier name."""
        names = set(self.stats) | {ns for r in self.resident for ns in r} | set(self.l3_written) | set(self.l3_others)
        out = {}
        for ns in sorted(names, key=tenant_label):
            c = self._counters(ns)
            row: dict[str, Any] = {"resident_tokens": {t: self.holds(ns, i) for i, t in enumerate(QUOTA_TIERS[:3])},
                                   "l3_blocks": self.holds(ns, L3_INDEX), "lookups": c["lookups"][0]}
            for key in ("hit_tokens", "evictions_caused", "evictions_suffered",
                        "evictions_suffered_from_others"):
                row[key] = {t: c[key][i] for i, t in enumerate(QUOTA_TIERS)}
            out[tenant_label(ns)] = row
        return out

    # -------------------------------------------------------------------- L3
    def l3_limited(self) -> bool:
        """Whether tenants' L3 blocks are counted against ``l3_blocks``."""
        return bool(self.config.l3_blocks)

    def expect_l3_counts(self, ttl_s: float) -> None:
        """From now on L3 shares count the other replicas' blocks as the directory hands
        them over (``set_l3_others``); counts older than ``ttl_s`` (or none yet) are stale,
        and nothing new is written to L3 while they are."""
        self.l3_counts_ttl_s = ttl_s

    def set_l3_others(self, blocks: Mapping[Hashable, int], now: float | None = None) -> None:
        """The directory's count of each tenant's L3 blocks written by the other replicas."""
        self.l3_others = {ns: n for ns, n in blocks.items() if n > 0}
        self.l3_counts_at = self.tree.clock() if now is None else now

    def l3_counts_fresh(self) -> bool:
        """Whether the other replicas' counts may be used (always, when none are expected)."""
        if self.l3_counts_ttl_s is None:
            return True
        return self.l3_counts_at is not None and self.tree.clock() - self.l3_counts_at <= self.l3_counts_ttl_s

    def l3_admit(self, namespace: Hashable, hashes: Sequence[int]) -> tuple[list[int], list[int]]:
        """Of blocks ``hashes`` a commit of ``namespace`` would write to L3: the indices
        to write, and the hashes (of this tenant or one over its guarantee) to remove
        from L3 first. What fits nowhere, or anything while the cluster's counts are
        stale, is skipped and counted."""
        if not self.config.l3_blocks:
            return list(range(len(hashes))), []
        if not self.l3_counts_fresh():
            new = sum(1 for h in hashes if h not in self.l3_written[namespace])
            self.l3_skipped_blocks += new
            self.l3_skipped_stale_blocks += new
            return [], []
        mine = self.l3_written[namespace]
        remove: list[int] = []
        take: list[int] = []
        batch: dict[int, int] = {}   # hash -> index, of this write's blocks taken so far
        for i, h in enumerate(hashes):
            if h in mine:
                continue
            if self.holds(namespace, L3_INDEX) + 1 > self.cap(namespace, L3_INDEX):
                victim = namespace if mine else None
            elif self._l3_total() + 1 > self.config.l3_blocks:
                victim = self._l3_victim(namespace)
            else:
                victim = NOBODY
            if victim is None:
                self.l3_skipped_blocks += 1
                continue
            if victim is not NOBODY:
                gone = self._l3_remove_oldest(victim, namespace)
                if gone in batch:   # one of this write's own blocks: not written at all
                    take.remove(batch.pop(gone))
                else:
                    remove.append(gone)
            mine[h] = None
            batch[h] = i
            take.append(i)
        return take, remove

    def _l3_total(self) -> int:
        return sum(len(v) for v in self.l3_written.values()) + sum(self.l3_others.values())

    def _l3_victim(self, namespace: Hashable) -> Hashable | None:
        over = [ns for ns, held in self.l3_written.items() if held and ns != namespace
                and self.over_guarantee(ns, L3_INDEX)]
        if over:   # the one furthest over its guarantee gives
            return max(over, key=lambda ns: self.holds(ns, L3_INDEX) - self.guarantee(ns, L3_INDEX))
        return namespace if self.l3_written.get(namespace) else None

    def _l3_remove_oldest(self, victim: Hashable, who: Hashable) -> int:
        h, _ = self.l3_written[victim].popitem(last=False)
        c = self._counters(victim)
        c["evictions_suffered"][L3_INDEX] += 1
        self._counters(who)["evictions_caused"][L3_INDEX] += 1
        if victim != who:
            c["evictions_suffered_from_others"][L3_INDEX] += 1
        return h

    # L3 tier listener (``L3Tier.listeners``): a fetch that found blocks missing.
    def on_l3_removed(self, hashes: Sequence[int]) -> None:
        self.l3_forget(hashes)

    def on_l3_stored(self, hashes: Sequence[int], namespace: Hashable = None) -> None:
        pass

    def on_l3_inventory(self, hashes: Sequence[int]) -> None:
        pass

    def l3_forget(self, hashes: Sequence[int]) -> None:
        """Blocks L3 no longer holds (a failed write, an eviction found at a fetch)."""
        drop = set(hashes)
        for held in self.l3_written.values():
            for h in [h for h in held if h in drop]:
                del held[h]
