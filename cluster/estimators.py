"""Robust estimates of measured costs: the median of the last few samples.

A moving average lets one outlier (a copy that waited behind the disk, a step that
lost its core to a neighbour) move the estimate by a fifth of its size, and every
decision priced on it for several samples after; the median of the last ``window``
samples moves by one rank at most, whatever the outlier's size. The cache's copy
rates (``cluster.cache.tier_moves``), the engine's prefill rate
(``cluster.engine.engine``) and its step time (``cluster.engine.preemption``) use it.
"""

from __future__ import annotations

from collections import deque
from statistics import median

RATE_WINDOW = 9   # samples a rate's median is taken over (odd: one sample is the median)


class RecentMedian:
    """The median of the last ``window`` samples (None before the first)."""

    __slots__ = ("recent",)

    def __init__(self, window: int = RATE_WINDOW):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.recent: deque[float] = deque(maxlen=window)

    def add(self, sample: float) -> float:
        """Take ``sample``; the median now."""
        self.recent.append(float(sample))
        return median(self.recent)

    def value(self) -> float | None:
        return median(self.recent) if self.recent else None

    def __len__(self) -> int:
        return len(self.recent)
