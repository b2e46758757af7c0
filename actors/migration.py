"""Migration: one worker pulls another's cached prefix instead of recomputing it.

The holder stages the prefix in whole host blocks (checksummed) under a lease
(``TieredCache.stage``); the target READs them over NIXL into its own staging
blocks, verifies every block, and installs them (``TieredCache.install``). If
NIXL is missing or fails, the staged blocks come through the link's fallback
(``PeerLink.fetch_blocks``: the holder's peer channel); if that fails too, the target recomputes. A
migration never raises: it only costs the prefill it would have saved, and
never more than a bounded time: every remote call of a migration (export,
info, fallback fetch) waits at most ``call_timeout_s``, and the NIXL READ as
long, so a holder that is gone or slow means recompute after at most four
of those bounds (``max_wait_s``).

What is installed is what was asked for: leases are unique across workers
(``<worker>/<process uuid>/<n>``; a lease this worker did not issue is
refused), the export carries the hash of the tokens (and tenant) it covers,
which the target compares with its own before installing (a mismatch is
refused and counted), and every block is verified against the holder's
checksum on both paths.

Threads and owners: the holder's side (``export_prefix``, ``fetch_blocks``,
``release``) runs on the engine thread, which owns the leases and
``holder_stats``; the target's side (``migrate_from``, ``pull_nixl``) runs
on the worker's event loop, which owns ``stats``, ``faults`` and the
transfer-rate estimate; the NIXL READ itself runs on an executor thread and
touches only its own staging blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from typing import Any, Callable, Protocol, Sequence

import numpy as np
import torch
import xxhash

from cluster.cache.tiered import TieredCache
from cluster.errors import InvalidInputError
from cluster.protocol import MigrationResult, StagedPrefix, Tenant, Transport, WorkerInfo
from cluster.transfer.nixl_transport import NixlEndpoint, TransferError

log = logging.getLogger(__name__)

LEASE_TTL_S = 60.0
FAULTS = ("nixl", "fallback")


class PeerLink(Protocol):
    """How one worker reaches another: ``actors.peer.PeerClient`` (the worker
    shell, ``actors.worker.CacheWorker``), or in-process for tests.
    All awaitable but ``release``, which is fire and forget. ``transport``
    names how ``fetch_blocks`` moves the staged blocks."""

    transport: Transport

    async def export_prefix(self, tokens: list[int], tenant: Tenant | None) -> StagedPrefix: ...

    async def info(self) -> WorkerInfo: ...

    async def fetch_blocks(self, lease: str) -> tuple[np.ndarray, str]: ...

    def release(self, lease: str | None) -> None: ...


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
        self.faults: set[str] = set()              # injected: "nixl", "fallback"
        # The holder's counters (engine thread) and the target's (event loop): one owner each.
        self.holder_stats = {"migrations_out": 0, "refused_lease_calls": 0}
        self.stats = {"migrations_in": 0, "migrated_tokens": 0, "migration_bytes": 0,
                      "nixl_failures": 0, "fallback_pulls": 0, "recomputed_after_failed_migration": 0,
                      "stale_migrations": 0, "migration_timeouts": 0, "refused_installs": 0}

    def inject_fault(self, kind: str, on: bool = True) -> None:
        if kind not in FAULTS:
            raise InvalidInputError(f"unknown fault {kind!r}; choose from {', '.join(FAULTS)}")
        (self.faults.add if on else self.faults.discard)(kind)

    # ------------------------------------------------------ holder, engine thread
    def export_prefix(self, tokens: list[int], namespace: Tenant | None = None,
                      max_tokens: int | None = None) -> StagedPrefix:
        """Stage the cached prefix of ``tokens`` in whole host blocks: their ids
        (for a NIXL READ), checksums and a lease; reserved until ``release`` or expiry."""
        n, ext = self.cache.stage(tokens, namespace, max_tokens)
        if n == 0:
            return StagedPrefix(self.worker_id)
        blocks = tuple(e.block_id for e in ext)
        lease = f"{self._lease_prefix}{next(self._lease_ids)}"
        self._leases[lease] = (ext, time.monotonic() + LEASE_TTL_S)
        self.holder_stats["migrations_out"] += 1
        return StagedPrefix(self.worker_id, n, blocks,
                            tuple(block_checksum(self.cache.staging.block(b)) for b in blocks),
                            lease, self.block_tokens, tokens_hash(list(tokens[:n]), namespace), self.stored_format)

    @property
    def stored_format(self) -> str:
        """The format of what this cache stages (its tier codec's ``format_id``): a target of
        another format (codec, or codec version during a rolling upgrade) never installs it."""
        return self.cache.codec.format_id if self.cache.codec is not None else "none"

    def _own_lease(self, lease: str) -> tuple[list, float]:
        entry = self._leases.get(lease) if isinstance(lease, str) else None
        if entry is None:   # expired, or a call meant for another worker: never serve someone else's KV
            self.holder_stats["refused_lease_calls"] += 1
            mine = isinstance(lease, str) and lease.startswith(self._lease_prefix)
            raise MigrationRefused(f"worker {self.worker_id} holds no lease {lease!r}"
                                   + ("" if mine else " (issued by another worker)"))
        return entry

    def fetch_blocks(self, lease: str) -> tuple[np.ndarray, str]:
        """A lease's staged blocks, whole (so the target verifies each block's
        checksum), for the fallback path: a numpy array (Ray moves it
        zero-copy; torch tensors take a slow pickling path) and the torch dtype
        name to view it back."""
        if "fallback" in self.faults:
            raise RuntimeError("injected fault: fallback fetch")
        ext, _ = self._own_lease(lease)
        kv = torch.cat([self.cache.staging.block(e.block_id) for e in ext], dim=2).contiguous()
        dtype = str(kv.dtype).removeprefix("torch.")
        if kv.dtype == torch.bfloat16:
            kv = kv.view(torch.int16)
        return kv.numpy().copy(), dtype

    def release(self, lease: str) -> None:
        """Free a lease's staging blocks, and any lease past its expiry."""
        entry = self._leases.pop(lease, None) if isinstance(lease, str) else None
        if entry is not None:
            self.cache.staging.free(entry[0])
        now = time.monotonic()
        for stale in [k for k, (_, exp) in self._leases.items() if exp < now]:
            self.cache.staging.free(self._leases.pop(stale)[0])

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

    def _verify(self, staged: StagedPrefix, kv_blocks: torch.Tensor) -> torch.Tensor:
        """Each whole staged block against its checksum; the request's KV, ``tokens`` long."""
        bt = self.block_tokens
        for i, want in enumerate(staged.checksums):
            if block_checksum(kv_blocks[:, :, i * bt:(i + 1) * bt]) != want:
                raise MigrationRefused(f"block {i} of the staged prefix failed its checksum")
        return kv_blocks[:, :, :staged.tokens]

    async def migrate_from(self, holder_id: str, link: PeerLink | None, tokens: list[int], tenant: Tenant | None,
                           run_on_engine: Callable[[Callable[[], Any]], Any]) -> MigrationResult:
        """Pull ``holder_id``'s prefix of ``tokens``: NIXL, else the link's
        fallback, else nothing (recompute), within ``max_wait_s``.
        ``run_on_engine`` awaits a function on the engine thread."""
        result = MigrationResult(holder_id)
        if link is None:   # the holder is gone
            self.stats["recomputed_after_failed_migration"] += 1
            return result
        try:
            staged = await self._bounded("export", holder_id, link.export_prefix(tokens, tenant))
        except Exception as exc:  # holder gone, slow, or unreachable
            log.warning("export from %s failed: %s", holder_id, exc)
            self.stats["recomputed_after_failed_migration"] += 1
            return result
        if not staged.tokens:  # stale decision: the holder evicted it meanwhile
            self.stats["stale_migrations"] += 1
            log.info("migration from %s found nothing cached (stale decision); recomputing", holder_id)
            return result
        n = staged.tokens
        if staged.codec != self.stored_format:   # same shape is not same format: never read it as ours
            self.stats["refused_installs"] += 1
            log.warning("export from %s is stored as %r, this cache stores %r; recomputing",
                        holder_id, staged.codec, self.stored_format)
            link.release(staged.lease)
            self.stats["recomputed_after_failed_migration"] += 1
            return result
        if (staged.holder != holder_id or n > len(tokens)
                or staged.tokens_hash != tokens_hash(list(tokens[:n]), tenant)):
            # Another worker answered, or for other tokens: its KV must never be installed.
            self.stats["refused_installs"] += 1
            log.error("export from %s answered by %s for other tokens; refused", holder_id, staged.holder)
            link.release(staged.lease)
            self.stats["recomputed_after_failed_migration"] += 1
            return result
        kv = None
        try:
            kv = await self._bounded("NIXL read", holder_id, self.pull_nixl(holder_id, link, staged))
            result.transport = Transport.NIXL
        except Exception as exc:
            self.stats["nixl_failures"] += 1
            log.warning("NIXL pull from %s failed (%s); using the %s", holder_id, exc, link.transport.value)
            try:
                array, dtype = await self._bounded(f"{link.transport.value} pull", holder_id,
                                                   link.fetch_blocks(staged.lease))
                kv = torch.from_numpy(array)
                kv = self._verify(staged, kv.view(torch.bfloat16) if dtype == "bfloat16" else kv)
                result.transport = link.transport
                self.stats["fallback_pulls"] += 1
            except Exception as exc2:
                if isinstance(exc2, MigrationRefused):
                    self.stats["refused_installs"] += 1
                kv = None
                log.warning("%s pull from %s failed too (%s); recomputing", link.transport.value, holder_id, exc2)
                self.stats["recomputed_after_failed_migration"] += 1
        finally:
            link.release(staged.lease)
        if kv is not None:
            result.tokens = await run_on_engine(lambda: self.cache.install(tokens, tenant, kv))
            result.bytes = kv.numel() * kv.element_size()
            self.stats["migrations_in"] += 1
            self.stats["migrated_tokens"] += result.tokens
        return result

    async def pull_nixl(self, holder_id: str, link: PeerLink, staged: StagedPrefix) -> torch.Tensor:
        """Connect to the holder's NIXL agent once, then READ and verify the staged blocks."""
        if "nixl" in self.faults:
            raise TransferError("injected fault: NIXL read")
        if self.nixl is None:
            raise TransferError("NIXL is not available on this worker")
        if holder_id not in self._nixl_peers:
            info = await self._bounded("info", holder_id, link.info())
            if info.nixl is None:
                raise TransferError(f"worker {holder_id} has no NIXL endpoint")
            self._nixl_peers[holder_id] = self.nixl.connect(info.nixl)
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        kv, nbytes = await loop.run_in_executor(None, self.pull_blocks_nixl, self._nixl_peers[holder_id],
                                                staged.blocks, staged.checksums, staged.tokens)
        self.stats["migration_bytes"] += nbytes
        self.note_transfer(kv.numel() * kv.element_size(), time.perf_counter() - t0)
        return kv

    def pull_blocks_nixl(self, peer: str, blocks: Sequence[int], checksums: Sequence[int],
                         tokens: int) -> tuple[torch.Tensor, int]:
        """(any thread but the engine's) READ ``blocks`` from ``peer`` into
        staging blocks of our own, verify each, return the KV (``tokens``
        long) and the bytes moved."""
        if self.nixl is None:
            raise TransferError("NIXL is not available on this worker")
        staging = self.cache.staging
        local = self.on_engine(lambda: staging.allocate(len(blocks) * self.block_tokens))
        try:
            local_ids = [e.block_id for e in local]
            nbytes = self.nixl.read_blocks(peer, list(blocks), local_ids)
            for b, want in zip(local_ids, checksums):
                if block_checksum(staging.block(b)) != want:
                    raise MigrationRefused(f"block checksum mismatch after NIXL read (local block {b})")
            kv = torch.cat([staging.block(b) for b in local_ids], dim=2)[:, :, :tokens].clone()
            return kv, nbytes
        finally:
            self.on_engine(lambda: staging.free(local))

    def note_transfer(self, nbytes: int, seconds: float) -> None:
        """Fold an observed migration into the transfer rate reported with the load."""
        if seconds > 0 and nbytes > (1 << 20):
            rate = nbytes / seconds / self.bytes_per_token
            old = self.transfer_tokens_per_s
            self.transfer_tokens_per_s = rate if old is None else 0.8 * old + 0.2 * rate
