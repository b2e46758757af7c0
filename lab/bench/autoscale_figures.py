"""The figures of ``prefix-cache bench autoscale``, pure (no cluster, no client: unit-tested).

- ``Phase`` and ``arrival_times``: the load's schedule, a Poisson process whose
  rate is constant within each phase (drawn by thinning, from the seed alone);
- ``ReplicaSample``: what the bench saw of the deployment at one moment (Serve's
  replica states, the directory's live workers);
- ``replica_seconds``: the running replica count integrated over a span;
- ``slo_attainment``: the share of requests whose TTFT was under the SLO (a
  request that failed counts as missed);
- ``scale_out_reaction``: from the load step to the first new replica running
  and to the first request a new replica answered; ``overload_onset``: from the
  step to the first request that missed the SLO (when the load first outran the
  replicas serving), and from then to the new replica running (the reaction
  proper: signal, decision, start-up);
- ``crossing_turns``: the turns whose session's previous turn ran on a replica
  that had left (``left_times``: stopped by a scale-in) before the turn was
  sent, and what they kept;
- ``idle_to_min``: from the last answer to the deployment back at its minimum;
- ``summary``: the two arms compared, with the issue's goals as booleans.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from lab.bench.common import percentile, rounded
from lab.bench.elastic_figures import reuse_ratio
from lab.load.chat_workload import Turn

# The goals (issue 52).
SLO_ATTAINMENT_GOAL = 0.95
REPLICA_SECONDS_RATIO_GOAL = 1.1
SCALE_OUT_GOAL_S = 15.0
PROCESS_TO_SERVING_GOAL_S = 8.0
IDLE_TO_MIN_GOAL_S = 180.0
CROSSING_REUSE_GOAL = 0.9


@dataclass(frozen=True)
class Phase:
    name: str
    duration_s: float
    sessions_per_s: float   # Poisson arrival rate of new sessions in this phase


def phases_of(durations: list[float], base_rate: float, ramp: float) -> list[Phase]:
    """``base``, ``peak`` (``ramp`` x the base rate), ``cool`` (the base rate again), in that
    order; ``durations``: the three phases' lengths in seconds."""
    if len(durations) != 3 or any(d <= 0 for d in durations):
        raise ValueError(f"three phase durations > 0 (base, peak, cool), got {durations}")
    if base_rate <= 0 or ramp < 1:
        raise ValueError(f"the base rate must be > 0 and the ramp >= 1, got {base_rate} and {ramp}")
    rates = (base_rate, base_rate * ramp, base_rate)
    return [Phase(name, float(d), r) for name, d, r in zip(("base", "peak", "cool"), durations, rates)]


def phase_bounds(phases: list[Phase]) -> list[tuple[str, float, float]]:
    """Each phase's name, start and end in seconds after the load's start."""
    out, t = [], 0.0
    for p in phases:
        out.append((p.name, t, t + p.duration_s))
        t += p.duration_s
    return out


def phase_at(phases: list[Phase], t: float) -> str:
    """The phase at ``t`` seconds after the start; before the start the first, after the end the last."""
    for name, _, end in phase_bounds(phases):
        if t < end:
            return name
    return phases[-1].name


def arrival_times(phases: list[Phase], seed: int) -> list[float]:
    """Session arrivals in seconds after the start: a Poisson process of each phase's rate,
    drawn by thinning a process at the highest rate (the same seed, the same arrivals)."""
    rng = random.Random(f"{seed}:autoscale-arrivals")
    top = max(p.sessions_per_s for p in phases)
    end = sum(p.duration_s for p in phases)
    rate = {name: r for name, r in ((p.name, p.sessions_per_s) for p in phases)}
    out, t = [], 0.0
    while True:
        t += rng.expovariate(top)
        if t >= end:
            return out
        if rng.random() * top < rate[phase_at(phases, t)]:
            out.append(t)


@dataclass(frozen=True)
class ReplicaSample:
    at: float                 # seconds after the load's start
    running: int              # Serve's RUNNING replicas
    starting: int             # Serve's replicas on their way (STARTING, UPDATING, RECOVERING)
    live: tuple[str, ...]     # the directory's live workers (replica ids)


def replica_seconds(samples: list[ReplicaSample], start: float, end: float) -> float:
    """The running replica count integrated over [start, end], each sample holding until the
    next (the first one also back to ``start``)."""
    if end <= start or not samples:
        return 0.0
    ordered = sorted(samples, key=lambda s: s.at)
    total = 0.0
    for i, s in enumerate(ordered):
        lo = start if i == 0 else max(start, s.at)
        hi = min(end, ordered[i + 1].at) if i + 1 < len(ordered) else end
        if hi > lo:
            total += s.running * (hi - lo)
    return total


def slo_attainment(turns: list[Turn], slo_s: float) -> float | None:
    """The share of requests answered with a TTFT at or under ``slo_s`` (failed ones miss it)."""
    if not turns:
        return None
    met = sum(1 for t in turns if t.ok and t.ttft_s is not None and t.ttft_s <= slo_s)
    return rounded(met / len(turns), 4)


def scale_events(samples: list[ReplicaSample]) -> list[tuple[float, int, int]]:
    """(when, running before, running after) at every change of the running count."""
    ordered = sorted(samples, key=lambda s: s.at)
    return [(b.at, a.running, b.running) for a, b in zip(ordered, ordered[1:]) if b.running != a.running]


def scale_out_reaction(samples: list[ReplicaSample], turns: list[Turn], step_at: float,
                       t0: float) -> dict:
    """From the load step (``step_at`` s after the start; turns' ``started_at`` are monotonic, the
    start at ``t0``) to the first sample with more replicas starting or running than ran at the
    step (the policy's decision, seen), to the first with more running, and to the first token a
    replica not live at the step streamed (None: none came)."""
    ordered = sorted(samples, key=lambda s: s.at)
    before = [s for s in ordered if s.at <= step_at]
    at_step = before[-1] if before else (ordered[0] if ordered else None)
    if at_step is None:
        return {"replicas_at_step": None, "scale_out_started_s": None, "scale_out_running_s": None,
                "scale_out_first_served_s": None}
    more = next((s for s in ordered if s.at > step_at and s.running > at_step.running), None)
    asked = next((s for s in ordered if s.at > step_at and s.running + s.starting > at_step.running), None)
    old = set(at_step.live)
    served = [t.started_at - t0 + t.ttft_s for t in turns
              if t.ok and t.ttft_s is not None and t.worker_id and t.worker_id not in old
              and t.started_at - t0 >= step_at]
    return {"replicas_at_step": at_step.running,
            "scale_out_started_s": rounded(asked.at - step_at, 2) if asked else None,
            "scale_out_running_s": rounded(more.at - step_at, 2) if more else None,
            "scale_out_first_served_s": rounded(min(served) - step_at, 2) if served else None}


def overload_onset(turns: list[Turn], step_at: float, t0: float, slo_s: float,
                   scale_out_running_s: float | None) -> dict:
    """``first_slo_miss_after_step_s``: from the load step to the sending of the first request sent
    after it whose TTFT was over ``slo_s`` (or that failed); ``scale_out_running_after_miss_s``:
    from then to the new replica running (``scale_out_running_s`` less it; negative when the
    replica came first). None where there is no such request or no scale-out."""
    missed = [t.started_at - t0 - step_at for t in turns
              if t.started_at - t0 >= step_at and (not t.ok or t.ttft_s is None or t.ttft_s > slo_s)]
    first = min(missed) if missed else None
    after = scale_out_running_s - first if first is not None and scale_out_running_s is not None else None
    return {"first_slo_miss_after_step_s": rounded(first, 2) if first is not None else None,
            "scale_out_running_after_miss_s": rounded(after, 2) if after is not None else None}


def gone_times(samples: list[ReplicaSample]) -> dict[str, float]:
    """Each worker that left the directory's live set: when it was first seen gone."""
    ordered = sorted(samples, key=lambda s: s.at)
    out: dict[str, float] = {}
    for a, b in zip(ordered, ordered[1:]):
        for w in set(a.live) - set(b.live):
            out.setdefault(w, b.at)
    return out


def left_times(samples: list[ReplicaSample]) -> dict[str, float]:
    """Each replica that left: from when no request could reach it any more, the latest scale-in
    (Serve's running count falling) at or before the directory dropped it that no earlier leaver
    took, or that drop where there is none (a replica stops taking requests when Serve stops it,
    and drains before it leaves)."""
    drops = [at for at, before, after in scale_events(samples) if after < before]
    out: dict[str, float] = {}
    for w, g in sorted(gone_times(samples).items(), key=lambda item: item[1]):
        earlier = [d for d in drops if d <= g]
        out[w] = earlier[-1] if earlier else g
        if earlier:   # one scale-in stops one replica
            drops.remove(earlier[-1])
    return out


def crossing_turns(turns: list[Turn], gone: dict[str, float], t0: float) -> list[tuple[Turn, Turn]]:
    """(previous turn, turn) of every session turn whose previous turn ran on a replica that had
    left (``gone``: when, s after the start) before this turn was sent: what a scale-in moved."""
    by_session: dict[int, dict[int, Turn]] = {}
    for t in turns:
        by_session.setdefault(t.session, {})[t.turn] = t
    out = []
    for session in sorted(by_session):
        mine = by_session[session]
        for k in sorted(mine):
            prev = mine.get(k - 1)
            if prev is None or not prev.ok or prev.worker_id not in gone:
                continue
            if gone[prev.worker_id] <= mine[k].started_at - t0:
                out.append((prev, mine[k]))
    return out


def crossing_figures(pairs: list[tuple[Turn, Turn]]) -> dict:
    """How much of what their previous turn left (prompt + reply) the crossing turns found cached
    (and in which tier: HOT after a peer pulled it at the hand-off, L3 ...), and how many failed."""
    cached = [t.cached_tokens if t.ok else 0 for _, t in pairs]
    previous = [p.prompt_tokens + p.completion_tokens for p, _ in pairs]
    by_tier: dict[str, int] = {}
    for _, t in pairs:
        for tier, n in (t.cached_by_tier if t.ok else {}).items():
            by_tier[tier] = by_tier.get(tier, 0) + int(n)
    return {"crossed_scale_in_turns": len(pairs), "crossed_scale_in_by_tier": by_tier,
            "crossed_scale_in_sessions": len({t.session for _, t in pairs}),
            "crossed_scale_in_reuse": reuse_ratio(cached, previous) if pairs else None,
            "crossed_scale_in_lost": sum(1 for _, t in pairs if not t.ok)}


def idle_to_min(samples: list[ReplicaSample], last_answer: float, min_replicas: int) -> float | None:
    """From the last answer to the first sample after it with ``min_replicas`` running and none
    starting (None: not seen)."""
    for s in sorted(samples, key=lambda s: s.at):
        if s.at >= last_answer and s.running <= min_replicas and s.starting == 0:
            return rounded(s.at - last_answer, 2)
    return None


def by_phase(turns: list[Turn], phases: list[Phase], t0: float, slo_s: float) -> dict:
    """Requests, SLO attainment and TTFT p50/p99 (ms) per phase, by when each request was sent
    (after the last phase's end: the last phase)."""
    out = {}
    for p in phases:
        mine = [t for t in turns if phase_at(phases, t.started_at - t0) == p.name]
        ttft = [t.ttft_s for t in mine if t.ok and t.ttft_s is not None]
        out[f"requests_{p.name}"] = len(mine)
        out[f"slo_attainment_{p.name}"] = slo_attainment(mine, slo_s)
        out[f"ttft_ms_p50_{p.name}"] = rounded(percentile(ttft, 50) * 1e3, 1) if ttft else None
        out[f"ttft_ms_p99_{p.name}"] = rounded(percentile(ttft, 99) * 1e3, 1) if ttft else None
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return rounded(a / b, 4) if a is not None and b else None


def _le(value: float | None, bound: float) -> bool:
    return value is not None and math.isfinite(value) and value <= bound


def summary(ours: dict, theirs: dict) -> dict:
    """The arms compared (``ours``: the prefix_cache arm's row, ``theirs``: serve_default's), each
    of the issue's goals a boolean (False where its figure is missing)."""
    ratio = _ratio(ours.get("replica_seconds"), theirs.get("replica_seconds"))
    slo, their_slo = ours.get("slo_attainment"), theirs.get("slo_attainment")
    starts = ours.get("process_to_ready_s_max")
    reuse, lost = ours.get("crossed_scale_in_reuse"), ours.get("crossed_scale_in_lost")
    return {"bench": "autoscale", "summary": True,
            "slo_attainment": slo, "slo_attainment_serve_default": their_slo,
            "replica_seconds": ours.get("replica_seconds"),
            "replica_seconds_serve_default": theirs.get("replica_seconds"),
            "replica_seconds_ratio": ratio,
            "scale_out_running_s": ours.get("scale_out_running_s"),
            "scale_out_running_s_serve_default": theirs.get("scale_out_running_s"),
            "first_slo_miss_after_step_s": ours.get("first_slo_miss_after_step_s"),
            "scale_out_running_after_miss_s": ours.get("scale_out_running_after_miss_s"),
            "idle_to_min_s": ours.get("idle_to_min_s"),
            "idle_to_min_s_serve_default": theirs.get("idle_to_min_s"),
            "lost_requests": ours.get("lost_requests"),
            "lost_requests_serve_default": theirs.get("lost_requests"),
            "goal_slo_attainment_ge_0_95": slo is not None and slo >= SLO_ATTAINMENT_GOAL,
            "goal_slo_above_serve_default": slo is not None and their_slo is not None and slo > their_slo,
            "goal_replica_seconds_le_1_1x": _le(ratio, REPLICA_SECONDS_RATIO_GOAL),
            "goal_scale_out_le_15s": _le(ours.get("scale_out_running_s"), SCALE_OUT_GOAL_S),
            "goal_process_to_serving_le_8s": _le(starts, PROCESS_TO_SERVING_GOAL_S),
            "goal_back_to_min_within_180s": _le(ours.get("idle_to_min_s"), IDLE_TO_MIN_GOAL_S),
            "goal_crossing_reuse_ge_0_9_none_lost": (reuse is not None and reuse >= CROSSING_REUSE_GOAL
                                                     and lost == 0),
            "goal_zero_lost": ours.get("lost_requests") == 0}
