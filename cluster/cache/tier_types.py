"""The tiered cache's vocabulary: its config, its moves, a match's answer, its errors.

Kept apart from ``cluster.cache.tiered`` (which re-exports every name) so the
cache itself reads as one class.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

import torch

from cluster.cache.allocator import Extent
from cluster.cache.codec import CODECS
from cluster.cache.kv_pool import cuda_available
from cluster.cache.offload import CopyEngine
from cluster.cache.quota_config import QuotaConfig
from cluster.cache.radix_tree import TreeNode
from cluster.errors import CacheError, InvalidInputError


class UnknownSessionError(CacheError, KeyError):
    """A prefetch named a session this cache has never seen (or has forgotten)."""

    def __str__(self) -> str:
        return str(self.args[0])


# A CPU cache's share of ``kv_memory_mb`` in HOT. On a CPU both tiers are the same DRAM: HOT
# serves a request without a copy, so the running batch gets most of the budget; WARM keeps
# an eighth, where demotions land without waiting for the disk on their way to COLD and from
# where a returning session comes back by a memcpy (a promotion costs ~1% of recomputing).
CPU_HOT_SHARE = 7 / 8
# COLD with ``kv_memory_mb`` and no COLD size given: this many times the budget on disk,
# at most a quarter of the directory's free space.
DEFAULT_COLD_TIMES_MEMORY = 4
COLD_DISK_SHARE = 0.25


def default_cold_dir() -> str:
    """Where COLD lives when no ``disk_dir`` is given: the user's cache
    (``$XDG_CACHE_HOME/prefix-cache/cold``, else ``~/.cache/prefix-cache/cold``), made here."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = os.path.join(base, "prefix-cache", "cold")
    os.makedirs(path, exist_ok=True)
    return path


@dataclass(frozen=True)
class TierConfig:
    # Block counts (16 tokens each by default); or give ``kv_memory_mb`` instead of hot_blocks
    # and warm_blocks, and the cache splits it (``sized``).
    hot_blocks: int = 0
    warm_blocks: int = 0
    cold_blocks: int = 0
    block_tokens: int = 16
    disk_dir: str | None = None
    high_watermark: float = 0.9
    low_watermark: float = 0.7
    mode: str = "slotted"
    device: str = "auto"
    eviction_policy: str = "lru"
    max_sessions: int = 100_000
    copy_gb_per_s: float | None = None   # pace host copies on CPU-only hosts (see offload.ThreadEngine)
    # Per-tenant shares of each tier (``cluster.cache.quota_config``; None: no quotas),
    # kept as the plain mapping ``QuotaConfig.to_dict`` writes, checked here.
    tenant_quotas: dict | None = None
    # How WARM, COLD and L3 store KV (cluster.cache.codec); HOT stays in the model's dtype.
    tier_codec: str = "none"
    # WARM and COLD sized in MiB of stored KV instead of blocks (either, not both): with a
    # compressed codec the same bytes hold more blocks. Resolved by ``sized``.
    warm_mb: float | None = None
    cold_mb: float | None = None
    # One KV budget in MiB instead of hot_blocks: on a CPU cache HOT and WARM together (the
    # cache splits it: ``CPU_HOT_SHARE``); on a CUDA cache HOT, from device memory, beside
    # warm_blocks/warm_mb from host memory (default: as many bytes again). Without a COLD size,
    # COLD is on: disk_dir (default the user's cache directory) holding
    # ``DEFAULT_COLD_TIMES_MEMORY`` times the budget; cold_mb: 0 turns it off.
    kv_memory_mb: float | None = None

    def __post_init__(self) -> None:
        if self.tenant_quotas is not None:
            object.__setattr__(self, "tenant_quotas", QuotaConfig.parse(self.tenant_quotas).to_dict())
        if self.kv_memory_mb is not None:
            mb = self.kv_memory_mb
            if isinstance(mb, bool) or not isinstance(mb, (int, float)) or not mb > 0:
                raise InvalidInputError(f"kv_memory_mb must be a positive number of MiB or null, got {mb!r}")
            if self.hot_blocks:
                raise InvalidInputError("give kv_memory_mb or hot_blocks, not both")
        elif isinstance(self.hot_blocks, bool) or not isinstance(self.hot_blocks, int) or self.hot_blocks <= 0:
            raise InvalidInputError(f"hot_blocks must be a positive integer (or give kv_memory_mb), "
                                    f"got {self.hot_blocks!r}")
        for name in ("warm_blocks", "cold_blocks"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise InvalidInputError(f"{name} must be a non-negative integer, got {v!r}")
        if self.tier_codec not in CODECS:
            raise InvalidInputError(f"tier_codec must be one of {', '.join(CODECS)}; got {self.tier_codec!r}")
        for name in ("warm", "cold"):
            mb = getattr(self, f"{name}_mb")
            if mb is None:
                continue
            if isinstance(mb, bool) or not isinstance(mb, (int, float)) or not (mb > 0 or (name == "cold" and mb == 0)):
                raise InvalidInputError(f"{name}_mb must be a positive number of MiB or null"
                                        f"{' (cold_mb: 0 turns COLD off)' if name == 'cold' else ''}, got {mb!r}")
            if getattr(self, f"{name}_blocks"):
                raise InvalidInputError(f"give {name}_blocks or {name}_mb, not both")
        if (self.cold_blocks or self.cold_mb) and not (self.warm_blocks or self.warm_mb or self.kv_memory_mb):
            raise InvalidInputError("cold_blocks needs warm_blocks > 0 (COLD is reached through WARM)")
        if self.copy_gb_per_s is not None and not (isinstance(self.copy_gb_per_s, (int, float))
                                                   and self.copy_gb_per_s > 0):
            raise InvalidInputError(f"copy_gb_per_s must be a positive number or None, got {self.copy_gb_per_s!r}")
        if not 0.0 < self.low_watermark < self.high_watermark <= 1.0:
            raise InvalidInputError(
                f"watermarks out of order: need 0 < low_watermark ({self.low_watermark}) < "
                f"high_watermark ({self.high_watermark}) <= 1")

    def check_budget(self, device_type: str) -> None:
        """``kv_memory_mb`` beside a WARM size is a CPU cache's configuration error (the budget
        is HOT and WARM together there); checked where the device is known: the app's build
        (its placement), the cache's start."""
        if self.kv_memory_mb is not None and device_type != "cuda" and (self.warm_blocks or
                                                                        self.warm_mb is not None):
            raise InvalidInputError("kv_memory_mb is HOT and WARM together on a CPU cache: "
                                    "give warm_blocks/warm_mb only with hot_blocks")

    def sized(self, block_bytes: int, hot_block_bytes: int | None = None, device_type: str = "cpu") -> "TierConfig":
        """This config in block counts: ``warm_mb``/``cold_mb`` in blocks of ``block_bytes``
        each (a stored block: the codec's size), ``kv_memory_mb`` split into HOT blocks of
        ``hot_block_bytes`` (the model's dtype) and, on a CPU cache, WARM (``split_memory``);
        at least one block each. COLD's default directory is made here."""
        out = self
        if self.kv_memory_mb is not None:
            if hot_block_bytes is None:
                raise InvalidInputError("kv_memory_mb needs a KV layout (a cache without KV payload counts blocks)")
            out = dataclasses.replace(out, kv_memory_mb=None, **split_memory(self, block_bytes, hot_block_bytes,
                                                                              device_type))
        if out.warm_mb is not None or out.cold_mb is not None:
            blocks = {f"{name}_blocks": max(1, int(mb * (1 << 20)) // block_bytes) if mb else 0   # cold_mb 0: off
                      for name in ("warm", "cold") if (mb := getattr(out, f"{name}_mb")) is not None}
            out = dataclasses.replace(out, warm_mb=None, cold_mb=None, **blocks)
        if out.cold_blocks and not out.warm_blocks:
            raise InvalidInputError("cold_blocks needs warm_blocks > 0 (COLD is reached through WARM)")
        if out.cold_blocks and not out.disk_dir and hot_block_bytes is not None:   # a real disk tier
            out = dataclasses.replace(out, disk_dir=default_cold_dir())
        return out

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if cuda_available() else "cpu")
        return torch.device(self.device)


def split_memory(config: TierConfig, block_bytes: int, hot_block_bytes: int, device_type: str) -> dict:
    """``config.kv_memory_mb`` as tier sizes: ``hot_blocks``, and on a CPU cache ``warm_blocks``
    (the rest of the budget; ``warm_blocks``/``warm_mb`` given beside it are a configuration
    error there); on CUDA, HOT is all of it and WARM is as given, else as many bytes of host
    memory again. Without a COLD size, COLD is ``DEFAULT_COLD_TIMES_MEMORY`` times the budget,
    at most a quarter of the free disk (``cold_mb: 0``: none)."""
    budget = int(config.kv_memory_mb * (1 << 20))
    out: dict = {}
    if device_type == "cuda":
        out["hot_blocks"] = max(1, budget // hot_block_bytes)
        if not config.warm_blocks and config.warm_mb is None:   # host memory: as much again, by default
            out["warm_blocks"] = max(1, budget // block_bytes)
    else:
        config.check_budget(device_type)
        hot = max(1, int(budget * CPU_HOT_SHARE) // hot_block_bytes)
        out["hot_blocks"] = hot
        out["warm_blocks"] = max(1, (budget - hot * hot_block_bytes) // block_bytes)
    if not config.cold_blocks and config.cold_mb is None:
        directory = config.disk_dir or default_cold_dir()
        try:
            disk = os.statvfs(directory)
        except OSError as exc:
            raise InvalidInputError(f"disk_dir {directory!r} (the COLD tier's directory): {exc.strerror}") from None
        free = disk.f_bavail * disk.f_frsize
        cold_bytes = min(DEFAULT_COLD_TIMES_MEMORY * budget, int(free * COLD_DISK_SHARE))
        out["cold_blocks"] = cold_bytes // block_bytes
        out["disk_dir"] = directory
        if not (config.warm_blocks or config.warm_mb is not None or out.get("warm_blocks")):
            out["cold_blocks"] = 0   # COLD is reached through WARM
    return out


class MoveKind(Enum):
    DEMOTE = "demote"
    PROMOTE = "promote"


@dataclass(slots=True)
class Move:
    """One asynchronous tier move; each node it carries points to it through
    ``node.busy`` until the owner applies its completion (then ``None``)."""

    kind: MoveKind
    nodes: list[TreeNode]
    src_tiers: list[int]
    dst_tier: int
    dst_extents: list[list[Extent]]
    engine: CopyEngine | None
    op_id: int = 0
    failed_index: list[int] = field(default_factory=list)
    error: BaseException | None = None   # set when the copy failed (applied by _complete)


class Readiness(NamedTuple):
    """``TieredCache.ready``'s answer for a waiting request."""

    ready: bool                 # its cached prefix is in HOT now: admit it
    tiers: list[int]            # that prefix as found, by tier: [hot, warm, cold] (+ [l3] while L3 brings some)
    blocked: bool = False       # a promotion it needs found no room: it waits, and so should those behind it
    recompute: int = 0          # tokens the tiers hold that are cheaper to recompute (measured): admit without them


@dataclass(slots=True)
class TieredMatch:
    length: int                   # tokens usable now (HOT, after any promotion)
    last_node: TreeNode
    extents: list[Extent]         # HOT extents covering tokens[:length]
    tier_lengths: list[int]       # HOT/WARM/COLD split of the prefix before promotion
    promoted_tokens: int = 0
    waited_s: float = 0.0
