"""prefix-cache bench coldstart: a WorkerCore's start-up parts, in fresh processes.

Starts ``--runs`` WorkerCores of the worker config (``--worker-json``, default the embedded
model with ``--kv-memory-mb``), each in a fresh Python process, and prints one JSON line a
start with each part's seconds (``WorkerCore.startup``: model, cache, engine with the packed
weights' source, L3/NIXL/grammars on their threads, the rates). Two arms in the same run:
``before`` (no packed-weights cache, ``PREFIX_CACHE_PACKED_CACHE=0``: the checkpoint cast and
packed in the process, and the full calibration before serving, ``calibrate_at_start``) and
``after`` (the defaults: the weights mapped and the packed copies from disk, and serving on
this machine's kept rates where a replica kept some, else on the prior, ``calibrate_at_start:
false``: ``actors/config.py``);
a summary line with each arm's median ``core_s``. No Ray.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from lab.bench.common import emit

_CHILD = """
import json, sys, time
t0 = time.perf_counter()
from actors.core import WorkerConfig, WorkerCore
t1 = time.perf_counter()
core = WorkerCore("coldstart", WorkerConfig.from_dict(json.loads(sys.argv[1])))
t2 = time.perf_counter()
print("COLDSTART " + json.dumps({"import_s": round(t1 - t0, 3), "core_s": round(t2 - t1, 3), **core.startup}))
core.close()
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs", type=int, default=3, help="starts per arm")
    parser.add_argument("--arms", default="before,after", help="comma-separated: before, after")
    parser.add_argument("--kv-memory-mb", type=int, default=1024)
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--worker-json", default=None, help="the worker config as JSON (overrides the two above)")


def start_once(worker: dict, arm: str) -> dict:
    env = dict(os.environ)
    if arm == "before":
        env["PREFIX_CACHE_PACKED_CACHE"] = "0"
        worker = {**worker, "calibrate_at_start": True}
    else:
        worker = {**worker, "calibrate_at_start": False}
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(worker)], env=env, capture_output=True,
                         text=True, timeout=900)
    lines = [line for line in out.stdout.splitlines() if line.startswith("COLDSTART ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"the {arm} start failed: {out.stderr[-2000:]}")
    return json.loads(lines[-1][len("COLDSTART "):])


def run(args: argparse.Namespace) -> int:
    worker = json.loads(args.worker_json) if args.worker_json else \
        {"kv_memory_mb": args.kv_memory_mb, "torch_threads": args.torch_threads}
    summary = {}
    for arm in [a.strip() for a in args.arms.split(",") if a.strip()]:
        cores = []
        for i in range(args.runs):
            parts = start_once(worker, arm)
            cores.append(parts["core_s"])
            emit({"bench": "coldstart", "arm": arm, "run": i, **parts})
        summary[f"{arm}_core_s_p50"] = round(statistics.median(cores), 3)
    emit({"bench": "coldstart", "summary": True, "runs": args.runs, **summary})
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="prefix-cache bench coldstart", description=__doc__)
    add_arguments(parser)
    parser.add_argument("--results", default=None)
    sys.exit(run(parser.parse_args()))
