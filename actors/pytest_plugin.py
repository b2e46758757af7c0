"""Pytest fixtures that start a real multi-node Ray cluster on loopback.

Registered through the ``pytest11`` entry point, so any project that installs
``prefix-cache-cluster`` can use them:

- ``ray_loopback_cluster``: a head and ``--pc-worker-nodes`` worker nodes
  (default 2) of ``ray.cluster_utils.Cluster``, every node on 127.0.0.1, each
  with a custom resource ``pc_node_<i>`` so an actor can be pinned to it.
- ``l3_master``: a ``mooncake_master`` and its pool holder on loopback for the
  session (``cluster.cache.l3.master.L3Master``), or None where Mooncake is
  not installed; stopped at the end.
- ``cache_cluster``: the directory plus one cache worker per node (the one
  worker shell, ``actors.worker.CacheWorker``, as a named actor: the class the
  Serve replica deploys), small built-in model, L3 on ``l3_master`` when there
  is one; yields a ``LoopbackCacheCluster`` with handles and helpers (a
  worker's peer channel: ``on_peer``).

- ``autoscaling_cluster``: a head whose Ray autoscaler (the real one, v1) runs on
  the fake node provider: worker nodes of type ``pc.autoscaled`` (1 CPU and one
  ``pc_autoscaled`` each, at most 2) are started when work waits for one and
  given back after ``AUTOSCALING_IDLE_MINUTES`` idle (``FakeAutoscalingCluster``).
  Module-scoped; it takes over this process's Ray connection (the actors the old
  one owned end with it) and reconnects afterwards, so its tests run last.

The plugin turns on the thread-ownership check (``PREFIX_CACHE_CHECK_THREADS``)
for the whole session, before Ray starts, so every worker runs with it.

All are session-scoped: starting Ray costs seconds, so the suite pays it once.
Tests that kill actors restore what they killed (``cache_cluster.restart_worker``).
``cache_cluster`` stops right after the last collected test that uses it, not at
the end of the session: its idle actors would otherwise share the cores with
every test after it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import json
import secrets
import socket
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from cluster.ownership import ENV_VAR as OWNERSHIP_ENV_VAR

log = logging.getLogger(__name__)

TEST_MODEL = dict(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32,
                  intermediate_size=256, seed=7)
TEST_WORKER_CONFIG = dict(model=TEST_MODEL, hot_blocks=256, warm_blocks=512, block_tokens=16,
                          max_batch_tokens=2048, torch_threads=1)
NAMESPACE = "prefix-cache-test"


def pytest_configure(config):
    # Ray reads this when it is imported and when nodes start: with it, every node
    # of a ray.cluster_utils.Cluster binds to 127.0.0.1. It must be set before any
    # test module imports ray, hence here and not in a fixture.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # Debug mode for engine-owned state (cluster.ownership): every worker and Serve
    # replica the tests start inherits it, so a cache touched off its engine thread
    # fails the test that did it.
    os.environ.setdefault(OWNERSHIP_ENV_VAR, "1")
    # The test clusters run with the app's environment (nice 0, not Ray's 15; Serve's settings).
    from actors.config import prepare_serving_env

    prepare_serving_env()


def pytest_addoption(parser):
    group = parser.getgroup("prefix-cache")
    group.addoption("--pc-worker-nodes", type=int, default=2,
                    help="worker nodes of the loopback Ray cluster (default 2, plus the head)")


_LAST_USER = pytest.StashKey[str]()
_LIVE_CLUSTERS: list["LoopbackCacheCluster"] = []


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    # The autoscaling cluster's tests last: its fixture takes this process's Ray connection,
    # and dropping a connection ends the actors it owns (the session cluster's workers).
    late = [item for item in items if "autoscaling_cluster" in getattr(item, "fixturenames", ())]
    if late:
        items[:] = [item for item in items if item not in late] + late
    # After any reordering plugin: the last test, in run order, that uses the cluster.
    users = [item.nodeid for item in items if "cache_cluster" in getattr(item, "fixturenames", ())]
    if users:
        config.stash[_LAST_USER] = users[-1]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    if item.nodeid == item.config.stash.get(_LAST_USER, None):
        for cc in _LIVE_CLUSTERS:
            cc.shutdown()


def node_resource(i: int) -> str:
    return f"pc_node_{i}"


@pytest.fixture(scope="session")
def ray_loopback_cluster(request):
    import ray
    from ray.cluster_utils import Cluster

    n = request.config.getoption("--pc-worker-nodes")
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 4, "resources": {node_resource(0): 1}, "include_dashboard": False})
    for i in range(1, n + 1):
        cluster.add_node(num_cpus=4, resources={node_resource(i): 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@dataclass
class LoopbackCacheCluster:
    cluster: Any
    namespace: str
    config: dict
    directory: Any = None
    workers: dict[str, Any] = field(default_factory=dict)
    # The peer channels' secret, and each worker's address (``wait_registered`` learns them).
    peer_secret: str = field(default_factory=lambda: secrets.token_hex(8))
    addresses: dict[str, str] = field(default_factory=dict)
    _starting: dict[str, Any] = field(default_factory=dict)

    @property
    def worker_ids(self) -> list[str]:
        return sorted(self.workers)

    def start_directory(self, policy: str = "cost"):
        from actors.directory import get_or_create_directory

        self.directory = get_or_create_directory(self.namespace, policy=policy,
                                                 block_tokens=self.config["block_tokens"])
        return self.directory

    def start_worker(self, i: int):
        from actors.worker import start_worker

        wid = f"w{i}"
        self.workers[wid] = start_worker(wid, self.config, namespace=self.namespace,
                                         resources={node_resource(i): 0.01}, num_gpus=0,
                                         peer_secret=self.peer_secret)
        self._starting[wid] = self.workers[wid].ready.remote()
        return self.workers[wid]

    def restart_worker(self, worker_id: str) -> None:
        """A new process for ``worker_id`` (the old one killed first, its name freed: a
        killed actor keeps it a while), registered with the directory."""
        import ray

        from cluster.names import worker_actor_name

        ray.kill(self.workers[worker_id], no_restart=True)
        # Until the killed actor's name is free: starting (get_if_exists) before that hands back
        # the dying actor, whose ready() then fails (ActorDiedError: killed by ray.kill).
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                ray.get_actor(worker_actor_name(worker_id), namespace=self.namespace)
            except ValueError:   # no such actor: the name is free
                break
            time.sleep(0.1)
        self.start_worker(int(worker_id[1:]))
        self.wait_registered()

    def shutdown(self) -> None:
        """Kill the workers and the directory (idempotent)."""
        import ray

        for h in self.workers.values():
            try:
                ray.kill(h, no_restart=True)
            except Exception as exc:   # already gone (a test killed it): nothing left to stop
                log.debug("teardown: worker actor already gone: %s", exc)
        self.workers.clear()
        if self.directory is not None:
            ray.kill(self.directory, no_restart=True)
            self.directory = None

    def client(self, **kw):
        from actors.client import ClusterClient

        return ClusterClient(self.namespace, self.config["block_tokens"], **kw)

    def wait_registered(self, timeout_s: float = 180.0) -> None:
        import ray

        deadline = time.monotonic() + timeout_s
        for wid, ref in list(self._starting.items()):
            self.addresses[wid] = ray.get(ref, timeout=timeout_s)
            del self._starting[wid]
        while time.monotonic() < deadline:
            if ray.get(self.directory.live_workers.remote(), timeout=30) == self.worker_ids:
                return
            time.sleep(0.1)
        raise TimeoutError(f"workers {self.worker_ids} did not all register with the directory")

    def on_peer(self, worker_id: str, call, timeout_s: float = 60.0):
        """``call(client)`` over ``worker_id``'s peer channel (``actors.peer.PeerClient``,
        what the ingress and the other workers use), run to its answer."""
        from actors.peer import PeerClient

        async def run():
            client = PeerClient(worker_id, self.addresses[worker_id], secret=self.peer_secret, timeout_s=timeout_s)
            try:
                return await call(client)
            finally:
                client.close()
        return asyncio.run(run())

    def flush_all(self) -> None:
        for wid in self.workers:
            self.on_peer(wid, lambda peer: peer.flush())


@pytest.fixture(scope="session")
def l3_master():
    from cluster.cache.l3 import mooncake_available

    if not mooncake_available():
        log.warning("mooncake is not importable: the test cluster runs without L3")
        yield None
        return
    from cluster.cache.l3.master import L3Master, L3MasterConfig

    with L3Master(L3MasterConfig(holder_segment_bytes=256 << 20)) as master:
        yield master


def l3_worker_config(master) -> dict:
    """Worker config keys for L3 on ``master`` (none without one). The test model
    computes faster than any store answers, so fetches are forced on."""
    return {} if master is None else {"l3_master": master.address, "l3_master_http": master.http_address,
                                      "l3_fetch": "always"}


@pytest.fixture(scope="session")
def cache_cluster(ray_loopback_cluster, l3_master, request):
    n = request.config.getoption("--pc-worker-nodes")
    cc = LoopbackCacheCluster(ray_loopback_cluster, NAMESPACE, {**TEST_WORKER_CONFIG, **l3_worker_config(l3_master)})
    cc.start_directory()
    for i in range(n + 1):
        cc.start_worker(i)
    cc.wait_registered()
    _LIVE_CLUSTERS.append(cc)
    yield cc
    cc.shutdown()
    _LIVE_CLUSTERS.remove(cc)


# The fake node provider of Ray's own autoscaler tests, loaded as an "external" provider:
# its "fake_multinode" type needs a defaults file the Ray wheel does not ship.
FAKE_NODE_PROVIDER = "ray.autoscaler._private.fake_multi_node.node_provider.FakeMultiNodeProvider"
AUTOSCALED_RESOURCE = "pc_autoscaled"
AUTOSCALING_IDLE_MINUTES = 0.05   # 3 s idle before the autoscaler gives a node back


def fake_autoscaling_config(gcs_address: str, head_resources: dict[str, float],
                            worker_types: dict[str, dict[str, Any]], idle_timeout_minutes: float) -> dict[str, Any]:
    """An autoscaler config for the fake node provider (what ``ray.cluster_utils.AutoscalingCluster``
    generates from Ray's example file, with the provider pointed at ``gcs_address``)."""
    types = {name: {"node_config": {}, "min_workers": 0, **t} for name, t in worker_types.items()}
    types["ray.head.default"] = {"resources": dict(head_resources), "node_config": {}, "max_workers": 0}
    return {"cluster_name": "pc-fake-autoscaling", "max_workers": sum(t.get("max_workers", 0) for t in types.values()),
            "provider": {"type": "external", "module": FAKE_NODE_PROVIDER, "gcs_address": gcs_address,
                         "use_node_id_as_ip": True, "disable_node_updaters": True,
                         "disable_launch_config_check": True},
            "available_node_types": types, "head_node_type": "ray.head.default",
            "upscaling_speed": 1.0, "idle_timeout_minutes": idle_timeout_minutes, "auth": {}, "docker": {},
            "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
            "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
            "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
            "rsync_exclude": [], "rsync_filter": []}


class FakeAutoscalingCluster:
    """A Ray head on loopback whose autoscaler adds and removes fake nodes (each a real raylet
    in the autoscaler's process) as work waits for them or leaves them idle.

    ``ray.cluster_utils.AutoscalingCluster`` runs ``ray stop --force`` on start and shutdown,
    which stops every Ray cluster on the machine, and reads a file the wheel does not ship;
    this runs the same autoscaler from a ``ray.cluster_utils.Cluster`` head of its own and
    stops only what it started: the head, and every process under the autoscaler's."""

    def __init__(self, head_cpus: int, worker_types: dict[str, dict[str, Any]],
                 idle_timeout_minutes: float = AUTOSCALING_IDLE_MINUTES):
        self.head_cpus, self.worker_types, self.idle_timeout_minutes = head_cpus, worker_types, idle_timeout_minutes
        self.cluster = None
        self._config_path: str | None = None

    def start(self) -> "FakeAutoscalingCluster":
        from ray.cluster_utils import Cluster

        with socket.socket() as sock:   # the GCS port, known before the head starts (the provider needs it)
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        config = fake_autoscaling_config(f"127.0.0.1:{port}", {"CPU": self.head_cpus}, self.worker_types,
                                         self.idle_timeout_minutes)
        fd, self._config_path = tempfile.mkstemp(prefix="pc-autoscaling-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(config, f)
        # The autoscaler process inherits these: the fake provider refuses to run without the
        # first; the second makes it look every second instead of every five.
        saved = {k: os.environ.get(k) for k in ("RAY_FAKE_CLUSTER", "AUTOSCALER_UPDATE_INTERVAL_S")}
        os.environ.update({"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"})
        try:
            self.cluster = Cluster(initialize_head=True, head_node_args={
                "num_cpus": self.head_cpus, "include_dashboard": False, "gcs_server_port": port,
                "autoscaling_config": self._config_path})
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        return self

    @property
    def address(self) -> str:
        return self.cluster.address

    def alive_nodes(self) -> list[dict[str, Any]]:
        import ray

        return [n for n in ray.nodes() if n["Alive"]]

    def wait_nodes(self, count: int, timeout_s: float) -> list[dict[str, Any]]:
        """Until exactly ``count`` nodes are alive (head included); TimeoutError naming what was seen."""
        deadline = time.monotonic() + timeout_s
        alive = self.alive_nodes()
        while len(alive) != count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(alive)} nodes alive after {timeout_s}s, waiting for {count}")
            time.sleep(0.5)
            alive = self.alive_nodes()
        return alive

    def shutdown(self) -> None:
        """The head, then whatever is left under the autoscaler's process (its fake nodes)."""
        import psutil
        from ray._private import ray_constants

        if self.cluster is None:
            return
        leftovers = []
        for info in self.cluster.head_node.all_processes.get(ray_constants.PROCESS_TYPE_MONITOR, []):
            try:
                leftovers += psutil.Process(info.process.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                pass
        self.cluster.shutdown()
        for proc in leftovers:
            try:
                proc.terminate()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(leftovers, timeout=10)
        for proc in alive:
            proc.kill()
        self.cluster = None
        if self._config_path is not None:
            os.unlink(self._config_path)
            self._config_path = None


@pytest.fixture(scope="module")
def autoscaling_cluster():
    import ray

    previous = None
    if ray.is_initialized():   # a session cluster of this plugin: reconnected afterwards
        ctx = ray.get_runtime_context()
        previous = (ctx.gcs_address, ctx.namespace)
        ray.shutdown()
    cluster = FakeAutoscalingCluster(head_cpus=1, worker_types={"pc.autoscaled": {
        "resources": {"CPU": 1, AUTOSCALED_RESOURCE: 1}, "max_workers": 2}}).start()
    try:
        ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        if previous is not None:
            ray.init(address=previous[0], namespace=previous[1], log_to_driver=False)
