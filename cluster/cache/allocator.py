"""Slotted block allocator: KV extents ``(block_id, offset, length)`` over fixed blocks.

Why slots: a radix tree produces many short nodes (a 5-token branch, the tail
of a prompt). Giving each its own block wastes most of the block (internal
fragmentation); packing them as slots into shared, partially filled blocks
keeps the waste near zero while long spans still get whole blocks, so a
prefix transfers with few descriptors.

Bookkeeping per block (plain lists indexed by block id, cheap in CPython):

- ``refcount``: number of live extents on the block; the block returns to the
  free list when it reaches zero.
- ``used``: tokens covered by live extents.
- ``live``: offset -> (length, owner) of each live extent, so a double free is
  detected, overlaps can be checked, and compaction can tell the owner (a
  tree node) where its KV moved.
- ``gap``: the largest run of free slots in the block. A freed slot is a gap
  that the next short span can take, so holes do not pile up between
  compactions.

Open partial blocks are indexed by their largest gap (one bucket per size,
plus a bitmask of non-empty buckets), so finding a slot is O(1), never a walk
over blocks; placing it behind the block's last extent is O(1), into an inner
gap one pass over that block's extents. The free list is a LIFO stack: O(1)
allocate and free.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple

from cluster.errors import InvalidInputError, PoolExhaustedError

ALLOC_MODES = ("slotted", "flat", "token")


_NONE: dict = {}  # read-only stand-in for a free block's (absent) extent table
_new_tuple = tuple.__new__  # builds an Extent without NamedTuple's keyword-handling __new__ (hot loops)


class Extent(NamedTuple):
    """``length`` tokens of KV at token ``offset`` inside block ``block_id``."""

    block_id: int
    offset: int
    length: int


@dataclass(frozen=True)
class AllocatorConfig:
    num_blocks: int
    block_tokens: int = 16
    mode: str = "slotted"

    def __post_init__(self) -> None:
        if not isinstance(self.num_blocks, int) or self.num_blocks <= 0:
            raise InvalidInputError(f"num_blocks must be a positive integer, got {self.num_blocks!r}")
        if not isinstance(self.block_tokens, int) or self.block_tokens <= 0:
            raise InvalidInputError(f"block_tokens must be a positive integer, got {self.block_tokens!r}")
        if self.mode not in ALLOC_MODES:
            raise InvalidInputError(f"mode must be one of {ALLOC_MODES}, got {self.mode!r}")
        if self.mode == "token" and self.block_tokens != 1:
            raise InvalidInputError("mode 'token' needs block_tokens=1 (one token per block)")

    @classmethod
    def token_granular(cls, num_tokens: int) -> "AllocatorConfig":
        return cls(num_blocks=num_tokens, block_tokens=1, mode="token")


class BlockAllocator:
    """Hands out extents; knows nothing about tensors (see ``KVPool``)."""

    def __init__(self, config: AllocatorConfig):
        self.config = config
        n, self.block_tokens = config.num_blocks, config.block_tokens
        self.num_blocks = n
        self.slotted = config.mode == "slotted"
        self.refcount = [0] * n
        self.used = [0] * n
        self.gap = [self.block_tokens] * n   # largest free run per block
        self.tail = [0] * n                  # end of the last extent: slots go here first
        self.inner_gap = [0] * n             # largest free run below ``tail``
        # None for a free block: a dict per block only while it is in use keeps
        # the garbage collector's work proportional to what is cached.
        self.live: list[dict[int, tuple[int, Any]] | None] = [None] * n
        # Blocks that accept new slots, bucketed by free room (1 .. block_tokens-1).
        self._open = [False] * n
        self._room_buckets: list[dict[int, None]] = [{} for _ in range(self.block_tokens)]
        self._room_mask = 0  # bit r set <=> bucket r is non-empty
        # Reverse order so that block 0 is handed out first (readable tests).
        self._free: list[int] = list(range(n - 1, -1, -1))
        self.used_tokens = 0

    # ------------------------------------------------------------------ queries
    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_tokens

    def free_tokens_estimate(self) -> int:
        """Tokens that can certainly still be allocated (free blocks only)."""
        return len(self._free) * self.block_tokens

    def allocated_slots(self) -> int:
        """Token slots no one else can use: whole blocks, except that the free
        slots of an open block (slotted mode) remain available to others."""
        if self.slotted:
            return sum(self.used[b] if self._open[b] else self.block_tokens
                       for b in range(self.num_blocks) if self.refcount[b])
        return self.used_blocks * self.block_tokens

    def partial_free_tokens(self) -> int:
        """Free slots inside used open blocks (usable by short spans only)."""
        return sum(self.block_tokens - self.used[b] for b in range(self.num_blocks)
                   if self.refcount[b] and self._open[b])

    def internal_fragmentation(self) -> float:
        allocated = self.allocated_slots()
        return 0.0 if allocated == 0 else (allocated - self.used_tokens) / allocated

    def owner_of(self, extent: Extent) -> Any:
        b, off, length = extent
        entry = (self.live[b] or _NONE).get(off) if type(b) is int and 0 <= b < self.num_blocks else None
        if entry is None or entry[0] != length:
            entry = self._lookup(extent)
        return entry[1]

    # --------------------------------------------------------------- allocation
    def blocks_needed(self, num_tokens: int) -> int:
        full, rest = divmod(num_tokens, self.block_tokens)
        if rest and not (self.slotted and self._find_open(rest) is not None):
            full += 1
        return full

    def allocate(self, num_tokens: int, owner: Any = None, *, private_tail: bool = False,
                 after: Extent | None = None) -> list[Extent]:
        """Allocate ``num_tokens`` token slots, all or nothing.

        With ``after`` (the last extent of the sequence being continued), the
        free slots right behind it in its block are used first, as a paged
        allocator grows a sequence's own tail block. Then whole blocks for the
        block-sized part; the remainder goes to a slot in an open partial block
        (slotted mode) or to a block of its own. With ``private_tail`` the
        remainder always gets its own block, kept closed to others, because
        the caller will append to it (decode).
        """
        if not isinstance(num_tokens, int) or num_tokens <= 0:
            raise InvalidInputError(f"num_tokens must be a positive integer, got {num_tokens!r}")
        bt = self.block_tokens
        grow = 0
        if after is not None:
            self._lookup(after)
            grow = min(num_tokens, self.room_after(after))
        full, rest = divmod(num_tokens - grow, bt)
        slot_block = None
        if rest and self.slotted and not private_tail:
            slot_block = self._find_open(rest)
            if grow and slot_block == after[0]:
                slot_block = None  # its room is the one the grow takes
        needed = full + (1 if rest and slot_block is None else 0)
        if needed > len(self._free):
            raise PoolExhaustedError(
                f"pool exhausted: {num_tokens} tokens need {needed} free blocks, {len(self._free)} left",
                needed_blocks=needed, free_blocks=len(self._free))
        out = []
        if grow:
            b, start = after[0], after[1] + after[2]
            self._unbucket(b)
            self.live[b][start] = (grow, owner)
            self.refcount[b] += 1
            self.used[b] += grow
            self.used_tokens += grow
            if start == self.tail[b]:  # behind the last extent: no gap changes but the tail room
                self.tail[b] = end = start + grow
                self.gap[b] = max(self.inner_gap[b], bt - end)
            else:
                self._refresh_gap(b)
            self._bucket(b)
            out.append(Extent(b, start, grow))
        if full:
            # Whole blocks: no gaps, no slot index; set the bookkeeping directly.
            free, live, refcount, used, gap, tail = self._free, self.live, self.refcount, self.used, self.gap, self.tail
            entry = (bt, owner)
            append = out.append
            for _ in range(full):
                b = free.pop()
                live[b] = {0: entry}
                refcount[b] = 1
                used[b] = bt
                gap[b] = 0
                tail[b] = bt
                append(_new_tuple(Extent, (b, 0, bt)))
            self.used_tokens += full * bt
        if rest:
            if slot_block is None:
                b = self._free.pop()
                self._place(b, 0, rest, owner)
                if self.slotted and not private_tail:
                    self._set_open(b, True)
                out.append(Extent(b, 0, rest))
            else:
                out.append(Extent(slot_block, self._place_slot(slot_block, rest, owner), rest))
        return out

    def try_grow(self, extent: Extent, num_tokens: int) -> Extent | None:
        """Extend ``extent`` in place by up to ``num_tokens`` if it is its block's
        only extent (a private tail); returns the grown extent."""
        b, off, length = extent
        self._lookup(extent)
        if self.refcount[b] != 1:
            return None
        grow = min(num_tokens, self.room_after(extent))
        if grow <= 0:
            return None
        self._unbucket(b)
        owner = self.live[b][off][1]
        self.live[b][off] = (length + grow, owner)
        self.used[b] += grow
        self.used_tokens += grow
        self._refresh_gap(b)
        self._bucket(b)
        return Extent(b, off, length + grow)

    def room_after(self, extent: Extent) -> int:
        """Free slots directly after ``extent`` in its block."""
        b, off, length = extent
        end = off + length
        tail = self.tail[b]
        if end >= tail:  # the block's last extent: everything behind it is free
            return self.block_tokens - end
        live = self.live[b]
        if end in live:  # packed: another extent starts right behind it
            return 0
        return min(o for o in live if o > end) - end

    def is_shared(self, extent: Extent) -> bool:
        """True when other extents live on the same block (append must copy first)."""
        return self.refcount[extent.block_id] > 1

    def free(self, extents: Iterable[Extent]) -> None:
        """Free extents. Validates all of them first, so a bad one frees nothing."""
        extents = list(extents)
        live, n = self.live, self.num_blocks
        for e in extents:
            b, off, length = e
            if type(b) is not int or not 0 <= b < n or ((live[b] or _NONE).get(off) or (None,))[0] != length:
                self._lookup(e)  # raises with the precise message
        # Validated above, so two entries at one (block, offset) can only be equal.
        if len(set(extents)) != len(extents):
            seen = set()
            for e in extents:
                if (e[0], e[1]) in seen:
                    raise InvalidInputError(f"extent {tuple(e)} listed twice in one free")
                seen.add((e[0], e[1]))
        # Reverse order: the tail of a sequence goes back first (nano-vllm habit),
        # so the next allocation reuses the hottest blocks.
        bt = self.block_tokens
        refcount, used, tail, inner, gap, is_open = (self.refcount, self.used, self.tail, self.inner_gap,
                                                     self.gap, self._open)
        push = self._free.append
        freed_tokens = 0
        for b, off, length in reversed(extents):
            freed_tokens += length
            if length == bt:  # a whole block: nothing else lives on it
                live[b] = None
                refcount[b] = used[b] = tail[b] = inner[b] = 0
                gap[b] = bt
                is_open[b] = False
                push(b)
                continue
            self._unbucket(b)
            del live[b][off]
            refcount[b] -= 1
            used[b] -= length
            if refcount[b] == 0:
                live[b] = None
                is_open[b] = False
                gap[b] = bt
                tail[b] = inner[b] = 0
                push(b)
            else:
                self._refresh_gap(b)
                # The freed slots are room again: in slotted mode others may use them.
                is_open[b] = is_open[b] or self.slotted
                self._bucket(b)
        self.used_tokens -= freed_tokens

    def seal(self, extent: Extent) -> None:
        """Open a private tail block to slots of others (the owner stopped appending)."""
        self._lookup(extent)
        self.set_open(extent.block_id, True)

    def set_owners(self, extents: Iterable[Extent], owner: Any) -> None:
        """``set_owner`` for many extents (the tree hands whole nodes over)."""
        live, n, bt = self.live, self.num_blocks, self.block_tokens
        whole = (bt, owner)  # one shared entry for every whole-block extent
        for e in extents:
            b, off, length = e
            table = live[b] if type(b) is int and 0 <= b < n else None
            entry = table.get(off) if table is not None else None
            if entry is None or entry[0] != length:
                self._lookup(e)
            table[off] = whole if length == bt else (length, owner)

    def set_owner(self, extent: Extent, owner: Any) -> None:
        b, off, length = extent
        entry = (self.live[b] or _NONE).get(off) if 0 <= b < self.num_blocks else None
        if entry is None or entry[0] != length:
            self._lookup(extent)
        self.live[b][off] = (length, owner)

    # -------------------------------------------------------- split and merge
    def split(self, extent: Extent, at: int) -> tuple[Extent, Extent]:
        """Cut an extent in two on the same block: no copy, refcount + 1."""
        b, off, length = extent
        _, owner = self._lookup(extent)
        if not 0 < at < length:
            raise InvalidInputError(f"split point {at} outside (0, {length}) of extent {tuple(extent)}")
        self.live[b][off] = (at, owner)
        self.live[b][off + at] = (length - at, owner)
        self.refcount[b] += 1
        return Extent(b, off, at), Extent(b, off + at, length - at)

    def try_join(self, first: Extent, second: Extent) -> Extent | None:
        """Join two adjacent extents of one block into one (refcount - 1)."""
        if first.block_id != second.block_id or first.offset + first.length != second.offset:
            return None
        _, owner = self._lookup(first)
        self._lookup(second)
        b = first.block_id
        del self.live[b][second.offset]
        self.live[b][first.offset] = (first.length + second.length, owner)
        self.refcount[b] -= 1
        return Extent(b, first.offset, first.length + second.length)

    # ---------------------------------------------------------------- compaction
    def compaction_candidates(self, limit: int) -> list[int]:
        """Partially used blocks, sparsest first: evacuating them turns scattered
        free slots into whole free blocks for long spans."""
        if not self.slotted:
            return []
        used, refcount, bt = self.used, self.refcount, self.block_tokens
        cands = [b for b in range(self.num_blocks) if refcount[b] and used[b] < bt]
        cands.sort(key=used.__getitem__)
        return cands[:limit]

    def fits_in_open_blocks(self, lengths: list[int]) -> bool:
        """Whether every length finds a slot in an open block (no fresh block)."""
        rooms = sorted(r for r in range(1, self.block_tokens) for _ in range(len(self._room_buckets[r])))
        for length in sorted(lengths, reverse=True):
            i = next((k for k, r in enumerate(rooms) if r >= length), None)
            if i is None:
                return False
            rooms[i] -= length
            rooms.sort()
        return True

    def is_open(self, block_id: int) -> bool:
        return self._open[block_id]

    def set_open(self, block_id: int, is_open: bool) -> None:
        """Open or close a used block to slots of other extents (compaction closes
        the block it evacuates)."""
        if self.refcount[block_id] and self.slotted:
            self._set_open(block_id, is_open)

    # ----------------------------------------------------------------- helpers
    def _lookup(self, extent: Extent) -> tuple[int, Any]:
        try:
            b, off, length = extent
        except (TypeError, ValueError):
            raise InvalidInputError(f"not an extent (block_id, offset, length): {extent!r}") from None
        if not (isinstance(b, int) and 0 <= b < self.num_blocks):
            raise InvalidInputError(f"extent {tuple(extent)}: block_id outside [0, {self.num_blocks})")
        entry = (self.live[b] or _NONE).get(off)
        if entry is None or entry[0] != length:
            raise InvalidInputError(f"extent {tuple(extent)} is not allocated (double free or stale extent?)")
        return entry

    def _place(self, b: int, off: int, length: int, owner: Any) -> None:
        if self.live[b] is None:
            self.live[b] = {}
        self.live[b][off] = (length, owner)
        self.refcount[b] += 1
        self.used[b] += length
        self.used_tokens += length
        self._refresh_gap(b)

    def _gaps(self, b: int) -> list[tuple[int, int]]:
        """Free runs ``(start, length)`` of block ``b``."""
        gaps, cursor = [], 0
        for off in sorted(self.live[b]):
            if off > cursor:
                gaps.append((cursor, off - cursor))
            cursor = off + self.live[b][off][0]
        if cursor < self.block_tokens:
            gaps.append((cursor, self.block_tokens - cursor))
        return gaps

    def _refresh_gap(self, b: int) -> None:
        live, bt = self.live[b], self.block_tokens
        if len(live) == 1:  # the common case: one extent, gaps before and after it
            ((off, (ln, _)),) = live.items()
            self.tail[b], self.inner_gap[b] = off + ln, off
        else:
            gaps = self._gaps(b)
            self.tail[b] = max(o + ln for o, (ln, _) in live.items())
            self.inner_gap[b] = max((g for s0, g in gaps if s0 < self.tail[b]), default=0)
        self.gap[b] = max(self.inner_gap[b], bt - self.tail[b])

    def _place_slot(self, b: int, size: int, owner: Any) -> int:
        """Put a ``size``-token slot into open block ``b``: at the tail when it
        fits (O(1), the common case), else into the best-fitting inner gap."""
        bt = self.block_tokens
        self._unbucket(b)
        start = tail = self.tail[b]
        if bt - tail >= size:
            self.tail[b] = tail + size
            self.gap[b] = max(self.inner_gap[b], bt - tail - size)
        else:
            # One pass over the block's extents: the best-fitting inner gap, and
            # the largest inner gap left is the new inner gap (the tail does not move).
            live = self.live[b]
            best = bt + 1
            second = cursor = 0
            for off in sorted(live):
                g = off - cursor
                if g >= size and g < best:
                    if best <= bt:
                        second = max(second, best)
                    best, start = g, cursor
                elif g > second:
                    second = g
                cursor = off + live[off][0]
            inner = max(second, best - size)
            self.inner_gap[b] = inner
            self.gap[b] = max(inner, bt - tail)
        self.live[b][start] = (size, owner)
        self.refcount[b] += 1
        self.used[b] += size
        self.used_tokens += size
        self._bucket(b)
        return start

    def _find_open(self, size: int) -> int | None:
        # Best fit: the smallest room that takes the slot keeps big rooms for big
        # slots. A bitmask of non-empty buckets makes the search O(1).
        mask = self._room_mask >> size
        if not mask:
            return None
        room = size + (mask & -mask).bit_length() - 1
        return next(iter(self._room_buckets[room]))

    def _set_open(self, b: int, is_open: bool) -> None:
        self._unbucket(b)
        self._open[b] = is_open
        self._bucket(b)

    def _bucket(self, b: int) -> None:
        room = self.gap[b]
        if self._open[b] and 0 < room < self.block_tokens:
            self._room_buckets[room][b] = None
            self._room_mask |= 1 << room

    def _unbucket(self, b: int) -> None:
        # Only open blocks are ever bucketed (``_set_open`` unbuckets before closing).
        if not self._open[b]:
            return
        room = self.gap[b]
        if 0 < room < self.block_tokens:
            bucket = self._room_buckets[room]
            if bucket.pop(b, 0) is None and not bucket:
                self._room_mask &= ~(1 << room)

    # ------------------------------------------------------------------ sizing
    def metadata_bytes(self, *extra: Any) -> int:
        """Bytes of this allocator's bookkeeping as CPython holds it (``sys.getsizeof``
        of every list, dict, tuple and int it references; owners excluded), plus
        the containers in ``extra`` (e.g. the tree nodes' extent lists)."""
        return deep_sizeof([self.refcount, self.used, self.gap, self.tail, self.inner_gap, self.live,
                            self._open, self._room_buckets, self._free, *extra])

    # --------------------------------------------------------------- invariants
    def check_invariants(self) -> None:
        bt = self.block_tokens
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        total_used = 0
        for b in range(self.num_blocks):
            live = self.live[b] or {}
            assert (self.live[b] is None) == (b in free), f"block {b}: extent table out of step with the free list"
            assert self.refcount[b] == len(live), f"block {b}: refcount {self.refcount[b]} != {len(live)} extents"
            assert self.used[b] == sum(ln for ln, _ in live.values()), f"block {b}: used count drifted"
            total_used += self.used[b]
            if b in free:
                assert not live and self.gap[b] == bt and not self._open[b], f"free block {b} still in use"
                continue
            assert live, f"block {b} is neither free nor used"
            spans = sorted((o, o + ln) for o, (ln, _) in live.items())
            for (s0, e0), (s1, _) in zip(spans, spans[1:]):
                assert e0 <= s1, f"block {b}: extents overlap at {s1}"
            assert spans[0][0] >= 0 and spans[-1][1] <= bt, f"block {b}: extent outside the block"
            assert self.gap[b] == max((g for _, g in self._gaps(b)), default=0), f"block {b}: gap stale"
            assert self.tail[b] == spans[-1][1], f"block {b}: tail stale"
            room = self.gap[b]
            in_bucket = 0 < room < bt and b in self._room_buckets[room]
            assert in_bucket == (self._open[b] and 0 < room), f"block {b}: slot index out of date"
        assert total_used == self.used_tokens, "used_tokens drifted"
        assert self._room_mask == sum(1 << r for r, d in enumerate(self._room_buckets) if d), "room mask stale"
        assert sum(len(d) for d in self._room_buckets) == sum(
            1 for b in range(self.num_blocks) if self._open[b] and 0 < self.gap[b] < bt), "stale bucket entry"


def deep_sizeof(roots: list[Any]) -> int:
    """Total ``sys.getsizeof`` of ``roots`` and the lists, dicts, tuples and ints
    they hold, each object once (cached small ints included: they cost a
    pointer, counted in their container)."""
    seen: set[int] = set()
    stack = list(roots)
    total = 0
    while stack:
        obj = stack.pop()
        t = type(obj)
        if id(obj) in seen or not (t in (list, dict, tuple, int) or issubclass(t, tuple)):
            continue
        seen.add(id(obj))
        if t is int:
            if not -5 <= obj <= 256:  # small ints are shared by the whole interpreter
                total += sys.getsizeof(obj)
            continue
        total += sys.getsizeof(obj)
        if t is dict:
            stack.extend(obj.keys())
            stack.extend(obj.values())
        else:
            stack.extend(obj)
    return total
