"""HostStaging: whole private blocks of the WARM pool, outside the tree, for migrations.

A holder stages a prefix here for a peer to READ (one NIXL descriptor per
block, addressed by block id); a target READs into staging blocks of its
own, verifies them, then installs. Blocks are allocated whole
(``private_tail``) so a block's checksum covers exactly one staged block.

``allocate`` and ``free`` change the WARM allocator: owner thread only.
``block`` and ``tensor`` are views a transfer thread may read or fill while
it holds the blocks.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from cluster.cache.allocator import Extent
from cluster.cache.kv_pool import KVPool
from cluster.errors import PoolExhaustedError


class HostStaging:
    def __init__(self, pool: KVPool, check_owner: Callable[[str], None],
                 reclaim: Callable[[int], int] | None = None):
        """``reclaim(blocks)``: frees WARM blocks that cost nothing to lose (the
        lower copies of HOT nodes) until ``blocks`` are free; tried once when the
        pool is full."""
        self.pool = pool
        self._check_owner = check_owner
        self._reclaim = reclaim

    @property
    def tensor(self) -> torch.Tensor:
        """The WARM pool's tensor (NIXL registers it)."""
        return self.pool.tensor

    def allocate(self, num_tokens: int) -> list[Extent]:
        """Whole host blocks for ``num_tokens``; evicts nothing cached (a pool full of
        cached prefixes raises), only redundant lower copies."""
        self._check_owner("HostStaging.allocate")
        try:
            return self.pool.allocator.allocate(num_tokens, private_tail=True)
        except PoolExhaustedError as exc:
            if self._reclaim is None or not self._reclaim(exc.needed_blocks):
                raise
            return self.pool.allocator.allocate(num_tokens, private_tail=True)

    def free(self, extents: Sequence[Extent]) -> None:
        self._check_owner("HostStaging.free")
        self.pool.allocator.free(extents)

    def write(self, extents: Sequence[Extent], kv: torch.Tensor) -> None:
        self.pool.write(extents, kv)

    def block(self, block_id: int) -> torch.Tensor:
        """One staged block (a view), e.g. to checksum it."""
        return self.pool.tensor[block_id]
