"""The directory's global index: which worker holds which block, at which tier.

Fed by the workers' KV event batches (``cluster.routing.events``), queried by
the routing policies with a request's block-hash chain.

Two maps are kept in step: ``hash -> {worker: tier}`` answers a match by
walking the chain once, and ``worker -> {hash: tier}`` drops a dead worker or
loads its snapshot without a scan of the whole index.

Sequence numbers: a worker's batches must arrive as 1, 2, 3, ... A batch that
skips ahead is a *gap* (something was lost); it is not applied and the worker
must be reloaded from a snapshot. A batch at or below the last applied one is
a *duplicate* (a retry) and is ignored. A worker re-registering (a restarted
process) starts over from sequence 0 with no entries.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from cluster.cache.radix_tree import COLD, HOT
from cluster.errors import InvalidInputError
from cluster.routing.events import EventBatch, MalformedBatchError

_U64 = 1 << 64


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
    __slots__ = ("last_seq", "entries", "needs_snapshot")

    def __init__(self) -> None:
        self.last_seq = 0
        self.entries: dict[int, int] = {}
        self.needs_snapshot = False


class GlobalIndex:
    def __init__(self) -> None:
        self._holders: dict[int, dict[str, int]] = {}
        self._workers: dict[str, _WorkerView] = {}
        self.stats = {"batches": 0, "events": 0, "hashes": 0, "gaps": 0, "duplicates": 0, "resyncs": 0,
                      "unknown_worker": 0, "malformed": 0, "snapshots": 0, "stale_snapshots": 0,
                      "matches": 0}
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

    def register_worker(self, worker_id: str) -> None:
        if not isinstance(worker_id, str) or not worker_id:
            raise InvalidInputError(f"worker_id must be a non-empty string, got {worker_id!r}")
        if worker_id in self._workers:
            self.drop_worker(worker_id)
        self._workers[worker_id] = _WorkerView()

    def drop_worker(self, worker_id: str) -> int:
        """Forget a worker and everything it held; returns the entries removed."""
        view = self._workers.pop(worker_id, None)
        if view is None:
            return 0
        self._remove_all(worker_id, view)
        return len(view.entries)

    def _remove_all(self, worker_id: str, view: _WorkerView) -> None:
        holders = self._holders
        for h in view.entries:
            d = holders[h]
            del d[worker_id]
            if not d:
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
        worker, holders, entries = batch.worker_id, self._holders, view.entries
        nhashes = 0
        for ev in batch.events:
            nhashes += len(ev.hashes)
            if ev.kind == "removed":
                for h in ev.hashes:
                    if entries.pop(h, None) is not None:
                        d = holders[h]
                        del d[worker]
                        if not d:
                            del holders[h]
            else:  # "stored" and "tier" both set the block's tier
                tier = ev.tier
                for h in ev.hashes:
                    entries[h] = tier
                    d = holders.get(h)
                    if d is None:
                        holders[h] = {worker: tier}
                    else:
                        d[worker] = tier
        self.stats["events"] += len(batch.events)
        self.stats["hashes"] += nhashes
        return "ok"

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
        self._remove_all(worker_id, view)
        view.entries = dict(entries)
        view.last_seq = seq
        view.needs_snapshot = False
        holders = self._holders
        for h, tier in view.entries.items():
            d = holders.get(h)
            if d is None:
                holders[h] = {worker_id: tier}
            else:
                d[worker_id] = tier
        self.stats["snapshots"] += 1
        return "ok"

    # ----------------------------------------------------------------- match
    def match(self, hashes: Sequence[int]) -> dict[str, PrefixHit]:
        """Per worker, the consecutive leading blocks of ``hashes`` it holds, by tier.

        Workers holding no leading block are absent.
        """
        return {w: hit for hit, workers in self.match_cohorts(hashes) for w in workers}

    def match_cohorts(self, hashes: Sequence[int]) -> list[tuple[PrefixHit, list[str]]]:
        """``match`` grouped: each distinct hit with the workers that have it.

        The chain is walked once. Workers are handled in cohorts that have
        held the same blocks at the same tiers so far; per-worker work happens
        only where the holder set changes (workers drop out or change tier),
        so a long prefix held by every worker costs one dict lookup and one
        dict comparison per block, and the answer has few entries to price.
        """
        self.stats["matches"] += 1
        holders = self._holders
        n = len(hashes)
        prev = holders.get(hashes[0]) if n else None
        if not prev:
            return []
        by_tier: dict[int, list[str]] = {}
        for w, tier in prev.items():
            by_tier.setdefault(tier, []).append(w)
        active = [(ws, tier, [0, 0, 0]) for tier, ws in by_tier.items()]   # (workers, current tier, counts)
        done: list[tuple[PrefixHit, list[str]]] = []
        run_start, i = 0, 1
        while i < n:
            cur = holders.get(hashes[i])
            if cur is None:
                break
            if cur != prev:
                moved = []
                for ws, tier, counts in active:
                    counts[tier] += i - run_start
                    split: dict[int | None, list[str]] = {}
                    for w in ws:
                        split.setdefault(cur.get(w), []).append(w)
                    for new_tier, part in split.items():
                        if new_tier is None:
                            done.append((PrefixHit(*counts), part))
                        else:
                            moved.append((part, new_tier, list(counts)))
                active, run_start, prev = moved, i, cur
                if not active:
                    break
            i += 1
        for ws, tier, counts in active:
            counts[tier] += i - run_start
            done.append((PrefixHit(*counts), ws))
        return done

    def hit(self, hashes: Sequence[int], worker_id: str) -> PrefixHit:
        """``match(hashes).get(worker_id, PrefixHit())`` for one worker, without the others."""
        holders = self._holders
        counts = [0, 0, 0]
        for h in hashes:
            d = holders.get(h)
            tier = None if d is None else d.get(worker_id)
            if tier is None:
                break
            counts[tier] += 1
        return PrefixHit(*counts)

    # ------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        total = 0
        for w, view in self._workers.items():
            for h, tier in view.entries.items():
                assert self._holders.get(h, {}).get(w) == tier, f"worker {w} holds {h:#x} at {tier}, index disagrees"
                assert HOT <= tier <= COLD, f"tier {tier} out of range"
            total += len(view.entries)
        assert sum(len(d) for d in self._holders.values()) == total, "holder map has entries no worker owns"
        for h, d in self._holders.items():
            assert d, f"empty holder set left for {h:#x}"
            for w in d:
                assert w in self._workers, f"{h:#x} held by unregistered worker {w}"
