"""Whether an L3 fetch beats recomputing its tokens: the fetch guard of ``l3_fetch: auto``.

A fetch costs a round trip plus its tokens at the store's rate. One rate in tokens per
second cannot say that: fetches of a block or two time mostly the round trip, and a rate
smoothed over them falls below prefill, though a fetch of a long prefix still beats its
recompute many times over. So the guard fits ``seconds = round_trip + tokens x per_token``
to the latest fetches (Theil-Sen: the median of the pairwise slopes, then the median
intercept, so one slow outlier moves nothing) and compares, for the run it is asked about,
the fetch's predicted seconds with its tokens' prefill.

Until ``min_samples`` fetches are timed it compares the rate it was given (the calibration's
or a peer's; unknown counts as faster: the first fetches measure it). Where the guard says
no, one fetch is still made every ``probe_s`` (a *probe*), so a guard that once judged L3
slower, on a busy moment or a rate measured elsewhere, finds out when that changes: without
fetches there would be no new sample, and L3 would stay off for good.
"""

from __future__ import annotations

import statistics
from collections import deque


class FetchCost:
    def __init__(self, *, max_samples: int = 64, min_samples: int = 4, probe_s: float = 30.0,
                 started_at: float = 0.0):
        """``started_at``: the clock's reading now (the first probe comes ``probe_s`` after it)."""
        self.samples: deque[tuple[int, float]] = deque(maxlen=max_samples)   # (tokens, seconds)
        self.min_samples = min_samples
        self.probe_s = probe_s
        self.rate: float | None = None   # tokens/s given (calibration, a peer): used until fitted
        self.last_probe = started_at
        self._fit: tuple[float, float] | None = None
        self._dirty = False

    def add(self, tokens: int, seconds: float) -> None:
        """A timed fetch that brought ``tokens``."""
        if tokens > 0 and seconds > 0:
            self.samples.append((tokens, seconds))
            self._dirty = True

    def fit(self) -> tuple[float, float] | None:
        """(round trip s, s a token) fitted to the samples; None with fewer than ``min_samples``.
        Without two sizes to tell them apart, the round trip is 0 and the per-token time
        the median of each fetch's own (the one-rate model: the conservative side)."""
        if len(self.samples) < self.min_samples:
            return None
        if self._dirty or self._fit is None:
            pts = list(self.samples)
            slopes = [(s2 - s1) / (t2 - t1) for i, (t1, s1) in enumerate(pts) for t2, s2 in pts[i + 1:]
                      if t2 != t1]
            if slopes:
                slope = max(0.0, statistics.median(slopes))
                trip = max(0.0, statistics.median(s - slope * t for t, s in pts))
            else:
                slope, trip = statistics.median(s / t for t, s in pts), 0.0
            self._fit, self._dirty = (trip, slope), False
        return self._fit

    def seconds(self, tokens: int) -> float | None:
        """A fetch of ``tokens``, predicted (None: not fitted, nor a rate given)."""
        fit = self.fit()
        if fit is not None:
            return fit[0] + tokens * fit[1]
        return tokens / self.rate if self.rate else None

    def beats_recompute(self, tokens: int, prefill_tokens_per_s: float | None) -> bool:
        """Whether fetching ``tokens`` is predicted faster than prefilling them (unknown: yes)."""
        predicted = self.seconds(tokens)
        if predicted is None or not prefill_tokens_per_s:
            return True
        return predicted < tokens / prefill_tokens_per_s

    def probe_due(self, now: float) -> bool:
        """Whether a fetch the guard would skip goes ahead as a probe (then one ``probe_s`` on)."""
        if now - self.last_probe < self.probe_s:
            return False
        self.last_probe = now
        return True
