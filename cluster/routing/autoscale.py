"""The cache replicas' autoscaling policy, without Ray: signals in, a replica count out.

``decide(config, signals, ...)`` is the whole policy. It sees each running
replica's ``ReplicaSignals`` (``cluster.routing.autoscale_signals``), the
deployment's target and running counts, its bounds, a clock reading and its
own ``AutoscaleState``, and returns a ``Decision`` (the count, why, the new
state). ``serve_app.autoscaling`` is the thin adapter Ray Serve calls.

Each replica's queued prefill is measured against the scale-out threshold:
``scale_out_queue_s`` seconds of prefill at the rate the replica measured, or
``scale_out_queued_tokens`` where it reports no rate. Summed over the replicas
that is the deployment's *queue load*, in replicas at the threshold.

- **Scale out** when the queue load exceeds the replicas reporting (the mean
  replica is past the threshold: to as many replicas as keep each at it) and the
  queue persisted: a replica's queue was above its threshold in at least
  ``scale_out_queue_share`` of its look-back readings (``queued_readings``;
  without readings the mean alone decides). A burst the replica clears in less
  than that (a few sessions arriving together at the base rate) raises the
  look-back mean as much as the start of a real ramp, but is gone before a new
  replica could serve: the policy holds (``queue_brief``). Also when a
  replica's TTFT p90 is above ``ttft_slo_s`` *and its wait is what more
  replicas can shorten*, or a replica was out of HOT room for
  ``scale_out_blocked`` of the look-back (one more replica each, and only
  once no replica is still starting: it is the help already on its way).
  At most ``max_scale_out_step`` replicas at once.
- **The TTFT's wait.** A replica's TTFT is its wait (the queue, steps shared
  with others' work) and its prompts' own prefill, which takes as long on any
  replica (``ReplicaSignals.ttft_wait_p90_s``). A TTFT p90 above the SLO
  scales out only where the wait p90 is at least ``low_fraction`` of the SLO
  or is what puts the p90 past it (the TTFT p90 less the wait p90 within the
  SLO); otherwise more replicas would cost replica-seconds and leave the TTFT
  where it is (long prompts on a slow replica: ``ttft_own_prefill`` when
  nothing else decides). A replica that reports no wait reads as all wait.
- **Scale in** when every signal has stayed low for ``downscale_window_s``:
  each replica's typical queue (the median of its look-back's readings: a burst
  it cleared within the look-back leaves the median where it was, as it leaves
  the scale-out alone) below ``low_fraction`` of its threshold, every wait p90
  below ``low_fraction`` x ``ttft_slo_s``, no replica out of HOT room, and the
  load fits on fewer replicas: the running requests (``running_per_replica``
  each), the typical queue (its load at ``low_fraction``) and the prefill the
  replicas did over their TTFT window (``prefill_share`` summed, at
  ``low_fraction`` of each replica's time). It goes to what the load needs in
  one step, so an idle deployment is back at ``min_replicas`` one window after
  its signals went quiet.
- **Rate limits**: no scale-out within ``scale_out_interval_s`` of the last
  scale event, no scale-in within ``scale_in_interval_s`` of it.
- Never below ``min_replicas`` nor above ``max_replicas``; without a signal
  from any replica (none reported yet) it holds.

Knobs come as a mapping (Serve's ``policy_kwargs``): ``AutoscaleConfig.from_kwargs``
names the key of every unknown or bad value.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from cluster.errors import InvalidInputError
from cluster.routing.autoscale_signals import ReplicaSignals

# The policy's keys in Serve's policy_state (beside Serve's own "__decision_*" keys).
_STATE_PREFIX = "prefix_cache_"


@dataclass(frozen=True)
class AutoscaleConfig:
    ttft_slo_s: float = 2.0              # a replica's TTFT p90 above this scales out
    scale_out_queue_s: float = 1.0       # seconds of queued prefill per replica that scale out
    scale_out_queued_tokens: int = 4096  # ... as tokens, for a replica that reports no prefill rate
    scale_out_blocked: float = 0.5       # share of the look-back a replica was out of HOT room that scales out
    scale_out_queue_share: float = 0.5   # share of a replica's look-back readings with its queue above the threshold
    max_scale_out_step: int = 2          # replicas added by one scale-out at most
    low_fraction: float = 0.5            # a signal is low below this share of its scale-out threshold
    running_per_replica: float = 4.0     # running requests one replica keeps after a scale-in
    downscale_window_s: float = 60.0     # every signal low this long before a scale-in
    scale_out_interval_s: float = 10.0   # since the last scale event, before a scale-out
    scale_in_interval_s: float = 30.0    # since the last scale event, before a scale-in

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            integral = f.type == "int"
            if (isinstance(value, bool) or not isinstance(value, int if integral else (int, float))
                    or not math.isfinite(value)):
                kind = "an integer" if integral else "a number"
                raise InvalidInputError(f"autoscaling policy option {f.name} must be {kind}, got {value!r}")
        positive = ("ttft_slo_s", "scale_out_queue_s", "scale_out_queued_tokens", "running_per_replica",
                    "max_scale_out_step")
        for name in positive:
            if getattr(self, name) <= 0:
                raise InvalidInputError(f"autoscaling policy option {name} must be > 0, got {getattr(self, name)!r}")
        for name in ("downscale_window_s", "scale_out_interval_s", "scale_in_interval_s"):
            if getattr(self, name) < 0:
                raise InvalidInputError(f"autoscaling policy option {name} must be >= 0 seconds, "
                                        f"got {getattr(self, name)!r}")
        for name in ("scale_out_blocked", "scale_out_queue_share", "low_fraction"):
            if not 0 < getattr(self, name) <= 1:
                raise InvalidInputError(f"autoscaling policy option {name} must be in (0, 1], "
                                        f"got {getattr(self, name)!r}")

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any] | None) -> "AutoscaleConfig":
        """The config from a mapping of option names to values; an unknown name fails naming it."""
        kwargs = dict(kwargs or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(map(str, set(kwargs) - known))
        if unknown:
            raise InvalidInputError(f"unknown autoscaling policy option(s) {', '.join(unknown)} "
                                    f"(options: {', '.join(sorted(known))})")
        return cls(**kwargs)

    def queue_threshold_tokens(self, replica: ReplicaSignals) -> float:
        """The queued prompt tokens that scale out on this replica: ``scale_out_queue_s`` of its
        measured prefill, or ``scale_out_queued_tokens`` when it reports no rate."""
        if replica.prefill_tokens_per_s > 0:
            return self.scale_out_queue_s * replica.prefill_tokens_per_s
        return float(self.scale_out_queued_tokens)


@dataclass(frozen=True, slots=True)
class AutoscaleState:
    """What the policy remembers between calls (kept in Serve's ``policy_state``)."""

    last_scale_at: float | None = None   # the last scale event this policy decided, either way
    low_since: float | None = None       # since when every signal has been low (None: one is not)

    def as_policy_state(self) -> dict[str, float | None]:
        return {_STATE_PREFIX + "last_scale_at": self.last_scale_at, _STATE_PREFIX + "low_since": self.low_since}

    @classmethod
    def from_policy_state(cls, state: Mapping[str, Any] | None) -> "AutoscaleState":
        state = state or {}

        def time_of(key: str) -> float | None:
            value = state.get(_STATE_PREFIX + key)
            return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        return cls(time_of("last_scale_at"), time_of("low_since"))


@dataclass(frozen=True, slots=True)
class Decision:
    replicas: int
    reason: str   # scale_out_queue, scale_out_ttft, scale_out_blocked, scale_in, hold, ... (see decide)
    state: AutoscaleState
    # What keeps the replicas where a scale-in does not come: the signals not low ("wait p90
    # 1.3 s"), or the load terms that need them ("prefill 0.62 of a replica needs 2"); "" otherwise.
    detail: str = ""
    held_by: tuple[str, ...] = ()   # their names ("queue", "wait", "room"; "running", "prefill", "min_replicas")


@dataclass(frozen=True, slots=True)
class _Reading:
    """The signals summed up: what the rules compare."""

    queue_load: float       # replicas at the queue threshold (sum of each replica's queue / its threshold)
    worst_ttft_s: float
    worst_blocked: float
    running: float          # requests running, all replicas
    queue_held: float | None   # the highest share of a replica's readings above its threshold (None: no readings)
    worst_wait_s: float     # the highest wait p90 (a replica that reports none: its TTFT p90)
    ttft_fixable: bool      # a replica's TTFT p90 is past the SLO, and its wait is what more replicas shorten
    prefill_load: float     # the replicas' prefill shares summed (those that report one)
    typical_queue_load: float    # as queue_load, each replica's queue its look-back's median reading
    worst_typical_queue: float   # ... and the highest replica's

    @classmethod
    def of(cls, config: AutoscaleConfig, signals: Sequence[ReplicaSignals]) -> "_Reading":
        shares = [s.queued_prompt_tokens / config.queue_threshold_tokens(s) for s in signals]
        typical = [(statistics.median(s.queued_readings) if s.queued_readings else s.queued_prompt_tokens)
                   / config.queue_threshold_tokens(s) for s in signals]
        held = [sum(q > config.queue_threshold_tokens(s) for q in s.queued_readings) / len(s.queued_readings)
                for s in signals if s.queued_readings]
        slo = config.ttft_slo_s
        fixable = any(s.ttft_p90_s > slo and (s.ttft_p90_s - s.wait_s <= slo or s.wait_s >= config.low_fraction * slo)
                      for s in signals)
        return cls(sum(shares), max(s.ttft_p90_s for s in signals),
                   max(s.blocked_for_room for s in signals), sum(s.engine_running for s in signals),
                   max(held) if held else None, max(s.wait_s for s in signals), fixable,
                   sum(s.prefill_share or 0.0 for s in signals), sum(typical), max(typical))

    def queue_persists(self, config: AutoscaleConfig) -> bool:
        """The queue stayed above a replica's threshold for ``scale_out_queue_share`` of its
        readings (True without readings: then the look-back mean alone decides)."""
        return self.queue_held is None or self.queue_held >= config.scale_out_queue_share


def decide(config: AutoscaleConfig, signals: Sequence[ReplicaSignals], *, target: int, running: int,
           min_replicas: int, max_replicas: int, now: float, state: AutoscaleState) -> Decision:
    """The replica count for the deployment now.

    ``signals``: one per running replica that reported; ``target``: the count Serve aims at
    now (replicas still starting included); ``running``: those already serving.
    Reasons: ``bounds`` (the target was outside them), ``no_signals``, ``scale_out_queue``,
    ``scale_out_ttft``, ``scale_out_blocked``, ``scale_in``, and for no change ``starting``
    (scale-out wanted, the replicas on their way cover it), ``at_max``, ``rate_limited``,
    ``queue_brief`` (the queue's mean is past the threshold, but no replica's queue stayed
    above it for ``scale_out_queue_share`` of its readings), ``low_window`` (low, not yet for
    the whole window), ``ttft_own_prefill`` (a TTFT p90 past the SLO that is its prompts' own
    prefill, not wait: more replicas would not shorten it), ``hold``."""
    if not min_replicas <= target <= max_replicas:
        return Decision(min(max(target, min_replicas), max_replicas), "bounds",
                        AutoscaleState(last_scale_at=now, low_since=None))
    if not signals:
        return Decision(target, "no_signals", dataclasses.replace(state, low_since=None))
    reading = _Reading.of(config, signals)
    out = _scale_out(config, reading, len(signals), target, running, max_replicas)
    if out is not None:
        want, reason = out
        busy = dataclasses.replace(state, low_since=None)
        if want <= target:
            return Decision(target, "at_max" if target >= max_replicas else "starting", busy)
        if state.last_scale_at is not None and now - state.last_scale_at < config.scale_out_interval_s:
            return Decision(target, "rate_limited", busy)
        return Decision(want, reason, AutoscaleState(last_scale_at=now, low_since=None))
    if reading.queue_load > len(signals):   # past the threshold on the mean, but not for long
        return Decision(target, "queue_brief", dataclasses.replace(state, low_since=None))
    decision = _scale_in(config, reading, target, min_replicas, now, state)
    if decision.reason == "hold" and reading.worst_ttft_s > config.ttft_slo_s:   # past the SLO, not by its wait
        return dataclasses.replace(decision, reason="ttft_own_prefill")
    return decision


def _scale_out(config: AutoscaleConfig, reading: _Reading, reporting: int, target: int, running: int,
               max_replicas: int) -> tuple[int, str] | None:
    """(the count wanted, why) when a signal asks for more replicas; None when none does."""
    wants: list[tuple[int, str]] = []
    if reading.queue_load > reporting and reading.queue_persists(config):   # the mean replica is past it, and held
        wants.append((math.ceil(reading.queue_load), "scale_out_queue"))
    one_more = target + 1 if running >= target else target   # a replica on its way is the one more
    if reading.ttft_fixable:
        wants.append((one_more, "scale_out_ttft"))
    if reading.worst_blocked >= config.scale_out_blocked:
        wants.append((one_more, "scale_out_blocked"))
    if not wants:
        return None
    want, reason = max(wants, key=lambda w: w[0])
    return min(want, target + config.max_scale_out_step, max_replicas), reason


def _scale_in(config: AutoscaleConfig, reading: _Reading, target: int, min_replicas: int, now: float,
              state: AutoscaleState) -> Decision:
    busy = {}   # the signals not low (the queue: its typical reading, which one burst does not move)
    if reading.worst_typical_queue > config.low_fraction:
        busy["queue"] = f"queue {reading.worst_typical_queue:.2f} of its threshold"
    if reading.worst_wait_s > config.low_fraction * config.ttft_slo_s:
        busy["wait"] = f"wait p90 {reading.worst_wait_s:.2f} s"
    if reading.worst_blocked > 0:
        busy["room"] = f"out of HOT room {reading.worst_blocked:.2f} of the look-back"
    if busy:
        return Decision(target, "hold", dataclasses.replace(state, low_since=None), "; ".join(busy.values()),
                        tuple(busy))
    terms = {"running": (f"running {reading.running:.1f}", math.ceil(reading.running / config.running_per_replica)),
             "queue": (f"queue {reading.typical_queue_load:.2f} of a replica",
                       math.ceil(reading.typical_queue_load / config.low_fraction)),
             "prefill": (f"prefill {reading.prefill_load:.2f} of a replica",
                         math.ceil(reading.prefill_load / config.low_fraction))}
    need = max(min_replicas, *(n for _, n in terms.values()))
    low_since = state.low_since if state.low_since is not None else now
    quiet = dataclasses.replace(state, low_since=low_since)
    if need >= target:
        held_by = tuple(name for name, (_, n) in terms.items() if n >= target) or ("min_replicas",)
        texts = [terms[name][0] if name in terms else name for name in held_by]
        return Decision(target, "hold", quiet, f"{', '.join(texts)} needs {target}", held_by)
    if now - low_since < config.downscale_window_s:
        return Decision(target, "low_window", quiet)
    if state.last_scale_at is not None and now - state.last_scale_at < config.scale_in_interval_s:
        return Decision(target, "rate_limited", quiet)
    return Decision(need, "scale_in", AutoscaleState(last_scale_at=now, low_since=None))
