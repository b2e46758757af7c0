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
- ``occupied``: a bitmask of the live token slots. The free run behind an
  extent, or around a freed one, is a couple of integer operations on it, so
  growing a sequence and coalescing freed slots never walk the block.
- ``live``: offset -> (length, owner) of each live extent, so a double free is
  detected, overlaps can be checked, and compaction can tell the owner (a
  tree node) where its KV moved. A block held whole by one extent stores
  that ``(length, owner)`` pair itself instead of a one-entry dict: a long
  prompt takes hundreds of whole blocks, and building a dict for each was
  the largest single cost of allocating them (``extents_at`` gives every
  block's table as a dict).

Every free run of an open partial block is indexed by its length (one bucket
per length, plus a bitmask of non-empty buckets): a slot takes the shortest
run that fits, anywhere in the pool (best fit), in O(1); a freed slot merges
with its neighbours and is a run the next short span can take, so holes do
not pile up between compactions. The free list is a LIFO stack: O(1)
allocate and free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple

from cluster.cache.allocator_checks import check_allocator, deep_sizeof
from cluster.errors import InvalidInputError, PoolExhaustedError

ALLOC_MODES = ("slotted", "flat", "token")


_new_tuple = tuple.__new__  # builds an Extent without NamedTuple's keyword-handling __new__ (hot loops)


def _entry(table: dict[int, tuple[int, Any]] | tuple[int, Any] | None, off: int) -> tuple[int, Any] | None:
    """The (length, owner) at ``off`` in a block's table: a dict, the pair of a
    block held whole, or None (free). Inlined as one expression in the hot paths."""
    return table.get(off) if type(table) is dict else (None if off else table)


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
        n, bt = config.num_blocks, config.block_tokens
        self.num_blocks, self.block_tokens = n, bt
        self.slotted = config.mode == "slotted"
        self._full_mask = (1 << bt) - 1
        self.refcount = [0] * n
        self.used = [0] * n
        self.occupied = [0] * n  # bit i set <=> token slot i of the block is live
        # None for a free block: a dict per block only while it is in use keeps
        # the garbage collector's work proportional to what is cached; a block
        # held whole by one extent holds that extent's (length, owner) itself.
        self.live: list[dict[int, tuple[int, Any]] | tuple[int, Any] | None] = [None] * n
        # Blocks that accept slots of others; their free runs are indexed by
        # length (1 .. block_tokens-1), key ``block * block_tokens + start``.
        self._open = [False] * n
        self._gaps: list[dict[int, None]] = [{} for _ in range(bt)]
        self._gap_mask = 0  # bit L set <=> some open block has a free run of length L
        # Reverse order so that block 0 is handed out first (readable tests).
        self._free: list[int] = list(range(n - 1, -1, -1))
        # Block b's whole-block extent, built the first time it is handed out and
        # reused after (extents are immutable): a long span allocates no tuples.
        self._whole: list[Extent | None] = [None] * n
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
        entry = _entry(self.live[b], off) if type(b) is int and 0 <= b < self.num_blocks else None
        if entry is None or entry[0] != length:
            entry = self._lookup(extent)
        return entry[1]

    def extents_at(self, block_id: int) -> dict[int, tuple[int, Any]]:
        """offset -> (length, owner) of the live extents on a block (a new dict
        for a block held whole by one extent; empty for a free block)."""
        t = self.live[block_id]
        return t if type(t) is dict else ({} if t is None else {0: t})

    def free_runs(self, block_id: int) -> list[tuple[int, int]]:
        """Free runs ``(start, length)`` of a block, in order."""
        return _free_runs(self.occupied[block_id], self._full_mask)

    def largest_gap(self, block_id: int) -> int:
        return max((length for _, length in self.free_runs(block_id)), default=0)

    # --------------------------------------------------------------- allocation
    def blocks_needed(self, num_tokens: int) -> int:
        full, rest = divmod(num_tokens, self.block_tokens)
        if rest and not (self.slotted and self._find_gap(rest, -1) is not None):
            full += 1
        return full

    def allocate(self, num_tokens: int, owner: Any = None, *, private_tail: bool = False,
                 after: Extent | None = None) -> list[Extent]:
        """Allocate ``num_tokens`` token slots, all or nothing.

        With ``after`` (the last extent of the sequence being continued), the
        free slots right behind it in its block are used first, as a paged
        allocator grows a sequence's own tail block. Then whole blocks for the
        block-sized part; the remainder goes to the best-fitting free run of
        an open block (slotted mode) or to a block of its own. With
        ``private_tail`` the remainder always gets its own block, kept closed
        to others, because the caller will append to it (decode).
        """
        if not isinstance(num_tokens, int) or num_tokens <= 0:
            raise InvalidInputError(f"num_tokens must be a positive integer, got {num_tokens!r}")
        bt, occupied, live = self.block_tokens, self.occupied, self.live
        gb = end = grow = room = 0
        if after is not None:
            gb, end, room = self._room_behind(after)
            grow = room if room < num_tokens else num_tokens
        full, rest = divmod(num_tokens - grow, bt)
        free = self._free
        if full > len(free):
            raise self._exhausted(num_tokens, full)
        slot = -1
        if rest and self.slotted and not private_tail:
            # The grow's own run is not a candidate: it takes that whole run when a rest remains.
            slot = self._take_best_fit(rest, gb * bt + end if grow else -1)
            if slot < 0 and full >= len(free):
                raise self._exhausted(num_tokens, full + 1)
        elif rest and full >= len(free):
            raise self._exhausted(num_tokens, full + 1)
        # Nothing below can fail: the pool has what the request needs.
        refcount, used = self.refcount, self.used
        out = []
        if grow:
            self._grow_into(gb, end, room, grow, owner)
            out.append(_new_tuple(Extent, (gb, end, grow)))
        if full:
            # Whole blocks: no free runs, nothing indexed; set the bookkeeping
            # directly. Each block's table is the one (length, owner) pair they share.
            entry, whole, extents = (bt, owner), self._full_mask, self._whole
            append = out.append
            for _ in range(full):
                b = free.pop()
                live[b] = entry
                refcount[b] = 1
                used[b] = bt
                occupied[b] = whole
                ext = extents[b]
                if ext is None:
                    ext = extents[b] = _new_tuple(Extent, (b, 0, bt))
                append(ext)
        if rest:
            if slot < 0:
                b = free.pop()
                live[b] = {0: (rest, owner)}
                refcount[b] = 1
                used[b] = rest
                occupied[b] = (1 << rest) - 1
                if self.slotted and not private_tail:
                    self._open[b] = True
                    self._add_gap(b * bt + rest, bt - rest)
                out.append(_new_tuple(Extent, (b, 0, rest)))
            else:
                b, start = divmod(slot, bt)
                live[b][start] = (rest, owner)
                occupied[b] |= ((1 << rest) - 1) << start
                refcount[b] += 1
                used[b] += rest
                out.append(_new_tuple(Extent, (b, start, rest)))
        self.used_tokens += num_tokens
        return out

    def _room_behind(self, after: Extent) -> tuple[int, int, int]:
        """``after``'s block, its end offset and the free slots right behind it (checked live)."""
        gb, off, length = after
        t = self.live[gb] if type(gb) is int and 0 <= gb < self.num_blocks else None
        entry = t.get(off) if type(t) is dict else (None if off else t)
        if entry is None or entry[0] != length:
            self._lookup(after)  # raises with the precise message
        end = off + length
        behind = self.occupied[gb] >> end  # the free run behind `after` starts at `end`
        return gb, end, (behind & -behind).bit_length() - 1 if behind else self.block_tokens - end

    def _take_best_fit(self, rest: int, excluded: int) -> int:
        """Best fit: take the shortest indexed free run that holds ``rest`` tokens
        (not the run starting at slot ``excluded``), index what it leaves, and return
        its first slot (-1: none). The bitmask of non-empty lengths makes it O(1)."""
        mask = self._gap_mask >> rest
        if not mask:
            return -1
        gaps = self._gaps
        run = rest + (mask & -mask).bit_length() - 1
        bucket = gaps[run]
        slot, _ = bucket.popitem()  # the newest run of that length
        if slot == excluded:
            bucket[slot] = None
            slot, run = self._find_gap(rest, slot) or (-1, 0)
            if slot < 0:
                return -1
            bucket = gaps[run]
            del bucket[slot]
        if not bucket:
            self._gap_mask ^= 1 << run
        if run > rest:
            gaps[run - rest][slot + rest] = None
            self._gap_mask |= 1 << (run - rest)
        return slot

    def _grow_into(self, gb: int, end: int, room: int, grow: int, owner: Any) -> None:
        """A new extent of ``grow`` tokens at ``end`` in block ``gb``, the front of its free run of ``room``."""
        if self._open[gb]:  # _take_gap, inlined
            gaps, key = self._gaps, gb * self.block_tokens + end
            bucket = gaps[room]
            del bucket[key]
            if not bucket:
                self._gap_mask ^= 1 << room
            if room > grow:
                gaps[room - grow][key + grow] = None
                self._gap_mask |= 1 << (room - grow)
        self.live[gb][end] = (grow, owner)
        self.occupied[gb] |= ((1 << grow) - 1) << end
        self.refcount[gb] += 1
        self.used[gb] += grow

    def try_grow(self, extent: Extent, num_tokens: int) -> Extent | None:
        """Extend ``extent`` in place by up to ``num_tokens`` if it is its block's
        only extent (a private tail); returns the grown extent."""
        b, off, length = extent
        _, owner = self._lookup(extent)
        if self.refcount[b] != 1:
            return None
        room = self.room_after(extent)
        grow = min(num_tokens, room)
        if grow <= 0:
            return None
        end = off + length
        if self._open[b]:
            self._take_gap(b * self.block_tokens + end, room, grow)
        self.live[b][off] = (length + grow, owner)
        self.occupied[b] |= ((1 << grow) - 1) << end
        self.used[b] += grow
        self.used_tokens += grow
        return Extent(b, off, length + grow)

    def room_after(self, extent: Extent) -> int:
        """Free slots directly after ``extent`` in its block."""
        b, off, length = extent
        end = off + length
        behind = self.occupied[b] >> end
        return (behind & -behind).bit_length() - 1 if behind else self.block_tokens - end

    def is_shared(self, extent: Extent) -> bool:
        """True when other extents live on the same block (append must copy first)."""
        return self.refcount[extent.block_id] > 1

    def free(self, extents: Iterable[Extent]) -> None:
        """Free extents. Validates all of them first, so a bad one frees nothing."""
        extents = list(extents)
        live, n = self.live, self.num_blocks
        for e in extents:
            b, off, length = e
            t = live[b] if type(b) is int and 0 <= b < n else None
            entry = t.get(off) if type(t) is dict else (None if off else t)
            if entry is None or entry[0] != length:
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
        refcount, used, occupied, is_open = self.refcount, self.used, self.occupied, self._open
        push = self._free.append
        freed_tokens = 0
        for b, off, length in reversed(extents):
            freed_tokens += length
            if length == bt:  # a whole block: nothing else lives on it
                live[b] = None
                refcount[b] = used[b] = occupied[b] = 0
                is_open[b] = False
                push(b)
                continue
            del live[b][off]
            refcount[b] -= 1
            used[b] -= length
            end = off + length
            occ = occupied[b] = occupied[b] & ~(((1 << length) - 1) << off)
            if refcount[b] == 0:
                if is_open[b]:  # the runs on either side of its last extent were indexed
                    if off:
                        self._drop_gap(b * bt, off)
                    if end < bt:
                        self._drop_gap(b * bt + end, bt - end)
                    is_open[b] = False
                live[b] = None
                push(b)
            elif is_open[b]:
                # Merge the freed slots with the free runs on either side: O(1) with the bitmask.
                lo = (occ & ((1 << off) - 1)).bit_length()
                behind = occ >> end
                hi = end + (behind & -behind).bit_length() - 1 if behind else bt
                base = b * bt
                if lo < off:
                    self._drop_gap(base + lo, off - lo)
                if hi > end:
                    self._drop_gap(base + end, hi - end)
                self._add_gap(base + lo, hi - lo)
            elif self.slotted:
                # The freed slots are room again: in slotted mode others may use them.
                self._set_open(b, True)
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
            t = live[b] if type(b) is int and 0 <= b < n else None
            if type(t) is dict:
                entry = t.get(off)
                if entry is None or entry[0] != length:
                    self._lookup(e)
                t[off] = whole if length == bt else (length, owner)
            elif t is None or off or length != bt:
                self._lookup(e)   # raises: not an extent of this allocator
            else:
                live[b] = whole   # a block held whole: its table is the pair itself

    def set_owner(self, extent: Extent, owner: Any) -> None:
        self._lookup(extent)
        b, off, length = extent
        table = self.live[b]
        if type(table) is dict:
            table[off] = (length, owner)
        else:   # a block held whole: its table is the pair itself
            self.live[b] = (length, owner)

    # -------------------------------------------------------- split and merge
    def split(self, extent: Extent, at: int) -> tuple[Extent, Extent]:
        """Cut an extent in two on the same block: no copy, refcount + 1."""
        b, off, length = extent
        _, owner = self._lookup(extent)
        if not 0 < at < length:
            raise InvalidInputError(f"split point {at} outside (0, {length}) of extent {tuple(extent)}")
        table = self.live[b]
        if type(table) is not dict:   # a block held whole: it gets a table of two extents
            table = self.live[b] = {}
        table[off] = (at, owner)
        table[off + at] = (length - at, owner)
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
        """Whether every length finds a free run of an open block (no fresh block)."""
        rooms = sorted(r for r in range(1, self.block_tokens) for _ in range(len(self._gaps[r])))
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
        entry = _entry(self.live[b], off)
        if entry is None or entry[0] != length:
            raise InvalidInputError(f"extent {tuple(extent)} is not allocated (double free or stale extent?)")
        return entry

    def _exhausted(self, num_tokens: int, needed: int) -> PoolExhaustedError:
        free = len(self._free)
        return PoolExhaustedError(f"pool exhausted: {num_tokens} tokens need {needed} free blocks, {free} left",
                                  needed_blocks=needed, free_blocks=free)

    def _find_gap(self, size: int, exclude: int) -> tuple[int, int] | None:
        """Best fit: the shortest free run that takes ``size`` slots (keeps long
        runs for long slots), as ``(key, length)``. The bitmask of non-empty
        lengths makes it O(1); ``exclude`` is a run already spoken for."""
        mask = self._gap_mask >> size
        while mask:
            low = mask & -mask
            length = size + low.bit_length() - 1
            for key in self._gaps[length]:
                if key != exclude:
                    return key, length
            mask ^= low
        return None

    def _add_gap(self, key: int, length: int) -> None:
        self._gaps[length][key] = None
        self._gap_mask |= 1 << length

    def _drop_gap(self, key: int, length: int) -> None:
        bucket = self._gaps[length]
        del bucket[key]
        if not bucket:
            self._gap_mask &= ~(1 << length)

    def _take_gap(self, key: int, length: int, size: int) -> None:
        """Place ``size`` slots at the start of the indexed run ``key``."""
        self._drop_gap(key, length)
        if length > size:
            self._add_gap(key + size, length - size)

    def _set_open(self, b: int, is_open: bool) -> None:
        if self._open[b] == is_open:
            return
        self._open[b] = is_open
        base = b * self.block_tokens
        for start, length in _free_runs(self.occupied[b], self._full_mask):
            if is_open:
                self._add_gap(base + start, length)
            else:
                self._drop_gap(base + start, length)

    # ------------------------------------------------------------------ sizing
    def metadata_bytes(self, *extra: Any) -> int:
        """Bytes of this allocator's bookkeeping as CPython holds it (``sys.getsizeof``
        of every list, dict, tuple and int it references; owners excluded), plus
        the containers in ``extra`` (e.g. the tree nodes' extent lists)."""
        return deep_sizeof([self.refcount, self.used, self.occupied, self.live,
                            self._open, self._gaps, self._free, self._whole, *extra])

    # --------------------------------------------------------------- invariants
    def check_invariants(self) -> None:
        """Recount every block's table, bitmask and the free-run index (tests):
        ``cluster.cache.allocator_checks``."""
        check_allocator(self)


def _free_runs(occupied: int, full_mask: int) -> list[tuple[int, int]]:
    """Runs ``(start, length)`` of zero bits in ``occupied`` below ``full_mask``."""
    free, runs = ~occupied & full_mask, []
    while free:
        start = (free & -free).bit_length() - 1
        x = free >> start
        length = (~x & (x + 1)).bit_length() - 1  # trailing ones of x
        runs.append((start, length))
        free ^= ((1 << length) - 1) << start
    return runs

