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

The lease talks to the cache through ``LeaseHost``, a small interface the
cache implements (room in HOT, the tree's insert and checkpoint, unlock); it
never reaches into the tree or the allocator itself. What it gives the engine
is its slot table (``slots``): the HOT pool slot of every position it holds,
prefix, own KV and reserved room, which attention reads and writes in place.

Every method runs on the cache's owner thread (the worker's engine thread).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Hashable, Protocol, Sequence

import torch

from cluster.cache.allocator import Extent
from cluster.errors import CacheError

if TYPE_CHECKING:
    from cluster.cache.kv_pool import KVPool
    from cluster.cache.radix_tree import TreeNode


class LeaseHost(Protocol):
    """What a lease asks of the cache that issued it (``TieredCache`` implements it)."""

    @property
    def hot(self) -> "KVPool": ...

    def check_owner(self, what: str) -> None: ...

    def lease_allocate(self, num_tokens: int, tenant: Hashable) -> list[Extent]: ...

    def lease_append(self, own: list[Extent], num_tokens: int,
                     tenant: Hashable) -> tuple[list[Extent], list[Extent]]: ...

    def lease_free(self, own: list[Extent], tenant: Hashable) -> None: ...

    def lease_checkpoint(self, tokens: Sequence[int], own: list[Extent], namespace: Hashable, start: int,
                         node: "TreeNode") -> "tuple[TreeNode, list[Extent]] | None": ...

    def lease_commit(self, tokens: Sequence[int], own: list[Extent], namespace: Hashable, start: int,
                     session_id: Any) -> "TreeNode | None": ...

    def lease_unlock(self, node: "TreeNode") -> None: ...


def extent_slots(extents: Sequence[Extent], block_tokens: int) -> list[int]:
    """The pool slot (``block * block_tokens + offset``) of every token of ``extents``."""
    out: list[int] = []
    for b, off, length in extents:
        first = b * block_tokens + off
        out.extend(range(first, first + length))
    return out


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
    - ``length``: tokens whose KV the lease holds (prefix + appended);
    - ``slots``: where in HOT each of them lies, and the reserved room after them.
    """

    __slots__ = ("host", "namespace", "cached_tokens", "tier_hits", "promoted_tokens", "waited_s",
                 "held_by_tier", "length", "_base", "_node", "_prefix", "_own", "_reserved", "_open",
                 "_table", "_table_len", "_own_at")

    def __init__(self, host: LeaseHost, namespace: Hashable, node: "TreeNode", prefix: list[Extent],
                 cached_tokens: int, tier_hits: tuple[int, int, int], promoted_tokens: int, waited_s: float,
                 held_by_tier: tuple[int, int, int] | None = None):
        self.host = host
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
        # The slot table: int64 slots of the prefix, the own KV and the reserved room, in
        # position order; grown in place as the lease grows (``_own_at``: where own KV starts).
        self._table = torch.empty(0, dtype=torch.long)
        self._table_len = 0
        self._own_at = 0
        self._put_slots(0, extent_slots(prefix, host.hot.block_tokens))

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

    @property
    def reserved_tokens(self) -> int:
        return 0 if self._reserved is None else sum(e.length for e in self._reserved)

    def _check(self, what: str) -> None:
        self.host.check_owner(f"KVLease.{what}")
        if not self._open:
            raise LeaseClosedError(f"KVLease.{what} on a lease that already ended")

    # ------------------------------------------------------------- the slot table
    def slots(self) -> torch.Tensor:
        """The HOT pool slot (``block * block_tokens + offset``, int64, on the CPU) of each
        position the lease holds, and then of its reserved room: what attention reads the
        past through and writes the new tokens' KV to (``KVPool.tensor`` viewed as
        ``[blocks * block_tokens]`` per layer). Valid until the lease next changes; the
        slots of the locked prefix and of the lease's own KV keep their bytes meanwhile."""
        self._check("slots")
        return self._table[:self._table_len]

    def _put_slots(self, at: int, slots: list[int]) -> None:
        end = at + len(slots)
        if end > self._table.numel():
            grown = torch.empty(max(end, 2 * self._table.numel(), 64), dtype=torch.long)
            grown[:self._table_len] = self._table[:self._table_len]
            self._table = grown
        if slots:
            self._table[at:end] = torch.tensor(slots, dtype=torch.long)
        self._table_len = end

    # ------------------------------------------------------------- reading
    def read(self) -> torch.Tensor:
        """All the KV the lease holds, ``[layers, 2, length, heads, dim]`` (a copy)."""
        self._check("read")
        return self.host.hot.read(self._prefix + self._own)[:, :, :self.length]   # not the reserved room

    # ------------------------------------------------------------- writing
    def append(self, kv: torch.Tensor) -> None:
        """Store the KV of the next ``kv.shape[2]`` tokens. The tail of the
        request's own KV grows in place when its block has room behind it,
        and is copied out first when that block is shared (copy-on-write).
        Raises ``PoolExhaustedError`` (nothing changed) when HOT has no room
        even after demoting what it can."""
        self._check("append")
        if self._reserved is not None:
            raise CacheError("KVLease.append while reserved room is not written yet")
        self.host.hot.write(self._grow(kv.shape[2]), kv)

    def reserve(self, num_tokens: int) -> None:
        """Take HOT room for the next ``num_tokens`` tokens now (their slots end the slot
        table), to be filled in place by the forward and confirmed with ``written``, or
        filled with ``write`` (a scheduler reserves before the forward, so nothing computed
        is ever thrown away for lack of room). Raises ``PoolExhaustedError`` with nothing
        changed when HOT cannot make the room by demoting or evicting unlocked prefixes."""
        self._check("reserve")
        if self._reserved is not None:
            raise CacheError("KVLease.reserve while an earlier reservation is not written yet")
        before = self.length
        self._reserved = self._grow(num_tokens)
        self.length = before   # ``length`` counts written tokens; the room waits for ``written``

    def written(self, num_tokens: int) -> None:
        """The forward wrote the KV of the reserved room's ``num_tokens`` tokens in place."""
        self._check("written")
        if self._reserved is None or self.reserved_tokens != num_tokens:
            raise CacheError(f"KVLease.written of {num_tokens} tokens does not match the reserved room "
                             f"of {self.reserved_tokens}")
        self._reserved = None
        self.length += num_tokens

    def write(self, kv: torch.Tensor) -> None:
        """Fill the room ``reserve`` took with the KV of exactly that many tokens."""
        self._check("write")
        room = self._reserved
        if room is None or sum(e.length for e in room) != kv.shape[2]:
            raise CacheError(f"KVLease.write of {kv.shape[2]} tokens does not match the reserved room")
        self.host.hot.write(room, kv)
        self.written(kv.shape[2])

    def extend(self, num_tokens: int) -> None:
        """Room for ``num_tokens`` more tokens without writing them: a cache
        without KV payload (simulations) keeps only the bookkeeping."""
        self._check("extend")
        self._grow(num_tokens)

    def _grow(self, n: int) -> list[Extent]:
        bt = self.host.hot.block_tokens
        if not self._own:
            self._own_at = self.length
            ext = self._own = self.host.lease_allocate(n, self.namespace)   # a prompt's tail may share a block as a slot
            self._put_slots(self._own_at, extent_slots(ext, bt))
        else:
            kept, tail = len(self._own) - 1, self._own[-1]
            self._own, ext = self.host.lease_append(self._own, n, self.namespace)
            now = self._own[kept]
            if (now.block_id, now.offset) != (tail.block_id, tail.offset):
                # copy-on-write moved the shared tail: its positions' slots change too
                self._put_slots(self._own_at, extent_slots(self._own, bt))
            else:
                self._put_slots(self.length, extent_slots(ext, bt))
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
        done = self.host.lease_checkpoint(tokens, self._own, self.namespace, self._base, self._node)
        if done is None:   # deferred: the commit inserts it
            return
        self._node, self._prefix = done
        self._own = []
        self._base = self._own_at = len(tokens)
        self._put_slots(0, extent_slots(self._prefix, self.host.hot.block_tokens))   # the tree's slots now

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
        try:
            return self.host.lease_commit(tokens, self._own, self.namespace, self._base, session_id)
        finally:
            self._own = []
            self._end()

    def release(self) -> None:
        """End without caching: free the private KV, unlock the prefix. Safe
        to call on a lease that already ended (it does nothing then)."""
        if not self._open:
            return
        self.host.check_owner("KVLease.release")
        try:
            if self._own:
                self.host.lease_free(self._own, self.namespace)
        finally:
            self._own, self._reserved = [], None
            self._end()

    def _end(self) -> None:
        self._open = False
        self.host.lease_unlock(self._node)
        self._node = None
        self._prefix = []
        self._table_len = 0

    def __repr__(self) -> str:
        state = "open" if self._open else "ended"
        return f"KVLease({state}, cached={self.cached_tokens}, length={self.length})"
