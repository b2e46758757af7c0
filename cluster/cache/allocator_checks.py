"""A ``BlockAllocator``'s checks and its footprint, kept apart from the allocator.

``check_allocator``: recount every block's extent table, refcount, used count and
occupancy bitmask, and the index of free runs (tests call it through
``BlockAllocator.check_invariants``). ``deep_sizeof``: bytes of bookkeeping as
CPython holds it (``BlockAllocator.metadata_bytes``, the fragmentation bench).
"""

from __future__ import annotations

import sys
from typing import Any


def check_allocator(a: Any) -> None:
    """``a``: a ``BlockAllocator`` (not imported: the allocator imports this module)."""
    bt = a.block_tokens
    free = set(a._free)
    assert len(free) == len(a._free), "a block is on the free list twice"
    total_used = 0
    expected_gaps = {}
    for b in range(a.num_blocks):
        live = a.extents_at(b)
        assert (a.live[b] is None) == (b in free), f"block {b}: extent table out of step with the free list"
        assert type(a.live[b]) is not tuple or a.live[b][0] == bt, f"block {b}: a pair table not whole"
        assert a.refcount[b] == len(live), f"block {b}: refcount {a.refcount[b]} != {len(live)} extents"
        assert a.used[b] == sum(ln for ln, _ in live.values()), f"block {b}: used count drifted"
        total_used += a.used[b]
        if b in free:
            assert not live and not a.occupied[b] and not a._open[b], f"free block {b} still in use"
            continue
        assert live, f"block {b} is neither free nor used"
        mask = 0
        for off, (ln, _) in live.items():
            assert off >= 0 and ln > 0 and off + ln <= bt, f"block {b}: extent outside the block"
            bits = ((1 << ln) - 1) << off
            assert not mask & bits, f"block {b}: extents overlap at {off}"
            mask |= bits
        assert a.occupied[b] == mask, f"block {b}: occupancy bitmask stale"
        if a._open[b]:
            for start, length in a.free_runs(b):
                expected_gaps[b * bt + start] = length
    assert total_used == a.used_tokens, "used_tokens drifted"
    indexed = {key: length for length, bucket in enumerate(a._gaps) for key in bucket}
    assert indexed == expected_gaps, "free-run index out of date"
    assert a._gap_mask == sum(1 << r for r, d in enumerate(a._gaps) if d), "run-length mask stale"


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
