"""``prefix-cache replay``: routing policies on a request trace, side by side.

Drives the real routing layer (``GlobalIndex``, the policies, one
``TieredCache`` per replica in payload-free simulation mode, KV events through
``KVEventPublisher``) through a Mooncake-format trace in simulated time, once
per policy, and prints one JSON line per policy.

Model of a replica. Its cache is a block-level radix tree: each trace hash id
is one "token" of a tree with ``block_tokens=1``, so capacities are in blocks
(``--hot-blocks`` device, ``--warm-blocks`` host, ``--cold-blocks`` disk,
watermark demotion HOT -> WARM -> COLD as in production). Its compute is one
FIFO server: a request starts when the previous one is done and takes

    promotion of its WARM/COLD hit blocks + pull of migrated blocks
    + prefill of the tokens not cached (at least one)

Latency constants (flags; defaults for Llama-3-8B in bf16 on one H100-class GPU):
- prefill 10,000 tokens/s per replica (``--prefill-tokens-per-s``);
- KV bytes per token 131,072 = 32 layers x 2 (K, V) x 8 KV heads x 128 dims
  x 2 bytes (``--kv-bytes-per-token``);
- host -> device 20 GB/s (``--h2d-gbps``): WARM promotion ~152,600 tokens/s;
- disk read 3 GB/s then host -> device (``--disk-gbps``): COLD ~19,900 tokens/s;
- replica -> replica transfer 10 GB/s (``--transfer-gbps``, NIXL/RDMA): ~76,300 tokens/s.
Decode is not modeled as compute (the server does prefill only), so TTFT =
queueing + promotion + transfer + prefill. The cost policy is given these
constants, as a worker's calibration would measure them.

Information (every line says which: ``"information"``).

``production`` (the default): what a deployed router really knows.
- Load: each replica sends ``(queued_tokens, running)`` as the engine computes
  it (``EngineLoop.measure_load``): waiting requests count their whole prompt,
  running ones their remaining output tokens; a request runs from its start
  until ``output_length x --decode-ms-per-token`` after its prefill. Reports
  leave every ``--report-interval-ms`` (20 ms, the workers' event interval; the
  replicas' clocks are offset) and arrive ``--event-delay-ms`` later; between
  two reports the router adds what it sent there itself (``RoutingTable.route``).
- KV events: a request's blocks are checkpointed when its prefill ends (as the
  engine checkpoints prompts) and leave on the replica's next report tick.
- Service times are the simulator's own (``ServiceModel``), not the policy's
  formulas: a prefill token's cost grows with its context as attention does
  (``--attention-tokens``), and every time gets lognormal noise
  (``--service-noise``), the same draws for every policy.

``oracle`` (``--oracle``, the replay before production information): each
replica's ``queued_tokens`` is its exact simulated drain time x the prefill
rate, ``running`` its requests not finished, a request's KV events leave when
it is routed, and service times are the cost policy's own formulas.

Model of the directory. A replica's batch of events reaches the index
``--event-delay-ms`` after it leaves; a gap or resync reloads the replica's
snapshot. The cache effects of a request (match, promotion, pull, insert of its
blocks) are applied to the replica's own tree when it is routed, in its FIFO
order (its KV is reserved at once, as a real engine reserves a running
request's blocks); only what the index learns waits for the events. Only the policies' ``choose`` calls are
timed for ``decisions_per_s``, in CPU time of the replaying thread
(``time.thread_time``), so other processes on a shared machine do not count;
``directory_decisions_per_s`` and ``decision_us_p99`` add the event batches
applied before each decision. With ``--routers N`` each of N routers has its
own policy and its own copy of the index, every copy applies every batch,
and request k is decided by router k mod N (as ingress replicas following
the directory's log do); ``aggregate_decisions_per_s`` is the decisions over
the busiest router's CPU time, what the N routers sustain on N cores.

Metrics:
- ``hit_rate``: input tokens served from any cache tier, local or pulled, over
  all input tokens; ``hot_hit_rate``/``warm_hit_rate``/``cold_hit_rate`` split
  the local hits, ``migrated_rate`` is the pulled part;
- ``load_imbalance``: max over replicas of the *time-averaged* queued work
  (tokens of prefill-equivalent waiting or running) divided by its mean over
  replicas; ``busy_imbalance`` the same for total service time;
- TTFT percentiles over all requests.

``ideal`` (upper bound): one global cache of R x (H, W, C) blocks that every
replica reads for free, each request served on the least loaded replica.

Without ``--trace`` the trace is synthetic (``synthetic_chat_trace``):
100,000 requests at 20 per second (83 minutes); 40 system prompts of 500 to
3,000 tokens picked with Zipf(1) popularity; 20% single requests, the other
sessions a geometric number of turns (mean 8); user messages ~250 and replies
~450 tokens (lognormal medians); think time exponential, mean 60 s. Mean input
8,700 tokens, close to Mooncake's published traces. Default capacity per
replica: 512 HOT blocks (256k tokens: 32 GiB of Llama-3-8B KV) and 2,560 WARM
blocks (160 GiB of host memory).
"""

from __future__ import annotations

import argparse

from cluster.errors import InvalidInputError
from cluster.hashing import block_hashes
from cluster.routing.events import EVENT_INTERVAL_S
from cluster.routing.policies import POLICIES, RATE_FIELDS
from cluster.routing.policies.baselines import APPROX_TREE_DEFAULTS, DEFAULT_APPROX_TREE_DEFAULTS
from cluster.trace import MOONCAKE_BLOCK_TOKENS, TraceRecord, load_trace
from lab.bench.common import emit, rounded
from lab.bench.replay_elastic import run_scale_events

# The trace and the model of a replica; Replica, ServiceModel and synthetic_chat_trace are re-exported.
from lab.bench.replay_model import (  # noqa: F401
    LatencyModel,
    Replica,
    ServiceModel,
    synthetic_chat_trace,
)
from lab.bench.replay_report import plot, seed_summary
from lab.bench.replay_sim import run_policy
from lab.bench.traces import SHAPES, shape_trace

ORDER = ("round_robin", "least_loaded", "prefix", "approx_tree", "ray_prefix", "cost", "ideal")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default=None, help="Mooncake JSONL trace (default: a synthetic chat trace)")
    p.add_argument("--format", default="mooncake", choices=["mooncake"])
    p.add_argument("--block-tokens", type=int, default=MOONCAKE_BLOCK_TOKENS, help="tokens per hash id (512)")
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--hot-blocks", type=int, default=512, help="device blocks per replica (512)")
    p.add_argument("--warm-blocks", type=int, default=2560, help="host blocks per replica (2,560)")
    p.add_argument("--cold-blocks", type=int, default=0, help="disk blocks per replica")
    p.add_argument("--records", type=int, default=None, help="replay the first N records (synthetic: 100,000)")
    p.add_argument("--policy", default="all", help=f"one of {', '.join(ORDER)}, or a comma list, or all")
    p.add_argument("--rate", type=float, default=20.0, help="synthetic trace: requests per second (20)")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival times (< 1: more load)")
    p.add_argument("--event-delay-ms", type=float, default=20.0, help="worker -> directory event latency")
    p.add_argument("--prefill-tokens-per-s", type=float, default=10_000.0)
    p.add_argument("--kv-bytes-per-token", type=int, default=131_072)
    p.add_argument("--h2d-gbps", type=float, default=20.0)
    p.add_argument("--disk-gbps", type=float, default=3.0)
    p.add_argument("--transfer-gbps", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", default=None, metavar="S[,S...]",
                   help="generated traces only: replay every policy on the trace of each seed, then print one "
                        "replay_seeds line per policy (mean, min, max over the seeds, and per seed against "
                        "every other policy in the run)")
    p.add_argument("--policy-arg", action="append", metavar="[POLICY.]NAME=VALUE",
                   help="override a policy parameter, e.g. cost.dup_weight=0.5 (repeatable)")
    p.add_argument("--approx-tree-defaults", choices=list(APPROX_TREE_DEFAULTS), default=DEFAULT_APPROX_TREE_DEFAULTS,
                   help="the SGLang router release whose defaults and rules the approx_tree baseline follows ("
                        + "; ".join(f"{k}: {d.source}" for k, d in APPROX_TREE_DEFAULTS.items())
                        + f"; default {DEFAULT_APPROX_TREE_DEFAULTS}); --policy-arg values still override single ones")
    p.add_argument("--plot", default=None, help="write hit rate and p99 TTFT per policy to this PNG")
    p.add_argument("--shape", default=None, choices=[*SHAPES, "mixed"],
                   help="synthetic trace of this shape (lab/bench/traces.py) instead of the default chat trace")
    p.add_argument("--routers", type=int, default=1,
                   help="independent routers, each with its own policy and copy of the index fed every "
                        "event batch; request k is decided by router k mod N (default 1)")
    p.add_argument("--oracle", action="store_true",
                   help="the old, optimistic information: each replica's load is its exact simulated drain time, "
                        "its KV events leave when the request is routed, and service times are the cost "
                        "policy's own formulas (default: production information, see the module docstring)")
    p.add_argument("--report-interval-ms", type=float, default=EVENT_INTERVAL_S * 1e3,
                   help="production information: how often a replica sends its load and events (20, as workers do)")
    p.add_argument("--decode-ms-per-token", type=float, default=20.0,
                   help="production information: how long a request stays running after its prefill, per output "
                        "token (its remaining tokens count in the load it reports; decode does not delay prefills)")
    p.add_argument("--attention-tokens", type=float, default=30_500.0,
                   help="production information: the context length at which attention doubles a prefill token's "
                        "cost in the simulator's service times (30,500 for Llama-3-8B; 0: no attention term)")
    p.add_argument("--service-noise", type=float, default=0.15,
                   help="production information: sigma of the lognormal noise on every simulated service time")
    p.add_argument("--scale-events", default=None, metavar="SPEC",
                   help="scale events at simulated seconds, e.g. scale_in@1200,scale_out@2400,kill@3600: each arm of "
                        "--scale-arms replays the trace with them and prints replay_scale lines (windows before and "
                        "after each event; lab/bench/replay_elastic.py)")
    p.add_argument("--scale-arms", default="elastic,baseline",
                   help="with --scale-events: elastic (L3, hand-off, warm-up), baseline (none), handoff_value and "
                        "handoff_lru (no write-behind, a hand-off of --handoff-blocks blocks in value or LRU order)")
    p.add_argument("--scale-window-s", type=float, default=300.0, help="with --scale-events: the measured window")
    p.add_argument("--l3-gbps", type=float, default=5.0,
                   help="with --scale-events: L3 -> replica bandwidth (Mooncake Store over RDMA; 5)")
    p.add_argument("--l3-blocks", type=int, default=None,
                   help="with --scale-events: L3 capacity in blocks (default: the replicas' HOT + WARM together)")
    p.add_argument("--handoff-blocks", type=int, default=None,
                   help="with --scale-events: the hand-off's L3 budget in blocks for the handoff_* arms "
                        "(default: an eighth of a replica's HOT + WARM)")
    p.add_argument("--misestimate", default=None, metavar="F[,F...]",
                   help="also run cost with each of its rate constants (and all of them) multiplied by each "
                        "factor, e.g. 0.5,2; the simulator keeps the true rates")


def run(args: argparse.Namespace) -> int:
    if args.replicas <= 0 or args.block_tokens <= 0:
        raise InvalidInputError("--replicas and --block-tokens must be positive")
    if args.time_scale <= 0:
        raise InvalidInputError("--time-scale must be positive")
    if args.service_noise < 0 or args.attention_tokens < 0:
        raise InvalidInputError("--service-noise and --attention-tokens must be >= 0")
    names = list(ORDER) if args.policy == "all" else args.policy.split(",")
    for name in names:
        if name not in POLICIES:
            raise InvalidInputError(f"unknown policy {name!r}; choose from {', '.join(ORDER)} or all")
    seeds = _seeds(args)
    latency = LatencyModel(args.prefill_tokens_per_s, args.kv_bytes_per_token, args.h2d_gbps, args.disk_gbps,
                           args.transfer_gbps, getattr(args, "l3_gbps", 0.0) if getattr(args, "scale_events", None)
                           else 0.0)
    if getattr(args, "scale_events", None):
        return run_scale_events(args, names, latency, seeds, records_of=_records, run_policy=run_policy)
    by_seed = []
    for seed in seeds:
        records = _records(args, seed)
        # Routing hashes: the chain over hash ids, as the replicas' publishers compute it (block of 1 id).
        hash_chains = [block_hashes(r.hash_ids, 1) for r in records]
        noise = None if args.oracle else ServiceModel.draws(len(records), args.service_noise, seed)
        results = []
        for name in names:
            res = run_policy(name, records, hash_chains, args, latency, noise=noise)
            if args.shape:
                res["shape"] = args.shape
            if not args.trace:
                res["seed"] = seed
            results.append(res)
            emit(res)
        if args.misestimate:
            misestimate_sweep(records, hash_chains, args, latency, results, None if args.trace else seed, noise)
        by_seed.append(results)
    if len(seeds) > 1:
        for line in seed_summary(seeds, by_seed):
            emit(line)
    if args.plot:
        plot(by_seed[0], args.plot)
    return 0


def _seeds(args: argparse.Namespace) -> list[int]:
    if args.seeds is None:
        return [args.seed]
    if args.trace:
        raise InvalidInputError("--seeds needs a generated trace (--shape or the default), not --trace")
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        raise InvalidInputError(f"--seeds takes integers like 0,1,2, got {args.seeds!r}") from None
    if len(set(seeds)) != len(seeds):
        raise InvalidInputError(f"--seeds lists a seed twice: {args.seeds!r}")
    if args.plot and len(seeds) > 1:
        raise InvalidInputError("--plot draws one run; give it one seed (--seed), not --seeds")
    return seeds


def _records(args: argparse.Namespace, seed: int) -> list[TraceRecord]:
    if args.trace:
        records = load_trace(args.trace, limit=args.records)
    elif args.shape:
        records = shape_trace(args.shape, args.records or 100_000, seed=seed, block_tokens=args.block_tokens,
                              rate=args.rate)
    else:
        records = synthetic_chat_trace(args.records or 100_000, seed=seed, block_tokens=args.block_tokens,
                                       rate=args.rate)
    if not records:
        raise InvalidInputError("the trace has no records")
    records.sort(key=lambda r: r.timestamp)
    return records


def misestimate_sweep(records, hash_chains, args, latency: LatencyModel, results: list[dict],
                      seed: int | None = None, noise: list | None = None) -> None:
    """``cost`` given wrong rate constants (each alone, then all together, times each
    factor) while the simulator keeps the true ones; one line per run and a summary."""
    try:
        factors = [float(f) for f in args.misestimate.split(",")]
    except ValueError:
        raise InvalidInputError(f"--misestimate takes factors like 0.5,2, got {args.misestimate!r}") from None
    if not factors or any(f <= 0 for f in factors):
        raise InvalidInputError("--misestimate factors must be positive")
    true = latency.cost_model(args.block_tokens)
    base = next((r for r in results if r["policy"] == "cost"), None)
    if base is None:
        base = run_policy("cost", records, hash_chains, args, latency, noise=noise)
    runs = []
    for f in factors:
        for fields in [(name,) for name in RATE_FIELDS] + [RATE_FIELDS]:
            res = run_policy("cost", records, hash_chains, args, latency, noise=noise,
                             believed=true.scaled(**dict.fromkeys(fields, f)))
            res["misestimate"] = {"factor": f, "constants": "all" if len(fields) > 1 else fields[0]}
            if seed is not None:
                res["seed"] = seed
            runs.append(res)
            emit(res)
    worst = min(runs, key=lambda r: r["hit_rate"])
    others = {r["policy"]: r["hit_rate"] for r in results if r["policy"] in ("approx_tree", "ray_prefix", "prefix")}
    ports = {k: v for k, v in others.items() if k != "prefix"}
    emit({"bench": "replay_misestimate", "information": base["information"],
          **({} if seed is None else {"seed": seed}), "factors": factors, "runs": len(runs), "cost_hit_rate": base["hit_rate"],
          "worst_hit_rate": worst["hit_rate"], "worst": worst["misestimate"],
          "max_loss_points": rounded(100 * (base["hit_rate"] - worst["hit_rate"]), 2),
          "worst_ttft_ms_p99": max(r["ttft_ms_p99"] for r in runs), "baselines_hit_rate": others,
          # null when the run had neither port to compare with (--policy without them)
          "above_baselines": (all(worst["hit_rate"] > v for k, v in ports.items()) if ports else None)})
