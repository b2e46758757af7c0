"""``prefix-cache bench elastic``: the cache across scale-in, scale-out and a crash, with and without its lifetime parts.

    prefix-cache bench elastic [--model SPEC] [--sessions 12] [--turns 8] [--event scale_in|scale_out|kill|all]
        [--l3 on|off] [--window-s 60] [--warm-s 60]

Two arms, one after the other, each on the embedded local cluster (real Serve
replicas, the real model, a real ``mooncake_master``), the same client:

- ``elastic``: L3 (write behind, fetch ahead), hand-off on scale-in, warm-up on
  scale-out (``--l3 off``: hand-off to peers and warm-up from peers only);
- ``baseline``: no L3, no hand-off, no warm-up: every replica's cache is its own.

A multi-turn chat workload runs throughout: ``--sessions`` sessions at once,
each sharing one system prompt, sending the model's real replies back, with
``--think-s`` between turns; a session that reached ``--turns`` turns starts
over as a new one. After ``--warm-s`` the events happen in order, each
followed by a ``--window-s`` window: ``scale_in`` (3 -> 2 replicas through a
Serve config update, the way ``serve deploy`` and KubeRay scale), ``scale_out``
(2 -> 3) and ``kill`` (``kill -9`` of the replica serving the most sessions;
Serve replaces it). One JSON row per event and arm:

- ``hit_rate_before``: cached / prompt tokens in the window before the event;
  ``hit_rate_after_60s``: the same in the window after it;
- ``reuse_ratio_after``: for the sessions the event touched (their last turn
  before it was on the replica that left or died; for scale-out, their first
  turn after it landed on the new replica), cached tokens of that first turn
  over the previous turn's prompt + reply;
- ``ttft_ms_p50_after``, ``ttft_ms_p99_after``: the window after the event;
- ``handoff_blocks``, ``handoff_s``, ``warmup_blocks``, ``warmup_s``: the
  replica's own reports (the directory keeps them);
- ``l3_hit_rate``: tokens read from L3 over prompt tokens in the window after;
  ``l3_fetch_ms_p50/p99`` and ``recompute_ms_p50/p99``: the replicas' L3
  fetches in the arm and what the same tokens cost to recompute at their
  measured prefill rate;
- ``new_replica_hit_rate_60s`` (scale-out): the new replica's own;
- ``lost_requests``: requests that failed (an error status, an error event, a
  cut stream) in the whole arm.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import threading
import time
from dataclasses import dataclass, field

from cluster.bench.common import emit, percentile, rounded
from serve_app.tools.chat_workload import QUESTIONS, Turn, ask_turn, system_prompt

EVENTS = ("scale_in", "scale_out", "kill")
APP_REPLICAS = "CacheReplica"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model spec (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--sessions", type=int, default=12, help="sessions at once")
    p.add_argument("--turns", type=int, default=8, help="turns of a session before it starts over as a new one")
    p.add_argument("--event", default="all", help="scale_in, scale_out, kill or all (in that order)")
    p.add_argument("--l3", choices=("on", "off"), default="on", help="L3 in the elastic arm (default on)")
    p.add_argument("--arms", default="elastic,baseline")
    p.add_argument("--system-tokens", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--think-s", type=float, default=1.0)
    p.add_argument("--warm-s", type=float, default=60.0, help="workload time before the first event")
    p.add_argument("--window-s", type=float, default=60.0, help="measured window after each event")
    p.add_argument("--hot-blocks", type=int, default=512, help="HOT blocks per replica")
    p.add_argument("--handoff-s", type=float, default=20.0)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)


@dataclass
class Record:
    """One turn and what the session's previous turn left (prompt + reply tokens)."""
    turn: Turn
    session: int
    previous_tokens: int


@dataclass
class Workload:
    """Sessions that chat until stopped, each turn recorded."""
    base: str
    model: str
    system: str
    args: argparse.Namespace
    records: list[Record] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    next_session: int = 0

    async def run(self) -> None:
        import httpx

        limits = httpx.Limits(max_connections=self.args.sessions + 4, max_keepalive_connections=self.args.sessions + 4)
        async with httpx.AsyncClient(base_url=self.base, timeout=300, limits=limits) as http:
            await asyncio.gather(*(self._slot(http, k) for k in range(self.args.sessions)))

    async def _slot(self, http, k: int) -> None:
        import random
        rng = random.Random(self.args.seed * 1000 + k)
        await asyncio.sleep(k * self.args.think_s / max(1, self.args.sessions))   # staggered starts
        while not self.stop.is_set():
            session = self.next_session
            self.next_session += 1
            messages, previous = [{"role": "system", "content": self.system}], 0
            for t in range(self.args.turns):
                if self.stop.is_set():
                    return
                messages.append({"role": "user", "content": rng.choice(QUESTIONS)})
                turn, reply = await ask_turn(http, self.model, messages, session, t, self.args.max_tokens)
                self.records.append(Record(turn, session, previous))
                if not turn.ok:
                    break   # a failed turn ends its session (counted as lost)
                previous = turn.prompt_tokens + turn.completion_tokens
                messages.append({"role": "assistant", "content": reply})
                await asyncio.sleep(self.args.think_s)


def _window(records: list[Record], start: float, end: float) -> list[Record]:
    return [r for r in records if r.turn.ok and start <= r.turn.started_at < end]


def _hit_rate(records: list[Record]) -> float | None:
    prompt = sum(r.turn.prompt_tokens for r in records)
    return rounded(sum(r.turn.cached_tokens for r in records) / prompt, 4) if prompt else None


def _ms(values: list[float], q: float) -> float | None:
    return rounded(percentile(values, q) * 1e3, 1) if values else None


class Cluster:
    """The local cluster and the app deployed from a config, as ``serve deploy`` does:
    changing ``CacheReplica``'s ``num_replicas`` is then a lightweight update
    (Serve adds or stops replicas; the others keep running)."""

    def __init__(self, worker: dict, port: int, replicas: int, l3: bool):
        from serve_app.local import LocalCluster

        self.local = LocalCluster(worker_nodes=2, l3_pool_mb=1024 if l3 else 0)
        if self.local.l3 is not None:
            worker = {**worker, "l3_master": self.local.l3.address}
        self.args = {"worker": worker, "admin_without_keys": True, "num_replicas": replicas,
                     "limits": {"max_prompt_tokens": 8192, "max_tokens": 1024}}
        self.port = port
        self.replicas = replicas
        self.apply()

    def apply(self) -> None:
        from ray import serve
        from ray.serve.context import _get_global_client
        from ray.serve.schema import ServeDeploySchema

        from serve_app.app import APP_NAME

        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        config = {"applications": [{"name": APP_NAME, "route_prefix": "/", "import_path": "serve_app.app:build_app",
                                    "args": self.args,
                                    "deployments": [{"name": APP_REPLICAS, "num_replicas": self.replicas}]}]}
        # What `serve deploy` sends (a config, not code): a new replica count alone restarts nothing.
        _get_global_client().deploy_apps(ServeDeploySchema.model_validate(config))
        self.local.wait_running(APP_NAME, 600)
        self.local.wait_ready("127.0.0.1", self.port, 600)

    def scale(self, replicas: int) -> None:
        self.replicas = replicas
        self.apply()
        self.wait_replicas(replicas)

    def wait_replicas(self, n: int, timeout_s: float = 300) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while True:
            live = self.live_workers()
            if len(live) == n and not self.directory_stats().get("draining"):
                return live
            if time.monotonic() > deadline:
                raise TimeoutError(f"the directory did not list {n} live replicas within {timeout_s}s: {live}")
            time.sleep(0.5)

    def directory(self):
        import ray

        from cluster.names import DIRECTORY_NAME
        return ray.get_actor(DIRECTORY_NAME, namespace="prefix-cache")

    def directory_stats(self) -> dict:
        import ray
        return ray.get(self.directory().get_stats.remote(), timeout=30)

    def live_workers(self) -> list[str]:
        import ray
        return ray.get(self.directory().live_workers.remote(), timeout=30)

    def worker_stats(self) -> dict:
        import httpx
        return httpx.get(f"http://127.0.0.1:{self.port}/v1/cache/stats", timeout=60).json().get("workers", {})

    def shutdown(self) -> None:
        self.local.shutdown()


def run_arm(arm: str, args, model: str, system: str, events: list[str]) -> list[dict]:
    from serve_app.local import DEMO_WORKER, free_port

    elastic = arm == "elastic"
    worker = {**DEMO_WORKER, "hot_blocks": args.hot_blocks,
              "handoff_s": args.handoff_s if elastic else 0.0, "warmup_s": 15.0 if elastic else 0.0}
    if args.model is not None:
        worker["model"] = args.model
    if not elastic:
        worker["l3_master"] = None
    start_replicas = 2 if events[0] == "scale_out" else 3
    cluster = Cluster(worker, args.port or free_port(), start_replicas, l3=elastic and args.l3 == "on")
    workload = Workload(f"http://127.0.0.1:{cluster.port}", model, system, args)
    thread = threading.Thread(target=lambda: asyncio.run(workload.run()), name="bench-elastic-client", daemon=True)
    rows = []
    try:
        thread.start()
        time.sleep(args.warm_s)
        for event in events:
            rows.append(_event(arm, event, args, cluster, workload))
            print(f"{arm}: {event} done ({rows[-1]['requests_after']} requests in its window)", flush=True)
        workload.stop.set()
        thread.join(timeout=300)
        lost = sum(1 for r in workload.records if not r.turn.ok)
        samples = [s for w in cluster.worker_stats().values() for s in (w.get("l3") or {}).get("fetch_samples", [])]
        for row in rows:   # over the arm: what ended badly, and what L3 fetches cost against recompute
            row["lost_requests"] = lost
            row["l3_fetch_ms_p50"] = rounded(percentile([s[0] for s in samples], 50), 2) if samples else None
            row["l3_fetch_ms_p99"] = rounded(percentile([s[0] for s in samples], 99), 2) if samples else None
            row["recompute_ms_p50"] = rounded(percentile([s[2] for s in samples], 50), 2) if samples else None
            row["recompute_ms_p99"] = rounded(percentile([s[2] for s in samples], 99), 2) if samples else None
            row["l3_fetches"] = len(samples)
    finally:
        workload.stop.set()
        cluster.shutdown()
    return rows


def _event(arm: str, event: str, args, cluster: Cluster, workload: Workload) -> dict:
    before_live = cluster.live_workers()
    at = time.monotonic()
    lifecycle_before = len(cluster.directory_stats().get("lifecycle", []))
    gone, new, dropped_s = None, None, None
    effective = at   # when the replica was gone (scale-in: once Serve stopped it)
    if event == "scale_in":
        cluster.scale(len(before_live) - 1)
        gone = (set(before_live) - set(cluster.live_workers())).pop()
        effective = time.monotonic()
    elif event == "scale_out":
        cluster.scale(len(before_live) + 1)
        new = (set(cluster.live_workers()) - set(before_live)).pop()
    elif event == "kill":
        recent = [r for r in workload.records if r.turn.ok and r.turn.started_at > at - args.window_s]
        counts: dict[str, int] = {}
        for r in recent:
            counts[r.turn.worker_id] = counts.get(r.turn.worker_id, 0) + 1
        gone = max(before_live, key=lambda w: counts.get(w, 0))
        pid = cluster.worker_stats()[gone]["worker"]["pid"]
        os.kill(pid, signal.SIGKILL)
        while gone in cluster.live_workers():
            time.sleep(0.05)
        dropped_s = time.monotonic() - at
    else:
        raise ValueError(f"unknown event {event!r}; choose from {', '.join(EVENTS)}")
    time.sleep(max(0.0, at + args.window_s - time.monotonic()))
    if event == "kill":   # Serve's replacement is up before the next event
        cluster.wait_replicas(len(before_live))
    recs = workload.records
    before = _window(recs, at - args.window_s, at)
    after = _window(recs, at, at + args.window_s)
    # The sessions the event touched, and each one's first turn after it: a session whose
    # last turn that *ended* before the replica was gone ran there, and the turn after that
    # one (a turn in flight at a kill is resumed elsewhere: it is that next turn).
    if event == "scale_out":
        first_after: dict[int, Record] = {}
        for r in recs:
            if r.turn.started_at >= at and r.session not in first_after:
                first_after[r.session] = r
        touched = [r for r in first_after.values() if r.turn.ok and r.turn.worker_id == new and r.previous_tokens]
    else:
        by_session: dict[int, list[Record]] = {}
        for r in recs:
            by_session.setdefault(r.session, []).append(r)
        touched = []
        for turns in by_session.values():
            turns.sort(key=lambda r: r.turn.started_at)
            done = [i for i, r in enumerate(turns) if r.turn.ok and r.turn.started_at + (r.turn.e2e_s or 0) < effective]
            if done and turns[done[-1]].turn.worker_id == gone and done[-1] + 1 < len(turns):
                nxt = turns[done[-1] + 1]
                if nxt.previous_tokens and nxt.turn.started_at < effective + args.window_s:
                    touched.append(nxt)
    reuse = (sum(min(r.turn.cached_tokens, r.previous_tokens) for r in touched if r.turn.ok)
             / sum(r.previous_tokens for r in touched)) if touched else None
    ttfts = [r.turn.ttft_s for r in after if r.turn.ttft_s is not None]
    prompt_after = sum(r.turn.prompt_tokens for r in after)
    l3_after = sum(int(r.turn.cached_by_tier.get("l3", 0)) for r in after)
    notes = cluster.directory_stats().get("lifecycle", [])[lifecycle_before:]
    handoff = next((n for n in notes if n["kind"] == "handoff" and n["worker_id"] == gone), None)
    warmup = next((n for n in notes if n["kind"] == "warmup" and n["worker_id"] == new), None)
    bt = args.block_tokens
    row = {"bench": "elastic", "arm": arm, "event": event, "l3": args.l3 if arm == "elastic" else "off",
           "replicas_before": len(before_live), "hit_rate_before": _hit_rate(before),
           "hit_rate_after_60s": _hit_rate(after), "window_s": args.window_s,
           "reuse_ratio_after": rounded(reuse, 4) if reuse is not None else None, "touched_sessions": len(touched),
           "ttft_ms_p50_after": _ms(ttfts, 50), "ttft_ms_p99_after": _ms(ttfts, 99),
           "ttft_ms_p50_touched": _ms([r.turn.ttft_s for r in touched if r.turn.ttft_s is not None], 50),
           "handoff_blocks": None if handoff is None else handoff["l3_blocks"] + handoff["peer_tokens"] // bt,
           "handoff_l3_blocks": None if handoff is None else handoff["l3_blocks"],
           "handoff_peer_prefixes": None if handoff is None else handoff["peer_prefixes"],
           "handoff_s": None if handoff is None else rounded(handoff["seconds"], 3),
           "warmup_blocks": None if warmup is None else warmup["tokens"] // bt,
           "warmup_s": None if warmup is None else rounded(warmup["seconds"], 3),
           "l3_hit_rate": rounded(l3_after / prompt_after, 4) if prompt_after else None,
           "requests_after": len(after)}
    if event == "scale_out":
        mine = [r for r in after if r.turn.worker_id == new]
        row["new_replica_requests"] = len(mine)
        row["new_replica_hit_rate_60s"] = _hit_rate(mine)
        row["goal_new_replica_ge_80pct_steady"] = bool(row["new_replica_hit_rate_60s"] and row["hit_rate_before"]
                                                       and row["new_replica_hit_rate_60s"]
                                                       >= 0.8 * row["hit_rate_before"])
    if event == "kill":
        row["directory_dropped_s"] = rounded(dropped_s, 3)
    return row


def run(args: argparse.Namespace) -> int:
    from cluster.engine.checkpoint import ModelSpec, load_tokenizer
    from serve_app.local import DEMO_WORKER, prepare_model

    for name in ("sessions", "turns", "max_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    events = list(EVENTS) if args.event == "all" else args.event.split(",")
    unknown = [e for e in events if e not in EVENTS]
    if unknown:
        raise ValueError(f"--event: unknown {unknown}; choose from {', '.join(EVENTS)} or all")
    arms = args.arms.split(",")
    if any(a not in ("elastic", "baseline") for a in arms):
        raise ValueError(f"--arms takes elastic and/or baseline, got {args.arms!r}")
    args.block_tokens = DEMO_WORKER["block_tokens"]
    model = prepare_model(args.model)
    system = system_prompt(load_tokenizer(ModelSpec.parse(args.model)), args.system_tokens, args.seed)
    for arm in arms:   # each arm's rows once it ended (lost requests and L3 costs are the arm's)
        for row in run_arm(arm, args, model, system, events):
            emit(row)
    return 0
