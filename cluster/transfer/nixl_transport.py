"""Block transport between KV pools over NIXL (UCX backend).

Why this exists: when the replica that holds a prefix is busy, another replica
pulls the WARM blocks from it instead of recomputing them (DESIGN.md). Pools
are laid out block first, so one block is one contiguous byte range and a run
of consecutive block ids is one contiguous range too. Each endpoint registers
its whole pool once; a peer turns block ids into (address, length) ranges from
the pool layout carried in ``metadata()`` and issues one one-sided READ, so the
owner of the data does nothing per transfer (its NIXL progress thread serves
the request when the transport is not truly one-sided, e.g. TCP).

Pure library: no Ray. The caller ships ``metadata()`` bytes to the peer by any
channel (a Ray call, a pipe) and calls ``connect`` there.

UCX settings. UCX reads them from the environment when an agent's backend is
created, so set them before constructing a ``NixlEndpoint`` (or pass
``ucx_env=recommended_ucx_env()``, which only fills keys the user left unset).

* One machine, no GPU (loopback, measured in this repo's CI container, 2 cores,
  READ of 64 KiB..256 MiB between two processes): ``UCX_TLS=sm,self`` (shared
  memory: posix/sysv for small messages, CMA single-copy for large ones) was
  the best or tied for best at every size; ``tcp,self`` is 2-6x slower. The
  UCX default selects the same transports as ``sm,self`` on a host without
  RDMA NICs, but also opens TCP interfaces, so we pin it. See
  ``recommended_ucx_env`` and the numbers in the module's report.
* A real cluster with RDMA NICs: ``UCX_TLS=rc,ud,sm,self`` (add ``cuda_copy,
  cuda_ipc`` when pools are on GPUs, ``gdr_copy`` if installed) and
  ``UCX_NET_DEVICES=mlx5_0:1`` (the HCA port nearest the GPU/CPU of the
  worker; list with ``ibv_devinfo``). Do not apply the loopback settings
  there: ``sm,self`` cannot reach another host.
"""

from __future__ import annotations

import functools
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

__all__ = [
    "NixlEndpoint",
    "TransferError",
    "nixl_available",
    "recommended_ucx_env",
]

_METADATA_VERSION = 1
_BACKEND = "UCX"
# Measured best on loopback without a GPU (see module docstring).
_LOOPBACK_UCX_ENV: dict[str, str] = {"UCX_TLS": "sm,self"}


class TransferError(RuntimeError):
    """A block transfer could not be set up or did not complete."""


def recommended_ucx_env() -> dict[str, str]:
    """UCX settings measured best for two processes on one host without GPU."""
    return dict(_LOOPBACK_UCX_ENV)


@functools.lru_cache(maxsize=1)
def nixl_available() -> bool:
    """True when nixl imports and an agent with a UCX backend can be created.

    Cached: probing creates a UCX context, which costs ~1 s.
    """
    try:
        from nixl._api import nixl_agent, nixl_agent_config

        probe = nixl_agent(
            f"probe-{os.getpid()}-{uuid.uuid4().hex[:8]}",
            nixl_agent_config(enable_prog_thread=False, backends=[_BACKEND]),
        )
        ok = _BACKEND in probe.backends
        del probe
        return ok
    except Exception:  # ImportError, missing plugin, UCX init failure
        return False


@dataclass(frozen=True)
class _PoolLayout:
    """What a peer needs to address blocks in a pool and check compatibility."""

    name: str
    base_addr: int
    num_blocks: int
    block_bytes: int
    mem_type: str  # "DRAM" or "VRAM"
    dev_id: int
    dtype: str
    block_shape: tuple[int, ...]


def _layout_of(name: str, pool: torch.Tensor) -> _PoolLayout:
    if pool.dim() < 1 or pool.shape[0] < 1:
        raise ValueError(f"pool must be shaped [num_blocks>=1, ...], got {tuple(pool.shape)}")
    if not pool.is_contiguous():
        raise ValueError("pool must be contiguous so that one block is one byte range")
    if pool.device.type == "cpu":
        mem_type, dev_id = "DRAM", 0  # NIXL uses device id 0 for host memory
    elif pool.device.type == "cuda":
        mem_type, dev_id = "VRAM", pool.device.index or 0
    else:
        raise ValueError(f"unsupported pool device {pool.device}")
    return _PoolLayout(
        name=name,
        base_addr=pool.data_ptr(),
        num_blocks=pool.shape[0],
        block_bytes=pool[0].numel() * pool.element_size(),
        mem_type=mem_type,
        dev_id=dev_id,
        dtype=str(pool.dtype),
        block_shape=tuple(pool.shape[1:]),
    )


def _runs(remote: np.ndarray, local: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split paired block ids into runs consecutive on both sides.

    Returns (remote_start, local_start, length) arrays; each run becomes one
    descriptor, so a contiguous prefix costs one descriptor, not one per block.
    """
    breaks = (np.diff(remote) != 1) | (np.diff(local) != 1)
    starts = np.concatenate(([0], np.flatnonzero(breaks) + 1))
    lengths = np.diff(np.concatenate((starts, [len(remote)])))
    return remote[starts], local[starts], lengths


def _make_agent(name: str, progress_delay_us: int | None) -> Any:
    """Create a ``nixl_agent`` with no backend yet and a progress thread that sleeps.

    The owner of the data must make UCX progress for a peer's READ to finish
    (wireup, and the GET itself on TCP/shared-memory AM paths), so the agent
    needs its progress thread. ``nixl_agent`` hard-codes the thread's delay
    to 0, which busy-spins one core per agent forever (measured: 3.0 CPU-s per
    3 s idle; 0.05 with 100 us). The wrapper keeps its C++ agent in ``.agent``
    and only reads it after construction, so we swap in one built from our own
    config before any backend exists.
    """
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


class NixlEndpoint:
    """One NIXL agent owning one registered KV pool; pulls blocks from peers.

    Not thread-safe for concurrent transfers by design: calls are serialized by
    an internal lock (one READ already saturates the link).
    """

    def __init__(
        self,
        name: str,
        pool: torch.Tensor,
        *,
        ucx_env: Mapping[str, str] | None = None,
        ucx_params: Mapping[str, str] | None = None,
        progress_delay_us: int | None = 100,
    ) -> None:
        self._layout = _layout_of(name, pool)
        self._pool = pool  # keep the registered memory alive
        for key, value in (ucx_env or {}).items():
            os.environ.setdefault(key, value)  # the user's own settings win
        self._lock = threading.RLock()
        self._peers: dict[str, _PoolLayout] = {}
        self._peer_md: dict[str, bytes] = {}
        self._unreleased: list[Any] = []  # xfer handles whose release failed
        self._closed = False
        # The progress thread lets this agent serve peers' READs on transports
        # that need the target to make progress (TCP, AM-based shared memory).
        self._agent = _make_agent(name, progress_delay_us)
        try:
            self._agent.create_backend(_BACKEND, dict(ucx_params or {}))
        except Exception as e:
            raise TransferError(
                f"cannot create NIXL UCX backend (UCX_TLS={os.environ.get('UCX_TLS')!r}): {e!r}"
            ) from e
        lay = self._layout
        region = [(lay.base_addr, lay.num_blocks * lay.block_bytes, lay.dev_id, "")]
        if lay.mem_type == "VRAM":
            with torch.cuda.device(lay.dev_id):  # register under the pool's CUDA context
                self._reg = self._agent.register_memory(region, "VRAM", backends=[_BACKEND])
        else:
            self._reg = self._agent.register_memory(region, "DRAM", backends=[_BACKEND])

    # -- introspection -------------------------------------------------------
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
        """Agent metadata plus pool layout, msgpack-encoded, for ``connect``."""
        self._check_open()
        lay = self._layout
        return msgpack.packb(
            {
                "version": _METADATA_VERSION,
                "name": lay.name,
                "agent_metadata": self._agent.get_agent_metadata(),
                "base_addr": lay.base_addr,
                "num_blocks": lay.num_blocks,
                "block_bytes": lay.block_bytes,
                "mem_type": lay.mem_type,
                "dev_id": lay.dev_id,
                "dtype": lay.dtype,
                "block_shape": list(lay.block_shape),
            },
            use_bin_type=True,
        )

    # -- peers ---------------------------------------------------------------
    def connect(self, peer_metadata: bytes) -> str:
        """Load a peer's agent and pool layout; return its name. Idempotent.

        Raises ``ValueError`` if the peer's blocks are not byte-compatible with
        ours (copying them would silently corrupt KV).
        """
        with self._lock:
            self._check_open()
            try:
                md = msgpack.unpackb(peer_metadata, raw=False)
                peer = _PoolLayout(
                    name=md["name"], base_addr=md["base_addr"], num_blocks=md["num_blocks"],
                    block_bytes=md["block_bytes"], mem_type=md["mem_type"], dev_id=md["dev_id"],
                    dtype=md["dtype"], block_shape=tuple(md["block_shape"]),
                )
                agent_md: bytes = md["agent_metadata"]
            except Exception as e:
                raise ValueError(f"malformed peer metadata: {e!r}") from e
            if md.get("version") != _METADATA_VERSION:
                raise ValueError(f"peer metadata version {md.get('version')} != {_METADATA_VERSION}")
            if peer.name == self.name:
                raise ValueError(f"peer has our own agent name {peer.name!r}")
            mine = self._layout
            diffs = [
                f"{field}: ours={getattr(mine, field)!r} peer={getattr(peer, field)!r}"
                for field in ("block_bytes", "dtype", "block_shape")
                if getattr(mine, field) != getattr(peer, field)
            ]
            if diffs:
                raise ValueError(f"incompatible pool layout with peer {peer.name!r}: " + "; ".join(diffs))
            if self._peer_md.get(peer.name) == agent_md:
                return peer.name
            if peer.name in self._peers:  # the peer restarted: replace stale state
                self.disconnect(peer.name)
            loaded = self._agent.add_remote_agent(agent_md)
            name = loaded.decode() if isinstance(loaded, bytes) else loaded
            if name != peer.name:
                self._agent.remove_remote_agent(name)
                raise ValueError(f"agent metadata names {name!r} but layout names {peer.name!r}")
            self._peers[name] = peer
            self._peer_md[name] = agent_md
            return name

    def disconnect(self, peer: str) -> None:
        """Forget a peer (no-op when unknown)."""
        with self._lock:
            if self._peers.pop(peer, None) is None:
                return
            self._peer_md.pop(peer, None)
            try:
                self._agent.remove_remote_agent(peer)
            except Exception:
                pass  # the peer's metadata is gone either way

    # -- transfer ------------------------------------------------------------
    def read_blocks(
        self,
        peer: str,
        remote_block_ids: Sequence[int],
        local_block_ids: Sequence[int],
        timeout_s: float = 10.0,
    ) -> int:
        """Copy peer blocks ``remote_block_ids[i]`` into our ``local_block_ids[i]``.

        One READ request; runs consecutive on both sides are coalesced into one
        descriptor each. Blocks until done or ``timeout_s``; returns bytes
        moved. The caller must ensure the peer's blocks are written (and, on a
        GPU, the producing stream synchronized) before calling.
        """
        with self._lock:
            self._check_open()
            self._retry_releases()
            layout = self._peers.get(peer)
            if layout is None:
                raise TransferError(f"unknown peer {peer!r}; call connect() first")
            remote = np.asarray(remote_block_ids, dtype=np.int64).reshape(-1)
            local = np.asarray(local_block_ids, dtype=np.int64).reshape(-1)
            if remote.shape != local.shape:
                raise ValueError(f"{len(remote)} remote block ids but {len(local)} local ones")
            if remote.size == 0:
                return 0
            _check_range("remote", remote, layout.num_blocks, peer)
            _check_range("local", local, self.num_blocks, self.name)
            if np.unique(local).size != local.size:
                raise ValueError("local_block_ids has duplicates: two blocks would race into one")
            bb = self.block_bytes
            r_start, l_start, length = _runs(remote, local)
            nbytes = (length * bb).astype(np.uint64)
            local_descs = np.stack(
                [self._layout.base_addr + (l_start * bb).astype(np.uint64), nbytes,
                 np.full_like(nbytes, self._layout.dev_id)], axis=1)
            remote_descs = np.stack(
                [layout.base_addr + (r_start * bb).astype(np.uint64), nbytes,
                 np.full_like(nbytes, layout.dev_id)], axis=1)
            self._transfer(peer, layout.mem_type, local_descs, remote_descs, timeout_s)
            return int(remote.size) * bb

    def _transfer(
        self, peer: str, remote_mem: str, local_descs: np.ndarray, remote_descs: np.ndarray, timeout_s: float
    ) -> None:
        agent = self._agent
        try:
            handle = agent.initialize_xfer(
                "READ",
                agent.get_xfer_descs(local_descs, self._layout.mem_type),
                agent.get_xfer_descs(remote_descs, remote_mem),
                peer,
                backends=[_BACKEND],
            )
        except Exception as e:
            raise TransferError(f"cannot create READ from {peer!r}: {e!r}") from e
        deadline = time.monotonic() + timeout_s
        try:
            state = agent.transfer(handle)
            delay = 0.0
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TransferError(f"READ from {peer!r} timed out after {timeout_s} s")
                time.sleep(delay)  # sleep(0) first: yield, keep latency low
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
        """Release a handle; if NIXL refuses (transfer still active), keep it and retry later."""
        try:
            handle.release()
        except Exception:
            self._unreleased.append(handle)

    def _retry_releases(self) -> None:
        pending, self._unreleased = self._unreleased, []
        for handle in pending:
            self._release(handle)

    # -- lifetime ------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"endpoint {self.name!r} is closed")

    def close(self) -> None:
        """Release handles, forget peers, deregister the pool. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for _ in range(100):  # let aborted transfers drain before deregistering
                self._retry_releases()
                if not self._unreleased:
                    break
                time.sleep(0.01)
            for peer in list(self._peers):
                self.disconnect(peer)
            if not self._unreleased:  # never pull memory from under a live transfer
                self._agent.deregister_memory(self._reg, backends=[_BACKEND])
            del self._agent

    def __enter__(self) -> NixlEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _check_range(side: str, ids: np.ndarray, num_blocks: int, owner: str) -> None:
    bad = ids[(ids < 0) | (ids >= num_blocks)]
    if bad.size:
        raise TransferError(
            f"{side} block id {int(bad[0])} out of range [0, {num_blocks}) for {owner!r}"
        )
