"""The figures of ``prefix-cache bench elastic``, pure: which sessions an event touched, what
they kept, hit rates, and the summary of the repeats (no cluster, no client: unit-tested)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from lab.bench.common import percentile, rounded
from lab.load.chat_workload import Turn

ROW_KEYS = ("bench", "summary", "arm", "event", "repeat")   # what names a row, not a figure of it
# Settings and labels, not figures: a summary gives them as they were (also where every repeat has None).
AS_IS_FIELDS = ("l3", "recompute_measured_by", "window_s", "replicas_before", "system_prompt_tokens")


@dataclass
class Record:
    """One turn and what the session's previous turn left (prompt + reply tokens)."""
    turn: Turn
    session: int
    previous_tokens: int


@dataclass
class Happening:
    """What an event did: its start (``at``), when the replica was gone (``effective``;
    scale-in: once Serve stopped it), which one left or died (``gone``) or came (``new``)."""
    before_live: list[str]
    at: float
    effective: float
    gone: str | None = None
    new: str | None = None
    dropped_s: float | None = None   # kill: until the directory no longer listed the replica


def reuse_ratio(cached: list[int], previous: list[int], system_tokens: int = 0) -> float | None:
    """Of what the touched sessions' previous turns left (prompt + reply), the share their next
    turn found cached: per turn max(0, min(cached, previous) - system_tokens) over
    previous - system_tokens. ``system_tokens`` 0 is ``reuse_ratio_after``; the shared system
    prompt's length gives ``reuse_ratio_own_after`` (the session's own history only).
    None when nothing is left to reuse."""
    if len(cached) != len(previous):
        raise ValueError(f"one cached count per previous turn: {len(cached)} != {len(previous)}")
    kept = sum(max(0, min(c, p) - system_tokens) for c, p in zip(cached, previous))
    left = sum(max(0, p - system_tokens) for p in previous)
    return rounded(kept / left, 4) if left else None


def touched_turns(event: str, recs: list[Record], h: Happening, window_s: float) -> list[Record]:
    """The sessions the event touched, each with the turn that shows what it kept.

    Scale-in and kill: the sessions whose cache was on the replica when the event *began*
    (their last turn that ended before ``h.at`` ran there), and each one's next turn (a
    turn in flight at a kill is resumed elsewhere: it is that next turn), if it started
    within ``window_s`` of the replica being gone. From the start, not from when the
    replica was gone: a scale-in drains the replica first, so the sessions move off it
    while it hands off, and those moves are what the event is about.
    Scale-out: the sessions that came to the new replica within the window, each one's
    first turn there, whose previous turn ran on another replica."""
    by_session: dict[int, list[Record]] = {}
    for r in recs:
        by_session.setdefault(r.session, []).append(r)
    touched = []
    for turns in by_session.values():
        turns.sort(key=lambda r: r.turn.started_at)
        if event == "scale_out":
            i = next((i for i, r in enumerate(turns) if r.turn.worker_id == h.new and
                      h.at <= r.turn.started_at < h.at + window_s), None)
            if i and turns[i].turn.ok and turns[i].previous_tokens and turns[i - 1].turn.worker_id != h.new:
                touched.append(turns[i])
            continue
        done = [i for i, r in enumerate(turns) if r.turn.ok and r.turn.started_at + (r.turn.e2e_s or 0) < h.at]
        if done and turns[done[-1]].turn.worker_id == h.gone and done[-1] + 1 < len(turns):
            nxt = turns[done[-1] + 1]
            if nxt.previous_tokens and nxt.turn.started_at < h.effective + window_s:
                touched.append(nxt)
    return touched


def in_window(records: list[Record], start: float, end: float) -> list[Record]:
    return [r for r in records if r.turn.ok and start <= r.turn.started_at < end]


def hit_rate(records: list[Record]) -> float | None:
    prompt = sum(r.turn.prompt_tokens for r in records)
    return rounded(sum(r.turn.cached_tokens for r in records) / prompt, 4) if prompt else None


def ms_at(values: list[float], q: float) -> float | None:
    return rounded(percentile(values, q) * 1e3, 1) if values else None


def summarize(rows: list[dict]) -> list[dict]:
    """One summary row per (arm, event) over the repeats, in the order they first appear:
    ``<field>_median/_min/_max`` of every numeric field (None values left out, None where all
    were None), ``<field>_true`` (how many repeats met it) of every yes/no field; text fields
    and settings (``AS_IS_FIELDS``) as they were or, where repeats differ, the sorted distinct values."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["arm"], row["event"]), []).append(row)
    out = []
    for (arm, event), group in groups.items():
        summary = {"bench": "elastic", "summary": True, "arm": arm, "event": event, "repeats": len(group)}
        for name in dict.fromkeys(k for row in group for k in row if k not in ROW_KEYS):
            summary.update(_aggregate(name, [row.get(name) for row in group]))
        out.append(summary)
    return out


def _aggregate(name: str, values: list) -> dict:
    """One field's summary entries (``summarize``); {} for values that are none of number, yes/no, text."""
    present = [v for v in values if v is not None]
    if name in AS_IS_FIELDS or (present and all(isinstance(v, str) for v in present)):
        distinct = sorted(set(present), key=str)
        return {name: (distinct[0] if len(distinct) == 1 else distinct) if distinct else None}
    if present and all(isinstance(v, bool) for v in present):
        return {f"{name}_true": sum(present)}
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in present):
        if not present:
            return {f"{name}_median": None, f"{name}_min": None, f"{name}_max": None}
        median = statistics.median(present)
        return {f"{name}_median": round(median, 4) if isinstance(median, float) else median,
                f"{name}_min": min(present), f"{name}_max": max(present)}
    return {}
