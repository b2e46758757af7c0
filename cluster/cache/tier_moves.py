"""The asynchronous copies between tiers: ``TierMoves``, an object ``TieredCache`` holds (``cache.moves``).

A demotion moves idle nodes of one tier a tier down, a promotion brings a
path's nodes up to HOT, each as one ``Move`` on a copy engine (``copier`` for
HOT <-> WARM, ``disk_io`` for COLD); ``_complete`` applies a finished one on
the owner's thread (from ``poll``), and ``make_room`` frees blocks of a full
tier by demoting (and waiting) or dropping.

Tiers are inclusive where that is free: a node promoted from WARM keeps its
WARM copy (``RadixTree.keep_lower``), so demoting it again is no copy, and
WARM reclaims such copies before it demotes or drops anything. Every token
that leaves the tree is counted by tier and reason (``count_drop``); a drop
while the tier below had room for it is a defect, counted apart. It is given the
tier space (``cluster.cache.tier_space``: the tree, the pools, room, the pick, the
counters) and the copy engines; it owns the moves in flight (``active``), and keeps the
space's count of what they take out of each tier and, by tenant, put into each.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Hashable, Sequence

import torch

from cluster.cache.allocator import Extent
from cluster.cache.kv_pool import copy_pairs
from cluster.cache.quotas import TenantCapError
from cluster.cache.radix_tree import TreeNode
from cluster.cache.tier_space import TierSpace
from cluster.cache.tier_types import Move, MoveKind
from cluster.errors import ChecksumError, PoolExhaustedError
from cluster.estimators import RecentMedian
from cluster.names import COLD, HOT, WARM

log = logging.getLogger(__name__)


class TierMoves:
    """Given the tier space (room, the pick, the counters) and the copy engines, it owns
    the moves in flight (``active``) and the measured promotion rates
    (``promote_s_per_token``). Owner thread only, like the cache."""

    def __init__(self, space: TierSpace, copier, disk_io, upload, layout):
        self.space, self.tree, self.pools, self.stats = space, space.tree, space.pools, space.stats
        self.copier, self.disk_io, self.upload, self.layout = copier, disk_io, upload, layout
        self.active: dict[tuple[int, int], Move] = {}   # (engine, op id) -> the move in flight
        self.refused: PoolExhaustedError | None = None   # why the last demotion found no room below
        # Measured seconds per token of a promotion from WARM and from COLD (None until one ran).
        self.promote_s_per_token: list[float | None] = [None, None, None]
        self._short_choices = 0   # choices to compute a colder part (every REMEASURE_EVERY-th promotes)
        self._copy_samples = [RecentMedian() for _ in range(3)]   # per source tier

    @property
    def hot(self):
        return self.pools[HOT]

    @property
    def num_tiers(self) -> int:
        return len(self.pools)

    # ------------------------------------------------------------ completions
    def poll(self) -> int:
        """Apply the moves that finished (never blocks); how many."""
        done = 0
        for engine in filter(None, (self.copier, self.disk_io)):
            for c in engine.poll():
                move = self.active.pop((id(engine), c.op_id), None)
                if move is not None:
                    self._complete(move, c.error, c.seconds)
                    done += 1
        return done

    def wait_all(self) -> None:
        while self.active:
            self.wait(next(iter(self.active.values())))

    def in_flight(self) -> int:
        return len(self.active)

    def wait(self, move: Move) -> None:
        try:
            move.engine.wait(move.op_id)
        except BaseException:
            pass  # the error arrives through poll
        while (id(move.engine), move.op_id) in self.active:
            if not self.poll():
                time.sleep(0.0005)

    def wait_path(self, nodes: list[TreeNode]) -> None:
        """Wait for the promotions that own any of ``nodes`` (one path's), each applied."""
        for n in nodes:
            if isinstance(n.busy, Move) and n.busy.kind is MoveKind.PROMOTE:
                self.wait(n.busy)

    def count_drop(self, tier: int, reason: str, tokens: int) -> None:
        """``tokens`` left the tree from ``tier`` for ``reason`` (``last_tier``: LRU at
        the lowest tier; ``lower_full``: the tier below could make no room; ``over_cap``:
        its tenant at its cap there (quotas); ``copy_failed``; ``checksum``; ``flush``)."""
        if not tokens:
            return
        self.stats.count_drop(tier, reason, tokens)
        if tier + 1 < self.num_tiers and reason not in ("checksum", "flush", "over_cap"):
            below = self.pools[tier + 1].allocator
            if below.free_blocks * below.block_tokens >= tokens + below.block_tokens:
                self.stats.dropped_with_room_tokens += tokens   # a defect: it should have gone down

    def make_room(self, tier: int, blocks: int) -> bool:
        """Synchronously free ``blocks`` in ``tier``: demote (wait) or drop. False if stuck."""
        alloc = self.pools[tier].allocator
        target = alloc.free_blocks + blocks
        self.stats.stalls += 1
        return self._free_until(tier, lambda: alloc.free_blocks >= target, target)

    def shed_own(self, tier: int, over_cap: Callable[[], bool]) -> None:
        """Push the acting tenant's own data out of ``tier`` (the space's pick takes only its
        nodes while it is at its cap) until ``over_cap()`` is False or nothing of it can go."""
        self.stats.quota_sheds += 1
        self._free_until(tier, lambda: not over_cap(), None)

    def _free_until(self, tier: int, done: Callable[[], bool], reclaim_to: int | None) -> bool:
        passed_over: list[TreeNode] = []
        try:
            return self._free_blocks_until(tier, done, reclaim_to, passed_over)
        finally:
            for node in passed_over:
                self.tree.requeue(node)

    def _free_blocks_until(self, tier: int, done: Callable[[], bool], reclaim_to: int | None,
                           passed_over: list[TreeNode]) -> bool:
        """Demote or drop the space's picks until ``done()``; ``reclaim_to``: free
        blocks WARM's lower copies are reclaimed up to first (None: shedding a tenant's
        data, which lower copies do not count toward)."""
        while not done():
            self.poll()
            if tier == WARM and self.tree.lower_copies and reclaim_to is not None:
                # Duplicates of HOT nodes go first, for free.
                self.space.reclaim_lower_to(reclaim_to)
                continue
            last_tier = tier == self.num_tiers - 1
            node = self.space.pick(tier, leaves_only=last_tier)
            if node is None:
                # Blocks held by copies in flight, out of this tier or into it (a promotion
                # leaves its nodes unlocked, so evictable, when it completes): wait for one.
                pending = [m for m in self.active.values() if tier in m.src_tiers or m.dst_tier == tier]
                if not pending or reclaim_to is None:
                    return done()
                self.wait(pending[0])
                continue
            if last_tier:
                self.count_drop(tier, "last_tier", self.tree.drop(node))
            else:
                node = self.fit_below(node)
                move = self.start_demotion(node)
                if node.alive and node.tier != tier:   # it had a lower copy: moved down at no copy
                    continue
                if move is not None:
                    self.wait(move)
                    if move.error is None or not node.alive or node.tier != tier:
                        continue
                    # The next tier failed the copy (a disk error): the node stays here, and
                    # demoting it again would fail again, forever. Drop it like a stuck one.
                    self.stats.demotion_failures += 1
                    if self.stats.demotion_failures == 1:
                        log.warning("demotion from tier %d failed (%s: %s); dropping instead", tier,
                                    type(move.error).__name__, move.error)
                over_cap = move is None and isinstance(self.refused, TenantCapError)
                if not node.children and not node.lock_ref and node.alive and not node.busy:
                    reason = "copy_failed" if move is not None else ("over_cap" if over_cap else "lower_full")
                    self.count_drop(tier, reason, self.tree.drop(node))   # the next tier is stuck too
                elif over_cap and self._subtree_idle(node):
                    # Its tenant's cap below is under one block: the node can never go down, and its
                    # data further down (COLD) cannot be reached without it. A cap stays a cap.
                    self.count_drop(tier, "over_cap", self.tree.drop_subtree(node))
                else:
                    passed_over.append(node)
        return True

    @staticmethod
    def _subtree_idle(node: TreeNode) -> bool:
        stack = [node]
        while stack:
            n = stack.pop()
            if n.lock_ref or n.busy:
                return False
            stack.extend(n.children.values())
        return True

    def fit_below(self, node: TreeNode) -> TreeNode:
        """``node`` as it may move down: whole, or, where it would take more than half of
        the tier below, cut so that its leaf-ward part does (the part that moves; the head
        stays, a candidate of its own once the tail has gone). A node larger than the tier
        below could never move down, however empty that tier (a 1k-token prefix over a WARM
        of 1k tokens: HOT stuck full, every waiting request stalled); one that fills it would
        push everything else out of it. Under quotas the part that moves also fits its tenant's
        cap in the tier below (a WARM cap of 9 tokens under a 29-token node: the node could
        never go down, and HOT stayed full of it)."""
        dst = node.tier + 1
        if dst >= self.num_tiers or node.lower is not None:   # a lower copy moves it down for free
            return node
        bt = self.pools[dst].allocator.config.block_tokens
        limit = self.pools[dst].allocator.num_blocks // 2 * bt
        quotas = self.space.quotas
        if quotas is not None:
            limit = min(limit, quotas.cap(self.tree.namespace_of(node), dst) // bt * bt)
        if limit == 0 or len(node.key) <= limit:
            return node
        start, p = 0, node.parent
        while p is not None:
            start += len(p.key)
            p = p.parent
        at = -(-(start + len(node.key) - limit) // bt) * bt - start   # the head ends on a block boundary
        if not 0 < at < len(node.key):
            return node
        self.tree.split_node(node, at)
        self.stats.demotion_splits += 1
        return node

    def start_demotion(self, nodes: TreeNode | list[TreeNode], *, wait_below: bool = True) -> Move | None:
        """Move nodes of one tier one tier down, as a single asynchronous copy
        (consecutive whole blocks coalesce). Nodes whose room cannot be found
        below stay where they are; None when none could start. ``wait_below=False``
        (background work): room below is only its free blocks, or, in the lowest tier,
        what dropping its LRU leaves frees; nothing waits for a copy further down."""
        nodes = [nodes] if isinstance(nodes, TreeNode) else list(nodes)
        self.refused = None
        copied = []
        for node in nodes:
            assert all(c.tier > node.tier for c in node.children.values()), \
                "only a frontier node (no child in its own tier) moves down"
            if node.lower is not None and node.tier == HOT and not node.busy and not node.lock_ref:
                if self.space.capped(self.tree.namespace_of(node), WARM, len(node.key)):
                    self.tree.drop_lower(node)   # its tenant at its WARM cap: room is made as for a copy
                    copied.append(node)
                    continue
                self.tree.demote_to_lower(node)   # its WARM copy is still there: nothing to move
                self.stats.demoted_to_warm += 1
                self.stats.demoted_without_copy += 1
            else:
                copied.append(node)
        nodes = copied
        if not nodes:
            return None
        src = nodes[0].tier
        dst = src + 1
        move = Move(MoveKind.DEMOTE, [], [], dst, [], None)
        for node in nodes:
            assert node.tier == src and not node.busy, "a batch demotes idle nodes of one tier"
            node.busy = move  # reserved: making room below may merge or drop idle nodes
        taken, dst_exts = [], []
        for node in nodes:
            try:   # room below is made for the node's own tenant (quotas)
                dst_exts.append(self.space.allocate(dst, len(node.key), private_tail=False,
                                                    tenant=self.tree.namespace_of(node),
                                                    make_room=wait_below or dst == self.num_tiers - 1))
                taken.append(node)
                self.space.coming(dst, node, len(node.key))   # counts for the next node's room already
            except PoolExhaustedError as exc:
                self.refused = exc
                break
        for node in nodes[len(taken):]:
            node.busy = None
        if not taken:
            return None
        move.nodes, move.src_tiers, move.dst_extents = taken, [src] * len(taken), dst_exts
        if self.layout is None:
            move.engine = self.copier
            move.op_id = self.copier.submit(lambda: None)
        elif dst == WARM:
            # One walk over every node's extents: consecutive whole blocks coalesce across nodes too.
            pairs = list(copy_pairs(self.pools[src], [e for n in taken for e in n.extents],
                                    self.pools[dst], [e for ext in dst_exts for e in ext]))
            move.engine = self.copier
            move.op_id = self.copier.submit_copies(pairs, codec=self.pools[dst].codec)
        else:
            warm, cold = self.pools[src], self.pools[dst]
            jobs = [(list(node.extents), ext) for node, ext in zip(taken, dst_exts)]
            pacer = self.disk_io.pacer

            def write_all() -> None:
                for src_ext, dst_ext in jobs:
                    kv = warm.read(src_ext)
                    cold.write(dst_ext, kv)
                    pacer.account(kv.numel() * kv.element_size())

            move.engine = self.disk_io
            move.op_id = self.disk_io.submit(write_all)
        for node in taken:
            self.space.leaving(src, len(node.key))
        self.active[(id(move.engine), move.op_id)] = move
        return move

    def start_promotion(self, nodes: list[TreeNode], *, background: bool = False,
                         make_room: bool = True) -> Move | None:
        """Bring ``nodes`` up to HOT in one asynchronous copy: a root-ward-first
        run of one path, or several such runs, parents before children.
        ``make_room=False``: only into HOT's free blocks (nothing is pushed out)."""
        for n in nodes:
            self.tree.lock(n)  # nothing on these paths may move or go meanwhile
            self.space.coming(n.tier, n, -len(n.key))   # on its way out: its tenant's room there is free
        dst_exts: list[list[Extent]] = []
        try:
            for n in nodes:   # for the node's own tenant: within its HOT cap (quotas)
                dst_exts.append(self.space.allocate(HOT, len(n.key), private_tail=False, make_room=make_room,
                                                    tenant=self.tree.namespace_of(n)))
                self.space.coming(HOT, n, len(n.key))
        except PoolExhaustedError:
            for n, ext in zip(nodes, dst_exts):
                self.hot.allocator.free(ext)
                self.space.coming(HOT, n, -len(n.key))
            for n in nodes:
                self.space.coming(n.tier, n, len(n.key))
                self.tree.unlock(n)
            self.stats.promotion_skipped_no_room += 1
            self.space.recap({self.tree.namespace_of(n) for n in nodes})
            return None
        move = Move(MoveKind.PROMOTE, list(nodes), [n.tier for n in nodes], HOT, dst_exts, None)
        if self.layout is None:
            move.engine = self.copier
            move.op_id = self.copier.submit(lambda: None)
        elif all(n.tier == WARM for n in nodes):
            pairs = list(copy_pairs(self.pools[WARM], [e for n in nodes for e in n.extents],
                                    self.hot, [e for ext in dst_exts for e in ext]))
            move.engine = self.copier
            # A request waits for a synchronous promotion: only prefetches are paced.
            move.op_id = self.copier.submit_copies(pairs, paced=background, codec=self.pools[WARM].codec)
        else:
            # COLD in the run: the disk thread stages and copies it up (``StagedUpload``).
            jobs = [(self.pools[n.tier], list(n.extents), ext) for n, ext in zip(nodes, dst_exts)]
            upload, failed = self.upload, move.failed_index
            pacer = self.disk_io.pacer if background else None
            after = None
            if self.hot.device.type == "cuda":   # the copies go after what the engine queued so far
                after = torch.cuda.Event()
                after.record(torch.cuda.current_stream(self.hot.device))
            move.engine = self.disk_io
            move.op_id = self.disk_io.submit(lambda: upload.run(jobs, failed, pacer, after))
        for n in nodes:
            n.busy = move
        self.active[(id(move.engine), move.op_id)] = move
        return move

    # A promotion must be measured this much slower than computing the same tokens before a
    # request recomputes them; and every REMEASURE_EVERY-th such case promotes all the same,
    # so the copy rate is measured again (a disk that was slow once is not written off).
    RECOMPUTE_MARGIN = 1.25
    REMEASURE_EVERY = 8

    def tiers_to_promote(self, tiers: Sequence[int], recompute_s_per_token: float) -> tuple[int, ...]:
        """Which colder parts of a prefix (``tiers``: its tokens by tier, root-ward HOT, then
        WARM, then COLD) are worth bringing up rather than computing again, at the measured
        copy rates and ``recompute_s_per_token``: ``(WARM, COLD)`` (all of it), ``(WARM,)``
        (partial promotion: the root-ward WARM part comes up, the COLD rest is computed) or
        ``()`` (compute it all). Promoting wins unless computing is measured cheaper by
        ``RECOMPUTE_MARGIN``. (The caller counts what it acts on: ``TieredCache.ready``.)"""
        colder = tuple(t for t in (WARM, COLD) if tiers[t])
        if any(self.promote_s_per_token[t] is None for t in colder):
            return colder   # not measured yet: promote (the copy measures it)
        copy = {t: tiers[t] * self.promote_s_per_token[t] for t in colder}
        compute = {t: tiers[t] * recompute_s_per_token * self.RECOMPUTE_MARGIN for t in colder}
        # Root-ward parts first: a part can come up only with every colder part above it.
        options = [colder[:k] for k in range(len(colder), -1, -1)]
        cost = {o: sum(copy[t] for t in o) + sum(compute[t] for t in colder if t not in o) for o in options}
        best = min(options, key=lambda o: (cost[o], -len(o)))   # ties: promote more
        if best == colder:
            return colder
        self._short_choices += 1
        if self._short_choices % self.REMEASURE_EVERY == 0:
            return colder   # measure the copy again
        return best

    def demote_path(self, tokens: Sequence[int], namespace: Hashable, tier: int) -> int:
        """Move the cached path of ``tokens`` down to ``tier`` now (leaf first, waiting for
        each copy); returns the tokens moved. For calibration and tests."""
        moved = 0
        for _ in range(tier):
            m = self.tree.match_prefix(tokens, namespace)
            for node in reversed(m.nodes):
                # Only a frontier node (no child in its tier, off the path too): tiers stay monotone.
                if node.tier < tier and not node.busy and not node.lock_ref and \
                        all(c.tier > node.tier for c in node.children.values()):
                    move = self.start_demotion(node)
                    if move is not None:
                        self.wait(move)
                    if move is not None or node.tier == tier:   # copied, or moved onto its lower copy
                        moved += len(node.key)
        return moved

    def check_invariants(self) -> None:
        """What leaves and enters each tier in flight is what the moves in flight carry."""
        moving = [(m, n, src) for m in self.active.values() for n, src in zip(m.nodes, m.src_tiers)]
        by_tenant: list[dict] = [{}, {}, {}]
        for m, n, src in moving:
            for tier, sign in ((m.dst_tier, 1), (src, -1 if m.kind is MoveKind.PROMOTE else 0)):
                ns = self.tree.namespace_of(n)
                by_tenant[tier][ns] = by_tenant[tier].get(ns, 0) + sign * len(n.key)
        assert self.space.pending_by_tenant == [{k: v for k, v in d.items() if v} for d in by_tenant], \
            "in-flight tokens by tenant drifted"
        for tier in range(self.num_tiers):
            assert self.space.pending_out[tier] == sum(len(n.key) for m, n, src in moving if m.kind is MoveKind.DEMOTE
                                                 and src == tier), "in-flight token count drifted"

    def promote_sync(self, nodes: list[TreeNode]) -> int:
        move = self.start_promotion(nodes)
        if move is None:
            return 0
        self.wait(move)
        return sum(len(n.key) for n in nodes if n.alive and n.tier == HOT)

    def _complete(self, move: Move, error: BaseException | None, seconds: float = 0.0) -> None:
        move.error = error
        for n in move.nodes:
            n.busy = None
        if move.kind is MoveKind.DEMOTE:
            src, dst = move.src_tiers[0], move.dst_tier
            freed: list[Extent] = []   # freed in one call: the next allocation gets them in order
            for node, dst_ext in zip(move.nodes, move.dst_extents):
                self.space.leaving(src, -len(node.key))
                self.space.coming(dst, node, -len(node.key))
                if error is not None or node.lock_ref:
                    # Failed copy, or the source got locked meanwhile: keep the source.
                    self.pools[dst].allocator.free(dst_ext)
                    self.stats.demotions_abandoned += 1
                    self.tree.requeue(node)
                    continue
                freed.extend(node.extents)
                self.tree.retier(node, dst, dst_ext)
                if dst == WARM:
                    self.stats.demoted_to_warm += 1
                else:
                    self.stats.demoted_to_cold += 1
            self.pools[src].allocator.free(freed)
            return
        # Promotion: apply root-ward first so tiers stay monotone along the path.
        for n in move.nodes:
            self.tree.unlock(n)
        bad = move.failed_index[0] if move.failed_index else (0 if error is not None else len(move.nodes))
        tokens = 0
        for i, (node, ext) in enumerate(zip(move.nodes, move.dst_extents)):
            self.space.coming(HOT, node, -len(node.key))   # landed here, or given up
            if i < bad:
                old_tier, old = node.tier, node.extents
                self.tree.retier(node, HOT, ext)
                self.space.coming(old_tier, node, len(node.key))
                if old_tier == WARM:   # inclusive: the WARM copy stays until WARM wants the room
                    self.tree.keep_lower(node, old)
                else:
                    self.pools[old_tier].allocator.free(old)
                self.stats.promoted_tokens += len(node.key)
                tokens += len(node.key)
            else:
                self.hot.allocator.free(ext)
                self.space.coming(node.tier, node, len(node.key))   # it stays where it was
        self.stats.promotions += 1
        if tokens and error is None and seconds > 0:
            self._note_copy_rate(move, tokens, seconds)
        if bad < len(move.nodes):
            if isinstance(error, ChecksumError):   # the stored copy is bad: it and what hangs below it go
                self.stats.checksum_failures += 1
                self.count_drop(move.src_tiers[bad], "checksum", self.tree.drop_subtree(move.nodes[bad]))
            else:   # the copy up failed, not the data: the nodes stay where they were, whole
                self.stats.promotion_failures += 1
                for node in move.nodes[bad:]:
                    if node.alive:
                        self.tree.requeue(node)

    def seed_copy_rate(self, tier: int, s_per_token: float) -> None:
        """A copy rate measured before this process (kept on the machine's disk) as the first
        sample of ``tier``'s median, where none is measured yet: the copies outvote it."""
        if self.promote_s_per_token[tier] is None:
            self.promote_s_per_token[tier] = self._copy_samples[tier].add(s_per_token)

    def _note_copy_rate(self, move: Move, tokens: int, seconds: float) -> None:
        """Seconds per token of promotions from the source tier (the copy's own time), the
        median of the recent copies (``cluster.estimators``): what ``ready`` weighs a promotion
        against recomputing. Set in place: the scheduler's time slicer reads the same list."""
        tier = max(move.src_tiers)
        self.promote_s_per_token[tier] = self._copy_samples[tier].add(seconds / tokens)
