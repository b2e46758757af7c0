"""The Serve app on this machine's GPU, end to end: the `serve` step of scripts/gpu-check.sh.

Starts a local Ray cluster (a head and one worker node on 127.0.0.1, each offering this
machine's GPUs) and deploys the app as a platform team would, ``gpus_per_replica`` unset:
the deploy decides from the cluster's resources (its log line is kept). With
``--expect-gpu`` it checks that the decision claimed a GPU and that every replica's process
is on one (``nvidia-smi``'s compute processes). Then ``prefix-cache demo``'s multi-turn
workload over HTTP (each session carries a document of its own, together more KV than the
replicas' HOT pools hold), three arms, caches flushed in between:

- ``tiered``: the cost router on HOT + WARM;
- ``tiered+prefetch``: the same, every request with its ``X-Session-Id`` header, which starts
  the session's prefetch when the headers arrive;
- ``drop``: no WARM (the app redeployed): what leaves HOT is gone.

One JSON row: the deploy's decision (its log line, the GPUs each replica claims), the
replicas and how many run on the GPU, per arm the requests, failures, hit rate, reuse and
TTFT p50/p99, and ``failed``: what missed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys

ARMS = (("tiered", False), ("tiered+prefetch", True), ("drop", False))


class _Count:
    def __init__(self) -> None:
        self.n = 0

    def update(self, k: int) -> None:
        self.n += k


def record_placements() -> list:
    """Every GPU claim the app's build decides (``serve_app.app`` calls ``decide_placement``
    once a build, here in this process: ``LocalCluster.deploy`` builds with ``serve.run``),
    kept as it returns them; its deploy log line is ``prefix-cache deploy: <reason>``."""
    import serve_app.app as app_module

    decided = []
    decide = app_module.decide_placement

    def recording(*args, **kwargs):
        decided.append(decide(*args, **kwargs))
        return decided[-1]

    app_module.decide_placement = recording
    return decided


def gpu_pids() -> set[int] | None:
    """The processes on an NVIDIA GPU of this machine (None: nvidia-smi did not answer)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return {int(p) for p in out.stdout.split() if p.strip().isdigit()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--model", default=None, help="model spec (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default=None, help="the model's dtype (default: the spec's)")
    p.add_argument("--expect-gpu", action="store_true", help="fail unless every replica runs on a GPU")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--document-words", type=int, default=450)
    p.add_argument("--hot-blocks", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import httpx

    from lab.demo import make_sessions, run_arm, summarize
    from serve_app.local import DEMO_WORKER, LocalCluster, free_port, prepare_model

    model = prepare_model(args.model)
    spec = args.model if args.dtype is None else {"source": args.model or "smollm2-135m-instruct",
                                                   "dtype": args.dtype}
    worker = {**DEMO_WORKER, "hot_blocks": args.hot_blocks, **({"model": spec} if spec is not None else {})}
    app = {"num_replicas": args.replicas, "worker": worker, "admin_without_keys": True}
    placements = record_placements()
    row: dict = {"model": model, "replicas": args.replicas}
    failed: list[str] = []
    local = LocalCluster(worker_nodes=1, cpus_per_node=4, l3_pool_mb=0)
    port = free_port()   # once the cluster's processes hold their ports
    base = f"http://127.0.0.1:{port}"
    try:
        local.deploy(app, port=port)
        row["placement"] = f"prefix-cache deploy: {placements[-1].reason}" if placements else None
        row["gpus_per_replica"] = placements[-1].num_gpus if placements else None
        stats = httpx.get(base + "/v1/cache/stats", timeout=60).json()["workers"]
        pids = {w: s.get("worker", {}).get("pid") for w, s in stats.items()}
        on_gpu = gpu_pids()
        row["replica_pids"] = sorted(p for p in pids.values() if p)
        row["replicas_on_gpu"] = None if on_gpu is None else sum(1 for p in pids.values() if p in on_gpu)
        if args.expect_gpu:
            if not row["gpus_per_replica"]:
                failed.append(f"the deploy did not claim a GPU: {row['placement']!r}")
            if row["replicas_on_gpu"] != args.replicas:
                failed.append(f"{row['replicas_on_gpu']} of {args.replicas} replicas run on the GPU "
                              f"(replica pids {row['replica_pids']}, GPU processes {sorted(on_gpu or ())})")
        sessions = make_sessions(args)
        arms = {}
        for arm, header in ARMS:
            if arm == "drop":   # HOT only: the app redeployed without WARM
                local.deploy({**app, "worker": {**worker, "warm_blocks": 0}}, port=port)
            try:
                results = asyncio.run(run_arm(base, model, "cost", sessions, args, _Count(), session_header=header))
            except Exception as exc:   # an HTTP error ends the arm; say which
                failed.append(f"{arm}: {type(exc).__name__}: {exc}")
                continue
            summary = summarize("cost", arm, results)
            arms[arm] = {"requests": summary["requests"], "hit_rate": round(summary["hit_rate"], 4),
                         "reuse": round(summary["reuse_ratio"], 4), "ttft_ms_p50": round(summary["ttft_ms_p50"], 1),
                         "ttft_ms_p99": round(summary["ttft_ms_p99"], 1)}
            if summary["requests"] != args.sessions * args.turns:
                failed.append(f"{arm}: {summary['requests']} of {args.sessions * args.turns} requests answered")
        row["arms"] = arms
        if "drop" in arms and "tiered" in arms and arms["tiered"]["ttft_ms_p50"]:
            row["drop_vs_tiered_ttft_p50"] = round(arms["drop"]["ttft_ms_p50"] / arms["tiered"]["ttft_ms_p50"], 2)
    except Exception as exc:
        failed.append(f"{type(exc).__name__}: {exc}")
    finally:
        try:
            local.shutdown()
        except Exception as exc:   # the row says what ran; the shutdown's trouble goes to stderr
            print(f"shutdown: {exc}", file=sys.stderr)
    row["failed"] = failed
    print(json.dumps(row), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
