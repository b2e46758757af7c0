"""The directory's global index: which worker holds which block, at which tier.

Fed by the workers' KV event batches (``cluster.routing.events``), queried by
the routing policies with a request's block-hash chain.

Two maps are kept in step: ``hash -> [hot, warm, cold]`` worker bitmasks
answers a match by walking the chain once (each worker owns one bit while it
is registered), and ``worker -> {hash: tier}`` drops a dead worker or loads
its snapshot without a scan of the whole index. With bitmasks, a match costs
a few integer operations per block however many workers hold it, and per
worker work happens only where holders drop out or change tier.

L3, the cluster-wide store, is kept apart: ``l3_blocks(hashes)`` is how many
leading blocks of a chain some worker wrote there (events of tier ``L3``).
Those entries belong to no worker and stay when the writer is dropped: the
store outlives it. A fetch that finds a block missing (evicted from L3)
removes it. The set is bounded (oldest forgotten first); a directory that
restarts starts it empty and relearns it from the next writes.

Sequence numbers: a worker's batches must arrive as 1, 2, 3, ... A batch that
skips ahead is a *gap* (something was lost); it is not applied and the worker
must be reloaded from a snapshot. A batch at or below the last applied one is
a *duplicate* (a retry) and is ignored. A worker re-registering (a restarted
process) starts over from sequence 0 with no entries.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import compress
from typing import Iterable, NamedTuple, Sequence

from cluster.cache.radix_tree import COLD, HOT
from cluster.errors import InvalidInputError
from cluster.names import L3
from cluster.routing.events import EventBatch, MalformedBatchError

_U64 = 1 << 64
_DIGITS = bytes.maketrans(b"01", b"\x00\x01")
_new_tuple = tuple.__new__   # builds a PrefixHit without NamedTuple's Python-level __new__


class PrefixHit(NamedTuple):
    """Consecutive leading blocks of a chain one worker holds, split by tier
    (tiers are monotone along a path: HOT blocks come first, then WARM, COLD).
    A tuple: cheap to build for every worker on every match, and hashable."""
    hot: int = 0
    warm: int = 0
    cold: int = 0

    @property
    def blocks(self) -> int:
        return self.hot + self.warm + self.cold


NO_HIT = PrefixHit()


class _WorkerView:
    __slots__ = ("last_seq", "entries", "needs_snapshot", "bit")

    def __init__(self, bit: int) -> None:
        self.last_seq = 0
        self.entries: dict[int, int] = {}
        self.needs_snapshot = False
        self.bit = bit


class GlobalIndex:
    _MASK_CACHE = 4096   # distinct holder sets remembered by ``workers_of``

    def __init__(self, max_l3_entries: int = 1 << 22) -> None:
        self._holders: dict[int, list[int]] = {}     # hash -> [hot, warm, cold] worker bitmasks
        self._workers: dict[str, _WorkerView] = {}
        self._by_bit: list[str | None] = []          # bit -> worker id (None: free)
        self._ids_of_mask: dict[int, list[str]] = {}
        self.version = 0   # changes whenever a worker's bit is assigned or freed
        self._l3: OrderedDict[int, None] = OrderedDict()   # block hashes L3 holds (as last heard)
        self.max_l3_entries = max_l3_entries
        self.stats = {"batches": 0, "events": 0, "hashes": 0, "gaps": 0, "duplicates": 0, "resyncs": 0,
                      "unknown_worker": 0, "malformed": 0, "snapshots": 0, "stale_snapshots": 0,
                      "matches": 0, "l3_stored": 0, "l3_removed": 0}
        self.last_error: str | None = None

    # ------------------------------------------------------------ membership
    @property
    def workers(self) -> list[str]:
        return list(self._workers)

    @property
    def num_hashes(self) -> int:
        return len(self._holders)

    def num_entries(self, worker_id: str) -> int:
        view = self._workers.get(worker_id)
        return 0 if view is None else len(view.entries)

    def entries(self, worker_id: str) -> dict[int, int]:
        """A copy of what the index believes ``worker_id`` holds: ``{hash: tier}``."""
        return dict(self._workers[worker_id].entries)

    def needs_snapshot(self, worker_id: str) -> bool:
        view = self._workers.get(worker_id)
        return view is not None and view.needs_snapshot

    def last_seq(self, worker_id: str) -> int:
        return self._workers[worker_id].last_seq

    def bit_of(self, worker_id: str) -> int | None:
        """The worker's bit in the holder masks (``1 << k``), None if unregistered."""
        view = self._workers.get(worker_id)
        return None if view is None else 1 << view.bit

    def workers_of(self, mask: int) -> list[str]:
        """The worker ids of a holder mask, in bit order (cached: the same holder
        sets come back on every request that shares a prefix). Do not mutate."""
        ids = self._ids_of_mask.get(mask)
        if ids is None:
            # The mask's binary digits, lowest bit first, as 0/1 bytes: compress()
            # picks the ids in C however many bits are set.
            ids = list(compress(self._by_bit, format(mask, "b")[::-1].encode().translate(_DIGITS)))
            if len(self._ids_of_mask) >= self._MASK_CACHE:
                self._ids_of_mask.clear()
            self._ids_of_mask[mask] = ids
        return ids

    def register_worker(self, worker_id: str) -> None:
        if not isinstance(worker_id, str) or not worker_id:
            raise InvalidInputError(f"worker_id must be a non-empty string, got {worker_id!r}")
        if worker_id in self._workers:
            self.drop_worker(worker_id)
        by_bit = self._by_bit
        bit = next((k for k, w in enumerate(by_bit) if w is None), len(by_bit))
        if bit == len(by_bit):
            by_bit.append(None)
        by_bit[bit] = worker_id
        self._workers[worker_id] = _WorkerView(bit)
        self._bits_changed()

    def drop_worker(self, worker_id: str) -> int:
        """Forget a worker and everything it held; returns the entries removed."""
        view = self._workers.pop(worker_id, None)
        if view is None:
            return 0
        self._remove_all(view)
        self._by_bit[view.bit] = None
        self._bits_changed()
        return len(view.entries)

    def _bits_changed(self) -> None:
        self._ids_of_mask.clear()
        self.version += 1

    def _remove_all(self, view: _WorkerView) -> None:
        holders, keep = self._holders, ~(1 << view.bit)
        for h, tier in view.entries.items():
            m = holders[h]
            m[tier] &= keep
            if not (m[0] or m[1] or m[2]):
                del holders[h]

    # --------------------------------------------------------------- updates
    def apply(self, batch: EventBatch) -> str:
        """Apply one batch: "ok", "gap", "duplicate", "unknown_worker" or "resync".

        On "gap" and "resync" the caller fetches the worker's ``snapshot()`` and
        hands it to ``load_snapshot``; until then the worker's last known
        entries stay (stale but mostly right, better than nothing for routing).
        """
        view = self._workers.get(batch.worker_id)
        if view is None:
            self.stats["unknown_worker"] += 1
            return "unknown_worker"
        if batch.seq <= view.last_seq:
            self.stats["duplicates"] += 1
            return "duplicate"
        if batch.resync:
            view.last_seq = batch.seq
            view.needs_snapshot = True
            self.stats["resyncs"] += 1
            return "resync"
        if batch.seq != view.last_seq + 1:
            view.needs_snapshot = True
            self.stats["gaps"] += 1
            return "gap"
        view.last_seq = batch.seq
        self.stats["batches"] += 1
        holders, entries = self._holders, view.entries
        bit = 1 << view.bit
        keep = ~bit
        nhashes = 0
        for ev in batch.events:
            nhashes += len(ev.hashes)
            if ev.tier == L3:
                self.note_l3(ev.kind, ev.hashes)
            elif ev.kind == "removed":
                for h in ev.hashes:
                    old = entries.pop(h, None)
                    if old is not None:
                        m = holders[h]
                        m[old] &= keep
                        if not (m[0] or m[1] or m[2]):
                            del holders[h]
            else:  # "stored" and "tier" both set the block's tier
                tier = ev.tier
                for h in ev.hashes:
                    old = entries.get(h)
                    if old == tier:
                        continue
                    entries[h] = tier
                    m = holders.get(h)
                    if m is None:
                        m = holders[h] = [0, 0, 0]
                    elif old is not None:
                        m[old] &= keep
                    m[tier] |= bit
        self.stats["events"] += len(batch.events)
        self.stats["hashes"] += nhashes
        return "ok"

    # -------------------------------------------------------------------- L3
    def note_l3(self, kind: str, hashes: list[int]) -> None:
        """Blocks ``stored`` in L3 or found ``removed`` from it (what L3 events carry)."""
        l3 = self._l3
        if kind == "removed":
            for h in hashes:
                l3.pop(h, None)
            self.stats["l3_removed"] += len(hashes)
            return
        for h in hashes:
            l3[h] = None
            l3.move_to_end(h)
        while len(l3) > self.max_l3_entries:
            l3.popitem(last=False)
        self.stats["l3_stored"] += len(hashes)

    def l3_blocks(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` L3 holds."""
        l3 = self._l3
        n = 0
        for h in hashes:
            if h not in l3:
                break
            n += 1
        return n

    @property
    def num_l3(self) -> int:
        return len(self._l3)

    def l3_entries(self) -> list[int]:
        return list(self._l3)

    def load_l3(self, hashes: Iterable[int]) -> None:
        """Replace the L3 entries (a table copy loading the directory's state)."""
        self._l3 = OrderedDict.fromkeys(hashes)

    def apply_encoded(self, data: bytes) -> str:
        """Decode and apply; "malformed" (counted, message in ``last_error``) for bad bytes."""
        try:
            batch = EventBatch.decode(data)
        except MalformedBatchError as exc:
            self.stats["malformed"] += 1
            self.last_error = str(exc)
            return "malformed"
        return self.apply(batch)

    def load_snapshot(self, worker_id: str, seq: int, entries: dict[int, int]) -> str:
        """Replace a worker's entries by its snapshot taken as of batch ``seq``.

        Returns "ok", "unknown_worker", or "stale" when batches after ``seq``
        were applied already (the snapshot would roll them back: ask again).
        """
        view = self._workers.get(worker_id)
        if view is None:
            self.stats["unknown_worker"] += 1
            return "unknown_worker"
        if type(seq) is not int or seq < 0:
            raise InvalidInputError(f"snapshot seq must be a non-negative integer, got {seq!r}")
        if seq < view.last_seq:
            self.stats["stale_snapshots"] += 1
            return "stale"
        for h, tier in entries.items():
            if type(h) is not int or not 0 <= h < _U64 or type(tier) is not int or not HOT <= tier <= COLD:
                raise InvalidInputError(f"snapshot entry {h!r}: {tier!r} is not (uint64 hash, tier 0..2)")
        self._remove_all(view)
        view.entries = dict(entries)
        view.last_seq = seq
        view.needs_snapshot = False
        holders, bit = self._holders, 1 << view.bit
        for h, tier in view.entries.items():
            m = holders.get(h)
            if m is None:
                m = holders[h] = [0, 0, 0]
            m[tier] |= bit
        self.stats["snapshots"] += 1
        return "ok"

    # ----------------------------------------------------------------- match
    def match(self, hashes: Sequence[int]) -> dict[str, PrefixHit]:
        """Per worker, the consecutive leading blocks of ``hashes`` it holds, by tier.

        Workers holding no leading block are absent.
        """
        return {w: hit for hit, workers in self.match_cohorts(hashes) for w in workers}

    def match_cohorts(self, hashes: Sequence[int]) -> list[tuple[PrefixHit, list[str]]]:
        """``match`` grouped: each distinct hit with the workers that have it."""
        workers_of = self.workers_of
        return [(hit, workers_of(mask)) for hit, mask in self.match_masks(hashes)]

    def match_masks(self, hashes: Sequence[int]) -> list[tuple[PrefixHit, int]]:
        """``match_cohorts`` with each cohort as a bitmask of workers (``bit_of``).

        The chain is walked once. Workers are handled in cohorts that have
        held the same blocks at the same tiers so far; a cohort is split only
        where the holder masks change (workers drop out or change tier), so a
        long prefix held by every worker costs one dict lookup and one
        comparison of three integers per block, and the answer has few
        entries to price.
        """
        self.stats["matches"] += 1
        holders = self._holders
        n = len(hashes)
        prev = holders.get(hashes[0]) if n else None
        if prev is None:
            return []
        new_hit = _new_tuple
        active = [(m, tier, [0, 0, 0]) for tier, m in enumerate(prev) if m]   # (workers, tier, counts)
        done: list[tuple[PrefixHit, int]] = []
        run_start, i = 0, 1
        while i < n:
            cur = holders.get(hashes[i])
            if cur is None:
                break
            if cur != prev:
                moved = []
                c0, c1, c2 = cur
                for ws, tier, counts in active:
                    counts[tier] += i - run_start
                    gone = ws & ~(c0 | c1 | c2)
                    if gone:
                        done.append((new_hit(PrefixHit, counts), gone))
                    parts = [(p, t) for t, p in ((0, ws & c0), (1, ws & c1), (2, ws & c2)) if p]
                    if len(parts) == 1:
                        moved.append((parts[0][0], parts[0][1], counts))
                    else:
                        moved.extend((p, t, list(counts)) for p, t in parts)
                active, run_start, prev = moved, i, cur
                if not active:
                    break
            i += 1
        for ws, tier, counts in active:
            counts[tier] += i - run_start
            done.append((new_hit(PrefixHit, counts), ws))
        return done

    def hit(self, hashes: Sequence[int], worker_id: str) -> PrefixHit:
        """``match(hashes).get(worker_id, PrefixHit())`` for one worker, without the others."""
        view = self._workers.get(worker_id)
        if view is None:
            return NO_HIT
        holders, bit = self._holders, 1 << view.bit
        counts = [0, 0, 0]
        for h in hashes:
            m = holders.get(h)
            if m is None:
                break
            if m[0] & bit:
                counts[0] += 1
            elif m[1] & bit:
                counts[1] += 1
            elif m[2] & bit:
                counts[2] += 1
            else:
                break
        return PrefixHit(*counts)

    # ------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        expected: dict[int, list[int]] = {}
        for w, view in self._workers.items():
            assert self._by_bit[view.bit] == w, f"worker {w}: bit {view.bit} assigned to {self._by_bit[view.bit]}"
            for h, tier in view.entries.items():
                assert HOT <= tier <= COLD, f"tier {tier} out of range"
                expected.setdefault(h, [0, 0, 0])[tier] |= 1 << view.bit
        assert sum(w is not None for w in self._by_bit) == len(self._workers), "a freed bit is still assigned"
        assert self._holders == expected, "holder masks disagree with the workers' entries"
