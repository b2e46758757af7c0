"""Tiered radix cache: HOT (device) -> WARM (host) -> COLD (disk).

Under pressure a node is demoted, not destroyed; the tree keeps its topology,
so ``match`` sees how much of a prefix is HOT, WARM and COLD, and a hit on a
colder part promotes the whole path back to HOT before the caller reads it.

Moves are asynchronous: a node being moved holds its ``Move`` in ``busy`` (no split,
merge, drop or second move), its source KV stays valid until the copy
completes, and completions are applied by the owner in ``poll``. A demotion
that finds its node locked when it completes is abandoned (the HOT copy is in
use); a promotion that fails (disk checksum) drops the bad node and its
subtree, and the caller recomputes.

The parts it holds, each given only what it uses:

- ``space`` (``cluster.cache.tier_space.TierSpace``): the room in each tier
  (allocation, watermarks, reclaim of lower copies, the quota pick);
- ``moves`` (``cluster.cache.tier_moves.TierMoves``): the copies between tiers;
- ``sessions`` (``cluster.cache.sessions.SessionPrefetch``): sessions and prefetch;
- ``staging`` (``cluster.cache.staging.HostStaging``): migrations' host blocks;
- ``quotas`` (``cluster.cache.quotas.TenantQuotas``, the space's; None without);
- ``l3`` (``cluster.cache.l3.link.L3Link``, once ``attach_l3``);
- ``stats`` (``cluster.cache.cache_stats.CacheStats``): every counter, one object.

What callers use, and nothing inside:

- a request: ``admit`` gives a ``KVLease`` (``cluster.cache.lease``): its
  prefix locked and in HOT, room for its own KV; the lease appends, commits
  or releases. ``prefetch`` starts bringing a returning session up early.
- a migration: ``stage`` (holder: the prefix copied into host blocks of
  ``staging``), ``install`` (target: KV computed elsewhere, cached here).
- the worker: ``poll``, ``housekeeping`` (idle gaps), ``drop_all``,
  ``add_listener``, ``close``; ``lookup``, ``tier_summary``, ``stats`` to look.
- the engine, under tenant quotas: ``set_work`` each step (who has work, whose
  guarantee holds: ``cluster.cache.quotas``), ``may_preempt``, ``hot_asks``, ``hot_room_for``.
- L3 (``attach_l3`` gives the cache an ``L3Link`` as ``l3``,
  ``cluster.cache.l3.link``): a committed sequence's full blocks are written
  behind the request; ``ready`` fetches the blocks a waiting request's prompt
  has past the tree's prefix, and installs them before it is admitted. What a
  leaving replica hands off (``queue_hand_off``, ``valuable_prefixes``) is the
  link's.
- a lease (``LeaseHost``, ``cluster.cache.lease``): ``lease_allocate``,
  ``lease_append``, ``lease_free``, ``lease_checkpoint``, ``lease_commit``,
  ``lease_unlock``, ``check_owner``: the only calls a ``KVLease`` makes.

Every one checks its ``owner`` (``cluster.ownership``) when checks are on:
the cache belongs to one thread, the worker's engine thread.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Collection, Hashable, Sequence

import torch

from cluster.cache.allocator import Extent
from cluster.cache.cache_stats import CacheStats
from cluster.cache.codec import CodecMismatchError, stored_block_bytes, tier_codec
from cluster.cache.disk import DiskPool
from cluster.cache.kv_pool import KVLayout, KVPool
from cluster.cache.lease import KVLease
from cluster.cache.l3.link import NO_ROOM, L3Link
from cluster.cache.l3.tier import L3Tier
from cluster.cache.quotas import TenantQuotas
from cluster.cache.radix_tree import RadixTree, TreeNode
from cluster.cache.sessions import SessionPrefetch
from cluster.cache.staging import HostStaging
from cluster.errors import CacheError, InvalidInputError, PoolExhaustedError
from cluster.names import COLD, HOT, TIER_NAMES, WARM
from cluster.ownership import ThreadOwner
from cluster.cache.tier_moves import TierMoves
from cluster.cache.tier_pools import build_copy_engines, build_pools
from cluster.cache.tier_space import TierSpace
from cluster.cache.tier_types import Move, MoveKind, Readiness, TieredMatch, TierConfig, UnknownSessionError

__all__ = ["TieredCache", "TierConfig", "Move", "MoveKind", "Readiness", "TieredMatch", "UnknownSessionError"]


class TieredCache:
    def __init__(self, config: TierConfig, layout: KVLayout | None, *, clock: Callable[[], float] = time.monotonic,
                 vocab_size: int | None = None, deterministic_io: bool = False, prefault: bool = True):
        """``deterministic_io``: background copies complete at the next poll,
        exactly (tests and replays); production leaves it off. ``prefault=False``: the
        CPU pools' pages are touched later, by their ``prefault`` (a worker's start-up thread)."""
        self.device = config.resolved_device()
        # How WARM, COLD and L3 store KV (``cluster.cache.codec``); sizes in MiB become blocks of it.
        self.codec = tier_codec(config, layout, self.device)
        config = config.sized(stored_block_bytes(self.codec, layout, config),
                              layout and layout.num_layers * 2 * config.block_tokens * layout.num_kv_heads
                              * layout.head_dim * layout.torch_dtype.itemsize, self.device.type)
        self.config = config
        self.layout = layout
        self.pools: list[Any] = build_pools(config, layout, self.device, self.codec, prefault=prefault)
        self.tree = RadixTree([p.allocator for p in self.pools], policy=config.eviction_policy, clock=clock,
                              vocab_size=vocab_size)
        self.copier, self.disk_io, upload = build_copy_engines(config, layout, self.device, self.pools,
                                                               deterministic_io)
        self.owner: ThreadOwner | None = None   # set by the worker when ownership checks are on
        self.stats = CacheStats()
        # The room in each tier (the quotas' pick among it), and the copies that move data
        # between tiers to make it: the space makes room through the moves, the moves take
        # room through the space.
        self.space = TierSpace(self.tree, self.pools, config, self.stats)
        self.quotas: TenantQuotas | None = self.space.quotas
        self.moves = TierMoves(self.space, self.copier, self.disk_io, upload, layout)
        self.space.bind(self.moves)
        self.sessions = SessionPrefetch(self.tree, self.space, self.moves, config, self.stats)
        # Host blocks for migrations (None without a WARM tier, or without KV payload).
        self.staging = HostStaging(self.space, self.check_owner) \
            if self.num_tiers > WARM and layout is not None else None
        self.l3: L3Link | None = None   # attach_l3

    @property
    def num_tiers(self) -> int:
        return len(self.pools)

    @property
    def hot(self) -> KVPool:
        return self.pools[HOT]

    def request_room_tokens(self) -> int:
        """The most KV one request may hold alone: HOT, less a block of slack for a
        copy-on-write tail."""
        hot = self.hot.allocator
        return hot.capacity_tokens - hot.block_tokens

    def check_owner(self, what: str) -> None:
        if self.owner is not None:
            self.owner.check(what if "." in what else f"TieredCache.{what}")

    # ------------------------------------------------------------ requests
    def admit(self, prompt: Sequence[int], namespace: Hashable = None, *, compute_last: bool = True,
              validate: bool = True, max_cached: int | None = None, promote: bool = True) -> KVLease:
        """A lease on ``prompt``'s KV: its longest cached prefix, promoted to
        HOT (all or nothing) and locked. With ``compute_last`` the last prompt
        token is left to compute (its logits start the output); ``max_cached``
        bounds the prefix used (a request that needs the logits of positions the
        cache holds computes them again). ``promote=False``: only the HOT part
        (a caller that chose to recompute the rest, ``Readiness.recompute``).
        The room for the rest is the lease's to reserve (``KVLease.reserve``: a
        caller that cannot get it releases the lease, and nothing stays locked).
        ``lease.held_by_tier`` says what the tiers held of what it could use."""
        self.check_owner("admit")
        with self.space.acting(namespace):
            m = self._match(prompt, namespace, lock=True, validate=validate, promote=promote)
        cap = len(prompt) - 1 if compute_last else len(prompt)
        if max_cached is not None:
            cap = min(cap, max(0, max_cached))
        usable = min(m.length, cap)
        tl = m.tier_lengths
        hot = min(usable, tl[HOT])
        warm = min(usable - hot, tl[WARM])
        hits = (hot, warm, usable - hot - warm)
        held = _split(min(sum(tl), cap), tl)
        if self.quotas is not None:
            self.quotas.note_hits(namespace, hits)
        return KVLease(self, namespace, m.last_node, _take(m.extents, usable), usable, hits,
                       m.promoted_tokens, m.waited_s, held)

    def ready(self, tokens: Sequence[int], namespace: Hashable = None, *, make_room: bool = True,
              recompute_s_per_token: float | None = None) -> Readiness:
        """Whether ``admit`` of ``tokens`` would find all its cached prefix in HOT
        now, and the HOT/WARM/COLD split of that prefix as found. When part of it
        is WARM or COLD, its promotion starts here (unless one is in flight
        already) and the answer is not ready until it is done: the caller admits
        other work meanwhile instead of waiting for the copy. A promotion that
        finds no room does not start, and the request waits (``blocked``): it is
        never admitted below what the tiers hold for it.

        ``make_room=False``: start the promotion only into HOT's free blocks;
        otherwise only look, leaving the prefix's recency as it was. A scheduler
        asks so for every waiting request behind the oldest: promotions that each
        pushed out another's prefix would let none of them run.

        ``recompute_s_per_token``: the engine's measured prefill cost; where the
        measured copy rates say bringing a colder part up takes longer than computing
        it, that part is left to compute (``TierMoves.tiers_to_promote``): all of the
        colder part, or, in a partial promotion, the COLD rest below a WARM part that
        comes up (counted in ``promotions_partial``). Once nothing is left to bring
        up, the answer is ready with ``recompute`` set to the tokens left (admit with
        ``promote=False``; counted in ``promotions_recompute_cheaper``)."""
        self.check_owner("ready")
        self.poll()
        if self.l3 is not None:
            asked = self.l3.fetch_ahead(tokens, namespace)
            if asked:   # tiers as found, and what L3 is bringing: [hot, warm, cold, l3]
                return Readiness(False, self.tree.peek(tokens, namespace, validate=False)[1] + [asked])
        hot, tiers = self.tree.peek(tokens, namespace, validate=False)
        if hot:
            return Readiness(True, tiers)
        up = (WARM, COLD)
        if recompute_s_per_token is not None:
            up = self.moves.tiers_to_promote(tiers, recompute_s_per_token)
        left = sum(tiers[t] for t in (WARM, COLD) if t not in up)   # computed again, by choice
        coming = sum(tiers[t] for t in up)
        if not coming:
            self.stats.promotions_recompute_cheaper += bool(left)
            return Readiness(True, tiers, recompute=left)
        if not make_room:
            bt = self.hot.allocator.block_tokens
            # Whole blocks for the colder tokens, and slack for the partial blocks at
            # node edges (an estimate: a promotion that misses it does not start).
            if self.hot.allocator.free_blocks < -(-coming // bt) + 2:
                return Readiness(False, tiers)
        m = self.tree.match_prefix(tokens, namespace, validate=False)
        tiers = list(m.tier_lengths)
        colder = [n for n in m.nodes if n.tier in up]
        if not colder:   # all in HOT (the look saw a HOT node moving), or only what is left to compute
            return Readiness(True, tiers, recompute=sum(tiers[t] for t in (WARM, COLD) if t not in up))
        if any(n.busy for n in m.nodes):
            return Readiness(False, tiers)
        with self.space.acting(namespace):
            move = self.moves.start_promotion(colder, make_room=make_room)
        if move is None:
            self.stats.promotion_skipped_no_room += 1
            return Readiness(False, tiers, blocked=make_room)
        if left:
            self.stats.promotions_partial += 1
        return Readiness(False, tiers)

    def lookup(self, tokens: Sequence[int], namespace: Hashable = None) -> TieredMatch:
        """What is cached of ``tokens`` and in which tier, moving and locking
        nothing (inspection, tests)."""
        self.check_owner("lookup")
        self.poll()
        m = self.tree.match_prefix(tokens, namespace)
        return TieredMatch(m.length, m.last_node, list(m.extents), list(m.tier_lengths))

    # ----------------------------------------------------------- migrations
    def stage(self, tokens: Sequence[int], namespace: Hashable = None, max_tokens: int | None = None
              ) -> tuple[int, list[Extent]]:
        """Copy the cached prefix of ``tokens`` (at most ``max_tokens``) into
        whole private host blocks, for a peer to read; returns its length and
        those blocks' extents (0 and [] when nothing is cached, or without a
        WARM tier). ``staging.free`` gives them back."""
        self.check_owner("stage")
        lease = self.admit(tokens, namespace, compute_last=False)
        try:
            n = lease.cached_tokens if max_tokens is None else min(lease.cached_tokens, max_tokens)
            if n == 0 or self.staging is None:
                return 0, []
            kv = lease.read()[:, :, :n].to("cpu")
            ext = self.staging.allocate(n)
            self.staging.write(ext, kv)
            return n, ext
        finally:
            lease.release()

    def install(self, tokens: Sequence[int], namespace: Hashable, kv: torch.Tensor) -> int:
        """Cache KV computed elsewhere for ``tokens[:kv.shape[2]]``; returns the
        tokens that were new here (what was cached already is kept)."""
        self.check_owner("install")
        if self.codec is not None and self.codec.compressed and not kv.is_floating_point():
            # A migration's blocks arrive as the holder's stored bytes (its WARM staging);
            # another codec's bytes are refused, never read as this one's.
            self.codec.check_stored(kv, "migrated KV")
            kv = self.codec.decode(kv)
        return max(0, self._install_at(tokens[:kv.shape[2]], namespace, kv, 0, validate=True) or 0)

    def _install_at(self, tokens: Sequence[int], namespace: Hashable, kv: torch.Tensor, start: int, *,
                    validate: bool = False) -> int | None:
        """Cache ``kv``, the KV of ``tokens[start:]``, behind the tree's prefix of ``tokens``;
        the tokens new here, or None when the tree no longer reaches ``start`` (evicted
        meanwhile), ``NO_ROOM`` when HOT has no room now (what ``L3Link`` installs with)."""
        end = len(tokens)
        lease = self.admit(tokens, namespace, compute_last=False, validate=validate)
        try:
            have = lease.cached_tokens
            if have >= end:
                return 0
            if have < start:
                return None
            lease.append(kv[:, :, have - start:].to(self.kv_device, self.kv_dtype))
            lease.commit(tokens)
            return end - have
        except PoolExhaustedError:
            return NO_ROOM
        finally:
            lease.release()

    # ------------------------------------------------------------------ L3
    def attach_l3(self, tier: L3Tier) -> None:
        """Use L3 through ``tier`` from now on (the cache owns it: ``close`` closes it)."""
        if tier.block_tokens != self.hot.allocator.block_tokens:
            raise InvalidInputError(f"L3 blocks of {tier.block_tokens} tokens on a cache of "
                                    f"{self.hot.allocator.block_tokens}-token blocks")
        if tier.codec_name != self.config.tier_codec:
            raise CodecMismatchError(f"an L3 tier of codec {tier.codec_name!r} on a cache whose tiers use "
                                     f"{self.config.tier_codec!r}: one codec for every tier")
        self.l3 = L3Link(tier, self.tree, self.pools, self._install_at, self.quotas)
        if self.quotas is not None:   # blocks found gone from L3 no longer count toward a tenant
            tier.listeners.append(self.quotas)

    def apply_l3(self) -> int:
        """Apply what the L3 thread finished (stored blocks reported, fetched ones
        installed); returns tokens installed."""
        return 0 if self.l3 is None else self.l3.apply()

    # -------------------------------------------------------- housekeeping
    @property
    def kv_device(self) -> torch.device:
        return self.hot.tensor.device

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.hot.tensor.dtype

    def add_listener(self, listener: Any) -> None:
        """Tree callbacks (``on_stored``/``on_tier``/``on_removed``), e.g. a KV event publisher."""
        self.tree.listeners.append(listener)

    def housekeeping(self) -> None:
        """Idle-gap work: demote past the watermarks, compact sparse blocks."""
        self.check_owner("housekeeping")
        if self.l3 is not None:
            self.l3.apply()
        self.space.enforce_watermarks()
        self.compact_idle()

    @property
    def protected_tokens(self) -> int:
        return self.tree.protected_tokens

    @property
    def evictable_tokens(self) -> int:
        return self.tree.evictable_tokens

    def fragmentation(self) -> float:
        return self.hot.allocator.internal_fragmentation()

    def drop_all(self) -> int:
        """Drop every unlocked cached prefix, coldest tier first; returns tokens freed."""
        self.check_owner("drop_all")
        self.poll()
        freed = 0
        for tier in reversed(range(self.num_tiers)):
            while True:
                n = self.tree.evict(1 << 40, tier)
                self.moves.count_drop(tier, "flush", n)
                freed += n
                if not n:
                    break
        return freed

    # ------------------------------------------------------ calibration hooks
    def demote_path(self, tokens: Sequence[int], namespace: Hashable = None, tier: int = WARM) -> int:
        """Move the cached path of ``tokens`` down to ``tier`` now (leaf first,
        waiting for each copy); returns the tokens moved. For calibration and tests."""
        self.check_owner("demote_path")
        return self.moves.demote_path(tokens, namespace, tier)

    def drop_page_cache(self) -> None:
        """Make the next COLD reads come from the device, not the OS page cache."""
        if self.num_tiers > COLD and isinstance(self.pools[COLD], DiskPool):
            self.pools[COLD].drop_page_cache()

    # ----------------------------------------------------------- internals
    def _match(self, tokens: Sequence[int], namespace: Hashable = None, *, promote: bool = True,
               lock: bool = False, validate: bool = True) -> TieredMatch:
        """Longest cached prefix, promoted to HOT (all or nothing) when ``promote``.

        With ``lock`` the returned node is locked before anything else can run,
        so its extents stay valid until ``_unlock``.
        """
        self.poll()
        t0 = time.perf_counter()
        m = self.tree.match_prefix(tokens, namespace, validate=validate)
        tier_lengths = list(m.tier_lengths)
        # Wait for moves that own nodes on the path (e.g. a prefetch still copying).
        waiting = [n for n in m.nodes if n.busy and (n.busy.kind is MoveKind.PROMOTE or n.tier != HOT)]
        if waiting:
            for n in waiting:
                if n.busy:
                    self.moves.wait(n.busy)
            m = self.tree.match_prefix(tokens, namespace, validate=False)
        promoted = 0
        if promote and m.length and m.nodes[-1].tier != HOT:
            promoted = self.moves.promote_sync([n for n in m.nodes if n.tier != HOT])
        hot_nodes = [n for n in m.nodes if n.tier == HOT]
        length = sum(len(n.key) for n in hot_nodes)
        last = hot_nodes[-1] if hot_nodes else self.tree.root(namespace)
        extents = [e for n in hot_nodes for e in n.extents]
        if lock:
            self.tree.lock(last)
        return TieredMatch(length, last, extents, tier_lengths, promoted, time.perf_counter() - t0)

    # ------------------------------------------------------ the lease's host (``LeaseHost``)
    def lease_allocate(self, num_tokens: int, tenant: Hashable) -> list[Extent]:
        """HOT extents for a lease's new KV; demotes (or drops) to make room, all or nothing.
        ``tenant``: whose KV it is (the lease's namespace): it counts toward that tenant's
        HOT share until it enters the tree or is freed (quotas)."""
        out = self.space.allocate(HOT, num_tokens, private_tail=False, tenant=tenant)
        if self.quotas is not None:
            self.quotas.note_running(tenant, num_tokens)
        return out

    def lease_append(self, extents: list[Extent], num_tokens: int,
                     tenant: Hashable) -> tuple[list[Extent], list[Extent]]:
        """Grow a lease's private HOT sequence (copy-on-write of a shared tail)."""
        out = self.space.append_hot(extents, num_tokens, tenant)
        if self.quotas is not None:
            self.quotas.note_running(tenant, num_tokens)
        return out

    def lease_free(self, own: list[Extent], tenant: Hashable) -> None:
        self._running_ends(own, tenant)
        self.hot.allocator.free(own)

    def _running_ends(self, own: Sequence[Extent], tenant: Hashable) -> None:
        if self.quotas is not None and own:   # into the tree, or freed: no longer running KV
            self.quotas.note_running(tenant, -sum(e.length for e in own))

    def lease_checkpoint(self, tokens: Sequence[int], own: list[Extent], namespace: Hashable, start: int,
                         node: TreeNode) -> tuple[TreeNode, list[Extent]] | None:
        """A lease's KV so far into the tree, kept locked: the new locked node and the
        sequence's HOT extents now (the tree's: a part another request inserted first is
        freed, a WARM/COLD copy re-homed onto ours); None when deferred to the commit."""
        if not self.tree.insert_keeps_whole(tokens, namespace, validate=False):
            # Another request's copy of these tokens is moving between tiers: the tree
            # would keep that one and free ours. Keep ours; the commit inserts it.
            self.stats.checkpoints_deferred += 1
            return None
        self.hot.allocator.seal(own[-1])
        self._running_ends(own, namespace)
        self.tree.insert(tokens, own, namespace, start=start)
        m = self.tree.match_prefix(tokens, namespace, validate=False)
        if m.length != len(tokens) or any(n.tier != HOT for n in m.nodes):
            raise CacheError("a checkpointed sequence is not whole in HOT")   # checked above: cannot happen
        self.tree.lock(m.last_node)
        self.tree.unlock(node)
        # Watermarks only once it is locked: demoting the new, still unlocked nodes would
        # take the lease's own KV out of HOT.
        self.space.enforce_watermarks()
        return m.last_node, [e for n in m.nodes for e in n.extents]

    def lease_commit(self, tokens: Sequence[int], own: list[Extent], namespace: Hashable, start: int,
                     session_id: Any) -> TreeNode | None:
        """A lease's sequence into the tree (its full blocks written behind to L3) and the
        session remembered; the node holding the last token (None: nothing appended).
        The lease unlocks its prefix itself, after."""
        node = None
        if own:
            self.hot.allocator.seal(own[-1])   # no later slots in a block about to enter the tree
            self._running_ends(own, namespace)
            node = self._insert(tokens, own, namespace, start=start).node
            if self.l3 is not None:   # behind the request, while the sequence is still locked
                self.l3.write_behind(tokens, namespace)
        if session_id is not None:
            self.sessions.note(session_id, tokens, namespace)
        return node

    def lease_unlock(self, node: TreeNode) -> None:
        self.tree.unlock(node)

    def _insert(self, tokens: Sequence[int], extents: Sequence[Extent], namespace: Hashable = None, *,
                start: int = 0, validate: bool = True):
        """Insert a lease's KV. A node on its path that is moving between tiers cannot
        be split or re-homed: the copy is waited for first, so the tree takes all of
        the new KV instead of freeing its tail."""
        for _ in range(4):
            moving = self.tree.moves_on_path(tokens, namespace, validate=False)
            if not moving:
                break
            for move in moving:
                self.moves.wait(move)
        res = self.tree.insert(tokens, extents, namespace, start=start, validate=validate)
        self.stats.commit_tail_discarded_tokens += res.discarded_tokens
        self.space.enforce_watermarks()
        return res

    # --------------------------------------------------------------- sessions
    def prefetch(self, session_id: Any = None, tokens: Sequence[int] | None = None,
                 namespace: Hashable = None) -> int:
        """Start promoting a session's WARM/COLD path; returns the tokens being
        brought up (0 when already HOT). Returns at once (``SessionPrefetch``)."""
        self.check_owner("prefetch")
        self.poll()
        return self.sessions.prefetch(session_id, tokens, namespace)

    def touch(self, tokens: Sequence[int], namespace: Hashable = None) -> float:
        """Mark the cached prefix of ``tokens`` as used now (a request for it arrived) and
        return that time (the tree's clock): while the request waits, a session prefetch
        does not push it out (``waiting_since``). Changes nothing else."""
        self.check_owner("touch")
        return self.sessions.touch(tokens, namespace)

    @property
    def waiting_since(self) -> float | None:
        """When the oldest waiting request was submitted (None: none waits): what a session
        prefetch must not push out was touched since (the engine keeps it current)."""
        return self.sessions.waiting_since

    @waiting_since.setter
    def waiting_since(self, value: float | None) -> None:
        self.sessions.waiting_since = value

    def usage(self, tier: int) -> float:
        """The share of ``tier`` held, less what is leaving and the lower copies (``TierSpace``)."""
        return self.space.usage(tier)

    def compact_idle(self, max_blocks_moved: int = 4) -> int:
        """Online compaction for idle gaps: evacuate a few sparse HOT and WARM
        blocks of idle, unlocked nodes into fewer blocks. Returns blocks freed."""
        movable = lambda n: isinstance(n, TreeNode) and not n.lock_ref and not n.busy  # noqa: E731
        freed = 0
        for pool in self.pools[:2]:
            if pool.tensor is not None:
                freed += pool.compact(max_blocks_moved, can_move=movable)
        self.stats.compacted_blocks += freed
        return freed

    # ------------------------------------------------------------ completions
    def poll(self) -> int:
        """Apply the tier moves that finished (never blocks); how many."""
        self.check_owner("poll")
        return self.moves.poll()

    def wait_all(self) -> None:
        self.moves.wait_all()

    def await_promotion(self, tokens: Sequence[int], namespace: Hashable = None) -> None:
        """Wait for the promotions in flight on ``tokens``' cached prefix (and apply them)."""
        self.check_owner("await_promotion")
        self.moves.wait_path(self.tree.match_prefix(tokens, namespace, validate=False).nodes)

    def in_flight(self) -> int:
        return self.moves.in_flight()

    @property
    def promote_s_per_token(self) -> list[float | None]:
        return self.moves.promote_s_per_token   # measured seconds per token of a promotion from each tier

    def close(self) -> None:
        self.wait_all()
        if self.l3 is not None:
            self.l3.tier.close()
        self.copier.close()
        if self.disk_io is not None:
            self.disk_io.close()
        if self.num_tiers > COLD and isinstance(self.pools[COLD], DiskPool):
            self.pools[COLD].close()

    # ------------------------------------------------------- tenant quotas (the engine's)
    def may_preempt(self, requester: Hashable, victim: Hashable, asked: int = 0) -> bool:
        """``TenantQuotas.may_preempt`` for ``asked`` HOT tokens of ``requester`` (always, without quotas)."""
        return self.quotas is None or self.quotas.may_preempt(requester, victim, asked)

    def hot_asks(self, tokens: Sequence[int], namespace: Hashable = None) -> int:
        """The HOT tokens admitting ``tokens`` adds to its tenant's: all but the prefix in HOT now (a look)."""
        return len(tokens) - self.tree.peek(tokens, namespace, validate=False)[1][HOT]

    def set_work(self, active: Collection[Hashable], protected: Collection[Hashable] | None = None) -> None:
        if self.quotas is not None:   # ``TenantQuotas.set_work``
            self.quotas.set_work(active, protected)

    def hot_room_for(self, namespace: Hashable) -> int:
        """All of HOT, or its tenant's HOT cap: the most a request of ``namespace`` can hold."""
        cap = self.hot.allocator.capacity_tokens
        return cap if self.quotas is None else min(cap, self.quotas.cap(namespace, HOT))

    def tenant_stats(self) -> dict[str, dict]:
        """Per tenant: resident tokens by tier, hits, evictions caused and suffered ({} without quotas)."""
        return {} if self.quotas is None else self.quotas.tenant_stats()

    def tier_summary(self) -> dict[str, dict[str, int]]:
        out = {}
        for tier, pool in enumerate(self.pools):
            a = pool.allocator
            out[TIER_NAMES[tier]] = {"used_tokens": a.used_tokens, "capacity_tokens": a.capacity_tokens,
                                     "used_blocks": a.used_blocks, "num_blocks": a.num_blocks}
        return out

    def check_invariants(self) -> None:
        self.tree.check_invariants()
        if self.quotas is not None:
            self.quotas.check_invariants(self.hot.allocator.used_tokens)
        for node in self.tree.iter_nodes():
            if node.busy:
                assert (id(node.busy.engine), node.busy.op_id) in self.moves.active, "busy node without a move"
        self.moves.check_invariants()


def _split(tokens: int, tier_lengths: Sequence[int]) -> tuple[int, int, int]:
    """The first ``tokens`` of a prefix laid out HOT, then WARM, then COLD, by tier."""
    hot = min(tokens, tier_lengths[HOT])
    warm = min(tokens - hot, tier_lengths[WARM])
    return hot, warm, tokens - hot - warm


def _take(extents: list[Extent], ntokens: int) -> list[Extent]:
    """The leading extents covering ``ntokens`` (the last one cut, as a view only)."""
    out, covered = [], 0
    for e in extents:
        if covered >= ntokens:
            break
        k = min(e.length, ntokens - covered)
        out.append(e if k == e.length else Extent(e.block_id, e.offset, k))
        covered += k
    return out
