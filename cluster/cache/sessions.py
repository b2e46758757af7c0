"""``SessionPrefetch``: predictive swap-in of a returning session (``TieredCache.sessions``).

A committed lease with a session id leaves the session's latest sequence here
(``note``, at most ``max_sessions``, least recently committed forgotten first). A
prefetch of the session (or of given tokens) starts promoting its WARM/COLD path
into HOT before its request arrives, without ever pushing out what a running or
waiting request needs: only into free HOT below the high watermark, after pushing
down only idle prefixes nobody touched since the oldest waiting request arrived
(``waiting_since``, kept current by the engine).

Given the tree, the tier space (room, the pick) and the moves; owner thread only.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Hashable, Sequence

from cluster.cache.cache_stats import CacheStats
from cluster.cache.radix_tree import RadixTree
from cluster.cache.tier_moves import TierMoves
from cluster.cache.tier_space import TierSpace
from cluster.cache.tier_types import TierConfig, UnknownSessionError
from cluster.names import HOT


class SessionPrefetch:
    def __init__(self, tree: RadixTree, space: TierSpace, moves: TierMoves, config: TierConfig,
                 stats: CacheStats):
        self.tree, self.space, self.moves, self.config, self.stats = tree, space, moves, config, stats
        self._sessions: OrderedDict[Any, tuple[Hashable, list[int]]] = OrderedDict()
        # What a session prefetch must not push out: prefixes touched since the oldest waiting
        # request was submitted (the engine keeps it current; None: none waits).
        self.waiting_since: float | None = None

    def __contains__(self, session_id: Any) -> bool:
        return session_id in self._sessions

    def note(self, session_id: Any, tokens: Sequence[int], namespace: Hashable = None) -> None:
        """Remember a session's latest sequence, for predictive swap-in."""
        self._sessions[session_id] = (namespace, list(tokens))
        self._sessions.move_to_end(session_id)
        while len(self._sessions) > self.config.max_sessions:
            self._sessions.popitem(last=False)

    def touch(self, tokens: Sequence[int], namespace: Hashable = None) -> float:
        """Mark the cached prefix of ``tokens`` as used now (a request for it arrived) and
        return that time (the tree's clock): while the request waits, a session prefetch
        does not push it out (``waiting_since``)."""
        now = self.tree.clock()
        self.tree.touch_path(tokens, namespace, now)
        return now

    def prefetch(self, session_id: Any = None, tokens: Sequence[int] | None = None,
                 namespace: Hashable = None) -> int:
        """Start promoting a session's WARM/COLD path; returns the tokens being brought
        up (0 when already HOT, or when no room is found). The caller polled the moves."""
        if tokens is None:
            if session_id not in self._sessions:
                self.stats.prefetch_unknown_session += 1
                raise UnknownSessionError(f"unknown session {session_id!r}: nothing to prefetch")
            namespace, tokens = self._sessions[session_id]
        floor = self.waiting_since if self.waiting_since is not None else float("inf")
        m = self.tree.match_prefix(tokens, namespace)
        cold = [n for n in m.nodes if n.tier != HOT]
        if not cold or any(n.busy for n in cold):
            return 0
        # Into free HOT, below the high watermark, after pushing down only idle prefixes, least
        # recently used first, that no waiting request touched: running requests' are locked, a
        # request's is touched when it is submitted (``touch``), another prefetch's is locked
        # while it copies and the most recently used after (the last an LRU push takes). With
        # many requests waiting at once it finds nothing to push and does nothing.
        alloc = self.space.pools[HOT].allocator
        need = sum(-(-len(n.key) // alloc.block_tokens) for n in cold) + 1
        want = need + (1.0 - self.config.high_watermark) * alloc.num_blocks
        if alloc.free_blocks < want:
            self.tree.lock(m.last_node)   # its own path is not one to push down meanwhile
            try:
                with self.space.acting(namespace):
                    room = self._demote_older(floor, want)
            finally:
                self.tree.unlock(m.last_node)
            if not room:
                self.stats.prefetch_skipped_no_room += 1
                return 0
        self.stats.prefetches += 1
        move = self.moves.start_promotion(cold, background=True, make_room=False)
        return 0 if move is None else sum(len(n.key) for n in cold)

    def _demote_older(self, used_before: float, want_blocks: float) -> bool:
        """Push idle HOT prefixes last used before ``used_before`` down to WARM (LRU first,
        waiting for each copy) until HOT has ``want_blocks`` free; whether it does."""
        alloc, passed_over = self.space.pools[HOT].allocator, []
        try:
            while alloc.free_blocks < want_blocks:
                node = self.space.pick(HOT, leaves_only=False)
                if node is None or node.last_access >= used_before:
                    if node is not None:
                        passed_over.append(node)
                    return False
                move = self.moves.start_demotion(node)
                if move is not None:
                    self.moves.wait(move)
                elif node.alive and node.tier == HOT:   # no room below for it
                    passed_over.append(node)
                    return False
            return True
        finally:
            for node in passed_over:
                self.tree.requeue(node)
