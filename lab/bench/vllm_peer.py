"""The vLLM peer of ``bench serving``: its command line in its default (compiled) mode with
our arm's step limits and a given KV size, its start, its row, and the stop of its process
group. The peer runs from its own virtualenv (``--peer-python``), never this project's."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from lab.bench.common import rounded
from lab.bench.equal_memory import memory_tokens, preemptions_per_stream

VLLM_BLOCK_TOKENS = 32   # vLLM's CPU backend needs a multiple of 32
VLLM_MAX_MODEL_LEN = 4096
# Our arm's fields, null in the peer's row.
OUR_ONLY_FIELDS = ("promoted_tokens", "recomputed_tokens", "recomputed_held_tokens", "recompute_chosen_tokens",
                   "dropped_tokens", "dropped_tokens_by_reason", "dropped_with_room_tokens", "compiled_kernels")


def vllm_kv_tokens(args, arm: str, hot_tokens: int) -> int:
    """vLLM's KV in tokens: our HOT (``vllm-same-hot``), or our HOT plus WARM, all the memory
    our arm keeps KV in (``vllm-all-memory``)."""
    if arm == "vllm-same-hot":
        return hot_tokens
    if arm == "vllm-all-memory":
        return hot_tokens + args.warm_tokens * args.replicas
    if arm == "vllm-same-memory":   # all of --memory-mb as KV
        return memory_tokens(args.memory_mb, args.token_bytes)
    raise ValueError(f"not a vLLM arm: {arm}")


def vllm_command(args, model_dir: Path, hot_tokens: int, port: int, limits: tuple[int, int]) -> tuple[list[str], dict]:
    """vLLM's command line and environment for a KV of ``hot_tokens`` tokens, with ``limits``
    (tokens a step computes at most, sequences running at most)."""
    blocks = -(-hot_tokens // VLLM_BLOCK_TOKENS) + 1   # vLLM holds one block back as its null block
    from cluster.engine import malloc
    from cluster.engine.checkpoint import _read_json, model_config_from_hf

    cfg = model_config_from_hf(_read_json(model_dir / "config.json"))
    block_bytes = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * VLLM_BLOCK_TOKENS * 4   # float32
    max_len = min(VLLM_MAX_MODEL_LEN, (blocks - 1) * VLLM_BLOCK_TOKENS)
    max_batch_tokens, max_running = limits
    # Its default mode (compiled; no --enforce-eager), and this app's step limits.
    cmd = [args.peer_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", "peer", "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
           "--enable-prefix-caching", "--block-size", str(VLLM_BLOCK_TOKENS),
           "--num-gpu-blocks-override", str(blocks), "--kv-cache-memory-bytes", str(blocks * block_bytes),
           "--max-model-len", str(max_len), "--max-num-batched-tokens", str(max_batch_tokens),
           "--max-num-seqs", str(max_running), "--enable-prompt-tokens-details"]
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


def run_vllm(args, model_dir: Path, drive, hot_tokens: int, arm: str, limits: tuple[int, int]) -> dict:
    """Start vLLM for ``arm`` (its KV: ``vllm_kv_tokens``), drive it, stop its process group; its row."""
    import httpx

    from serve_app.local import free_port

    port = free_port()
    kv_tokens = vllm_kv_tokens(args, arm, hot_tokens)
    cmd, env = vllm_command(args, model_dir, kv_tokens, port, limits)
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-serving-vllm-{port}.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        started = time.monotonic()
        while True:   # vLLM's CPU start-up: imports, engine init and its compile, minutes on 2 cores
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {proc.returncode} before it was ready (log: {log.name})")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - started > args.peer_start_s:
                raise TimeoutError(f"vLLM did not become ready in {args.peer_start_s:.0f} s (log: {log.name})")
            time.sleep(1)
        start_s = time.monotonic() - started
        row = drive(base, "peer")
        metrics = httpx.get(base + "/metrics", timeout=30).text
        hits, queries = _metric(metrics, "vllm:prefix_cache_hits_total"), _metric(metrics, "vllm:prefix_cache_queries_total")
        row["preemptions"] = int(_metric(metrics, "vllm:num_preemptions_total"))
        row["prefix_cache_hit_rate"] = rounded(hits / queries, 4) if queries else None
        row["preemptions_per_stream"] = preemptions_per_stream(row)
        value = lambda flag: int(cmd[cmd.index(flag) + 1])   # noqa: E731
        return {"impl": arm, "workload": row.pop("workload"), "l3": False, "kv_tokens": kv_tokens,
                "hot_tokens": hot_tokens, "warm_tokens": args.warm_tokens * args.replicas,
                "block_tokens": VLLM_BLOCK_TOKENS, "max_model_len": value("--max-model-len"),
                "max_num_batched_tokens": value("--max-num-batched-tokens"), "max_num_seqs": value("--max-num-seqs"),
                "enforce_eager": "--enforce-eager" in cmd, "start_s": round(start_s, 1),
                "cpus": args.peer_cpus, "openmp": "intel" if "libiomp5" in env.get("LD_PRELOAD", "") else "gnu",
                "tcmalloc": "tcmalloc" in env.get("LD_PRELOAD", ""), **dict.fromkeys(OUR_ONLY_FIELDS), **row}
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
