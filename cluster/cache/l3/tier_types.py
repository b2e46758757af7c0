"""The L3 tier's types: its config, its stats, the jobs its I/O threads run and
what they hand back (``cluster.cache.l3.tier`` has the tier itself)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Hashable

import torch
import xxhash

from cluster.cache.l3.store import L3Block
from cluster.errors import InvalidInputError

WRITE_POLICIES = ("commit", "off")
FETCH_POLICIES = ("auto", "always", "off")


def l3_model_id(name: str, model: Any) -> str:
    """The model part of L3 keys: the served name and a fingerprint of the
    weights (a sample of every parameter), so two checkpoints under one name,
    or two seeds of the built-in model, never read each other's blocks."""
    digest = xxhash.xxh3_64()
    for pname, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        flat = p.detach().reshape(-1)[:64].to("cpu", torch.float32).contiguous()
        digest.update(pname.encode())
        digest.update(flat.numpy().tobytes())
    safe = "".join(c if c.isprintable() and not c.isspace() else "_" for c in name)[:160] or "model"
    return f"{safe}-{digest.intdigest():016x}"


@dataclass(frozen=True)
class L3TierConfig:
    """How the cache uses L3.

    - ``model_id``: part of every key (blocks of another model are never read).
    - ``write``: ``commit`` stores the full blocks of every committed sequence
      behind the request (what crash survival needs: a replica killed a moment
      after a turn has that turn in L3); ``off`` never writes (read only).
    - ``fetch``: read blocks the tree lacks from L3 before prefill: ``auto``
      where the measured fetch rate beats prefill, ``always`` (tests, or an
      operator who measured otherwise), ``off``.
    - ``min_fetch_blocks``: fetch only when at least this many full blocks lie
      past the tree's prefix (a one-block fetch saves less than its round trip).
    - ``max_fetch_blocks``: the most blocks one fetch asks for.
    - ``max_pending_bytes``: KV queued for writing; past it new writes are dropped.
    - ``max_remembered``: block hashes remembered as written (and as missing).
    - ``miss_ttl_s``: a block a fetch found missing is not asked for again this long.
    - ``write_nice``: the nice value of the thread that writes (0-19; 0: as the rest of
      the process). Fetches have a thread of their own at the process's priority: a
      request may be waiting for one. Writes wait for nobody, so by default they take
      the cores when the engine leaves them (between steps, in its Python stretches)
      instead of beside its two threads.
    """
    model_id: str
    write: str = "commit"
    fetch: str = "auto"
    min_fetch_blocks: int = 2
    max_fetch_blocks: int = 1024
    max_pending_bytes: int = 256 << 20
    max_remembered: int = 1 << 20
    miss_ttl_s: float = 10.0
    write_nice: int = 19

    def __post_init__(self) -> None:
        if self.write not in WRITE_POLICIES:
            raise InvalidInputError(f"l3 write policy must be one of {WRITE_POLICIES}, got {self.write!r}")
        if self.fetch not in FETCH_POLICIES:
            raise InvalidInputError(f"l3 fetch policy must be one of {FETCH_POLICIES}, got {self.fetch!r}")
        for name in ("min_fetch_blocks", "max_fetch_blocks", "max_pending_bytes", "max_remembered"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise InvalidInputError(f"l3 {name} must be a positive integer, got {v!r}")
        if not isinstance(self.miss_ttl_s, (int, float)) or self.miss_ttl_s < 0:
            raise InvalidInputError(f"l3 miss_ttl_s must be >= 0, got {self.miss_ttl_s!r}")
        if isinstance(self.write_nice, bool) or not isinstance(self.write_nice, int) or not 0 <= self.write_nice <= 19:
            raise InvalidInputError(f"l3 write_nice must be an integer in 0..19, got {self.write_nice!r}")


@dataclass(slots=True)
class FetchResult:
    """Blocks ``[first_block, first_block + blocks)`` of ``tokens`` read from L3, and
    a partial block of ``tail_tokens`` after them (``kv`` covers exactly those tokens,
    token-major ``[L, 2, T, H, D]``)."""
    namespace: Hashable
    tokens: list[int]          # the sequence the fetch was for, up to the end of what was found
    first_block: int
    blocks: int                # leading blocks found (0: the first one was missing)
    kv: torch.Tensor | None
    missing: list[int]         # hash of the first block not found (empty when all were found)
    seconds: float             # the I/O thread's time for it
    first_hash: int = 0        # the hash of block ``first_block`` (what the fetch is known by)
    bytes: int = 0
    found: list[int] = field(default_factory=list)   # hashes of the blocks found
    unanswered: bool = False   # the run stopped at a block the store did not answer for (timeout, off)
    backoff: list[int] = field(default_factory=list)   # that block: not asked for again a while (locally)
    tail_tokens: int = 0       # a partial block found after the blocks (``kv`` and ``tokens`` end with it)
    tail_hash: int = 0         # ... its ``cluster.hashing.tail_hash``


@dataclass(slots=True)
class WriteDone:
    """A finished write: which of its full blocks and its partial block were stored."""
    hashes: list[int]
    stored: list[bool]
    nbytes: int
    tail: int | None = None    # the partial block's hash (None: the write had none)
    tail_stored: bool = False
    namespace: Any = None      # the tenant they were written for
    cancelled: int = 0         # of ``hashes``, not written: a later write removed them first


@dataclass(slots=True)
class FetchJob:
    namespace: Hashable
    tokens: list[int]          # up to block_tokens - 1 past the last block asked for (a partial block's)
    hashes: list[int]
    first_block: int


@dataclass(slots=True)
class InventoryJob:
    """List every block of this model and layout L3 holds (for the directory)."""


@dataclass(slots=True)
class WriteJob:
    blocks: list[L3Block]      # the full blocks of ``hashes``, then the partial one of ``tail``
    hashes: list[int]
    nbytes: int
    tail: int | None = None    # the hash of a partial last block written after them (``tail_hash``)
    remove: list = field(default_factory=list)   # keys to remove first (tenant quotas: ``TenantQuotas.l3_admit``)
    keys: list[tuple[Any, tuple[int, ...]]] = field(default_factory=list)   # blocks the I/O thread makes
    parts: list[torch.Tensor] = field(default_factory=list)                 # from these (encoded there)
    namespace: Any = None      # the tenant the blocks are written for (the listeners hear it)
    # Blocks of ``hashes`` a later write removes for a quota while this one still waits in the
    # queue: not written at all (removing them first would find nothing, and this write
    # would then store them past the quota). Marked under the tier's lock.
    cancelled: set = field(default_factory=set)


@dataclass
class L3TierStats:
    writes_queued: int = 0          # blocks handed to the I/O thread
    quota_removed: int = 0          # blocks removed to keep a tenant's L3 quota (``TenantQuotas.l3_admit``)
    blocks_written: int = 0         # stored (or found already there)
    write_failures: int = 0
    writes_cancelled: int = 0       # queued, then removed for a quota before they ran: never written
    writes_dropped: int = 0         # not stored: over max_pending_bytes, or queued when a flush came
    bytes_written: int = 0
    fetches: int = 0
    fetch_blocks_asked: int = 0
    fetch_blocks_hit: int = 0
    tails_written: int = 0          # partial last blocks stored (or found already there)
    tails_fetched: int = 0          # partial blocks a fetch found after its full blocks
    fetch_misses: int = 0           # fetches that found not even their first block
    fetch_skipped_slower: int = 0   # a fetch was possible but recompute is faster
    fetch_probes: int = 0           # ... fetched anyway, one a while, to measure L3 again (``FetchCost``)
    fetch_unanswered: int = 0       # fetches cut short by a block the store did not answer for
    verify_failed_removed: int = 0  # blocks that failed verification, removed from L3
    inventories: int = 0            # L3 inventories sent to the directory
    inventory_blocks: int = 0       # ... and the blocks the latest one listed
    inventory_listed: bool | None = None   # the latest came from the store's listing (False: what was known)
    bytes_fetched: int = 0
    installed_tokens: int = 0
    install_failures: int = 0
    install_retries: int = 0    # fetched blocks kept for a later look: HOT had no room for them yet
    fetches_timed: int = 0          # fetches that found blocks, timed (the latest in ``fetch_s``)
    fetch_s: list[float] = field(default_factory=list)   # the latest fetches' times (bounded)
    fetch_tokens: list[int] = field(default_factory=list)   # ... and the tokens each brought

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k not in ("fetch_s", "fetch_tokens")}
        times = sorted(self.fetch_s)
        out["fetch_ms_p50"] = round(times[len(times) // 2] * 1e3, 3) if times else None
        out["fetch_ms_p99"] = round(times[min(len(times) - 1, int(0.99 * len(times)))] * 1e3, 3) if times else None
        return out


class BoundedHashes:
    """A set of hashes that forgets its oldest entries past ``limit`` (values: a time)."""
    __slots__ = ("limit", "_d")

    def __init__(self, limit: int):
        self.limit = limit
        self._d: OrderedDict[int, float] = OrderedDict()

    def add(self, h: int, value: float = 0.0) -> None:
        d = self._d
        d[h] = value
        d.move_to_end(h)
        if len(d) > self.limit:
            d.popitem(last=False)

    def get(self, h: int) -> float | None:
        return self._d.get(h)

    def discard(self, h: int) -> None:
        self._d.pop(h, None)

    def __contains__(self, h: int) -> bool:
        return h in self._d

    def keys(self) -> list[int]:
        return list(self._d)

    def __len__(self) -> int:
        return len(self._d)
