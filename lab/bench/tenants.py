"""`prefix-cache bench tenants`: a noisy neighbour, with and without per-tenant quotas.

    prefix-cache bench tenants [--sessions 5] [--turns 3] [--doc-tokens 600] [--flood-tokens 600]
                               [--flood-ratio 2] [--hot-tokens 2048] [--warm-tokens 8192] [--quotas JSON]
                               [--step-tokens 32]

Tenant B (key ``key-b``) runs the long-session workload
(``lab.load.session_workload``: sessions with their own documents,
Poisson arrivals, think times and long pauses) through the HTTP app, and tenant
A (key ``key-a``) floods it with distinct long prompts (``--flood-tokens``
each, never repeated) at ``--flood-ratio`` times B's request rate (B's rate as
measured when it ran alone), open loop with Poisson arrivals (seeded: every arm
gets the same gaps), for as long as B runs. In one run:

1. ``b_alone``: B alone, as a tenant without shares;
2. ``flood_no_quotas``: B while A floods, both tenants without shares (plain
   LRU between them, as without ``tenant_quotas``);
3. ``flood_quotas``: B while A floods, as the tenants ``tenant_quotas`` gives
   shares (``--quotas``; by default B is guaranteed half of HOT and three
   quarters of WARM, A capped at half of HOT and a quarter of WARM).

The first two arms run on the app without ``tenant_quotas`` (B and A as
``tenant-b0``/``tenant-a0``), the third on the same app redeployed with them (B
and A as ``tenant-b``/``tenant-a``); the cache is flushed before each arm. On an
app with quotas an unlisted tenant is not quota-free: its HOT room excludes the
listed tenants' guarantees.

Every arm runs the same plan (documents, questions, arrivals, pauses, reply
lengths) and the same flood. One JSON line per arm (B's later-turn cached
share and TTFT p50/p99, A's served and failed counts, what the replicas'
per-tenant counters say B lost to A, and where B's later turns' time to first
token went: ``b_ttft_parts_ms_later_turns_p50``, the median of each part
(``serve_app.timing``), and ``b_steps_later_turns_p50`` / ``_max``, the same
wait in engine steps (steps waited before admission, of those waiting for a
promotion, the steps the prompt took, the tokens, rows, decodes and other
tenants' tokens of the step of its first forward), ``b_later_turns_promoted``
the later turns that waited for a promotion, and ``b_later_turns_detail`` each
later turn's figures, named by ``b_later_turns_detail_keys``). Each row also carries both tenants'
serving figures (``b_``/``a_`` + TTFT p50, TPOT p50/p99, ITL p99/max, e2e p50, output tok/s), so a
scheduling default shows what it costs beside the TTFT it was tuned for. Then a summary line with
the ratios to B alone (B's TPOT, ITL p99, e2e and tok/s too), A's serving figures with quotas over
without, and the goals of issues 44 and 53 (cached share >= 0.9x, TTFT p50 <= 1.5x with quotas; A
served, 0 failed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

from lab.bench.common import emit, rounded
from lab.load.chat_workload import WorkloadResult, ask_turn, system_prompt
from lab.load.session_workload import document, plan_sessions, run_sessions, session_fields

# tenant-a and tenant-b have shares in the quotas arm; tenant-a0 and tenant-b0 (the same clients
# under other keys) run the arms without quotas, on the app without tenant_quotas.
KEYS = {"key-a": "tenant-a", "key-b": "tenant-b", "key-a0": "tenant-a0", "key-b0": "tenant-b0"}
ADMIN_KEY = "key-admin"
# B's sessions fit in its guarantees (HOT half, WARM three quarters); A may use HOT's other half and a
# quarter of WARM, and no more, whatever it sends.
DEFAULT_QUOTAS = {"tenants": {"tenant-b": {"hot": {"guarantee": 0.5}, "warm": {"guarantee": 0.75}},
                              "tenant-a": {"hot": {"cap": 0.5}, "warm": {"cap": 0.25}}}}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sessions", type=int, default=5, help="tenant B's chat sessions")
    p.add_argument("--turns", type=int, default=3, help="turns per session")
    p.add_argument("--doc-tokens", type=int, default=600, help="tokens of each of B's session documents")
    p.add_argument("--system-tokens", type=int, default=80, help="tokens of B's shared system prompt")
    p.add_argument("--max-tokens", type=int, default=32, help="B's reply tokens per turn (upper bound)")
    p.add_argument("--arrival-s", type=float, default=2.0, help="mean gap between B's session arrivals")
    p.add_argument("--think-s", type=float, default=2.0, help="mean pause between a reply and B's next turn")
    p.add_argument("--long-pause-share", type=float, default=0.25, help="share of B's pauses that are long")
    p.add_argument("--long-pause-s", type=float, default=8.0, help="mean of a long pause")
    p.add_argument("--flood-tokens", type=int, default=600, help="tokens of each of A's (distinct) prompts")
    p.add_argument("--flood-max-tokens", type=int, default=8, help="A's reply tokens per request")
    p.add_argument("--flood-max-s", type=float, default=None,
                   help="A sends for at most this long (default: 3x B's wall time alone), then B runs on alone")
    p.add_argument("--flood-ratio", type=float, default=2.0, help="A's request rate over B's (B's measured alone)")
    p.add_argument("--hot-tokens", type=int, default=2048, help="the replica's HOT tokens")
    p.add_argument("--warm-tokens", type=int, default=8192, help="the replica's WARM tokens")
    p.add_argument("--quotas", default=None, metavar="JSON",
                   help="tenant_quotas of the quotas arm (tenants tenant-a, tenant-b); default: B guaranteed "
                        "half of HOT and 3/4 of WARM, A capped at half of HOT and 1/4 of WARM")
    p.add_argument("--step-tokens", type=int, default=32,
                   help="tenant_quotas.step_tokens of the quotas arm (the engine step's token budget while both "
                        "tenants are active; 0: none, every step max_batch_tokens)")
    p.add_argument("--torch-threads", type=int, default=2, help="the replica's torch threads")
    p.add_argument("--model", default=None, help="model spec (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", type=int, default=1,
                   help="run the three arms this many times (each run's lines, then a line with the median and "
                        "the spread of the ratios to B alone)")
    p.add_argument("--port", type=int, default=None)


def check_args(args: argparse.Namespace) -> dict:
    """The quotas arm's ``tenant_quotas``, after every argument was checked (ValueError names it)."""
    from cluster.cache.quota_config import QuotaConfig

    for name in ("sessions", "turns", "doc_tokens", "max_tokens", "flood_tokens", "flood_max_tokens",
                 "hot_tokens", "warm_tokens", "torch_threads", "runs"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("arrival_s", "think_s", "long_pause_s"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
    if args.step_tokens < 0:
        raise ValueError("--step-tokens must be >= 0 (0: no shorter steps)")
    if not args.flood_ratio > 0:
        raise ValueError("--flood-ratio must be > 0")
    if not 0.0 <= args.long_pause_share <= 1.0:
        raise ValueError("--long-pause-share must be in [0, 1]")
    quotas = DEFAULT_QUOTAS if args.quotas is None else json.loads(args.quotas)
    if args.step_tokens and isinstance(quotas, dict):
        quotas = {"step_tokens": args.step_tokens, **quotas}   # --quotas may set its own
    QuotaConfig.parse(quotas, KEYS)   # a bad one fails here, before anything starts
    return quotas


# ------------------------------------------------------------------- the flood
async def flood(base: str, model: str, prompts: list[str], rate_per_s: float, stop: asyncio.Event,
                max_tokens: int, key: str = "key-a", max_s: float | None = None, timeout_s: float = 600.0,
                seed: int = 0) -> dict:
    """Tenant A: Poisson arrivals at ``rate_per_s`` (open loop, each a distinct prompt; the
    gaps seeded by ``seed``) until ``stop`` (or ``max_s`` of sending); then waits for those
    in flight. Served and failed counts, and A's serving figures (``SERVING_FIELDS``)."""
    import httpx

    result = WorkloadResult()

    async def one(i: int, http) -> None:
        # Distinct from the first token: no flood request shares a prefix with another.
        messages = [{"role": "user", "content": f"Request {i}. " + prompts[i % len(prompts)]}]
        turn, _ = await ask_turn(http, model, messages, i, 0, max_tokens)
        result.turns.append(turn)

    tasks = []
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base, timeout=timeout_s, limits=limits,
                                 headers={"Authorization": f"Bearer {key}"}) as http:
        gaps = random.Random(f"{seed}:flood-arrivals")
        t0, i, at = time.perf_counter(), 0, 0.0
        while not stop.is_set() and (max_s is None or time.perf_counter() - t0 < max_s):
            tasks.append(asyncio.create_task(one(i, http)))
            i += 1
            at += gaps.expovariate(rate_per_s)
            try:
                await asyncio.wait_for(stop.wait(), max(0.0, t0 + at - time.perf_counter()))
            except TimeoutError:
                pass
        await asyncio.gather(*tasks)
        result.wall_s = time.perf_counter() - t0
    served = sum(t.ok for t in result.turns)
    return {"a_sent": len(tasks), "a_served": served, "a_failed": len(result.turns) - served,
            **serving_fields("a_", result.summary())}


# Each tenant's serving figures in every arm row (``WorkloadResult.summary``'s keys, prefixed
# ``b_``/``a_``): a scheduling default must carry them beside the TTFT it was tuned for.
SERVING_FIELDS = ("ttft_ms_p50", "tpot_ms_p50", "tpot_ms_p99", "itl_ms_p99", "itl_ms_max", "e2e_ms_p50",
                  "output_tokens_per_s")


def serving_fields(prefix: str, summary: dict) -> dict:
    return {prefix + key: summary.get(key) for key in SERVING_FIELDS}


async def b_with_flood(base: str, model: str, plan, system: str, prompts: list[str] | None,
                       rate_per_s: float, flood_max_tokens: int, suffix: str = "",
                       flood_max_s: float | None = None, seed: int = 0) -> tuple:
    """B's sessions (``key-b`` + ``suffix``), with A's flood beside them when ``prompts`` is given."""
    stop = asyncio.Event()
    flooding = asyncio.create_task(flood(base, model, prompts, rate_per_s, stop, flood_max_tokens,
                                         key="key-a" + suffix, max_s=flood_max_s, seed=seed)) if prompts else None
    b = await run_sessions(base, model, plan, system=system, api_key="key-b" + suffix)
    stop.set()
    a = await flooding if flooding is not None else \
        {"a_sent": 0, "a_served": 0, "a_failed": 0, **serving_fields("a_", {})}
    return b, a


# --------------------------------------------------------------------- the run
def _tenant_counters(stats: dict, tenant: str) -> dict:
    """One tenant's per-tenant counters summed over the replicas (``TieredCache.tenant_stats``)."""
    out: dict = {}
    for worker in (stats.get("workers") or {}).values():
        row = (worker.get("tenants") or {}).get(tenant)
        for key, value in (row or {}).items():
            if isinstance(value, dict):
                into = out.setdefault(key, {})
                for tier, n in value.items():
                    into[tier] = into.get(tier, 0) + n
            else:
                out[key] = out.get(key, 0) + value
    return out


def run_arm(name: str, base: str, model: str, plan, system: str, prompts, rate: float, args) -> dict:
    """One arm on a deployed app whose cache was just emptied: its JSON row."""
    import httpx

    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    httpx.post(base + "/v1/cache/flush", headers=admin, json={}, timeout=60).raise_for_status()
    quotas = name == "flood_quotas"
    b, a = asyncio.run(b_with_flood(base, model, plan, system, prompts, rate, args.flood_max_tokens,
                                    "" if quotas else "0", args.flood_max_s, args.seed))
    stats = httpx.get(base + "/v1/cache/stats", headers=admin, timeout=60).json()
    summary = b.summary()
    fields = session_fields(b.turns)
    b_lost = _tenant_counters(stats, "tenant-b" if quotas else "tenant-b0").get(
        "evictions_suffered_from_others", {})
    return {"bench": "tenants", "arm": name, "quotas": quotas,
            "b_requests": summary["requests"], "b_failed": summary["failed"], "b_wall_s": summary["wall_s"],
            "b_rate_per_s": rounded(summary["requests"] / b.wall_s, 3) if b.wall_s else None,
            "b_later_turns_cached_share": fields["later_turns_cached_share"],
            "b_ttft_ms_later_turns_p50": fields["ttft_ms_later_turns_p50"],
            "b_ttft_ms_later_turns_p99": fields["ttft_ms_later_turns_p99"],
            "b_ttft_ms_first_turn_p50": fields["ttft_ms_first_turn_p50"], **serving_fields("b_", summary),
            "a_rate_per_s": rounded(rate, 3) if prompts else 0.0,
            "a_max_send_s": rounded(args.flood_max_s, 1) if prompts else None, **a,
            "b_tokens_lost_to_a": b_lost, "errors": summary["errors"], **_engine_fields(stats),
            "b_ttft_parts_ms_later_turns_p50": summary.get("ttft_parts_ms_later_turns_p50"),
            **step_counts([t for t in b.turns if t.ok and t.turn > 0])}


def step_counts(turns: list) -> dict:
    """B's later turns' wait in engine steps, from the replica's counts in each response's
    ``timing_steps`` (``cluster.protocol.STEP_COUNTS``): the median and the highest of each, and
    how many of the turns waited for a promotion of their prefix."""
    from cluster.protocol import STEP_COUNTS

    timed = [t.timing_steps for t in turns if t.timing_steps]
    if not timed:
        return {}
    out = {"b_steps_later_turns_p50": {k: rounded(statistics.median(m[k] for m in timed), 1) for k in STEP_COUNTS},
           "b_steps_later_turns_max": {k: max(m[k] for m in timed) for k in STEP_COUNTS}}
    out["b_later_turns_promoted"] = sum(1 for m in timed if m["promotion_waits"])
    # Each later turn, in the order they ended: TTFT, replica queue and first forward (ms), then its counts.
    out["b_later_turns_detail_keys"] = ["ttft_ms", "replica_queue_ms", "first_forward_ms", *STEP_COUNTS]
    out["b_later_turns_detail"] = [
        [rounded(t.ttft_s * 1e3, 1), t.timing_ms.get("replica_queue"), t.timing_ms.get("first_forward"),
         *(t.timing_steps[k] for k in STEP_COUNTS)] for t in turns if t.timing_steps and t.ttft_s is not None]
    return out


# The engine's counters each row carries (``Scheduler.STAT_KEYS``), summed over the replicas: who
# was preempted, recomputed or waited for room in the arm.
ENGINE_COUNTERS = ("preemptions", "preempted_tokens", "recomputed_tokens", "recomputed_held_tokens",
                   "waits_for_room", "waits_for_promotion_room", "slot_yields", "time_slice_preemptions",
                   "room_claims")


def _engine_fields(stats: dict) -> dict:
    """The replicas' engine steps in the arm (the cache was flushed, not the counters: totals
    since deploy), for where B's time went: steps, mean step time and ``ENGINE_COUNTERS``."""
    steps = step_ms = 0.0
    counters = dict.fromkeys(ENGINE_COUNTERS, 0)
    for worker in (stats.get("workers") or {}).values():
        engine = worker.get("engine") or {}
        steps += engine.get("steps", 0)
        step_ms += engine.get("step_ms", 0.0)
        for key in ENGINE_COUNTERS:
            counters[key] += engine.get(key, 0)
    return {"engine_steps_since_deploy": int(steps),
            "engine_step_ms_mean": rounded(step_ms / steps, 1) if steps else None,
            **{f"engine_{key}_since_deploy": n for key, n in counters.items()}}


# The serving figures the summary compares: B beside A's flood with quotas over B alone, and A with
# quotas over A without.
SERVING_RATIOS = ("tpot_ms_p50", "itl_ms_p99", "e2e_ms_p50", "output_tokens_per_s")


def compare(alone: dict, no_quotas: dict, quotas: dict) -> dict:
    """The summary line: ratios to B alone (A's: with quotas over without) and the goals, met or not."""
    def ratio(row: dict, key: str, base: dict = alone) -> float | None:
        return rounded(row[key] / base[key], 3) if row.get(key) is not None and base.get(key) else None

    share_q, ttft_q = ratio(quotas, "b_later_turns_cached_share"), ratio(quotas, "b_ttft_ms_later_turns_p50")
    return {"bench": "tenants", "arm": "summary",
            **{f"b_{key}_vs_alone_quotas": ratio(quotas, f"b_{key}") for key in SERVING_RATIOS},
            **{f"a_{key}_quotas_vs_no_quotas": ratio(quotas, f"a_{key}", no_quotas) for key in SERVING_RATIOS},
            "cached_share_vs_alone_quotas": share_q,
            "cached_share_vs_alone_no_quotas": ratio(no_quotas, "b_later_turns_cached_share"),
            "ttft_p50_vs_alone_quotas": ttft_q,
            "ttft_p50_vs_alone_no_quotas": ratio(no_quotas, "b_ttft_ms_later_turns_p50"),
            "goal_cached_share_met": share_q is not None and share_q >= 0.9,
            "goal_ttft_p50_met": ttft_q is not None and ttft_q <= 1.5,
            "goal_a_served_met": quotas["a_served"] > 0 and quotas["a_failed"] == 0}


def run(args: argparse.Namespace) -> int:
    from cluster.engine.checkpoint import ModelSpec, load_tokenizer
    from serve_app.local import DEMO_WORKER, LocalCluster, free_port, prepare_model

    quotas = check_args(args)
    model_id = prepare_model(args.model)
    tokenizer = load_tokenizer(ModelSpec.parse(args.model))
    system = system_prompt(tokenizer, args.system_tokens, args.seed)
    plan = plan_sessions(tokenizer, sessions=args.sessions, turns=args.turns, doc_tokens=args.doc_tokens,
                         arrival_s=args.arrival_s, think_s=args.think_s, long_pause_share=args.long_pause_share,
                         long_pause_s=args.long_pause_s, max_tokens=args.max_tokens, seed=args.seed)
    rng = random.Random(f"{args.seed}:flood")
    prompts = [document(tokenizer, args.flood_tokens, rng.randrange(1 << 30), i) for i in range(16)]
    block = DEMO_WORKER["block_tokens"]
    worker = {**DEMO_WORKER, "hot_blocks": max(1, args.hot_tokens // block),
              "warm_blocks": max(1, args.warm_tokens // block), "torch_threads": args.torch_threads}
    if args.model is not None:
        worker["model"] = args.model
    app = {"num_replicas": 1, "worker": worker, "api_keys": ",".join(f"{k}={t}" for k, t in KEYS.items()),
           "admin_keys": ADMIN_KEY, "limits": {"max_prompt_tokens": 8192, "max_tokens": 1024},
           "tenant_quotas": quotas}
    local = LocalCluster(worker_nodes=0, cpus_per_node=2, l3_pool_mb=0)
    port = args.port or free_port()   # once the cluster's processes hold their ports
    base = f"http://127.0.0.1:{port}"
    summaries, max_s = [], args.flood_max_s
    try:
        for _ in range(max(1, args.runs)):
            args.flood_max_s = max_s
            summaries.append(run_once(local, app, port, base, model_id, plan, system, prompts, quotas, args))
            emit(summaries[-1])
    finally:
        local.shutdown()
    if len(summaries) > 1:
        emit(over_runs(summaries))
    return 0


def run_once(local, app: dict, port: int, base: str, model_id: str, plan, system: str, prompts, quotas,
             args) -> dict:
    """The three arms, each on a freshly deployed app; their lines, and the summary line returned."""
    # The arms without quotas run on the app without ``tenant_quotas``: on the quotas' app an
    # unlisted tenant's HOT room excludes the listed tenants' guarantees, so it is not quota-free.
    local.deploy({k: v for k, v in app.items() if k != "tenant_quotas"}, port=port)
    alone = run_arm("b_alone", base, model_id, plan, system, None, 0.0, args)
    emit(alone)
    rate = args.flood_ratio * alone["b_rate_per_s"]
    # A machine the flood overloads stretches B's run, and with it the flood: bound the sending.
    args.flood_max_s = args.flood_max_s or 3.0 * alone["b_wall_s"]
    no_quotas = run_arm("flood_no_quotas", base, model_id, plan, system, prompts, rate, args)
    emit(no_quotas)
    local.deploy(app, port=port)   # the same app with the quotas (fresh replicas, empty caches)
    with_quotas = run_arm("flood_quotas", base, model_id, plan, system, prompts, rate, args)
    emit({**with_quotas, "tenant_quotas": quotas})
    return {**compare(alone, no_quotas, with_quotas), "b_failed": alone["b_failed"] + with_quotas["b_failed"],
            "b_ttft_ms_later_turns_p50_alone": alone["b_ttft_ms_later_turns_p50"],
            "b_ttft_ms_later_turns_p50_quotas": with_quotas["b_ttft_ms_later_turns_p50"]}


def over_runs(summaries: list[dict]) -> dict:
    """The runs' summary lines as one: the median of each ratio and its spread (min, max)."""
    row: dict = {"bench": "tenants", "arm": "runs", "runs": len(summaries)}
    for key in ("cached_share_vs_alone_quotas", "ttft_p50_vs_alone_quotas", "cached_share_vs_alone_no_quotas",
                "ttft_p50_vs_alone_no_quotas", *(f"b_{k}_vs_alone_quotas" for k in SERVING_RATIOS),
                *(f"a_{k}_quotas_vs_no_quotas" for k in SERVING_RATIOS)):
        values = [s[key] for s in summaries if s.get(key) is not None]
        row[f"{key}_median"] = rounded(statistics.median(values), 3) if values else None
        row[f"{key}_spread"] = [min(values), max(values)] if values else None
    row["goal_cached_share_met"] = (row["cached_share_vs_alone_quotas_median"] or 0) >= 0.9
    row["goal_ttft_p50_met"] = row["ttft_p50_vs_alone_quotas_median"] is not None and \
        row["ttft_p50_vs_alone_quotas_median"] <= 1.5
    row["goal_a_served_met"] = all(s["goal_a_served_met"] for s in summaries)
    row["b_failed"] = sum(s["b_failed"] for s in summaries)
    return row
