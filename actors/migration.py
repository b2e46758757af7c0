"""Migration: one worker pulls another's cached prefix instead of recomputing it.

The holder stages the prefix in whole host blocks (checksummed) under a lease;
the target READs them over NIXL into its own staging blocks, verifies every
block, and installs them in its tree. If NIXL is missing or fails, the staged
KV comes through the Ray object store; if that fails too, the target
recomputes. A migration never raises: it only costs the prefill it would have
saved, and never more than a bounded time: every remote call of a migration
(export, info, object-store pull) waits at most ``call_timeout_s``, and the
NIXL READ as long, so a holder that is gone or slow means recompute after at
most four of those bounds (``max_wait_s``).

What is installed is what was asked for: leases are unique across workers
(``<worker>/<process uuid>/<n>``; a lease this worker did not issue is
refused), the export carries the hash of the tokens (and tenant) it covers,
which the target compares with its own before installing (a mismatch is
refused and counted), and every block is verified against the holder's
checksum on both paths, NIXL and object store.

Threads: ``export_prefix``, ``export_array``, ``release`` and ``install``
run on the engine thread (they touch the cache; callers use ``EngineLoop.run``).
``migrate_from`` and ``pull_nixl`` run on the worker's event loop, which owns
``stats``, ``faults`` and the transfer-rate estimate; the NIXL READ itself runs
on an executor thread and touches only its own staging blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from typing import Any, Callable, Protocol

import numpy as np
import torch
import xxhash

from cluster.cache.tiered import TieredCache
from cluster.protocol import MigrationResult, Transport
from cluster.transfer.nixl_transport import NixlEndpoint, TransferError

log = logging.getLogger(__name__)

LEASE_TTL_S = 60.0
FAULTS = ("nixl", "object_store")


class PeerLink(Protocol):
    """How one worker reaches another (a Ray actor handle, a Serve handle with a
    targeted call, or in-process for tests). All awaitable but ``release``,
    which is fire and forget."""

    async def export_prefix(self, tokens: list[int], tenant: Any) -> dict: ...

    async def info(self) -> dict: ...

    async def export_array(self, lease: str) -> tuple[np.ndarray, str]: ...

    def release(self, lease: str) -> None: ...


def block_checksum(block: torch.Tensor) -> int:
    block = block.contiguous()
    if block.dtype == torch.bfloat16:   # numpy has no bfloat16: hash the same bytes as int16
        block = block.view(torch.int16)
    return xxhash.xxh3_64_intdigest(block.numpy().tobytes())


def tokens_hash(tokens: list[int], namespace: Any) -> int:
    """What an export covers: its tokens and the tenant they belong to."""
    h = xxhash.xxh3_64(repr(namespace).encode())
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.intdigest()


class MigrationRefused(TransferError):
    """What arrived is not what was asked for (a lease of another worker, other tokens, a bad block)."""


class Migrator:
    def __init__(self, worker_id: str, cache: TieredCache, nixl: NixlEndpoint | None, *, block_tokens: int,
                 bytes_per_token: int, transfer_tokens_per_s: float | None = None, call_timeout_s: float = 2.0):
        self.worker_id = worker_id
        self.cache = cache
        self.nixl = nixl
        self.block_tokens = block_tokens
        self.bytes_per_token = bytes_per_token
        self.transfer_tokens_per_s = transfer_tokens_per_s   # replaced whole; read by the load reports
        # How the NIXL thread reaches the engine thread; direct until the loop starts (calibration).
        self.on_engine: Callable[[Callable[[], Any]], Any] = lambda fn: fn()
        self.call_timeout_s = call_timeout_s
        self._leases: dict[str, tuple[list, float]] = {}
        self._lease_prefix = f"{worker_id}/{uuid.uuid4().hex[:12]}/"
        self._lease_ids = itertools.count(1)
        self._nixl_peers: dict[str, str] = {}      # worker id -> NIXL agent name
        self.faults: set[str] = set()              # injected: "nixl", "object_store"
        self.stats = {"migrations_in": 0, "migrations_out": 0, "migrated_tokens": 0, "migration_bytes": 0,
                      "nixl_failures": 0, "object_store_fallbacks": 0, "recomputed_after_failed_migration": 0,
                      "stale_migrations": 0, "migration_timeouts": 0, "refused_installs": 0,
                      "refused_lease_calls": 0}

    def inject_fault(self, kind: str, on: bool = True) -> None:
        if kind not in FAULTS:
            raise ValueError(f"unknown fault {kind!r}")
        (self.faults.add if on else self.faults.discard)(kind)

    # ------------------------------------------------------ holder, engine thread
    def export_prefix(self, tokens: list[int], namespace: Any = None, max_tokens: int | None = None) -> dict:
        """Stage the cached prefix of ``tokens`` in whole host blocks: their ids
        (for a NIXL READ), checksums and a lease; reserved until ``release`` or expiry."""
        cache = self.cache
        m = cache.match(tokens, namespace, lock=True)
        try:
            n = m.length if max_tokens is None else min(m.length, max_tokens)
            if n == 0 or cache.host_tensor is None:
                return {"tokens": 0}
            kv = cache.read(m.extents)[:, :, :n].to("cpu")
            ext = cache.allocate_staging(n)
            cache.write_staging(ext, kv)
        finally:
            cache.unlock(m.last_node)
        blocks = [e.block_id for e in ext]
        lease = f"{self._lease_prefix}{next(self._lease_ids)}"
        self._leases[lease] = (ext, time.monotonic() + LEASE_TTL_S)
        return {"tokens": n, "blocks": blocks, "checksums": [block_checksum(cache.staging_block(b)) for b in blocks],
                "lease": lease, "block_tokens": self.block_tokens, "holder": self.worker_id,
                "tokens_hash": tokens_hash(list(tokens[:n]), namespace)}

    def _own_lease(self, lease: str) -> tuple[list, float]:
        entry = self._leases.get(lease) if isinstance(lease, str) else None
        if entry is None:   # expired, or a call meant for another worker: never serve someone else's KV
            self.stats["refused_lease_calls"] += 1
            mine = isinstance(lease, str) and lease.startswith(self._lease_prefix)
            raise MigrationRefused(f"worker {self.worker_id} holds no lease {lease!r}"
                                   + ("" if mine else " (issued by another worker)"))
        return entry

    def export_array(self, lease: str) -> tuple[np.ndarray, str]:
        """A lease's staged blocks, whole (so the target verifies each block's
        checksum), for the object-store fallback: a numpy array (Ray moves it
        zero-copy; torch tensors take a slow pickling path) and the torch dtype
        name to view it back."""
        if "object_store" in self.faults:
            raise RuntimeError("injected fault: object store export")
        ext, _ = self._own_lease(lease)
        kv = torch.cat([self.cache.staging_block(e.block_id) for e in ext], dim=2).contiguous()
        dtype = str(kv.dtype).removeprefix("torch.")
        if kv.dtype == torch.bfloat16:
            kv = kv.view(torch.int16)
        return kv.numpy().copy(), dtype

    def release(self, lease: str) -> None:
        """Free a lease's staging blocks, and any lease past its expiry."""
        entry = self._leases.pop(lease, None) if isinstance(lease, str) else None
        if entry is not None:
            self.cache.free_staging(entry[0])
        now = time.monotonic()
        for stale in [k for k, (_, exp) in self._leases.items() if exp < now]:
            self.cache.free_staging(self._leases.pop(stale)[0])

    # ------------------------------------------------------ target, engine thread
    def install(self, tokens: list[int], namespace: Any, kv: torch.Tensor) -> int:
        """Insert migrated KV for ``tokens[:n]``; returns the tokens that were new here."""
        cache = self.cache
        n = kv.shape[2]
        m = cache.match(tokens[:n], namespace, lock=True)
        try:
            if m.length >= n:
                return 0
            ext = cache.allocate(n - m.length)
            cache.write(ext, kv[:, :, m.length:n].to(cache.kv_device))
            cache.insert(tokens[:n], ext, namespace, start=m.length)
        finally:
            cache.unlock(m.last_node)
        return n - m.length

    # ------------------------------------------------------- target, event loop
    @property
    def max_wait_s(self) -> float:
        """The longest a migration can delay its request: export, info, the
        READ and the object-store pull, each bounded by ``call_timeout_s``."""
        return 4 * self.call_timeout_s

    async def _bounded(self, what: str, holder_id: str, awaitable):
        try:
            return await asyncio.wait_for(awaitable, self.call_timeout_s)
        except asyncio.TimeoutError:
            self.stats["migration_timeouts"] += 1
            raise TransferError(f"{what} from {holder_id} took longer than {self.call_timeout_s:g} s") from None

    def _verify(self, staged: dict, kv_blocks: torch.Tensor) -> torch.Tensor:
        """Each whole staged block against its checksum; the request's KV, ``tokens`` long."""
        bt = self.block_tokens
        for i, want in enumerate(staged["checksums"]):
            if block_checksum(kv_blocks[:, :, i * bt:(i + 1) * bt]) != want:
                raise MigrationRefused(f"block {i} of the staged prefix failed its checksum")
        return kv_blocks[:, :, :staged["tokens"]]

    async def migrate_from(self, holder_id: str, link: PeerLink | None, tokens: list[int], tenant: Any,
                           run_on_engine: Callable[[Callable[[], Any]], Any]) -> MigrationResult:
        """Pull ``holder_id``'s prefix of ``tokens``: NIXL, else the object store,
        else nothing (recompute), within ``max_wait_s``. ``run_on_engine``
        awaits a function on the engine thread."""
        result = MigrationResult(holder_id)
        if link is None:   # the holder is gone
            self.stats["recomputed_after_failed_migration"] += 1
            return result
        try:
            staged = await self._bounded("export", holder_id, link.export_prefix(tokens, tenant))
        except Exception as exc:  # holder gone, slow, or not reachable through the router
            log.warning("export from %s failed: %s", holder_id, exc)
            self.stats["recomputed_after_failed_migration"] += 1
            return result
        if not staged.get("tokens"):  # stale decision: the holder evicted it meanwhile
            self.stats["stale_migrations"] += 1
            log.info("migration from %s found nothing cached (stale decision); recomputing", holder_id)
            return result
        n = staged["tokens"]
        if (staged.get("holder") != holder_id or n > len(tokens)
                or staged.get("tokens_hash") != tokens_hash(list(tokens[:n]), tenant)):
            # Another worker answered, or for other tokens: its KV must never be installed.
            self.stats["refused_installs"] += 1
            log.error("export from %s answered by %s for other tokens; refused", holder_id, staged.get("holder"))
            link.release(staged.get("lease"))
            self.stats["recomputed_after_failed_migration"] += 1
            return result
        kv = None
        try:
            kv = await self._bounded("NIXL read", holder_id, self.pull_nixl(holder_id, link, staged))
            result.transport = Transport.NIXL
        except Exception as exc:
            self.stats["nixl_failures"] += 1
            log.warning("NIXL pull from %s failed (%s); using the object store", holder_id, exc)
            try:
                array, dtype = await self._bounded("object-store pull", holder_id, link.export_array(staged["lease"]))
                kv = torch.from_numpy(array)
                kv = self._verify(staged, kv.view(torch.bfloat16) if dtype == "bfloat16" else kv)
                result.transport = Transport.OBJECT_STORE
                self.stats["object_store_fallbacks"] += 1
            except Exception as exc2:
                if isinstance(exc2, MigrationRefused):
                    self.stats["refused_installs"] += 1
                kv = None
                log.warning("object-store pull from %s failed too (%s); recomputing", holder_id, exc2)
                self.stats["recomputed_after_failed_migration"] += 1
        finally:
            link.release(staged["lease"])
        if kv is not None:
            result.tokens = await run_on_engine(lambda: self.install(tokens, tenant, kv))
            result.bytes = kv.numel() * kv.element_size()
            self.stats["migrations_in"] += 1
            self.stats["migrated_tokens"] += result.tokens
        return result

    async def pull_nixl(self, holder_id: str, link: PeerLink, staged: dict) -> torch.Tensor:
        """Connect to the holder's NIXL agent once, then READ and verify the staged blocks."""
        if "nixl" in self.faults:
            raise TransferError("injected fault: NIXL read")
        if self.nixl is None:
            raise TransferError("NIXL is not available on this worker")
        if holder_id not in self._nixl_peers:
            info = await self._bounded("info", holder_id, link.info())
            if info["nixl"] is None:
                raise TransferError(f"worker {holder_id} has no NIXL endpoint")
            self._nixl_peers[holder_id] = self.nixl.connect(info["nixl"])
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        kv, nbytes = await loop.run_in_executor(None, self.pull_blocks_nixl, self._nixl_peers[holder_id], staged)
        self.stats["migration_bytes"] += nbytes
        self.note_transfer(kv.numel() * kv.element_size(), time.perf_counter() - t0)
        return kv

    def pull_blocks_nixl(self, peer: str, staged: dict) -> tuple[torch.Tensor, int]:
        """(any thread but the engine's) READ staged blocks from ``peer`` into
        staging blocks of our own, verify each, return the KV and bytes moved."""
        if self.nixl is None:
            raise TransferError("NIXL is not available on this worker")
        cache = self.cache
        nblocks = len(staged["blocks"])
        local = self.on_engine(lambda: cache.allocate_staging(nblocks * self.block_tokens))
        try:
            local_ids = [e.block_id for e in local]
            nbytes = self.nixl.read_blocks(peer, staged["blocks"], local_ids)
            for b, want in zip(local_ids, staged["checksums"]):
                if block_checksum(cache.staging_block(b)) != want:
                    raise MigrationRefused(f"block checksum mismatch after NIXL read (local block {b})")
            kv = torch.cat([cache.staging_block(b) for b in local_ids], dim=2)[:, :, :staged["tokens"]].clone()
            return kv, nbytes
        finally:
            self.on_engine(lambda: cache.free_staging(local))

    def note_transfer(self, nbytes: int, seconds: float) -> None:
        """Fold an observed migration into the transfer rate reported with the load."""
        if seconds > 0 and nbytes > (1 << 20):
            rate = nbytes / seconds / self.bytes_per_token
            old = self.transfer_tokens_per_s
            self.transfer_tokens_per_s = rate if old is None else 0.8 * old + 0.2 * rate
