"""What a cache replica tells the autoscaler: its signals and its prefill rate.

Each replica's engine thread publishes a ``ReplicaSignals`` after every
iteration, beside its ``LoadReport`` (``actors.engine_loop``); the replica
hands it to Ray Serve as custom autoscaling metrics (``as_metrics``, Serve's
``record_autoscaling_stats`` hook), and the policy (``cluster.routing.autoscale``)
reads them back per replica (``from_metrics``), averaged by Serve over its
``look_back_period_s``:

- ``queued_prompt_tokens``: the prompt tokens of the requests waiting for
  admission that the cache did not serve (the prefill work queued);
- ``blocked_for_room``: 1 while an admission waits for HOT room (its prefix
  cannot be promoted, or its own KV has no room), else 0; averaged over the
  look-back it is the share of the window the replica was out of HOT room;
- ``ttft_p90_s``: the 90th percentile of the replica's time to first token
  over the last ``TTFT_WINDOW_S`` (from the request reaching the replica,
  migration included, to its first token; 0 with none in the window);
- ``ttft_wait_p90_s``: the 90th percentile, over the same window, of each
  request's *wait*: its time to first token less its own prefill (its
  uncached prompt tokens at the replica's prefill rate). The wait is what
  more replicas shorten (the queue, a step shared with others' work); a
  prompt's own prefill takes as long on any replica. Optional: a replica
  that does not report it is read as all wait (``wait_s``);
- ``prefill_share``: the share of the window the replica's prefill took
  (the uncached prompt tokens of the requests whose first token came in the
  window, at its prefill rate, over ``TTFT_WINDOW_S``): the prefill work a
  scale-in would put on fewer replicas. Optional (None: not reported);
- ``engine_running``: the requests in the engine's running batch;
- ``prefill_tokens_per_s``: the prefill rate the engine measured on its own
  prompt-heavy steps (the calibrated rate before it has one; 0: unknown), so
  the policy can read queued tokens as seconds of prefill.

Beside the averages, the policy gets each replica's ``queued_readings``: the
look-back's own readings of ``queued_prompt_tokens``, oldest first (Serve's
raw time series; Serve records them at even intervals, 1 s under this app's
settings), so it can tell a queue that persists from a burst the replica
cleared (empty where Serve gave no series).

Names are Serve metric keys; ``engine_running`` is not ``running_requests``,
which is Serve's own key for a replica's ongoing requests.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Mapping

TTFT_WINDOW_S = 30.0
TTFT_WINDOW_SAMPLES = 1024   # the newest kept when a window holds more (a sort of 1k floats per change)

QUEUED_PROMPT_TOKENS = "queued_prompt_tokens"
BLOCKED_FOR_ROOM = "blocked_for_room"
TTFT_P90_S = "ttft_p90_s"
ENGINE_RUNNING = "engine_running"
PREFILL_TOKENS_PER_S = "prefill_tokens_per_s"
TTFT_WAIT_P90_S = "ttft_wait_p90_s"
PREFILL_SHARE = "prefill_share"
METRIC_NAMES = (QUEUED_PROMPT_TOKENS, BLOCKED_FOR_ROOM, TTFT_P90_S, ENGINE_RUNNING, PREFILL_TOKENS_PER_S,
                TTFT_WAIT_P90_S, PREFILL_SHARE)
# The metrics a replica may leave out, and what they read as then (None: not reported).
OPTIONAL_METRICS = {PREFILL_TOKENS_PER_S: 0.0, TTFT_WAIT_P90_S: None, PREFILL_SHARE: None}


@dataclass(frozen=True, slots=True)
class ReplicaSignals:
    """One replica's signals (as published, or as Serve averaged them over its look-back)."""

    queued_prompt_tokens: float = 0.0
    blocked_for_room: float = 0.0
    ttft_p90_s: float = 0.0
    engine_running: float = 0.0
    prefill_tokens_per_s: float = 0.0
    queued_readings: tuple[float, ...] = ()   # the look-back's readings of queued_prompt_tokens, oldest first
    ttft_wait_p90_s: float | None = None      # None: not reported (all of the TTFT reads as wait)
    prefill_share: float | None = None        # None: not reported

    @property
    def wait_s(self) -> float:
        """The TTFT p90's wait part: ``ttft_wait_p90_s``, or the whole ``ttft_p90_s`` from a
        replica that does not report it."""
        return self.ttft_p90_s if self.ttft_wait_p90_s is None else self.ttft_wait_p90_s

    def as_metrics(self) -> dict[str, float]:
        """Serve's custom metrics: metric name -> number (an optional one not reported is left out)."""
        metrics = {QUEUED_PROMPT_TOKENS: float(self.queued_prompt_tokens), BLOCKED_FOR_ROOM: float(self.blocked_for_room),
                   TTFT_P90_S: float(self.ttft_p90_s), ENGINE_RUNNING: float(self.engine_running),
                   PREFILL_TOKENS_PER_S: float(self.prefill_tokens_per_s)}
        for name, value in ((TTFT_WAIT_P90_S, self.ttft_wait_p90_s), (PREFILL_SHARE, self.prefill_share)):
            if value is not None:
                metrics[name] = float(value)
        return metrics

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, float]) -> "ReplicaSignals | None":
        """A replica's signals from its metrics; None when one of the four is missing or one
        reported is not a finite number (a replica that has not reported yet, or not this
        project's replica). The prefill rate (0: unknown), the wait and the prefill share (None:
        not reported) are optional."""
        values = {}
        for name in METRIC_NAMES:
            value = metrics.get(name)
            if value is None and name in OPTIONAL_METRICS:
                values[name] = OPTIONAL_METRICS[name]
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                return None
            values[name] = max(0.0, float(value))
        return cls(**values)


class TtftWindow:
    """Times to first token over the last ``window_s``: their 90th percentile, their waits'
    90th percentile and the share of the window the requests' own prefill took.

    Each sample is (when, ttft, own prefill seconds or None where the rate is unknown: then
    all of its TTFT is wait and it adds no prefill). Owned by one thread (the engine's). The
    percentiles are recomputed only when the window changed (a sample came or one expired),
    not on every read. Past ``max_samples`` in a window the oldest go first (the prefill
    share then counts the newest ``max_samples``)."""

    def __init__(self, window_s: float = TTFT_WINDOW_S, max_samples: int = TTFT_WINDOW_SAMPLES):
        if not window_s > 0 or max_samples < 1:
            raise ValueError("a TTFT window needs window_s > 0 and max_samples >= 1")
        self.window_s = window_s
        # (when, ttft_s, wait_s, own prefill s), oldest first
        self._samples: deque[tuple[float, float, float, float]] = deque(maxlen=max_samples)
        self._figures: tuple[float, float, float] | None = (0.0, 0.0, 0.0)   # None: stale

    def add(self, now: float, ttft_s: float, prefill_s: float | None = None) -> None:
        ttft_s = max(0.0, ttft_s)
        own = min(ttft_s, max(0.0, prefill_s)) if prefill_s is not None else 0.0
        self._samples.append((now, ttft_s, ttft_s - own, own))
        self._figures = None

    def _current(self, now: float) -> tuple[float, float, float]:
        """(TTFT p90, wait p90, prefill share) of the samples newer than ``now - window_s``."""
        samples, horizon = self._samples, now - self.window_s
        while samples and samples[0][0] <= horizon:
            samples.popleft()
            self._figures = None
        if self._figures is None:
            self._figures = (_p90([s[1] for s in samples]), _p90([s[2] for s in samples]),
                             sum(s[3] for s in samples) / self.window_s)
        return self._figures

    def p90(self, now: float) -> float:
        """The nearest-rank 90th percentile of the window's TTFTs (0: none)."""
        return self._current(now)[0]

    def wait_p90(self, now: float) -> float:
        """The nearest-rank 90th percentile of the window's waits (0: none)."""
        return self._current(now)[1]

    def prefill_share(self, now: float) -> float:
        """The window's own prefill seconds over ``window_s``."""
        return self._current(now)[2]

    def __len__(self) -> int:
        return len(self._samples)


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[math.ceil(0.9 * len(ordered)) - 1] if ordered else 0.0
