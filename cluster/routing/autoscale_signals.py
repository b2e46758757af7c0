"""What a cache replica tells the autoscaler: four signals and its prefill rate.

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
METRIC_NAMES = (QUEUED_PROMPT_TOKENS, BLOCKED_FOR_ROOM, TTFT_P90_S, ENGINE_RUNNING, PREFILL_TOKENS_PER_S)


@dataclass(frozen=True, slots=True)
class ReplicaSignals:
    """One replica's signals (as published, or as Serve averaged them over its look-back)."""

    queued_prompt_tokens: float = 0.0
    blocked_for_room: float = 0.0
    ttft_p90_s: float = 0.0
    engine_running: float = 0.0
    prefill_tokens_per_s: float = 0.0
    queued_readings: tuple[float, ...] = ()   # the look-back's readings of queued_prompt_tokens, oldest first

    def as_metrics(self) -> dict[str, float]:
        """Serve's custom metrics: metric name -> number."""
        return {QUEUED_PROMPT_TOKENS: float(self.queued_prompt_tokens), BLOCKED_FOR_ROOM: float(self.blocked_for_room),
                TTFT_P90_S: float(self.ttft_p90_s), ENGINE_RUNNING: float(self.engine_running),
                PREFILL_TOKENS_PER_S: float(self.prefill_tokens_per_s)}

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, float]) -> "ReplicaSignals | None":
        """A replica's signals from its metrics; None when one of the four is missing or not a
        finite number (a replica that has not reported yet, or not this project's replica). The
        prefill rate is optional (0: unknown)."""
        values = {}
        for name in METRIC_NAMES:
            value = metrics.get(name)
            if value is None and name == PREFILL_TOKENS_PER_S:
                value = 0.0
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                return None
            values[name] = max(0.0, float(value))
        return cls(**values)


class TtftWindow:
    """Times to first token over the last ``window_s`` and their 90th percentile.

    Owned by one thread (the engine's). The percentile is recomputed only when the
    window changed (a sample came or one expired), not on every read."""

    def __init__(self, window_s: float = TTFT_WINDOW_S, max_samples: int = TTFT_WINDOW_SAMPLES):
        if not window_s > 0 or max_samples < 1:
            raise ValueError("a TTFT window needs window_s > 0 and max_samples >= 1")
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)   # (when, ttft_s), oldest first
        self._p90: float | None = 0.0   # None: stale

    def add(self, now: float, ttft_s: float) -> None:
        self._samples.append((now, max(0.0, ttft_s)))
        self._p90 = None

    def p90(self, now: float) -> float:
        """The nearest-rank 90th percentile of the samples newer than ``now - window_s`` (0: none)."""
        samples, horizon = self._samples, now - self.window_s
        while samples and samples[0][0] <= horizon:
            samples.popleft()
            self._p90 = None
        if self._p90 is None:
            ordered = sorted(ttft for _, ttft in samples)
            self._p90 = ordered[math.ceil(0.9 * len(ordered)) - 1] if ordered else 0.0
        return self._p90

    def __len__(self) -> int:
        return len(self._samples)
