"""actors.connect against the real loopback Ray cluster: a command joins it
without the environment variable set, and a dead address is an error in
bounded time, never a hang.

Each case runs in a child process: the test process already holds a driver
of the session's cluster, and what is checked is a fresh command's join.
"""

import os
import socket
import subprocess
import sys

import pytest

from actors.connect import connect, is_loopback
from cluster.errors import InvalidInputError

pytestmark = pytest.mark.distributed

# Imports Ray before joining (as a command whose modules import it would), so
# the switch Ray read at import must be set by connect itself.
CHILD = """
import sys
import threading
import ray
from actors.connect import connect
try:
    connect(sys.argv[1], timeout_s=float(sys.argv[2]), log_to_driver=False, logging_level="ERROR")
except TimeoutError as exc:
    print("TIMEOUT", exc, flush=True)
    # What would keep the process alive past sys.exit: a thread that is not a daemon.
    print("LINGERING", sorted(t.name for t in threading.enumerate()
                              if t is not threading.main_thread() and not t.daemon), flush=True)
    sys.exit(3)
print("NODES", sum(1 for n in ray.nodes() if n["Alive"]), flush=True)
print("NODE_IP", ray.util.get_node_ip_address(), flush=True)
"""


def _child(address: str, timeout_s: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS")}
    return subprocess.run([sys.executable, "-c", CHILD, address, str(timeout_s)], env=env, capture_output=True,
                          text=True, timeout=120)


def test_a_command_joins_the_loopback_cluster_without_the_variable(ray_loopback_cluster):
    address = ray_loopback_cluster.address
    assert is_loopback(address)
    done = _child(address, 60)
    assert done.returncode == 0, done.stderr[-2000:]
    nodes = len(ray_loopback_cluster.list_all_nodes())
    assert f"NODES {nodes}" in done.stdout
    assert "NODE_IP 127.0.0.1" in done.stdout   # the driver stayed on loopback


def test_a_dead_address_is_an_error_naming_it_within_the_timeout():
    with socket.socket() as s:   # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = _child(f"127.0.0.1:{port}", 3)   # _child's own timeout only guards against a hang
    assert done.returncode == 3, (done.stdout, done.stderr[-2000:])
    assert f"TIMEOUT no Ray cluster answered at 127.0.0.1:{port} within 3 s" in done.stdout
    # The process gave up and exited on its own: no thread of the failed join kept it alive.
    assert "LINGERING []" in done.stdout, done.stdout


@pytest.mark.parametrize("address, loopback", [
    ("127.0.0.1:6379", True), ("localhost:6379", True), ("[::1]:6379", True),
    ("10.0.0.7:6379", False), ("auto", False), ("ray-head.svc:6379", False),
])
def test_is_loopback(address, loopback):
    assert is_loopback(address) is loopback


@pytest.mark.parametrize("timeout_s", [0, -1, float("nan"), "30"])
def test_the_timeout_must_be_a_positive_number(timeout_s):
    with pytest.raises(InvalidInputError, match="connect timeout must be a positive number"):
        connect("127.0.0.1:6379", timeout_s=timeout_s)


# A local cluster started by a command that imported Ray first (``prefix-cache serve``
# imports the app, and Ray with it, to check the config before the cluster starts).
LOCAL_CHILD = """
import ray
from serve_app.local import LocalCluster
local = LocalCluster(worker_nodes=1, cpus_per_node=1, l3_pool_mb=0)
try:
    print("ADDRESS", local.cluster.address, flush=True)
    print("NODES", sorted({n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}), flush=True)
finally:
    ray.shutdown()
    local.cluster.shutdown()
"""


def test_a_local_cluster_stays_on_loopback_when_ray_was_imported_first():
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS")}
    done = subprocess.run([sys.executable, "-c", LOCAL_CHILD], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ADDRESS 127.0.0.1:" in done.stdout and "NODES ['127.0.0.1']" in done.stdout, done.stdout
