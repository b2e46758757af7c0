"""What a tiered cache is built of: its pools (one per tier) and its copy engines.

``build_pools``: HOT on the device, WARM in (pinned, under CUDA) host memory, COLD
a file of block slots (``DiskPool``; bookkeeping only in a simulation without KV
payload). ``build_copy_engines``: the engine for HOT <-> WARM copies and the disk
thread for COLD (immediate, bookkeeping only, without KV payload), and the staged
COLD -> HOT upload on the disk thread.
"""

from __future__ import annotations

from typing import Any

import torch

from cluster.cache.allocator import AllocatorConfig
from cluster.cache.disk import DiskPool
from cluster.cache.kv_pool import KVLayout, KVPool
from cluster.cache.offload import ImmediateEngine, ThreadEngine, make_copy_engine
from cluster.cache.tier_types import TierConfig
from cluster.cache.upload import StagedUpload
from cluster.errors import InvalidInputError
from cluster.names import COLD, HOT


def build_pools(config: TierConfig, layout: KVLayout | None, device: torch.device, codec: Any,
                prefault: bool = True) -> list[Any]:
    """One pool per tier of ``config`` (sized already: ``TierConfig.sized``); ``prefault=False``:
    the CPU pools' pages are touched later (``KVPool.prefault``)."""
    bt, mode = config.block_tokens, config.mode
    pools: list[Any] = [KVPool(AllocatorConfig(config.hot_blocks, bt, mode), layout, device=device, name="hot",
                               prefault=prefault)]
    if config.warm_blocks:
        pools.append(KVPool(AllocatorConfig(config.warm_blocks, bt, mode), layout, codec=codec,
                            device="cpu", pin_memory=device.type == "cuda", name="warm", prefault=prefault))
    if config.cold_blocks and layout is None:  # simulation: bookkeeping only, no file
        pools.append(KVPool(AllocatorConfig(config.cold_blocks, bt, mode), None, name="cold"))
    elif config.cold_blocks:
        if not config.disk_dir:
            raise InvalidInputError("cold_blocks > 0 needs disk_dir (the COLD tier's directory)")
        pools.append(DiskPool(AllocatorConfig(config.cold_blocks, bt, mode), layout, config.disk_dir, codec=codec))
    return pools


def build_copy_engines(config: TierConfig, layout: KVLayout | None, device: torch.device, pools: list[Any],
                       deterministic_io: bool) -> tuple[Any, Any, StagedUpload | None]:
    """``(copier, disk_io, upload)``: HOT <-> WARM copies, the disk thread (None without
    COLD), and COLD -> HOT through staging buffers on the disk thread, on the copy stream
    under CUDA (None without COLD or without KV payload)."""
    if layout is None:  # no KV payload: moves are bookkeeping and complete at once
        return ImmediateEngine(), ImmediateEngine() if config.cold_blocks else None, None
    pace = config.copy_gb_per_s * 1e9 if config.copy_gb_per_s else None
    copier = make_copy_engine(device, deterministic=deterministic_io, max_bytes_per_s=pace)
    disk_io = ThreadEngine("kv-disk", drain_on_poll=deterministic_io, max_bytes_per_s=pace) \
        if config.cold_blocks else None
    upload = StagedUpload(pools[HOT], pools[COLD], stream=getattr(copier, "stream", None)) \
        if len(pools) > COLD else None
    return copier, disk_io, upload
