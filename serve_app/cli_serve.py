"""``prefix-cache serve``: run the app in the foreground on 127.0.0.1:8000.

Without ``--address`` it starts the embedded default (a head and two worker
nodes on loopback, and a local L3 master where Mooncake is installed); with
``--address`` it deploys onto that Ray cluster (L3 on ``--l3-master``).
Ctrl-C tears down what it started.
"""

from __future__ import annotations

import argparse
import json
import signal
import time
from typing import Callable

from serve_app.local import DEMO_WORKER, LocalCluster, prepare_model


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=None, help="existing Ray cluster address (default: start one locally)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--replicas", type=int, default=3, help="cache replicas (default 3)")
    p.add_argument("--autoscale", type=replica_bounds, default=None, metavar="MIN:MAX",
                   help="autoscale the cache replicas between MIN and MAX instead of --replicas, with the "
                        "prefix_cache policy (queued prefill, TTFT, HOT room; --args "
                        "'{\"autoscaling_policy\": \"serve_default\"}' for Serve's own)")
    p.add_argument("--worker-nodes", type=int, default=2, help="local cluster worker nodes (default 2)")
    p.add_argument("--routing-policy", "--policy", dest="policy", default="cost",
                   help="the directory's routing policy (default cost)")
    p.add_argument("--model", default=None, help="model spec (default: the embedded SmolLM2-135M-Instruct; "
                                                  "a hub id, a checkpoint directory, a .gguf file, or 'builtin')")
    p.add_argument("--args", default=None, help="extra application args as JSON (merged over the defaults)")
    p.add_argument("--l3", choices=("on", "off"), default="on",
                   help="L3 on Mooncake Store (default on: a local master and pool holder are started; "
                        "off: each replica's cache is its own)")
    p.add_argument("--l3-pool-mb", type=int, default=1024, help="the local L3 pool, MiB (default 1024)")
    p.add_argument("--l3-master", default=None,
                   help="host:port of a running mooncake_master to use instead of starting one")


def replica_bounds(text: str) -> tuple[int, int]:
    """``MIN:MAX`` (0 <= MIN <= MAX, MAX >= 1) as two integers; argparse names the flag on error."""
    lo, sep, hi = text.partition(":")
    try:
        bounds = int(lo), int(hi)
    except ValueError:
        bounds = None
    if not sep or bounds is None or bounds[0] < 0 or bounds[1] < max(1, bounds[0]):
        raise argparse.ArgumentTypeError(f"expected MIN:MAX replicas with 0 <= MIN <= MAX and MAX >= 1, "
                                         f"got {text!r}")
    return bounds


def wait_for_stop(poll_s: float = 0.2, ready: Callable[[], None] | None = None) -> int:
    """Block until SIGINT or SIGTERM (both set explicitly: a shell that starts
    us in the background ignores SIGINT); returns the first signal's number.
    ``ready`` runs once the handlers are in place (say how to stop only then).

    The handler only appends to a list. It runs on the main thread between
    bytecodes, so one that took a lock the main thread may hold (``Event.set``
    while the loop sits in ``Event.wait``) deadlocks when two signals arrive
    together, as they do when Ctrl-C reaches a wrapper and this process both.
    """
    stopping: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: stopping.append(signum))
    if ready is not None:
        ready()
    while not stopping:
        time.sleep(poll_s)
    return stopping[0]


def run(args: argparse.Namespace) -> int:
    app_args = {"num_replicas": args.replicas, "routing_policy": args.policy, "worker": dict(DEMO_WORKER)}
    if args.autoscale is not None:
        del app_args["num_replicas"]
        app_args["autoscaling_config"] = {"min_replicas": args.autoscale[0], "max_replicas": args.autoscale[1]}
    if args.model is not None:
        app_args["worker"]["model"] = args.model
    if args.l3 == "on" and args.l3_master:
        app_args["worker"]["l3_master"] = args.l3_master
    if args.args:
        app_args.update(json.loads(args.args))
    from serve_app.app import worker_config_of   # checks the config before anything starts

    try:
        worker_config_of(app_args)
    except ValueError as exc:
        raise SystemExit(f"prefix-cache serve: {exc}") from None
    if not args.address:   # on a cluster of its own, each replica gets the model where it runs
        print("preparing the model (the first run converts the embedded GGUF once, ~30 s)...", flush=True)
    model = prepare_model(app_args["worker"].get("model"), resolve=not args.address)
    if args.address:
        from actors.connect import connect

        try:   # with a deadline; a loopback cluster keeps this driver on loopback
            connect(args.address)
        except (TimeoutError, ConnectionError, RuntimeError) as exc:
            raise SystemExit(f"prefix-cache serve: cannot join the Ray cluster at {args.address}: {exc}") from None
        from ray import serve

        from serve_app.app import APP_NAME, build_app

        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_app(app_args), name=APP_NAME, route_prefix="/", blocking=False)
        LocalCluster.wait_ready(args.host, args.port, 300)
        local = None
    else:
        local = LocalCluster(worker_nodes=args.worker_nodes,
                             l3_pool_mb=args.l3_pool_mb if args.l3 == "on" and not args.l3_master else 0)
        local.deploy(app_args, port=args.port, host=args.host)
        # What `prefix-cache loadtest --address` (kills, memory) needs.
        print(f"Ray cluster at {local.cluster.address}", flush=True)
    try:
        wait_for_stop(ready=lambda: print(f"serving {model} on http://{args.host}:{args.port}  (Ctrl-C to stop)",
                                          flush=True))
    finally:
        print("shutting down...", flush=True)
        if local is not None:
            local.shutdown()
        else:
            from ray import serve

            serve.delete("prefix-cache")
    return 0
