"""``CacheStats``: the tiered cache's counters, one typed object (``TieredCache.stats``).

Every part of the cache that counts (the cache itself, ``TierSpace``, ``TierMoves``,
``SessionPrefetch``) is handed this one object and adds to its named fields; nothing
counts into a dict of its own. Readers (the worker's stats, the metrics, benchmarks,
tests) read it as a read-only mapping of counter name -> value, the names unchanged:
``as_dict()`` is the snapshot. Drops are counted by tier and reason too
(``count_drop``), and read as ``dropped_<tier>_<reason>_tokens`` keys that appear
once non-zero.

Owner thread only, like the cache.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Iterator

from cluster.names import TIER_NAMES


@dataclass(slots=True)
class CacheStats(Mapping):
    # moves between tiers (``TierMoves``)
    demoted_to_warm: int = 0
    demoted_to_cold: int = 0
    demoted_without_copy: int = 0        # onto a node's WARM lower copy: no copy at all
    demotions_abandoned: int = 0         # its node locked (or the copy failed) before it landed
    demotion_failures: int = 0           # the tier below failed the copy (a disk error)
    demotion_splits: int = 0             # a node cut to fit the tier below (``fit_below``)
    promoted_tokens: int = 0
    promotions: int = 0
    promotion_failures: int = 0          # the copy up failed, not the data
    promotion_skipped_no_room: int = 0
    promotions_recompute_cheaper: int = 0
    promotions_partial: int = 0
    checksum_failures: int = 0
    stalls: int = 0                      # room made synchronously (``make_room``)
    quota_sheds: int = 0                 # a tenant at its cap pushed its own data out
    # what leaves the tree (``count_drop``); the last two are defects
    dropped_tokens: int = 0
    dropped_with_room_tokens: int = 0    # dropped while the tier below had room for it
    commit_tail_discarded_tokens: int = 0
    # room (``TierSpace``)
    lower_copies_reclaimed_tokens: int = 0
    compacted_blocks: int = 0
    checkpoints_deferred: int = 0
    # sessions (``SessionPrefetch``)
    prefetches: int = 0
    prefetch_unknown_session: int = 0
    prefetch_skipped_no_room: int = 0
    dropped_by: dict[str, int] = field(default_factory=dict)   # "<tier>_<reason>" -> tokens

    def count_drop(self, tier: int, reason: str, tokens: int) -> None:
        """``tokens`` left the tree from ``tier`` for ``reason`` (the total and the split)."""
        self.dropped_tokens += tokens
        key = f"{TIER_NAMES[tier].lower()}_{reason}"
        self.dropped_by[key] = self.dropped_by.get(key, 0) + tokens

    # --------------------------------------------------------------- reading
    def as_dict(self) -> dict[str, int]:
        """Every counter by its name (a copy): what the worker reports."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "dropped_by"}
        out.update((f"dropped_{k}_tokens", v) for k, v in self.dropped_by.items())
        return out

    def __getitem__(self, name: str) -> int:
        if name.startswith("dropped_") and name.endswith("_tokens") and name[8:-7] in self.dropped_by:
            return self.dropped_by[name[8:-7]]
        if name == "dropped_by" or name not in _COUNTERS:
            raise KeyError(name)
        return getattr(self, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.as_dict())

    def __len__(self) -> int:
        return len(_COUNTERS) + len(self.dropped_by)

    # --------------------------------------------- a snapshot put back (calibration)
    def clear(self) -> None:
        """Every counter back to zero."""
        for name in _COUNTERS:
            setattr(self, name, 0)
        self.dropped_by = {}

    def update(self, snapshot: Mapping[str, int]) -> None:
        """Counters set from ``snapshot`` (an ``as_dict()``): a run that must not count
        (the worker's calibration) puts the counters back as they were."""
        for name, value in snapshot.items():
            if name in _COUNTERS:
                setattr(self, name, value)
            elif name.startswith("dropped_") and name.endswith("_tokens"):
                self.dropped_by[name[8:-7]] = value
            else:
                raise KeyError(name)


_COUNTERS = frozenset(f.name for f in fields(CacheStats) if f.name != "dropped_by")
