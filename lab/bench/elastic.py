"""``prefix-cache bench elastic``: the cache across scale-in, scale-out and a crash, with and without its lifetime parts.

    prefix-cache bench elastic [--model SPEC] [--sessions 36] [--turns 8] [--think-s 4]
        [--event scale_in|scale_out|kill|all] [--l3 on|off] [--window-s 60] [--warm-s 60] [--repeats 3]

Two arms, each on the embedded local cluster (real Serve replicas, the real
model, a real ``mooncake_master``), the same client:

- ``elastic``: L3 (write behind, fetch ahead), hand-off on scale-in, warm-up on
  scale-out (``--l3 off``: hand-off to peers and warm-up from peers only);
- ``baseline``: no L3, no hand-off, no warm-up: every replica's cache is its own.

The whole arm set runs ``--repeats`` times (default 3), a fresh cluster for
every arm and repeat, the arms' order alternating so that neither always runs
first on a machine that warms up or gets busier: repeat 0 runs ``--arms`` in
the order given, repeat 1 reversed, repeat 2 as given, and so on.

A multi-turn chat workload runs throughout: ``--sessions`` sessions at once
(default 36: about 12 on each of 3 replicas, so that the replica an event
removes carries 12 or more; ``goal_touched_ge_12`` says whether it did), each
sharing one system prompt, sending the model's real replies back, with
``--think-s`` between turns (default 4 s, chosen so that 36 sessions of
SmolLM2-135M stay within what 2 CPU cores serve); a session that
reached ``--turns`` turns starts over as a new one. After ``--warm-s`` the
events happen in order, each followed by a ``--window-s`` window: ``scale_in``
(3 -> 2 replicas through a Serve config update, the way ``serve deploy`` and
KubeRay scale), ``scale_out`` (2 -> 3) and ``kill`` (``kill -9`` of the
replica serving the most sessions; Serve replaces it). A run takes about
repeats x arms x (start-up + ``--warm-s`` + events x ``--window-s``): with
the defaults, over 40 minutes. One JSON row per event, arm and repeat
(``"repeat": i``), printed when the arm ends:

- ``hit_rate_before``: cached / prompt tokens in the window before the event;
  ``hit_rate_after_60s``: the same in the window after it;
- ``touched_sessions``: the sessions the event touched (their last turn
  that ended before the event began ran on the replica that left or died:
  a scale-in drains it first, so sessions move off it during the hand-off;
  for scale-out, the sessions whose first turn on the new replica came in
  the window, their previous turn elsewhere); ``goal_touched_ge_12``: whether
  there were at least 12 (fewer make the two ratios below noise);
- ``reuse_ratio_after``: for the touched sessions, each one's first turn
  after the event: sum of min(cached tokens, previous turn's prompt + reply)
  over sum of the previous turns' prompt + reply (a failed turn counts 0 cached);
- ``reuse_ratio_own_after``: the same with the system prompt every replica
  holds anyway taken out of both sides: per turn max(0, min(cached, previous)
  - S) over previous - S, where S is ``system_prompt_tokens``: the exact
  length of the token prefix that every session's first prompt shares, found
  once from the server's own prompt builder (``ChatPromptBuilder``): the chat
  template of [system, question] for every question the workload asks, and
  their longest common token prefix (the templated system turn and the next
  turn's header). This is the part of a session's own history the event
  kept; ``reuse_ratio_after`` also counts the shared prompt every replica had;
- ``ttft_ms_p50_after``, ``ttft_ms_p99_after``: the window after the event;
  ``ttft_ms_p50_touched``: the touched turns';
- ``handoff_blocks``, ``handoff_s``, ``warmup_blocks``, ``warmup_s``: the
  replica's own reports (the directory keeps them);
- ``l3_hit_rate``: tokens read from L3 over prompt tokens in the window after;
- over the whole arm (the same in each of its rows): ``l3_fetches``,
  ``l3_fetch_ms_p50/p99`` and ``l3_fetch_tokens_p50``: the replicas' timed L3
  fetches (their latest 512 each); ``recompute_ms_p50/p99``: an *estimate*,
  each fetch's tokens over the replica's prefill rate calibrated at start-up
  (best of two fresh prompts of up to 256 tokens, ``actors.calibration``);
  ``recompute_measured_ms_p50/p99``: *measured*: once the workload stopped,
  up to 8 of the fetches' token counts (spread over their sorted order,
  smallest and largest included) are sent one at a time as fresh prompts of
  about that many tokens that no cache holds (a unique nonce first, then
  random words; ``max_tokens`` 1), and each is timed by the replica's own
  timing of it (``recompute_measured_by``: ``"replica_prefix_load+first_forward"``,
  from the response's ``prefix_cache.timing_ms``: admitting the prompt and the
  forward over it, every prefill chunk included), or by the client's time to
  first token where a response carries no timing (``"client_ttft"``);
  ``recompute_measured_probes`` (``_failed``: those that got no answer, each
  printed) and ``recompute_measured_tokens_p50`` (the probes' uncached prompt
  tokens) say what was timed; with 8 probes the p99 is their slowest. The
  probes recompute from an empty cache: the fetched tokens recomputed after
  a cached prefix attend to more, so this is the lower side of recompute.
  None without L3 fetches (the baseline arm, ``--l3 off``);
- ``new_replica_hit_rate_60s`` (scale-out): the new replica's own;
- ``lost_requests``: requests that failed (an error status, an error event, a
  cut stream) in the whole arm.

After all repeats, one summary row per arm and event:
``{"bench": "elastic", "summary": true, "arm", "event", "repeats": N, ...}``
with ``<field>_median``, ``<field>_min`` and ``<field>_max`` for every numeric
field of the per-repeat rows (None values left out; None where all were
None), ``<field>_true`` (in how many repeats it held) for every yes/no goal,
and text fields and settings (``l3``, ``recompute_measured_by``,
``window_s``, ``replicas_before``, ``system_prompt_tokens``) as they were (a
sorted list where the repeats differ).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

from lab.bench.common import emit, percentile, rounded
from lab.bench.elastic_figures import (  # pure
    Happening,
    Record,
    hit_rate,
    in_window,
    ms_at,
    reuse_ratio,
    summarize,
    touched_turns,
)
from lab.load.chat_workload import QUESTIONS, WORDS, Turn, ask_turn, system_prompt

EVENTS = ("scale_in", "scale_out", "kill")
ARMS = ("elastic", "baseline")
APP_REPLICAS = "CacheReplica"
TOUCHED_GOAL = 12     # sessions an event must touch for its reuse ratios to say something
PROBES = 8            # fresh prompts timed per arm for the measured recompute


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model spec (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--sessions", type=int, default=36, help="sessions at once (about 12 per replica at 3)")
    p.add_argument("--turns", type=int, default=8, help="turns of a session before it starts over as a new one")
    p.add_argument("--event", default="all", help="scale_in, scale_out, kill or all (in that order)")
    p.add_argument("--l3", choices=("on", "off"), default="on", help="L3 in the elastic arm (default on)")
    p.add_argument("--arms", default="elastic,baseline")
    p.add_argument("--repeats", type=int, default=3,
                   help="times the whole arm set runs, the arms' order alternating (default 3)")
    p.add_argument("--system-tokens", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--think-s", type=float, default=4.0, help="pause between a session's turns")
    p.add_argument("--warm-s", type=float, default=60.0, help="workload time before the first event")
    p.add_argument("--window-s", type=float, default=60.0, help="measured window after each event")
    p.add_argument("--hot-blocks", type=int, default=512, help="HOT blocks per replica")
    p.add_argument("--handoff-s", type=float, default=20.0)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)


def plan(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The events and the arms the arguments ask for, or a ValueError that says what to change
    (checked before the model loads or a cluster starts)."""
    for name in ("sessions", "turns", "max_tokens", "repeats"):
        value = getattr(args, name)
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    events = list(EVENTS) if args.event == "all" else args.event.split(",")
    unknown = [e for e in events if e not in EVENTS]
    if unknown:
        raise ValueError(f"--event: unknown {unknown}; choose from {', '.join(EVENTS)} or all")
    arms = args.arms.split(",")
    if any(a not in ARMS for a in arms):
        raise ValueError(f"--arms takes elastic and/or baseline, got {args.arms!r}")
    return events, arms


def arm_order(arms: list[str], repeat: int) -> list[str]:
    """The arms of one repeat: as given on even repeats, reversed on odd ones, so that a machine
    getting warmer or busier over the run favours neither arm."""
    return list(arms) if repeat % 2 == 0 else list(reversed(arms))


def shared_prompt_tokens(prompts, system: str) -> int:
    """The tokens every session's prompt shares: the longest common token prefix of the first
    prompt of every question the workload asks, as the server builds it (``prompts``: a
    ``ChatPromptBuilder``): the templated system turn and the header of the turn after it."""
    firsts = [prompts.build([{"role": "system", "content": system}, {"role": "user", "content": q}]).ids
              for q in QUESTIONS]
    return len(os.path.commonprefix(firsts))


def probe_sizes(tokens: list[int], k: int = PROBES) -> list[int]:
    """Up to ``k`` of the fetches' token counts, evenly spread over their sorted order (the smallest
    and the largest included), so that the probes' percentiles stand for the fetches'."""
    ordered = sorted(tokens)
    if len(ordered) <= k:
        return ordered
    return [ordered[round(i * (len(ordered) - 1) / max(1, k - 1))] for i in range(k)]


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


class Cluster:
    """The local cluster and the app deployed from a config, as ``serve deploy`` does:
    changing ``CacheReplica``'s ``num_replicas`` is then a lightweight update
    (Serve adds or stops replicas; the others keep running)."""

    def __init__(self, worker: dict, port: int, replicas: int, l3: bool):
        from serve_app.local import LocalCluster

        self.local = LocalCluster(worker_nodes=2, l3_pool_mb=1024 if l3 else 0)
        if self.local.l3 is not None:
            worker = {**worker, "l3_master": self.local.l3.address, "l3_master_http": self.local.l3.http_address}
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


@dataclass(frozen=True)
class Setup:
    """What every arm and repeat shares: the served model's name, the system prompt, its exact
    token count in a templated prompt, and the server's own prompt builder (for the probes)."""
    model: str
    system: str
    system_tokens: int
    prompts: object   # cluster.engine.text.ChatPromptBuilder over the model's tokenizer


def run_arm(arm: str, args, setup: Setup, events: list[str], repeat: int) -> list[dict]:
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
    workload = Workload(f"http://127.0.0.1:{cluster.port}", setup.model, setup.system, args)
    thread = threading.Thread(target=lambda: asyncio.run(workload.run()), name="bench-elastic-client", daemon=True)
    rows = []
    try:
        thread.start()
        time.sleep(args.warm_s)
        for event in events:
            rows.append(_event(arm, event, args, cluster, workload, setup, repeat))
            print(f"{arm} (repeat {repeat}): {event} done ({rows[-1]['requests_after']} requests in its window)",
                  flush=True)
        workload.stop.set()
        thread.join(timeout=300)
        figures = _arm_figures(cluster, workload, setup, args.seed * 1000 + repeat)
        for row in rows:   # over the arm: what ended badly, and what L3 fetches cost against recompute
            row.update(figures)
    finally:
        workload.stop.set()
        cluster.shutdown()
    return rows


def _arm_figures(cluster: Cluster, workload: Workload, setup: Setup, seed: int) -> dict:
    """The arm's lost requests and its L3 fetches against recompute (estimated and measured),
    once its workload stopped and before its cluster goes."""
    samples = [s for w in cluster.worker_stats().values() for s in (w.get("l3") or {}).get("fetch_samples", [])]
    fetch_ms, tokens, estimate_ms = [s[0] for s in samples], [s[1] for s in samples], [s[2] for s in samples]

    def p(values: list[float], q: float) -> float | None:
        return rounded(percentile(values, q), 2) if values else None

    out = {"lost_requests": sum(1 for r in workload.records if not r.turn.ok),
           "l3_fetch_ms_p50": p(fetch_ms, 50), "l3_fetch_ms_p99": p(fetch_ms, 99),
           "recompute_ms_p50": p(estimate_ms, 50), "recompute_ms_p99": p(estimate_ms, 99),
           "l3_fetches": len(samples), "l3_fetch_tokens_p50": p(tokens, 50)}
    out.update(measure_recompute(f"http://127.0.0.1:{cluster.port}", setup, probe_sizes(tokens), seed))
    return out


def measure_recompute(base: str, setup: Setup, sizes: list[int], seed: int) -> dict:
    """Fresh prompts of about ``sizes`` tokens, one at a time on the idle app, each timed by the
    replica (admission and the forward over it) or, without its timing, by the client's TTFT."""
    rng = random.Random(seed)
    chats = [fresh_messages(setup.prompts, n, rng, f"probe-{uuid.uuid4().hex[:12]}") for n in sizes]

    async def ask_all() -> list[Turn]:
        import httpx

        async with httpx.AsyncClient(base_url=base, timeout=300) as http:
            return [(await ask_turn(http, setup.model, chat, -1, i, 1))[0] for i, chat in enumerate(chats)]

    answered = asyncio.run(ask_all()) if chats else []
    turns = [t for t in answered if t.ok]
    for t in answered:
        if not t.ok:
            print(f"recompute probe {t.turn} failed: {t.error}", flush=True)
    by_replica = bool(turns) and all("first_forward" in t.timing_ms for t in turns)
    if by_replica:
        ms = [float(t.timing_ms.get("prefix_load") or 0.0) + float(t.timing_ms["first_forward"]) for t in turns]
    else:   # TTFT, or the whole request where the one token carried no text
        ms = [(t.ttft_s if t.ttft_s is not None else t.e2e_s) * 1e3 for t in turns]
    uncached = [t.prompt_tokens - t.cached_tokens for t in turns]
    return {"recompute_measured_ms_p50": rounded(percentile(ms, 50), 2) if ms else None,
            "recompute_measured_ms_p99": rounded(percentile(ms, 99), 2) if ms else None,
            "recompute_measured_by": None if not turns else
            ("replica_prefix_load+first_forward" if by_replica else "client_ttft"),
            "recompute_measured_probes": len(turns), "recompute_measured_probes_failed": len(answered) - len(turns),
            "recompute_measured_tokens_p50": percentile(uncached, 50) if uncached else None}


def fresh_messages(prompts, tokens: int, rng: random.Random, nonce: str) -> list[dict]:
    """A chat whose prompt (as the server builds it, ``prompts``) has the fewest words that reach
    ``tokens`` tokens, and that no cache holds: ``nonce`` opens the system turn (a system turn of
    its own, or the template would add its default one, the same in every probe)."""
    words = [rng.choice(WORDS) for _ in range(max(8, 2 * tokens))]   # more than enough: a word is a token or more

    def chat(n: int) -> list[dict]:
        return [{"role": "system", "content": " ".join([nonce, *words[:n]])}, {"role": "user", "content": "Go on."}]

    lo, hi = 0, len(words)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(prompts.build(chat(mid)).ids) >= tokens:
            hi = mid
        else:
            lo = mid + 1
    return chat(lo)


def _trigger(event: str, args, cluster: Cluster, workload: Workload) -> Happening:
    h = Happening(cluster.live_workers(), time.monotonic(), 0.0)
    h.effective = h.at
    if event == "scale_in":
        cluster.scale(len(h.before_live) - 1)
        h.gone = (set(h.before_live) - set(cluster.live_workers())).pop()
        h.effective = time.monotonic()
    elif event == "scale_out":
        cluster.scale(len(h.before_live) + 1)
        h.new = (set(cluster.live_workers()) - set(h.before_live)).pop()
    elif event == "kill":
        counts = Counter(r.turn.worker_id for r in workload.records
                         if r.turn.ok and r.turn.started_at > h.at - args.window_s)
        h.gone = max(h.before_live, key=lambda w: counts.get(w, 0))
        os.kill(cluster.worker_stats()[h.gone]["worker"]["pid"], signal.SIGKILL)
        while h.gone in cluster.live_workers():
            time.sleep(0.05)
        h.dropped_s = time.monotonic() - h.at
    else:
        raise ValueError(f"unknown event {event!r}; choose from {', '.join(EVENTS)}")
    return h


def _event(arm: str, event: str, args, cluster: Cluster, workload: Workload, setup: Setup, repeat: int) -> dict:
    lifecycle_before = len(cluster.directory_stats().get("lifecycle", []))
    h = _trigger(event, args, cluster, workload)
    time.sleep(max(0.0, h.at + args.window_s - time.monotonic()))
    if event == "kill":   # Serve's replacement is up before the next event
        cluster.wait_replicas(len(h.before_live))
    recs = list(workload.records)
    touched = touched_turns(event, recs, h, args.window_s)
    notes = cluster.directory_stats().get("lifecycle", [])[lifecycle_before:]
    row = {"bench": "elastic", "arm": arm, "event": event, "repeat": repeat,
           "l3": args.l3 if arm == "elastic" else "off", "replicas_before": len(h.before_live)}
    row.update(_event_figures(recs, h, touched, args.window_s, setup.system_tokens))
    row.update(_lifecycle_figures(notes, h, args.block_tokens))
    after = in_window(recs, h.at, h.at + args.window_s)
    prompt_after = sum(r.turn.prompt_tokens for r in after)
    l3_after = sum(int(r.turn.cached_by_tier.get("l3", 0)) for r in after)
    row["l3_hit_rate"] = rounded(l3_after / prompt_after, 4) if prompt_after else None
    row["requests_after"] = len(after)
    if event == "scale_out":
        mine = [r for r in after if r.turn.worker_id == h.new]
        row["new_replica_requests"] = len(mine)
        row["new_replica_hit_rate_60s"] = hit_rate(mine)
        row["goal_new_replica_ge_80pct_steady"] = bool(row["new_replica_hit_rate_60s"] and row["hit_rate_before"]
                                                       and row["new_replica_hit_rate_60s"]
                                                       >= 0.8 * row["hit_rate_before"])
    if event == "kill":
        row["directory_dropped_s"] = rounded(h.dropped_s, 3)
    return row


def _event_figures(recs: list[Record], h: Happening, touched: list[Record], window_s: float,
                   system_tokens: int) -> dict:
    """Hit rates around the event, the touched sessions' reuse (with and without the shared
    system prompt) and the TTFTs after it."""
    before = in_window(recs, h.at - window_s, h.at)
    after = in_window(recs, h.at, h.at + window_s)
    cached = [r.turn.cached_tokens if r.turn.ok else 0 for r in touched]
    previous = [r.previous_tokens for r in touched]
    ttfts = [r.turn.ttft_s for r in after if r.turn.ttft_s is not None]
    return {"hit_rate_before": hit_rate(before), "hit_rate_after_60s": hit_rate(after), "window_s": window_s,
            "reuse_ratio_after": reuse_ratio(cached, previous),
            "reuse_ratio_own_after": reuse_ratio(cached, previous, system_tokens),
            "system_prompt_tokens": system_tokens,
            "touched_sessions": len(touched), "goal_touched_ge_12": len(touched) >= TOUCHED_GOAL,
            "ttft_ms_p50_after": ms_at(ttfts, 50), "ttft_ms_p99_after": ms_at(ttfts, 99),
            "ttft_ms_p50_touched": ms_at([r.turn.ttft_s for r in touched if r.turn.ttft_s is not None], 50)}


def _lifecycle_figures(notes: list[dict], h: Happening, block_tokens: int) -> dict:
    """The hand-off of the replica that left and the warm-up of the one that came, as they reported them."""
    handoff = next((n for n in notes if n["kind"] == "handoff" and n["worker_id"] == h.gone), None)
    warmup = next((n for n in notes if n["kind"] == "warmup" and n["worker_id"] == h.new), None)
    bt = block_tokens
    return {"handoff_blocks": None if handoff is None else handoff["l3_blocks"] + handoff["peer_tokens"] // bt,
            "handoff_l3_blocks": None if handoff is None else handoff["l3_blocks"],
            "handoff_peer_prefixes": None if handoff is None else handoff["peer_prefixes"],
            "handoff_s": None if handoff is None else rounded(handoff["seconds"], 3),
            "warmup_blocks": None if warmup is None else warmup["tokens"] // bt,
            "warmup_s": None if warmup is None else rounded(warmup["seconds"], 3)}


def run(args: argparse.Namespace) -> int:
    from cluster.engine.checkpoint import ModelSpec, load_tokenizer
    from cluster.engine.text import ChatPromptBuilder
    from serve_app.local import DEMO_WORKER, prepare_model

    events, arms = plan(args)
    args.block_tokens = DEMO_WORKER["block_tokens"]
    model = prepare_model(args.model)
    tokenizer = load_tokenizer(ModelSpec.parse(args.model))
    system = system_prompt(tokenizer, args.system_tokens, args.seed)
    prompts = ChatPromptBuilder(tokenizer)
    setup = Setup(model, system, shared_prompt_tokens(prompts, system), prompts)
    rows = []
    for repeat in range(args.repeats):
        for arm in arm_order(arms, repeat):   # each arm's rows once it ended (lost requests and L3 costs are the arm's)
            for row in run_arm(arm, args, setup, events, repeat):
                emit(row)
                rows.append(row)
    for row in summarize(rows):
        emit(row)
    return 0
