"""KVLease: one request's hold on the KV cache, from admission to commit.

The engine never sees a tree node, a pool or an extent: it asks the cache
for a lease on a prompt (``TieredCache.admit``) and gets back an opaque
object that knows which prefix it holds and where its own new KV goes::

    prompt    |<------------- cached_tokens ------------->|<--- computed by the request --->|
    KV        |  prefix: tree nodes, locked, HOT          |  own extents, private to lease  |
              |  (promoted from WARM/COLD when admitted)  |  appended step by step (CoW)    |
                                                          ^ length grows with append()

A lease ends exactly once: ``commit`` inserts the sequence into the tree
(so the next turn finds it) and unlocks the prefix; ``release`` frees the
private KV and unlocks.

Every method runs on the cache's owner thread (the worker's engine thread).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Hashable, Sequence

import torch

from cluster.cache.allocator import Extent
from cluster.errors import CacheError
from cluster.names import HOT

if TYPE_CHECKING:
    from cluster.cache.radix_tree import TreeNode
    from cluster.cache.tiered import TieredCache


class LeaseClosedError(CacheError):
    """A lease was used after ``commit`` or ``release`` ended it."""


class KVLease:
    """What ``TieredCache.admit`` hands out; see the module docstring.

    Fields a caller reads:

    - ``cached_tokens``: prompt tokens whose KV came from the cache;
    - ``tier_hits``: how many of them were HOT, WARM and COLD before admission
      (WARM/COLD parts were promoted to HOT before ``admit`` returned);
    - ``promoted_tokens``, ``waited_s``: what admission moved, and how long it
      waited for copies already in flight;
    - ``held_by_tier``: what HOT, WARM and COLD held of the prefix it could use
      (``missed_by_tier``: the part of that it did not get, and so recomputes);
    - ``length``: tokens whose KV the lease holds (prefix + appended).
    """

    __slots__ = ("cache", "namespace", "cached_tokens", "tier_hits", "promoted_tokens", "waited_s",
                 "held_by_tier", "length", "_base", "_node", "_prefix", "_own", "_reserved", "_open")

    def __init__(self, cache: "TieredCache", namespace: Hashable, node: "TreeNode", prefix: list[Extent],
                 cached_tokens: int, tier_hits: tuple[int, int, int], promoted_tokens: int, waited_s: float,
                 held_by_tier: tuple[int, int, int] | None = None):
        self.cache = cache
        self.held_by_tier = held_by_tier if held_by_tier is not None else tier_hits
        self.namespace = namespace
        self.cached_tokens = cached_tokens
        self.tier_hits = tier_hits
        self.promoted_tokens = promoted_tokens
        self.waited_s = waited_s
        self.length = cached_tokens
        self._base = cached_tokens   # tokens in the tree under the locked node (grows with ``checkpoint``)
        self._node = node            # locked until the lease ends
        self._prefix = prefix        # HOT extents of tokens[:_base]
        self._own: list[Extent] = []   # this request's KV after the prefix, not in the tree yet
        self._reserved: list[Extent] | None = None   # room taken by ``reserve``, not yet written
        self._open = True

    @property
    def missed_by_tier(self) -> tuple[int, int, int]:
        """Tokens the tiers held for this lease beyond its cached prefix, by the tier
        that held them: what the request recomputes although it was cached."""
        out, start = [], 0
        for held in self.held_by_tier:
            end = start + held
            out.append(max(0, end - max(start, self.cached_tokens)))
            start = end
        return out[0], out[1], out[2]

    @property
    def open(self) -> bool:
        return self._open

    @property
    def uncommitted(self) -> int:
        """Tokens of KV the lease holds that are not in the tree yet."""
        return self.length - self._base

    def _check(self, what: str) -> None:
        self.cache._check_owner(f"KVLease.{what}")
        if not self._open:
            raise LeaseClosedError(f"KVLease.{what} on a lease that already ended")

    # ------------------------------------------------------------- reading
    def read_prefix_into(self, out: torch.Tensor) -> None:
        """Copy the cached prefix's KV into ``out`` ``[layers, 2, cached_tokens, heads, dim]``."""
        self._check("read_prefix_into")
        if self.cached_tokens:
            self.cache.hot.read_into(self._prefix, out)

    @property
    def prefix_extents(self) -> tuple[Extent, ...]:
        """Where in HOT the cached prefix's KV lies (what ``read_prefix_into`` copies): the
        prefix stays locked, so those slots keep these bytes for as long as the lease is open."""
        return tuple(self._prefix)

    def read(self) -> torch.Tensor:
        """All the KV the lease holds, ``[layers, 2, length, heads, dim]`` (a copy)."""
        self._check("read")
        return self.cache.hot.read(self._prefix + self._own)

    # ------------------------------------------------------------- writing
    def append(self, kv: torch.Tensor) -> None:
        """Store the KV of the next ``kv.shape[2]`` tokens. The tail of the
        request's own KV grows in place when its block has room behind it,
        and is copied out first when that block is shared (copy-on-write).
        Raises ``PoolExhaustedError`` (nothing changed) when HOT has no room
        even after demoting what it can."""
        self._check("append")
        self.cache.hot.write(self._grow(kv.shape[2]), kv)

    def reserve(self, num_tokens: int) -> None:
        """Take HOT room for the next ``num_tokens`` tokens now, to be filled by
        ``write`` (a scheduler reserves before the forward, so nothing computed
        is ever thrown away for lack of room). Raises ``PoolExhaustedError``
        with nothing changed when HOT cannot make the room by demoting or
        evicting unlocked prefixes."""
        self._check("reserve")
        if self._reserved is not None:
            raise CacheError("KVLease.reserve while an earlier reservation is not written yet")
        before = self.length
        self._reserved = self._grow(num_tokens)
        self.length = before   # ``length`` counts written tokens; the room waits for ``write``

    def write(self, kv: torch.Tensor) -> None:
        """Fill the room ``reserve`` took with the KV of exactly that many tokens."""
        self._check("write")
        room, self._reserved = self._reserved, None
        n = kv.shape[2]
        if room is None or sum(e.length for e in room) != n:
            raise CacheError(f"KVLease.write of {n} tokens does not match the reserved room")
        self.cache.hot.write(room, kv)
        self.length += n

    def extend(self, num_tokens: int) -> None:
        """Room for ``num_tokens`` more tokens without writing them: a cache
        without KV payload (simulations) keeps only the bookkeeping."""
        self._check("extend")
        self._grow(num_tokens)

    def _grow(self, n: int) -> list[Extent]:
        if not self._own:
            ext = self._own = self.cache._allocate_hot(n, self.namespace)   # a prompt's tail may share a block
        else:                                                                # (the namespace: tenant quotas)
            self._own, ext = self.cache._append_hot(self._own, n, self.namespace)
        self.length += n
        return ext

    def checkpoint(self, tokens: Sequence[int]) -> None:
        """Hand what the lease computed so far (``tokens``, ``length`` of them) to
        the tree now, keeping it locked: requests admitted from now on find it
        cached (a burst of prompts sharing a system prompt computes it once).
        The lease goes on appending after it."""
        self._check("checkpoint")
        if self._reserved is not None:
            raise CacheError("KVLease.checkpoint with reserved room not written")
        if len(tokens) != self.length:
            raise CacheError(f"checkpoint of {len(tokens)} tokens on a lease holding KV for {self.length}")
        if not self._own:
            return
        cache = self.cache
        if not cache.tree.insert_keeps_whole(tokens, self.namespace, validate=False):
            # Another request's copy of these tokens is moving between tiers: the tree
            # would keep that one and free ours. Keep ours; the commit inserts it.
            cache.stats["checkpoints_deferred"] += 1
            return
        cache.hot.allocator.seal(self._own[-1])
        # The tree's now (a part another request inserted first is freed, a WARM/COLD
        # copy re-homed onto ours). Watermarks only once it is locked: demoting the
        # new, still unlocked nodes would take the lease's own KV out of HOT.
        cache.tree.insert(tokens, self._own, self.namespace, start=self._base)
        self._own = []
        m = cache.tree.match_prefix(tokens, self.namespace, validate=False)
        if m.length != len(tokens) or any(n.tier != HOT for n in m.nodes):
            raise CacheError("a checkpointed sequence is not whole in HOT")   # checked above: cannot happen
        cache.tree.lock(m.last_node)
        cache._unlock(self._node)
        self._node = m.last_node
        self._prefix = [e for n in m.nodes for e in n.extents]
        self._base = len(tokens)
        cache._enforce_watermarks()

    # ------------------------------------------------------------- ending
    def commit(self, tokens: Sequence[int], session_id: Any = None) -> "TreeNode | None":
        """Insert ``tokens`` (``length`` of them: the sequence this lease holds
        KV for) into the tree, remember the session, unlock; returns the node
        holding the last token (None when nothing was appended)."""
        self._check("commit")
        if self._reserved is not None:
            raise CacheError("KVLease.commit with reserved room not written")
        if len(tokens) != self.length:
            raise CacheError(f"commit of {len(tokens)} tokens on a lease holding KV for {self.length}")
        cache, node = self.cache, None
        try:
            if self._own:
                cache.hot.allocator.seal(self._own[-1])   # no later slots in a block about to enter the tree
                node = cache._insert(tokens, self._own, self.namespace, start=self._base).node
                if cache.l3 is not None:   # behind the request, while the sequence is still locked
                    cache.l3.write_behind(tokens, self.namespace)
            if session_id is not None:
                cache._note_session(session_id, tokens, self.namespace)
        finally:
            self._own = []
            self._end()
        return node

    def release(self) -> None:
        """End without caching: free the private KV, unlock the prefix. Safe
        to call on a lease that already ended (it does nothing then)."""
        if not self._open:
            return
        self.cache._check_owner("KVLease.release")
        try:
            if self._own:
                self.cache.hot.allocator.free(self._own)
        finally:
            self._own, self._reserved = [], None
            self._end()

    def _end(self) -> None:
        self._open = False
        self.cache._unlock(self._node)
        self._node = None
        self._prefix = []

    def __repr__(self) -> str:
        state = "open" if self._open else "ended"
        return f"KVLease({state}, cached={self.cached_tokens}, length={self.length})"
