"""The tiered cache's vocabulary: its config, its moves, a match's answer, its errors.

Kept apart from ``cluster.cache.tiered`` (which re-exports every name) so the
cache itself reads as one class.
"""

from __future__ import annotations

import dataclasses
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


@dataclass(frozen=True)
class TierConfig:
    hot_blocks: int
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

    def __post_init__(self) -> None:
        if self.tenant_quotas is not None:
            object.__setattr__(self, "tenant_quotas", QuotaConfig.parse(self.tenant_quotas).to_dict())
        if not isinstance(self.hot_blocks, int) or self.hot_blocks <= 0:
            raise InvalidInputError(f"hot_blocks must be a positive integer, got {self.hot_blocks!r}")
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
            if isinstance(mb, bool) or not isinstance(mb, (int, float)) or not mb > 0:
                raise InvalidInputError(f"{name}_mb must be a positive number of MiB or null, got {mb!r}")
            if getattr(self, f"{name}_blocks"):
                raise InvalidInputError(f"give {name}_blocks or {name}_mb, not both")
        if (self.cold_blocks or self.cold_mb) and not (self.warm_blocks or self.warm_mb):
            raise InvalidInputError("cold_blocks needs warm_blocks > 0 (COLD is reached through WARM)")
        if self.copy_gb_per_s is not None and not (isinstance(self.copy_gb_per_s, (int, float))
                                                   and self.copy_gb_per_s > 0):
            raise InvalidInputError(f"copy_gb_per_s must be a positive number or None, got {self.copy_gb_per_s!r}")
        if not 0.0 < self.low_watermark < self.high_watermark <= 1.0:
            raise InvalidInputError(
                f"watermarks out of order: need 0 < low_watermark ({self.low_watermark}) < "
                f"high_watermark ({self.high_watermark}) <= 1")

    def sized(self, block_bytes: int) -> "TierConfig":
        """This config with ``warm_mb``/``cold_mb`` turned into block counts of
        ``block_bytes`` each (a stored block: the codec's size), at least one block."""
        if self.warm_mb is None and self.cold_mb is None:
            return self
        blocks = {f"{name}_blocks": max(1, int(getattr(self, f"{name}_mb") * (1 << 20)) // block_bytes)
                  for name in ("warm", "cold") if getattr(self, f"{name}_mb") is not None}
        return dataclasses.replace(self, warm_mb=None, cold_mb=None, **blocks)

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if cuda_available() else "cpu")
        return torch.device(self.device)


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
