"""``prefix-cache bench multiturn``: what tiering buys a multi-turn chat fleet.

S sessions in groups that share a long system prompt; each turn sends the
whole conversation plus a new user message and gets a reply; users think
30 to 120 s between turns. The device pool holds about a quarter of the
sessions' KV; the host pool and the disk hold the rest. Policies, in one run:

- ``drop``: HOT only, LRU eviction destroys KV;
- ``tiered``: HOT -> WARM -> COLD, promotion on a hit;
- ``tiered+prefetch``: as tiered, and a returning session's prefix is
  prefetched (promoted in the background) before the engine sees its request.
  When, is ``--prefetch-trigger`` (one row each, in the order given):

  - ``arrival`` (the default arm, what the app does): the prefetch starts when
    the request arrives, as the ingress starts it from the ``X-Session-Id``
    header, knowing nothing in advance; ``--header-lead-s`` (default 0) is how
    long before the whole request reaches the engine its headers came (body
    transfer, parsing, tokenizing, routing), the only lead it gets;
  - ``foresight``: the prefetch starts exactly ``--prefetch-lead-s`` before an
    arrival the benchmark knows in advance (a client that announces its next
    turn, e.g. ``POST /v1/sessions/{id}/prefetch`` when its user starts typing).

  Every row carries ``prefetch_trigger`` (``arrival``, ``foresight``, or
  ``none`` for ``drop`` and ``tiered``) and ``prefetch_lead_s`` (the lead that
  arm got; null without prefetch).

Time is simulated, compute is real: a discrete-event loop advances the clock
by the measured wall time of each engine step (so queueing is real), and jumps
over idle gaps (background copies are let finish, as they would in that time).
TTFT is the simulated time from a request's arrival to its first token,
promotion and queueing included. Each reply decodes ``--decode-tokens`` for
real; the rest of the reply is teacher-forced in one batched forward right
after, so its KV is cached exactly as decoding would have left it, at a
fraction of the time.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import random
import tempfile
import time

import torch

from cluster.cache.kv_pool import KVLayout
from cluster.cache.tiered import TierConfig, TieredCache, UnknownSessionError
from cluster.engine.checkpoint import ModelSpec, load_model
from cluster.engine.engine import DEFAULT_TIME_SLICE_S, Engine, EngineRequest, SamplingParams
from lab.bench.common import emit, percentile, plot_cdfs, rounded

POLICIES = ("drop", "tiered", "tiered+prefetch")
TRIGGERS = ("arrival", "foresight")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="builtin",
                   help="model spec (default: the seeded built-in model; 'smollm2-135m-instruct' for the "
                        "embedded real model, or a checkpoint directory, .gguf file or hub id)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu", help="cpu | cuda: where the model and the HOT pool live")
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--turns", type=int, default=4, help="turns per session (default 4)")
    p.add_argument("--group-size", type=int, default=8, help="sessions sharing one system prompt")
    p.add_argument("--system-tokens", default="1000,2000", help="system prompt length range")
    p.add_argument("--message-tokens", default="50,300", help="user message and reply length range")
    p.add_argument("--think-s", default="30,120", help="think time between turns, seconds (simulated)")
    p.add_argument("--hot-fraction", type=float, default=0.25, help="device pool / sessions' KV (default 0.25)")
    p.add_argument("--decode-tokens", type=int, default=16, help="reply tokens decoded for real per turn")
    p.add_argument("--prefetch-lead-s", type=float, default=2.0,
                   help="the foresight arm's lead: its prefetch starts this long before the arrival (default 2)")
    p.add_argument("--prefetch-trigger", default=",".join(TRIGGERS),
                   help="when tiered+prefetch prefetches, one row each: arrival (when the request arrives, no "
                        "foresight; the default arm) and/or foresight (--prefetch-lead-s before a known arrival); "
                        "default: arrival,foresight")
    p.add_argument("--header-lead-s", type=float, default=0.0,
                   help="the arrival arm's lead: how long before the whole request reaches the engine its "
                        "headers arrived (default 0: at the same moment)")
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--copy-gb-per-s", type=float, default=1.0,
                   help="pace background demotions to this rate (CPU-only hosts share DRAM bandwidth with "
                        "the forward pass; 0: unpaced)")
    p.add_argument("--tier-codec", default="none", help="how WARM and COLD store KV: none | int8 (default none)")
    p.add_argument("--warm-mb", type=float, default=None,
                   help="WARM sized in MiB of stored KV (default: half the sessions' tokens, in blocks)")
    p.add_argument("--cold", action=argparse.BooleanOptionalAction, default=True,
                   help="a COLD tier below WARM for the tiered policies (default on)")
    p.add_argument("--max-batch-tokens", type=int, default=4096)
    p.add_argument("--threads", type=int, default=1, help="torch threads for the model (default 1)")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, help="write TTFT distributions per policy to this PNG")


def _range(text: str) -> tuple[float, float]:
    lo, hi = (float(x) for x in text.split(","))
    if lo > hi or lo < 0:
        raise ValueError(f"bad range {text!r}: want LOW,HIGH with 0 <= LOW <= HIGH")
    return lo, hi


class Workload:
    """The scripted part of every session, identical for every policy."""

    def __init__(self, args: argparse.Namespace, vocab: int):
        rng = random.Random(args.seed)
        s_lo, s_hi = _range(args.system_tokens)
        m_lo, m_hi = _range(args.message_tokens)
        t_lo, t_hi = _range(args.think_s)
        groups = -(-args.sessions // args.group_size)
        self.system = [[rng.randrange(vocab) for _ in range(rng.randint(int(s_lo), int(s_hi)))]
                       for _ in range(groups)]
        self.user = [[[rng.randrange(vocab) for _ in range(rng.randint(int(m_lo), int(m_hi)))]
                      for _ in range(args.turns)] for _ in range(args.sessions)]
        self.reply_len = [[rng.randint(int(m_lo), int(m_hi)) for _ in range(args.turns)] for _ in range(args.sessions)]
        self.reply_rest = [[[rng.randrange(vocab) for _ in range(max(0, n - args.decode_tokens))] for n in row]
                           for row in self.reply_len]
        self.start = [rng.uniform(0, t_hi) for _ in range(args.sessions)]
        self.think = [[rng.uniform(t_lo, t_hi) for _ in range(args.turns)] for _ in range(args.sessions)]
        self.group = [i // args.group_size for i in range(args.sessions)]

    def longest_prompt(self) -> int:
        return max(len(self.system[self.group[s]]) + sum(len(u) for u in self.user[s]) + sum(self.reply_len[s])
                   for s in range(len(self.user)))

    def total_tokens(self) -> int:
        per_session = [sum(len(u) for u in self.user[s]) + sum(self.reply_len[s]) for s in range(len(self.user))]
        return sum(len(p) for p in self.system) + sum(per_session)


def _make_cache(policy: str, hot_tokens: int, total: int, args, layout, disk_dir) -> TieredCache:
    bt = args.block_tokens
    hot = max(8, hot_tokens // bt)
    if policy == "drop":
        cfg = TierConfig(hot_blocks=hot, block_tokens=bt, device=args.device)
    else:
        warm = {"warm_mb": args.warm_mb} if getattr(args, "warm_mb", None) else \
            {"warm_blocks": max(8, total // (2 * bt))}
        cold = max(8, 2 * total // bt) if getattr(args, "cold", True) else 0
        cfg = TierConfig(hot_blocks=hot, **warm, cold_blocks=cold, block_tokens=bt, disk_dir=disk_dir if cold else None,
                         device=args.device, copy_gb_per_s=args.copy_gb_per_s or None,
                         tier_codec=getattr(args, "tier_codec", "none"))
    return TieredCache(cfg, layout)


def prefetch_lead(trigger: str, args) -> float | None:
    """How long before its request's arrival an arm's prefetch starts (None: no prefetch)."""
    return {"arrival": args.header_lead_s, "foresight": args.prefetch_lead_s}.get(trigger)


def run_policy(policy: str, model, work: Workload, args, disk_dir: str, prefill_tok_s: float,
               trigger: str = "none", trace: list | None = None) -> dict:
    """One arm: ``policy``, and for ``tiered+prefetch`` its ``trigger`` (``arrival`` or ``foresight``).
    ``trace``: each arrival and prefetch is appended to it as it is handled, as
    (kind, session, turn, scheduled simulated time, handled simulated time)."""
    if (policy == "tiered+prefetch") != (trigger in TRIGGERS):
        raise ValueError(f"policy {policy!r} with prefetch trigger {trigger!r}: tiered+prefetch takes one of "
                         f"{', '.join(TRIGGERS)}, the others 'none'")
    arm = _Arm(policy, model, work, args, disk_dir, prefetch_lead(trigger, args), trace)
    wall0 = time.perf_counter()
    while arm.events or arm.engine.has_work():
        arm.handle_due_events()
        for ev in arm.step():
            arm.on_token(ev)
    wall = time.perf_counter() - wall0
    return arm.result(trigger, prefill_tok_s, wall)


class _Arm:
    """One arm's simulated time: the sessions' arrivals and prefetches in order, one
    engine over the arm's cache, and what the arm measures."""

    def __init__(self, policy: str, model, work: Workload, args, disk_dir: str, lead: float | None,
                 trace: list | None):
        self.policy, self.work, self.args, self.lead, self.trace = policy, work, args, lead, trace
        c = model.config
        layout = KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, c.dtype)
        self.total = work.total_tokens()
        # HOT must at least hold one whole conversation plus its decode, or nothing runs.
        hot_tokens = max(int(args.hot_fraction * self.total), 2 * work.longest_prompt())
        self.cache = _make_cache(policy, hot_tokens, self.total, args, layout, disk_dir)
        self.engine = Engine(model, self.cache, max_batch_tokens=args.max_batch_tokens,
                             time_slice_s=DEFAULT_TIME_SLICE_S)   # as a serving worker runs it
        self.history = [list(work.system[work.group[s]]) for s in range(args.sessions)]
        self.events: list[tuple[float, int, str, int, int]] = []   # (time, seq, kind, session, turn)
        self.seq = 0
        for s in range(args.sessions):
            self.arrives(work.start[s], s, 0)
        self.now = 0.0
        self.meta: dict[int, tuple[int, int, float, str]] = {}   # request id -> (session, turn, arrival, kind)
        self.ttft: list[float] = []
        self.hits = self.prompt_tokens = self.recomputed = self.failed = 0
        self.errors: dict[str, int] = {}
        self.windows: dict[int, int] = {}
        self.later = {"ttft": [], "hits": 0, "prompt": 0}   # turns after a session's first
        self.decode_idle: list[float] = []
        self.decode_busy: list[float] = []

    def arrives(self, at: float, s: int, turn: int) -> None:
        # The prefetch goes first: at a lead of 0 it is handled just before its request.
        if self.lead is not None:
            heapq.heappush(self.events, (at - self.lead, self.seq, "prefetch", s, turn))
            self.seq += 1
        heapq.heappush(self.events, (at, self.seq, "arrive", s, turn))
        self.seq += 1

    def handle_due_events(self) -> None:
        """Jump over an idle gap, then submit every arrival and run every prefetch now due."""
        events, engine, cache = self.events, self.engine, self.cache
        if not engine.has_work() and events and events[0][0] > self.now:
            cache.wait_all()            # copies finish within any real idle gap
            self.now = events[0][0]
        while events and events[0][0] <= self.now:
            at, _, kind, s, turn = heapq.heappop(events)
            if self.trace is not None:
                self.trace.append((kind, s, turn, at, self.now))
            if kind == "prefetch":
                try:
                    cache.prefetch(session_id=s)
                except UnknownSessionError:
                    pass                # first turn: nothing cached yet
                continue
            prompt = self.history[s] + self.work.user[s][turn]
            req = engine.submit(EngineRequest(prompt, SamplingParams(max_tokens=self.args.decode_tokens),
                                              session_id=s))
            self.meta[req.request_id] = (s, turn, self.now, "turn")

    def step(self) -> list:
        """One engine step, its wall time added to simulated time (decode-only steps timed apart)."""
        offload = self.cache.in_flight() > 0
        decode_only = not self.engine.scheduler.waiting
        t0 = time.perf_counter()
        step_events = self.engine.step()
        dt = time.perf_counter() - t0
        self.now += dt
        if decode_only and self.engine.scheduler.running:
            (self.decode_busy if offload else self.decode_idle).append(dt * 1e3)
        return step_events

    def on_token(self, ev) -> None:
        req = ev.request
        s, turn, arrival, kind = self.meta[req.request_id]
        if req.error:
            self.failed += 1
            reason = req.error.split(":")[0]
            self.errors[reason] = self.errors.get(reason, 0) + 1
            return
        if kind == "turn" and len(req.output) == 1:
            self.ttft.append((self.now - arrival) * 1e3)
            self.prompt_tokens += len(req.prompt)
            self.hits += req.cached_tokens
            self.recomputed += len(req.prompt) - req.cached_tokens
            if turn:   # turns after a session's first
                self.later["ttft"].append(self.ttft[-1])
                self.later["hits"] += req.cached_tokens
                self.later["prompt"] += len(req.prompt)
            w = int(self.now // 10)
            self.windows[w] = self.windows.get(w, 0) + len(req.prompt) - req.cached_tokens
        if not ev.finished or kind != "turn":
            return
        rest = self.work.reply_rest[s][turn]
        self.history[s] = req.prompt + req.output + rest
        if rest:  # teacher-force the rest of the reply (see module docstring)
            cont = self.engine.submit(EngineRequest(self.history[s], SamplingParams(max_tokens=1), session_id=s))
            self.meta[cont.request_id] = (s, turn, self.now, "reply")
        if turn + 1 < self.args.turns:
            self.arrives(self.now + self.work.think[s][turn], s, turn + 1)

    def result(self, trigger: str, prefill_tok_s: float, wall: float) -> dict:
        ttft, cache, engine = self.ttft, self.cache, self.engine
        storms = sum(1 for tokens in self.windows.values() if tokens > prefill_tok_s * 10)
        stats = cache.stats
        cache.close()
        if not ttft:
            raise RuntimeError(f"policy {self.policy}: no request completed ({self.failed} failed); enlarge the pools")
        return {"bench": "multiturn", "policy": self.policy, "prefetch_trigger": trigger, "prefetch_lead_s": self.lead,
                "requests": len(ttft), "failed_requests": self.failed,
                "failures": self.errors,
                "hit_rate": rounded(self.hits / self.prompt_tokens if self.prompt_tokens else 0.0),
                "ttft_ms_mean": rounded(sum(ttft) / len(ttft), 2), "ttft_ms_p50": rounded(percentile(ttft, 50), 2),
                "ttft_ms_p99": rounded(percentile(ttft, 99), 2), "recomputed_tokens": self.recomputed,
                "later_turn_cached_share": rounded(self.later["hits"] / self.later["prompt"] if self.later["prompt"] else 0.0),
                "later_ttft_ms_p50": rounded(percentile(self.later["ttft"], 50), 2) if self.later["ttft"] else None,
                "later_ttft_ms_p99": rounded(percentile(self.later["ttft"], 99), 2) if self.later["ttft"] else None,
                "prefill_storms": storms, "decode_step_ms_p50": rounded(percentile(self.decode_idle, 50), 3),
                "decode_step_ms_p50_offload": rounded(percentile(self.decode_busy, 50), 3),
                "decode_steps_with_offload": len(self.decode_busy), "promoted_tokens": stats["promoted_tokens"],
                "demoted_to_warm": stats["demoted_to_warm"], "demoted_to_cold": stats["demoted_to_cold"],
                "prefetches": stats["prefetches"],
                # Prompt tokens a tier held that the engine recomputed: by its measured cost decision
                # (copying them up slower than prefill, e.g. COLD reads on a slow disk), and otherwise.
                "recompute_chosen_tokens": engine.stats["recompute_chosen_tokens"],
                "recomputed_held_tokens": engine.stats["recomputed_held_tokens"],
                "hot_tokens": cache.hot.allocator.capacity_tokens,
                "session_tokens": self.total, "sim_seconds": rounded(self.now, 1), "wall_seconds": rounded(wall, 1),
                "_ttft": ttft}


def measure_prefill(model, tokens: int = 2000) -> float:
    """Prompt tokens a second of one prefill of ``tokens`` (the second of two), through the
    model's one forward over a scratch pool of one block."""
    c = model.config
    x = torch.randint(0, c.vocab_size, (tokens,), device=model.device)
    pool = torch.zeros(1, c.num_layers, 2, tokens, c.num_kv_heads, c.head_dim, dtype=c.torch_dtype,
                       device=model.device)
    item = [(x, 0, torch.arange(tokens))]
    model.forward_paged(item, pool, last_logits_only=True)
    t0 = time.perf_counter()
    model.forward_paged(item, pool, last_logits_only=True)
    return tokens / (time.perf_counter() - t0)


def arms(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(policy, prefetch trigger) of every row, in order: ``tiered+prefetch`` once per trigger."""
    policies = args.policies.split(",")
    for p in policies:
        if p not in POLICIES:
            raise ValueError(f"unknown policy {p!r}; choose from {', '.join(POLICIES)}")
    triggers = args.prefetch_trigger.split(",")
    for t in triggers:
        if t not in TRIGGERS:
            raise ValueError(f"unknown prefetch trigger {t!r}; choose from {', '.join(TRIGGERS)}")
    if args.header_lead_s < 0 or args.prefetch_lead_s < 0:
        raise ValueError("--header-lead-s and --prefetch-lead-s must be >= 0")
    return [(p, t) for p in policies for t in (triggers if p == "tiered+prefetch" else ["none"])]


def run(args: argparse.Namespace) -> int:
    todo = arms(args)
    torch.set_num_threads(args.threads)
    spec = ModelSpec.parse(args.model)
    if spec.source == "builtin" and not spec.builtin:
        spec = dataclasses.replace(spec, builtin={"seed": args.seed})
    model = load_model(dataclasses.replace(spec, dtype=args.dtype), device=args.device).model
    work = Workload(args, model.config.vocab_size)
    prefill_tok_s = measure_prefill(model)
    results = []
    with tempfile.TemporaryDirectory() as disk_dir:
        for policy, trigger in todo:
            res = run_policy(policy, model, work, args, disk_dir, prefill_tok_s, trigger)
            results.append(res)
            emit({k: v for k, v in res.items() if not k.startswith("_")} | {"prefill_tokens_per_s": round(prefill_tok_s)})
    if args.plot:
        plot(results, args.plot)
    return 0


def plot(results: list[dict], path: str) -> None:
    def label(r: dict) -> str:
        return r["policy"] + (f" ({r['prefetch_trigger']})" if r["prefetch_trigger"] != "none" else "")

    plot_cdfs([(f"{label(r)} (p50 {r['ttft_ms_p50']:.0f} ms, hit {r['hit_rate']:.0%})", r["_ttft"])
               for r in results], path, title="Multi-turn TTFT by cache policy",
              xlabel="time to first token (ms, log scale)")
