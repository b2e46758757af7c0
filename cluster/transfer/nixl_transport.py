"""Block transport between KV pools over NIXL (UCX backend).

Why: when the replica holding a prefix is busy, another replica pulls the WARM
blocks from it instead of recomputing them (DESIGN.md). Pools are block first,
so a run of consecutive block ids is one contiguous byte range. Each endpoint
registers its whole pool once; a peer turns block ids into address ranges from
the layout carried in ``metadata()`` and posts one READ. The data owner runs no
code per transfer, but its NIXL progress thread must be alive (wireup and, on
TCP/shared memory, the GET itself need the target to make progress).

Pure library, no Ray: ship ``metadata()`` to the peer by any channel and call
``connect`` there.

UCX settings are read from the environment when the backend is created: set
them before building an endpoint, or pass ``ucx_env=recommended_ucx_env()``
(fills only keys the user left unset).

* One host, no GPU: ``UCX_TLS=tcp,sm,self``. Measured (two processes, 2-core
  VM, one READ of 64 KiB..256 MiB, best of 5): ~1.1 GB/s at 64 KiB, 3.3 at
  256 KiB, 7 at 1 MiB, 9.5 at 4 MiB, 5-6 beyond (out of cache); the same as
  the UCX default here and as ``tcp,cma,self``. The bulk data goes by CMA
  (``process_vm_readv``, one copy; needs ptrace rights and one PID namespace);
  without CMA (``tcp,self``, ``tcp,posix,self``) it is ~1 GB/s at best. ``sm,self`` alone cannot create
  the backend: NIXL asks UCX for peer-failure handling, which shared memory
  lacks, so TCP must stay in the list; it is also what makes a dead peer fail
  a READ at once (NIXL_ERR_REMOTE_DISCONNECT) instead of at the timeout.
* Cluster with RDMA: ``UCX_TLS=rc,ud,tcp,sm,self`` (plus ``cuda_copy,cuda_ipc``
  for GPU pools, ``gdr_copy`` if installed) and ``UCX_NET_DEVICES=mlx5_0:1``
  (the HCA port nearest the worker's GPU/CPU; ``ibv_devinfo`` lists them).
  With GPU pools keep ``cuda_copy`` in the list: without it UCX is reported
  to treat VRAM as host memory and crash in NIXL's progress thread.

On a host without RDMA devices (``/sys/class/infiniband`` empty or absent)
the first agent also sets ``UCX_MODULES=^ib,rdmacm`` unless the user set it:
UCX's InfiniBand modules are useless there, and where rdma-core is installed
system-wide (``libibverbs1``, which Mooncake needs) they load its providers,
so a second libibverbs and libnl sit beside the copies bundled in the NIXL
wheel, and libnl's destructor crashes every process that made an agent when
it exits (SIGSEGV in ``rtnl_tc_unregister``; measured with nixl 1.5.1).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch

log = logging.getLogger(__name__)

# The progress thread's idle poll timeout. It once was 100 us, which NIXL rounds up to
# 1 ms: a thousand wake-ups a second in every replica, each one preempting a thread of
# the engine's OpenMP team on a busy core while the other waits at the barrier (what one
# such poller costs a decode step: docs/benchmarks.md). Incoming
# traffic wakes the thread through the UCX workers' event fds, so a long timeout costs
# transfers nothing (``prefix-cache bench transfer``: the same READ times).
PROGRESS_POLL_US = 100_000

__all__ = ["NixlEndpoint", "TransferError", "nixl_available", "recommended_ucx_env"]

_BACKEND = "UCX"
_METADATA_VERSION = 1
_LOOPBACK_UCX_ENV = {"UCX_TLS": "tcp,sm,self"}  # measured, see module docstring


class TransferError(RuntimeError):
    """A block transfer could not be set up or did not complete."""


def _skip_ib_modules_without_rdma() -> None:
    """``UCX_MODULES=^ib,rdmacm`` on a host without RDMA devices (module docstring)."""
    if "UCX_MODULES" in os.environ:
        return
    try:
        devices = os.listdir("/sys/class/infiniband")
    except OSError:
        devices = []
    if not devices:
        os.environ["UCX_MODULES"] = "^ib,rdmacm"


def recommended_ucx_env() -> dict[str, str]:
    """UCX settings measured best for processes on one host without a GPU."""
    return dict(_LOOPBACK_UCX_ENV)


@functools.lru_cache(maxsize=1)
def nixl_available() -> bool:
    """True when nixl imports and an agent with a UCX backend can be created (cached)."""
    _skip_ib_modules_without_rdma()
    try:
        from nixl._api import nixl_agent, nixl_agent_config

        probe = nixl_agent(
            f"probe-{os.getpid()}-{uuid.uuid4().hex[:8]}",
            nixl_agent_config(enable_prog_thread=False, backends=[_BACKEND]),
        )
        return _BACKEND in probe.backends
    except Exception:  # ImportError, no UCX plugin, UCX init failure
        return False


def _make_agent(name: str, progress_delay_us: int | None) -> Any:
    """A ``nixl_agent`` without backends whose progress thread sleeps between polls.

    ``nixl_agent`` hard-codes the progress thread's delay to 0, which spins a
    whole core per agent forever (measured 3.0 CPU-s per idle 3 s). The wrapper
    only touches its C++ agent via ``.agent``, so swap in one built from our
    config before any backend exists. The delay is the timeout of the thread's
    ``poll`` on the UCX workers' event fds (rounded up to whole ms): traffic
    wakes it at once, the timeout only spaces its idle wake-ups
    (``PROGRESS_POLL_US``).
    """
    _skip_ib_modules_without_rdma()
    from nixl import _bindings
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
    if progress_delay_us is not None:
        cfg = _bindings.nixlAgentConfig()
        cfg.useProgThread = True
        cfg.useListenThread = False
        cfg.pthrDelay = int(progress_delay_us)
        cfg.syncMode = _bindings.NIXL_THREAD_SYNC_NONE  # nixl_agent's default without listener
        cfg.captureTelemetry = False
        agent.agent = _bindings.nixlAgent(name, cfg)
    return agent


@dataclass(frozen=True)
class _PoolLayout:
    """What a peer needs to address our blocks and check they match its own."""

    name: str
    base_addr: int
    num_blocks: int
    block_bytes: int
    mem_type: str  # "DRAM" or "VRAM"
    dev_id: int
    dtype: str
    block_shape: tuple[int, ...]

    @classmethod
    def of(cls, name: str, pool: torch.Tensor) -> _PoolLayout:
        if pool.dim() < 1 or pool.shape[0] < 1:
            raise ValueError(f"pool must be shaped [num_blocks>=1, ...], got {tuple(pool.shape)}")
        if not pool.is_contiguous():
            raise ValueError("pool must be contiguous so that each block is one byte range")
        if pool.device.type == "cpu":
            mem_type, dev_id = "DRAM", 0  # NIXL's device id for host memory
        elif pool.device.type == "cuda":
            mem_type, dev_id = "VRAM", pool.device.index or 0
        else:
            raise ValueError(f"unsupported pool device {pool.device}")
        return cls(name, pool.data_ptr(), pool.shape[0], pool[0].numel() * pool.element_size(),
                   mem_type, dev_id, str(pool.dtype), tuple(pool.shape[1:]))

    def descs(self, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Nx3 uint64 (address, bytes, device id) rows for runs of blocks."""
        nbytes = lengths.astype(np.uint64) * np.uint64(self.block_bytes)
        addr = np.uint64(self.base_addr) + starts.astype(np.uint64) * np.uint64(self.block_bytes)
        return np.stack([addr, nbytes, np.full_like(nbytes, self.dev_id)], axis=1)


def _runs(remote: np.ndarray, local: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split paired ids into runs consecutive on both sides: (remote_start, local_start, length).

    One descriptor per run: 16 contiguous 4 KiB blocks read in 55 us instead of 86 us.
    """
    breaks = (np.diff(remote) != 1) | (np.diff(local) != 1)
    starts = np.concatenate(([0], np.flatnonzero(breaks) + 1))
    return remote[starts], local[starts], np.diff(np.append(starts, len(remote)))


def _check_range(side: str, ids: np.ndarray, num_blocks: int, owner: str) -> None:
    bad = ids[(ids < 0) | (ids >= num_blocks)]
    if bad.size:
        raise TransferError(
            f"{side} block id {int(bad[0])} out of range [0, {num_blocks}) of {owner!r}"
        )


class NixlEndpoint:
    """One NIXL agent and one registered KV pool; pulls blocks from connected peers.

    Calls are serialized by a lock: one READ already saturates the link, and
    NIXL's agent is created without internal locking.
    """

    def __init__(
        self,
        name: str,
        pool: torch.Tensor,
        *,
        ucx_env: Mapping[str, str] | None = None,
        ucx_params: Mapping[str, str] | None = None,
        progress_delay_us: int | None = PROGRESS_POLL_US,
    ) -> None:
        """``ucx_params`` go to the UCX backend (e.g. ``num_workers``); ``progress_delay_us=None``
        disables the progress thread, which leaves peers unable to read from us."""
        self._layout = _PoolLayout.of(name, pool)
        self._pool = pool  # keep the registered memory alive
        self._lock = threading.RLock()
        self._peers: dict[str, tuple[_PoolLayout, bytes]] = {}
        self._unreleased: list[Any] = []  # xfer handles NIXL refused to release yet
        self._closed = False
        for key, value in (ucx_env or {}).items():
            os.environ.setdefault(key, value)
        self._agent = _make_agent(name, progress_delay_us)
        mem = self._layout.mem_type
        try:
            self._agent.create_backend(_BACKEND, dict(ucx_params or {}))
            region = [(self._layout.base_addr, self._layout.num_blocks * self._layout.block_bytes,
                       self._layout.dev_id, "")]
            if mem == "VRAM":  # register with the pool's device current
                with torch.cuda.device(self._layout.dev_id):
                    self._reg = self._agent.register_memory(region, mem, backends=[_BACKEND])
            else:
                self._reg = self._agent.register_memory(region, mem, backends=[_BACKEND])
        except Exception as e:
            raise TransferError(f"cannot set up NIXL UCX for a {mem} pool "
                                f"(UCX_TLS={os.environ.get('UCX_TLS')!r}): {e!r}") from e

    @property
    def name(self) -> str:
        return self._layout.name

    @property
    def num_blocks(self) -> int:
        return self._layout.num_blocks

    @property
    def block_bytes(self) -> int:
        return self._layout.block_bytes

    @property
    def peers(self) -> list[str]:
        return list(self._peers)

    def metadata(self) -> bytes:
        """msgpack: NIXL agent metadata plus our pool layout, for a peer's ``connect``."""
        self._check_open()
        lay = self._layout
        return msgpack.packb({
            "version": _METADATA_VERSION, "name": lay.name,
            "agent_metadata": self._agent.get_agent_metadata(),
            "base_addr": lay.base_addr, "num_blocks": lay.num_blocks,
            "block_bytes": lay.block_bytes,
            "mem_type": lay.mem_type, "dev_id": lay.dev_id, "dtype": lay.dtype,
            "block_shape": list(lay.block_shape),
        }, use_bin_type=True)

    def connect(self, peer_metadata: bytes) -> str:
        """Load a peer's agent and pool layout; return its name. Idempotent; a restarted
        peer (same name, new metadata) replaces the stale one.

        Raises ``ValueError`` if the peer's blocks are not byte-compatible with ours:
        copying them would silently corrupt KV.
        """
        with self._lock:
            self._check_open()
            try:
                md = msgpack.unpackb(peer_metadata, raw=False)
                peer = _PoolLayout(
                    md["name"], md["base_addr"], md["num_blocks"], md["block_bytes"],
                    md["mem_type"], md["dev_id"], md["dtype"], tuple(md["block_shape"]),
                )
                agent_md: bytes = md["agent_metadata"]
            except Exception as e:
                raise ValueError(f"malformed peer metadata: {e!r}") from e
            if md.get("version") != _METADATA_VERSION:
                raise ValueError(
                    f"peer metadata version {md.get('version')!r} != {_METADATA_VERSION}"
                )
            if peer.name == self.name:
                raise ValueError(f"peer uses our own agent name {peer.name!r}")
            diffs = [f"{f}: ours={getattr(self._layout, f)!r} peer={getattr(peer, f)!r}"
                     for f in ("block_bytes", "dtype", "block_shape")
                     if getattr(self._layout, f) != getattr(peer, f)]
            if diffs:
                raise ValueError(
                    f"incompatible pool layout with peer {peer.name!r}: " + "; ".join(diffs)
                )
            known = self._peers.get(peer.name)
            if known is not None and known[1] == agent_md:
                return peer.name
            self.disconnect(peer.name)
            loaded = self._agent.add_remote_agent(agent_md)
            loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
            if loaded != peer.name:
                self._agent.remove_remote_agent(loaded)
                raise ValueError(
                    f"agent metadata names {loaded!r} but the layout names {peer.name!r}"
                )
            self._peers[peer.name] = (peer, agent_md)
            return peer.name

    def disconnect(self, peer: str) -> None:
        """Forget a peer (no-op when unknown)."""
        with self._lock:
            if self._peers.pop(peer, None) is not None:
                try:
                    self._agent.remove_remote_agent(peer)
                except Exception:
                    pass  # already gone on the NIXL side

    def read_blocks(
        self,
        peer: str,
        remote_block_ids: Sequence[int],
        local_block_ids: Sequence[int],
        timeout_s: float = 10.0,
    ) -> int:
        """Copy the peer's ``remote_block_ids[i]`` into our ``local_block_ids[i]``.

        One READ request, one descriptor per run of ids consecutive on both
        sides; blocks until done or ``timeout_s`` and returns the bytes moved.
        The peer's blocks must be complete (GPU producer stream synchronized)
        before the call.
        """
        with self._lock:
            self._check_open()
            self._retry_releases()
            entry = self._peers.get(peer)
            if entry is None:
                raise TransferError(f"unknown peer {peer!r}; call connect() first")
            layout = entry[0]
            remote = np.asarray(remote_block_ids, dtype=np.int64).reshape(-1)
            local = np.asarray(local_block_ids, dtype=np.int64).reshape(-1)
            if remote.shape != local.shape:
                raise ValueError(f"{remote.size} remote block ids but {local.size} local ones")
            if remote.size == 0:
                return 0
            _check_range("remote", remote, layout.num_blocks, peer)
            _check_range("local", local, self.num_blocks, self.name)
            if np.unique(local).size != local.size:
                raise ValueError("local_block_ids has duplicates: two blocks would race into one")
            r_start, l_start, length = _runs(remote, local)
            local_descs = self._layout.descs(l_start, length)
            self._read(peer, layout, local_descs, layout.descs(r_start, length), timeout_s)
            return int(remote.size) * self.block_bytes

    def _read(
        self, peer: str, layout: _PoolLayout, local: np.ndarray, remote: np.ndarray, timeout_s: float
    ) -> None:
        agent = self._agent
        try:
            handle = agent.initialize_xfer(
                "READ", agent.get_xfer_descs(local, self._layout.mem_type),
                agent.get_xfer_descs(remote, layout.mem_type), peer, backends=[_BACKEND])
        except Exception as e:
            raise TransferError(f"cannot create READ from {peer!r}: {e!r}") from e
        deadline = time.monotonic() + timeout_s
        try:
            state, delay = agent.transfer(handle), 0.0
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TransferError(f"READ from {peer!r} timed out after {timeout_s} s")
                time.sleep(delay)  # yield first, then back off to 1 ms
                delay = min(delay * 2 or 1e-5, 1e-3)
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferError(f"READ from {peer!r} failed (state {state})")
        except TransferError:
            raise
        except Exception as e:
            raise TransferError(f"READ from {peer!r} failed: {e!r}") from e
        finally:
            self._release(handle)

    def _release(self, handle: Any) -> None:
        """Release (aborting if still active); if NIXL refuses, keep it and retry later."""
        try:
            handle.release()
        except Exception:
            self._unreleased.append(handle)

    def _retry_releases(self) -> None:
        pending, self._unreleased = self._unreleased, []
        for handle in pending:
            self._release(handle)

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"endpoint {self.name!r} is closed")

    def close(self) -> None:
        """Release handles, forget peers, deregister the pool, drop the agent. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for _ in range(100):  # give aborted transfers up to 1 s to drain
                self._retry_releases()
                if not self._unreleased:
                    break
                time.sleep(0.01)
            for peer in list(self._peers):
                self.disconnect(peer)
            if self._unreleased:
                return  # a transfer may still write our pool: keep agent and memory alive
            reg = getattr(self, "_reg", None)
            if reg is not None:
                try:
                    self._agent.deregister_memory(reg, backends=[_BACKEND])
                except Exception as exc:   # the agent goes anyway; say so, the memory stays pinned
                    log.warning("NIXL endpoint %s: deregistering its memory failed: %s", self.name, exc)
            self._agent = None

    def __enter__(self) -> NixlEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception as exc:   # garbage collection: nobody to raise to, so say it
            log.debug("NIXL endpoint close from __del__ failed: %s", exc)
