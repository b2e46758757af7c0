"""The embedded default: a local multi-node Ray cluster on 127.0.0.1 running the app,
with an L3 of its own (a ``mooncake_master`` and a pool holder on loopback, stopped
with the cluster) where Mooncake is installed."""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

log = logging.getLogger(__name__)

# Sized for the embedded SmolLM2-135M-Instruct in float32 (45 KiB of KV per token):
# 8k tokens HOT (360 MiB) and 16k WARM (720 MiB) per replica.
DEMO_WORKER = {"block_tokens": 16, "hot_blocks": 512, "warm_blocks": 1024, "max_batch_tokens": 512,
               "torch_threads": 1}


def prepare_model(spec=None, resolve: bool = True) -> str:
    """Resolve (download or convert) the model once, here, before replicas start,
    so three replicas do not wait on one another's conversion; returns its id."""
    from cluster.engine.checkpoint import ModelSpec, model_id, resolve_checkpoint

    parsed = ModelSpec.parse(spec)
    if resolve:
        resolve_checkpoint(parsed)
    return model_id(parsed)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_l3(pool_mb: int):
    """A local ``mooncake_master`` with a ``pool_mb`` MiB pool holder, or None (one
    line says why) when Mooncake is not installed or does not start."""
    from cluster.cache.l3 import INSTALL_HINT, mooncake_available
    from cluster.cache.l3.master import L3Master, L3MasterConfig, L3MasterError

    if not mooncake_available():
        print(f"L3 off: mooncake is not installed ({INSTALL_HINT})", flush=True)
        return None
    try:
        return L3Master(L3MasterConfig(holder_segment_bytes=pool_mb << 20)).start()
    except (L3MasterError, OSError) as exc:
        print(f"L3 off: the local mooncake_master did not start: {exc}", flush=True)
        return None


class LocalCluster:
    """A head and ``worker_nodes`` Ray nodes, every one on loopback, plus Serve, plus
    (``l3_pool_mb`` > 0) a local L3 master the replicas use."""

    def __init__(self, worker_nodes: int = 2, cpus_per_node: int = 2, namespace: str = "prefix-cache",
                 l3_pool_mb: int = 1024):
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before Ray starts: bind 127.0.0.1
        if os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0":
            # Ray reads the variable into this switch once, when it is imported; a command that
            # imported Ray first (``prefix-cache serve`` checks the app's config before it starts
            # the cluster) had every node on the machine's address. The switch works either way.
            from ray._private import ray_constants

            ray_constants.ENABLE_RAY_CLUSTER = False
        from actors.config import prepare_serving_env

        prepare_serving_env()   # replicas at nice 0, Serve's gRPC and loop settings (actors/config.py)
        import ray
        from ray.cluster_utils import Cluster

        self.l3 = start_l3(l3_pool_mb) if l3_pool_mb > 0 else None

        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": cpus_per_node, "include_dashboard": False})
        for _ in range(worker_nodes):
            self.cluster.add_node(num_cpus=cpus_per_node)
        self.cluster.wait_for_nodes()
        ray.init(address=self.cluster.address, namespace=namespace, log_to_driver=False)
        self.port: int | None = None

    def deploy(self, args: dict[str, Any], port: int = 8000, host: str = "127.0.0.1", timeout_s: float = 180):
        from ray import serve

        from serve_app.app import APP_NAME, build_app

        if self.l3 is not None and "l3_master" not in args.get("worker", {}):
            args = {**args, "worker": {**args.get("worker", {}), "l3_master": self.l3.address,
                                       "l3_master_http": self.l3.http_address}}
        serve.start(http_options={"host": host, "port": port})
        serve.run(build_app(args), name=APP_NAME, route_prefix="/", blocking=False)
        self.port = port
        self.wait_running(APP_NAME, timeout_s)   # a redeploy: until every new replica serves
        self.wait_ready(host, port, timeout_s)

    @staticmethod
    def wait_running(app_name: str, timeout_s: float) -> None:
        from ray import serve

        deadline = time.monotonic() + timeout_s
        status = None
        while time.monotonic() < deadline:
            app = serve.status().applications.get(app_name)
            status = app.status if app is not None else None
            if status == "RUNNING":
                return
            if status == "DEPLOY_FAILED":
                raise RuntimeError(f"deploying {app_name} failed: {app.message}")
            time.sleep(0.5)
        raise TimeoutError(f"the app {app_name} was not running within {timeout_s}s (status {status})")

    @staticmethod
    def wait_ready(host: str, port: int, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://{host}:{port}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError as exc:
                last = exc
            time.sleep(0.5)
        raise TimeoutError(f"the app did not answer /healthz on {host}:{port} within {timeout_s}s ({last})")

    def shutdown(self) -> None:
        import ray
        from ray import serve

        from serve_app.app import APP_NAME

        try:
            # Delete the app (replicas drain and exit); the cluster's processes go
            # with cluster.shutdown, so the Serve controller needs no separate kill.
            serve.delete(APP_NAME)
        finally:
            ray.shutdown()
            self.cluster.shutdown()
            if self.l3 is not None:
                self.l3.stop()
