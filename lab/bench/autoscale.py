"""``prefix-cache bench autoscale``: the cache replicas autoscaled under a load that ramps up 4x and back.

    prefix-cache bench autoscale [--max-replicas 2] [--phase-s 30,80,110] [--base-rate 0.12] [--ramp 4]
        [--scale-in-idle 30] [--ttft-slo-s 2] [--arms prefix_cache,serve_default] [--seed 0]

Two arms, each on a fresh embedded local cluster (a head and two worker nodes
on loopback, the real default model, ``torch_threads`` 1 per replica, a local
L3 where Mooncake is installed), autoscaled between ``--min-replicas`` and
``--max-replicas``, the same trace (the same seed) in both:

- ``prefix_cache``: this project's policy (``serve_app/autoscaling.py``), with
  ``ttft_slo_s`` = ``--ttft-slo-s`` and ``downscale_window_s`` = ``--scale-in-idle``;
- ``serve_default``: Serve's request-count policy as Serve ships it, except
  ``downscale_delay_s`` = ``--scale-in-idle`` (Serve's own 600 s would outlast the run).

The load: sessions arrive as a Poisson process whose rate is ``--base-rate``
sessions/s in the ``base`` phase, ``--ramp`` x that in ``peak`` and the base
rate again in ``cool`` (``--phase-s``: the three lengths). Each session has its
own document of ``--doc-tokens`` (``lab.load.session_workload``), asks
``--turns`` questions with exponential pauses of mean ``--think-s`` between them,
and sends the model's real replies back. Arrivals stop at the end of ``cool``;
the sessions under way finish (each within ``--tail-s`` after it), then the
bench waits (at most ``--idle-cap-s``) for the deployment to be back at
``--min-replicas``. A sampler reads Serve's replica states and the directory's
live workers every ``--sample-s`` (each read bounded).

One row per arm (``lab.bench.autoscale_figures`` computes every figure):

- ``ttft_ms_p50_<phase>``/``ttft_ms_p99_<phase>`` and ``requests_<phase>`` (by
  when each request was sent), ``slo_attainment`` (share of all requests with
  TTFT <= ``ttft_slo_s``; failed ones miss) and ``slo_attainment_<phase>``;
- ``replica_seconds``: Serve's RUNNING replica count integrated from the load's
  start to the last answer; ``replica_seconds_idle``: from then to the end of
  the idle wait; ``scale_events``: [s after the start, before, after];
- ``scale_out_started_s``: from the load step (the start of ``peak``) to the
  first sample with more replicas starting or running than ran at the step
  (the policy's decision as Serve carried it out); ``scale_out_running_s``: to
  the first sample with more replicas RUNNING than at the step;
  ``scale_out_first_served_s``: to the first token a replica that was not live
  at the step streamed; ``first_slo_miss_after_step_s``: to the sending of the
  first request that missed the SLO (the load outrunning the replicas serving)
  and ``scale_out_running_after_miss_s``: from then to the new replica running;
- ``replica_starts``: each replica's start-up as it noted it with the directory
  (``process_to_ready_s``: from its process's start to ready to serve; Ray may
  hand an actor a worker process it started earlier, which only adds to it;
  ``process_to_imported_s``: to the worker's modules imported, ``imported_to_start_s``: from
  then to the worker's own start-up),
  and ``process_to_ready_s_max`` over the replicas started after the load began;
- ``replicas_left``: each replica that left, and when it stopped taking requests
  (the scale-in that stopped it, before the directory dropped it);
- ``crossed_scale_in_*``: the turns whose session's previous turn ran on a
  replica that had left before the turn was sent: how many, their sessions,
  ``crossed_scale_in_reuse`` (of what the previous turn left, prompt + reply,
  the share found cached; a failed turn counts 0), ``crossed_scale_in_by_tier``
  (where those cached tokens were) and how many failed;
- ``handoffs``: each stopped replica's hand-off report (blocks queued for L3,
  sequences its peers pulled); ``l3_at_end``: the live replicas' L3 counters
  (fetches, misses, skips, install failures) and ``l3_master``: the L3 pool's
  capacity, use and evictions at the end;
- ``idle_to_min_s``: from the last answer to ``min_replicas`` running, none starting
  (0 where a scale-in during ``cool`` got there first); ``peak_end_to_min_s``: the
  same from the end of ``peak``, the load back at its base rate;
- ``lost_requests``: failed requests plus those still unanswered at the deadline;
- the serving figures every row carries (``lab.load.chat_workload``):
  TTFT, TPOT p50/p99, ITL p99, e2e p50, output tok/s, cached share.

A ``summary`` row compares the arms and states the issue's goals as booleans
(``goal_*``: SLO attainment >= 0.95 and above Serve's default, at <= 1.1x its
replica-seconds; scale-out <= 15 s; a replica serving <= 8 s after its process
starts; back at the minimum within 180 s; crossing sessions keep >= 0.9, none lost).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import sys
import threading
import time

from lab.bench.autoscale_figures import (
    Phase,
    ReplicaSample,
    arrival_times,
    by_phase,
    crossing_figures,
    crossing_turns,
    idle_to_min,
    left_times,
    overload_onset,
    phase_bounds,
    phases_of,
    replica_seconds,
    scale_events,
    scale_out_reaction,
    slo_attainment,
    summary,
)
from lab.bench.common import emit, rounded
from lab.load.chat_workload import Turn, WorkloadResult, ask_turn
from lab.load.session_workload import SESSION_HEADER, PlannedSession, plan_sessions

ARMS = ("prefix_cache", "serve_default")
APP_REPLICAS = "CacheReplica"
STARTING_STATES = ("STARTING", "UPDATING", "RECOVERING", "PENDING_MIGRATION")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model spec (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--arms", default=",".join(ARMS), help="prefix_cache and/or serve_default, run in this order")
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--max-replicas", type=int, default=2, help="default 2: what this 2-core machine holds")
    p.add_argument("--phase-s", default="30,80,110", help="lengths of the base, peak and cool phases (s)")
    p.add_argument("--base-rate", type=float, default=0.12, help="sessions/s arriving in base and cool")
    p.add_argument("--ramp", type=float, default=4.0, help="peak rate / base rate (default 4)")
    p.add_argument("--turns", type=int, default=8, help="turns per session")
    p.add_argument("--think-s", type=float, default=6.0, help="mean pause between a session's turns")
    p.add_argument("--doc-tokens", type=int, default=500, help="tokens of each session's own document")
    p.add_argument("--max-tokens", type=int, default=24, help="max_tokens of a turn (drawn from 16..this)")
    p.add_argument("--ttft-slo-s", type=float, default=2.0,
                   help="the SLO: the prefix_cache policy's ttft_slo_s and the attainment's bound")
    p.add_argument("--scale-in-idle", type=float, default=30.0,
                   help="prefix_cache's downscale_window_s and serve_default's downscale_delay_s (s)")
    p.add_argument("--tail-s", type=float, default=120.0, help="after cool, the sessions under way finish within")
    p.add_argument("--idle-cap-s", type=float, default=180.0,
                   help="longest wait after the last answer for min_replicas (the goal's 3 minutes)")
    p.add_argument("--sample-s", type=float, default=0.5, help="replica sampling period")
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--raw", default=None, metavar="FILE",
                   help="also append each arm's samples, the workers' loads and the requests to FILE "
                        "(one JSON line per arm)")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)


def check(args: argparse.Namespace) -> tuple[list[str], list[Phase]]:
    """The arms and phases the arguments ask for, or a ValueError that says what to change
    (before the model loads or a cluster starts)."""
    arms = args.arms.split(",")
    if not arms or any(a not in ARMS for a in arms):
        raise ValueError(f"--arms takes {' and/or '.join(ARMS)}, got {args.arms!r}")
    if not 0 <= args.min_replicas <= args.max_replicas or args.max_replicas < 1:
        raise ValueError(f"need 0 <= --min-replicas <= --max-replicas and --max-replicas >= 1, "
                         f"got {args.min_replicas} and {args.max_replicas}")
    for name in ("turns", "doc_tokens", "max_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("ttft_slo_s", "sample_s", "request_timeout_s"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    try:
        durations = [float(x) for x in args.phase_s.split(",")]
    except ValueError:
        raise ValueError(f"--phase-s takes three numbers of seconds, got {args.phase_s!r}") from None
    return arms, phases_of(durations, args.base_rate, args.ramp)


def app_args(arm: str, args: argparse.Namespace, worker: dict) -> dict:
    """The app's args for one arm: the same bounds, the arm's policy."""
    bounds = {"min_replicas": args.min_replicas, "max_replicas": args.max_replicas}
    out = {"worker": worker, "admin_without_keys": True,
           "limits": {"max_prompt_tokens": 8192, "max_tokens": 1024}}
    if arm == "prefix_cache":
        out.update(autoscaling_config=bounds, autoscaling_policy="prefix_cache",
                   autoscaling_policy_args={"ttft_slo_s": args.ttft_slo_s, "downscale_window_s": args.scale_in_idle})
    else:
        out.update(autoscaling_config={**bounds, "downscale_delay_s": args.scale_in_idle},
                   autoscaling_policy="serve_default")
    return out


class Sampler:
    """Serve's replica states and the directory's live workers every ``period_s``, each read bounded
    (a read that times out is a missing sample, never a stall). With ``loads``, also each live
    worker's load as the directory last heard it (queued tokens: the waiting prompt tokens the
    cache did not serve plus the running requests' tokens still to decode; running requests):
    ``self.loads``, one (s after the start, {worker: [queued_tokens, running]}) per sample."""

    def __init__(self, t0: float, period_s: float, timeout_s: float = 5.0, loads: bool = False):
        self.t0, self.period_s, self.timeout_s, self.with_loads = t0, period_s, timeout_s, loads
        self.samples: list[ReplicaSample] = []
        self.loads: list[tuple[float, dict[str, list[int]]]] = []
        self.missed = 0
        self._stop = threading.Event()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="autoscale-sampler-read")
        self._thread = threading.Thread(target=self._loop, name="autoscale-sampler", daemon=True)

    def start(self) -> "Sampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.timeout_s + self.period_s + 1)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def latest(self) -> ReplicaSample | None:
        return self.samples[-1] if self.samples else None

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                running, starting, live, loads = self._pool.submit(self._read).result(timeout=self.timeout_s)
                at = time.monotonic() - self.t0
                self.samples.append(ReplicaSample(at, running, starting, live))
                if loads is not None:
                    self.loads.append((at, loads))
            except Exception:   # a slow controller or directory: this sample is missing, say how many
                self.missed += 1
            self._stop.wait(self.period_s)

    def _read(self) -> tuple[int, int, tuple[str, ...], dict[str, list[int]] | None]:
        import ray
        from ray import serve

        from cluster.names import DIRECTORY_NAME
        from serve_app.app import APP_NAME

        app = serve.status().applications.get(APP_NAME)
        states = {}
        if app is not None and APP_REPLICAS in app.deployments:
            states = {getattr(k, "value", str(k)): v for k, v in app.deployments[APP_REPLICAS].replica_states.items()}
        directory = ray.get_actor(DIRECTORY_NAME, namespace="prefix-cache")
        loads = None
        if self.with_loads:
            workers = ray.get(directory.get_stats.remote(), timeout=self.timeout_s)["workers"]
            live = list(workers)
            loads = {w[-8:]: [int(v["queued_tokens"]), int(v["running"])] for w, v in workers.items()}
        else:
            live = ray.get(directory.live_workers.remote(), timeout=self.timeout_s)
        return (int(states.get("RUNNING", 0)), sum(int(states.get(s, 0)) for s in STARTING_STATES),
                tuple(sorted(live)), loads)


@dataclasses.dataclass
class LoadRun:
    turns: list[Turn]
    in_flight_at_deadline: int
    wall_s: float


async def run_load(base: str, model: str, plan: list[PlannedSession], system: str, t0: float,
                   deadline_s: float, timeout_s: float) -> LoadRun:
    """Every session of ``plan`` at its ``start_s`` after ``t0`` (monotonic), turns after their pauses;
    what is still unanswered ``deadline_s`` after ``t0`` is cancelled and counted."""
    import httpx

    turns: list[Turn] = []
    in_flight = [0]

    async def one(s: PlannedSession, http) -> None:
        await asyncio.sleep(max(0.0, t0 + s.start_s - time.monotonic()))
        messages = [{"role": "system", "content": system}]
        for planned in s.turns:
            if planned.turn:
                await asyncio.sleep(planned.pause_s)
            messages.append({"role": "user", "content": s.first_message(planned) if planned.turn == 0
                             else planned.question})
            in_flight[0] += 1
            try:
                turn, reply = await ask_turn(http, model, messages, s.session, planned.turn, planned.max_tokens,
                                             headers={SESSION_HEADER: s.session_id})
            finally:
                in_flight[0] -= 1
            turns.append(turn)
            if not turn.ok:
                return
            messages.append({"role": "assistant", "content": reply})

    limits = httpx.Limits(max_connections=len(plan) + 4, max_keepalive_connections=len(plan) + 4)
    async with httpx.AsyncClient(base_url=base, timeout=timeout_s, limits=limits) as http:
        tasks = [asyncio.ensure_future(one(s, http)) for s in plan]
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, t0 + deadline_s - time.monotonic()))
        left = in_flight[0]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return LoadRun(turns, left, time.monotonic() - t0)


def wait_for_min(sampler: Sampler, last_answer: float, min_replicas: int, cap_s: float) -> None:
    """Until a sample after ``last_answer`` shows ``min_replicas`` running and none starting, or ``cap_s``."""
    while time.monotonic() - sampler.t0 < last_answer + cap_s:
        s = sampler.latest()
        if s is not None and s.at >= last_answer and s.running <= min_replicas and s.starting == 0:
            return
        time.sleep(sampler.period_s)


def start_figures(notes: list[dict], load_wall: float) -> dict:
    """Each replica's start-up note (kind ``startup``) and the longest process-to-ready of those
    started after the load began (``load_wall``: its wall-clock start)."""
    starts = []
    for n in notes:
        if n.get("kind") != "startup":
            continue
        proc = n.get("process_started_at")
        starts.append({"worker_id": n["worker_id"][-8:], "started_after_load_s": rounded(n["started_at"] - load_wall, 2),
                       "core_s": n.get("core_s"), "total_s": n.get("total_s"),
                       "process_to_ready_s": rounded(n["ready_at"] - proc, 2) if proc else None,
                       # the process's start to the worker imported, then to the worker's start
                       "process_to_imported_s": rounded(n["imported_at"] - proc, 2)
                       if proc and n.get("imported_at") else None,
                       "imported_to_start_s": rounded(n["started_at"] - n["imported_at"], 2)
                       if n.get("imported_at") else None,
                       "core_parts": n.get("core_parts")})
    later = [s["process_to_ready_s"] for s in starts
             if s["started_after_load_s"] > 0 and s["process_to_ready_s"] is not None]
    return {"replica_starts": starts, "process_to_ready_s_max": max(later) if later else None}


HANDOFF_KEYS = ("l3_blocks", "l3_prefixes", "of_prefixes", "l3_flushed", "peer_prefixes", "peer_tokens", "seconds")
L3_KEYS = ("fetches", "fetch_blocks_asked", "fetch_blocks_hit", "fetch_misses", "fetch_skipped_slower",
           "fetch_unanswered", "install_failures", "installed_tokens", "writes_dropped", "write_failures")


def handoff_figures(notes: list[dict]) -> list[dict]:
    """Each replica's hand-off as it noted it with the directory (kind ``handoff``)."""
    return [{"worker_id": n["worker_id"][-8:], **{k: rounded(n[k], 2) if isinstance(n.get(k), float) else n.get(k)
                                                  for k in HANDOFF_KEYS}}
            for n in notes if n.get("kind") == "handoff"]


def l3_counters(base: str) -> dict:
    """The live replicas' L3 counters at the end (``GET /v1/cache/stats``; {} when it does not answer)."""
    import httpx

    try:
        workers = httpx.get(base + "/v1/cache/stats", timeout=30).json().get("workers", {})
    except (httpx.HTTPError, ValueError):
        return {}
    out = {}
    for w, st in workers.items():
        l3 = st.get("l3") or {}
        out[w[-8:]] = {**{k: l3.get(k) for k in L3_KEYS}, "put_failures": (l3.get("store") or {}).get("put_failures")}
    return out


MASTER_METRICS = ("master_total_capacity_bytes", "master_allocated_bytes", "master_key_count",
                  "master_evicted_key_count", "master_evicted_size_bytes")


def master_counters(url: str) -> dict:
    """The L3 master's pool and evictions at the end (its Prometheus text; {} when it does not answer):
    a full pool evicts, and a session missing one block of its run reads only what comes before it."""
    import httpx

    try:
        text = httpx.get(url, timeout=10).text
    except httpx.HTTPError:
        return {}
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in MASTER_METRICS:
            out[name.removeprefix("master_")] = int(float(value))
    return out


def arm_row(arm: str, args, phases: list[Phase], load: LoadRun, samples: list[ReplicaSample], t0: float,
            notes: list[dict], load_wall: float) -> dict:
    """One arm's figures from what it recorded."""
    turns = load.turns
    answered = [t.started_at - t0 + t.e2e_s for t in turns if t.ok and t.e2e_s is not None]
    last_answer = max(answered) if answered else sum(p.duration_s for p in phases)
    step_at = phase_bounds(phases)[1][1]
    serving = WorkloadResult(turns=turns, wall_s=last_answer).summary()
    row = {"bench": "autoscale", "arm": arm, "seed": args.seed, "min_replicas": args.min_replicas,
           "max_replicas": args.max_replicas, "ttft_slo_s": args.ttft_slo_s, "scale_in_idle_s": args.scale_in_idle,
           "phases": [[p.name, p.duration_s, p.sessions_per_s] for p in phases], "torch_threads": 1,
           "sessions": len({t.session for t in turns}), **serving,
           "lost_requests": serving["failed"] + load.in_flight_at_deadline,
           "unanswered_at_deadline": load.in_flight_at_deadline,
           "slo_attainment": slo_attainment(turns, args.ttft_slo_s)}
    row.update(by_phase(turns, phases, t0, args.ttft_slo_s))
    end = samples[-1].at if samples else last_answer
    row.update({"replica_seconds": rounded(replica_seconds(samples, 0.0, last_answer), 1),
                "replica_seconds_idle": rounded(replica_seconds(samples, last_answer, end), 1),
                "replicas_max_seen": max((s.running for s in samples), default=None),
                "scale_events": [[rounded(at, 1), a, b] for at, a, b in scale_events(samples)],
                "last_answer_s": rounded(last_answer, 2)})
    row.update(scale_out_reaction(samples, turns, step_at, t0))
    row.update(overload_onset(turns, step_at, t0, args.ttft_slo_s, row["scale_out_running_s"]))
    gone = left_times(samples)
    row["replicas_left"] = [[w[-8:], rounded(at, 1)] for w, at in sorted(gone.items(), key=lambda g: g[1])]
    row.update(crossing_figures(crossing_turns(turns, gone, t0)))
    row["idle_to_min_s"] = idle_to_min(samples, last_answer, args.min_replicas)
    row["peak_end_to_min_s"] = idle_to_min(samples, phase_bounds(phases)[1][2], args.min_replicas)
    row.update(start_figures(notes, load_wall))
    return row


def write_raw(path: str, arm: str, samples: list[ReplicaSample], turns: list[Turn], t0: float,
              loads: list[tuple[float, dict]] | None = None) -> None:
    """One JSON line: the arm's replica samples, the workers' loads (``Sampler.loads``) and its
    requests (times in s after the load's start)."""
    import json

    record = {"arm": arm, "samples": [[rounded(s.at, 3), s.running, s.starting, list(s.live)] for s in samples],
              "loads": [[rounded(at, 3), w] for at, w in loads or []],
              "turns": [{"session": t.session, "turn": t.turn, "ok": t.ok, "sent_s": rounded(t.started_at - t0, 3),
                         "ttft_s": t.ttft_s, "e2e_s": t.e2e_s, "worker_id": t.worker_id, "prompt": t.prompt_tokens,
                         "completion": t.completion_tokens, "cached": t.cached_tokens,
                         "cached_by_tier": t.cached_by_tier, "error": t.error}
                        for t in turns]}
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def run_arm(arm: str, args, phases: list[Phase], plan: list[PlannedSession], system: str, model: str) -> dict:
    import ray

    from cluster.names import DIRECTORY_NAME
    from serve_app.local import DEMO_WORKER, LocalCluster, free_port

    worker = dict(DEMO_WORKER)
    if args.model is not None:
        worker["model"] = args.model
    local = LocalCluster(worker_nodes=2, l3_pool_mb=1024)
    try:
        port = args.port or free_port()
        local.deploy(app_args(arm, args, worker), port=port, timeout_s=600)
        print(f"{arm}: deployed, load starts", flush=True)
        t0, load_wall = time.monotonic(), time.time()
        sampler = Sampler(t0, args.sample_s, loads=bool(args.raw)).start()
        total = sum(p.duration_s for p in phases)
        load = asyncio.run(run_load(f"http://127.0.0.1:{port}", model, plan, system, t0, total + args.tail_s,
                                    args.request_timeout_s))
        answered = [t.started_at - t0 + t.e2e_s for t in load.turns if t.ok and t.e2e_s is not None]
        print(f"{arm}: load done ({len(load.turns)} requests), waiting for min_replicas", flush=True)
        wait_for_min(sampler, max(answered) if answered else total, args.min_replicas, args.idle_cap_s)
        sampler.stop()
        directory = ray.get_actor(DIRECTORY_NAME, namespace="prefix-cache")
        notes = ray.get(directory.get_stats.remote(), timeout=30).get("lifecycle", [])
        row = arm_row(arm, args, phases, load, list(sampler.samples), t0, notes, load_wall)
        row["samples_missed"] = sampler.missed
        row["handoffs"] = handoff_figures(notes)
        row["l3_at_end"] = l3_counters(f"http://127.0.0.1:{port}")
        row["l3_master"] = master_counters(local.l3.metrics_url) if local.l3 is not None else None
        if args.raw:
            write_raw(args.raw, arm, list(sampler.samples), load.turns, t0, list(sampler.loads))
        return row
    finally:
        local.shutdown()


def run(args: argparse.Namespace) -> int:
    from cluster.engine.checkpoint import ModelSpec, load_tokenizer
    from serve_app.local import prepare_model

    try:
        arms, phases = check(args)
    except ValueError as exc:
        raise SystemExit(f"prefix-cache bench autoscale: {exc}") from None
    model = prepare_model(args.model)
    tokenizer = load_tokenizer(ModelSpec.parse(args.model))
    starts = arrival_times(phases, args.seed)
    sessions = plan_sessions(tokenizer, sessions=max(1, len(starts)), turns=args.turns, doc_tokens=args.doc_tokens,
                             arrival_s=0.0, think_s=args.think_s, long_pause_share=0.0, long_pause_s=0.0,
                             max_tokens=args.max_tokens, seed=args.seed)
    plan = [dataclasses.replace(s, start_s=t) for s, t in zip(sessions, starts or [0.0])]
    system = "You answer questions about the document the user gives you, briefly."
    print(f"{len(plan)} sessions of {args.turns} turns over {sum(p.duration_s for p in phases):.0f} s "
          f"({', '.join(f'{p.name} {p.sessions_per_s:g}/s' for p in phases)})", flush=True)
    rows = {}
    for arm in arms:
        rows[arm] = run_arm(arm, args, phases, plan, system, model)
        emit(rows[arm])
    if set(ARMS) <= set(rows):
        emit(summary(rows["prefix_cache"], rows["serve_default"]))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="prefix-cache bench autoscale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--results", default=None, help="also append the JSON lines to FILE")
    _args = parser.parse_args()
    from cluster import results

    results.RESULTS_FILE = _args.results
    sys.exit(run(_args))
