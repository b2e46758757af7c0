"""A local Mooncake Store for L3: a ``mooncake_master`` and a pool holder.

Starts ``mooncake_master`` bound to 127.0.0.1 on free ports and, unless
``holder_segment_bytes`` is 0, one standalone ``mooncake_client`` that holds
the memory pool (the node's segment: replicas are consumers and own none, see
``cluster.cache.l3``). Bounded: ``start`` waits until the master answers and
the holder's segment is mounted, or raises ``L3MasterError`` with the tail of
the process's log; ``stop`` ends both (SIGTERM, then SIGKILL) and runs at
interpreter exit too; with ``kill_with_parent`` the kernel ends them if this
process dies (Linux ``PR_SET_PDEATHSIG``: tied to the *thread* that started
them, so start from a long-lived thread). Pure library, subprocesses only.

    with L3Master() as l3:
        store = MooncakeL3Store(L3Config(master_address=l3.address))

Ports: the master's RPC and metrics ports and the holder's service port are
chosen here; Mooncake's clients also bind a P2P handshake port on 0.0.0.0 and
a transfer port on every interface, which cannot be moved to loopback.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from dataclasses import dataclass
from pathlib import Path

from cluster.errors import CacheError, InvalidInputError

__all__ = ["L3Master", "L3MasterConfig", "L3MasterError", "find_mooncake_binary"]

INSTALL_HINT = ("install the pip package mooncake-transfer-engine-non-cuda==0.3.13.post1 on CPU machines "
                "(mooncake-transfer-engine on CUDA machines), e.g. pip install 'prefix-cache-cluster[l3]', "
                "and the Debian/Ubuntu package libibverbs1 (apt-get install libibverbs1)")
_FALLBACK_BIN_DIRS = ("/opt/mooncake-venv/bin",)
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never via http_proxy


class L3MasterError(CacheError, RuntimeError):
    """A local Mooncake master or pool holder could not be found or started."""


def find_mooncake_binary(name: str) -> Path:
    """``mooncake_master`` / ``mooncake_client``: from ``$MOONCAKE_BIN_DIR``, the
    installed ``mooncake`` package (where the wheel keeps the executables), the
    running interpreter's bin directory, /opt/mooncake-venv/bin, then PATH."""
    dirs: list[Path] = []
    if os.environ.get("MOONCAKE_BIN_DIR"):
        dirs.append(Path(os.environ["MOONCAKE_BIN_DIR"]))
    try:
        spec = importlib.util.find_spec("mooncake")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        dirs.extend(Path(p) for p in spec.submodule_search_locations)
    dirs.append(Path(sys.executable).parent)
    dirs.extend(Path(d) for d in _FALLBACK_BIN_DIRS)
    for d in dirs:
        candidate = d / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which(name)
    if found:
        return Path(found)
    raise L3MasterError(f"{name} not found (looked in {', '.join(str(d) for d in dirs)} and PATH): {INSTALL_HINT}")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _pdeathsig_hook():
    """A preexec hook that asks the kernel to SIGTERM the child when its parent
    thread exits (Linux); None elsewhere. libc is loaded here, in the parent: the
    hook runs between fork and exec and must do as little as possible."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass(frozen=True)
class L3MasterConfig:
    host: str = "127.0.0.1"
    rpc_port: int = 0                       # 0: a free port
    metrics_port: int = 0
    holder_port: int = 0
    holder_segment_bytes: int = 512 << 20   # the pool; 0: no holder (clients bring segments)
    holder_buffer_bytes: int = 16 << 20
    client_ttl_s: int = 10                  # a dead client's segment is dropped after this
    kv_lease_ttl_ms: int = 10_000           # a read object cannot be evicted for this long
    ready_timeout_s: float = 30.0
    stop_timeout_s: float = 5.0
    log_dir: str | None = None              # None: a fresh temporary directory
    kill_with_parent: bool = True

    def __post_init__(self) -> None:
        if self.holder_segment_bytes < 0 or self.holder_buffer_bytes <= 0 or self.client_ttl_s < 1 \
                or self.kv_lease_ttl_ms < 0 or not self.ready_timeout_s > 0 or not self.stop_timeout_s > 0:
            raise InvalidInputError("holder_segment_bytes must be >= 0, holder_buffer_bytes > 0, client_ttl_s >= 1, "
                                    "kv_lease_ttl_ms >= 0 and the timeouts positive")


class L3Master:
    """A running local master (and pool holder); a context manager."""

    def __init__(self, config: L3MasterConfig | None = None):
        self.config = config or L3MasterConfig()
        self.master: subprocess.Popen | None = None
        self.holder: subprocess.Popen | None = None
        self.rpc_port = self.metrics_port = self.holder_port = 0
        self.log_dir = Path(self.config.log_dir or tempfile.mkdtemp(prefix="l3-master-"))
        self._scratch = None if self.config.log_dir else self.log_dir  # removed at stop
        self._finalizer: weakref.finalize | None = None

    @property
    def address(self) -> str:
        """``host:port`` of the master's RPC service (``L3Config.master_address``)."""
        return f"{self.config.host}:{self.rpc_port}"

    @property
    def http_address(self) -> str:
        """``host:port`` of the master's HTTP server (metrics, key listing: ``L3Config.http_address``)."""
        return f"{self.config.host}:{self.metrics_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.config.host}:{self.metrics_port}/metrics"

    def __enter__(self) -> "L3Master":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------- lifecycle
    def start(self) -> "L3Master":
        if self.master is not None:
            return self
        cfg = self.config
        master_bin = find_mooncake_binary("mooncake_master")
        holder_bin = find_mooncake_binary("mooncake_client") if cfg.holder_segment_bytes else None
        self.rpc_port = cfg.rpc_port or _free_port(cfg.host)
        self.metrics_port = cfg.metrics_port or _free_port(cfg.host)
        deadline = time.monotonic() + cfg.ready_timeout_s
        try:
            self.master = self._spawn("master", [
                str(master_bin), f"--rpc_address={cfg.host}", f"--rpc_port={self.rpc_port}",
                f"--metrics_host={cfg.host}", f"--metrics_port={self.metrics_port}",
                f"--client_ttl={cfg.client_ttl_s}", f"--default_kv_lease_ttl={cfg.kv_lease_ttl_ms}",
                "--logtostderr"])
            self._finalizer = weakref.finalize(self, _stop_all, [self.master], cfg.stop_timeout_s, self._scratch)
            self._wait(self.master, "master", deadline, self._master_answers)
            if holder_bin is not None:
                self.holder_port = cfg.holder_port or _free_port(cfg.host)
                self.holder = self._spawn("holder", [
                    str(holder_bin), f"--host={cfg.host}", f"--port={self.holder_port}",
                    f"--global_segment_size={cfg.holder_segment_bytes}",
                    f"--local_buffer_size={cfg.holder_buffer_bytes}",
                    f"--master_server_address={self.address}", "--metadata_server=P2PHANDSHAKE",
                    "--protocol=tcp"])
                self._finalizer.detach()
                self._finalizer = weakref.finalize(self, _stop_all, [self.holder, self.master], cfg.stop_timeout_s,
                                                  self._scratch)
                self._wait(self.holder, "holder", deadline,
                           lambda: (self._metric("master_total_capacity_bytes") or 0) >= cfg.holder_segment_bytes)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """End the holder, then the master (idempotent); the logs go with a temporary log_dir."""
        if self._finalizer is not None:
            self._finalizer()  # runs _stop_all once; also registered for interpreter exit
            self._finalizer = None
        else:
            _stop_all([p for p in (self.holder, self.master) if p is not None], self.config.stop_timeout_s,
                      self._scratch)
        self.master = self.holder = None

    # ------------------------------------------------------------- helpers
    def _spawn(self, role: str, argv: list[str]) -> subprocess.Popen:
        log_path = self.log_dir / f"{role}.log"
        with open(log_path, "ab") as log_file:
            return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                    preexec_fn=_pdeathsig_hook() if self.config.kill_with_parent else None)

    def log_tail(self, role: str, lines: int = 8) -> str:
        """The last error lines (glog ``E``/``F``) and the last lines of a process's log."""
        try:
            text = (self.log_dir / f"{role}.log").read_text(errors="replace").splitlines()
        except OSError:
            return ""
        errors = [line for line in text if line[:1] in ("E", "F") and line[1:2].isdigit()][-lines:]
        return "\n".join(line[:300] for line in errors + [line for line in text[-lines:] if line not in errors])

    def _wait(self, proc: subprocess.Popen, role: str, deadline: float, ready) -> None:
        while True:
            if proc.poll() is not None:
                raise L3MasterError(f"mooncake {role} exited with status {proc.returncode} before it was ready; "
                                    f"the end of its log:\n{self.log_tail(role)}")
            if ready():
                return
            if time.monotonic() > deadline:
                raise L3MasterError(f"mooncake {role} not ready after {self.config.ready_timeout_s} s; "
                                    f"the end of its log:\n{self.log_tail(role)}")
            time.sleep(0.05)

    def metrics(self) -> dict[str, float]:
        """The master's unlabelled metrics (``master_key_count``, ...); {} when it does not answer."""
        try:
            with _NO_PROXY.open(self.metrics_url, timeout=1.0) as resp:
                text = resp.read().decode(errors="replace")
        except (OSError, urllib.error.URLError):
            return {}
        out = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if line.startswith("#") or "{" in name or not value:
                continue
            try:
                out[name] = float(value)
            except ValueError:
                continue
        return out

    def _master_answers(self) -> bool:
        try:
            socket.create_connection((self.config.host, self.rpc_port), timeout=0.5).close()
        except OSError:
            return False
        return self._metric("master_total_capacity_bytes") is not None

    def _metric(self, name: str) -> float | None:
        return self.metrics().get(name)


def _stop_all(procs: list[subprocess.Popen], timeout_s: float, scratch: Path | None) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)

