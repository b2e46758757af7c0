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
from cluster.cache.tier_space import TierSpace
from cluster.names import WARM


class HostStaging:
    def __init__(self, space: TierSpace, check_owner: Callable[[str], None]):
        """``space``: the cache's tier space, whose WARM pool the blocks are taken from
        (``allocate_staging``: only redundant lower copies are reclaimed for them)."""
        self.space = space
        self.pool = space.pools[WARM]
        self._check_owner = check_owner

    @property
    def tensor(self) -> torch.Tensor:
        """The WARM pool's tensor (NIXL registers it)."""
        return self.pool.tensor

    def allocate(self, num_tokens: int) -> list[Extent]:
        """Whole host blocks for ``num_tokens``; evicts nothing cached (a pool full of
        cached prefixes raises), only redundant lower copies."""
        self._check_owner("HostStaging.allocate")
        return self.space.allocate_staging(num_tokens)

    def free(self, extents: Sequence[Extent]) -> None:
        self._check_owner("HostStaging.free")
        self.pool.allocator.free(extents)

    def write(self, extents: Sequence[Extent], kv: torch.Tensor) -> None:
        self.pool.write(extents, kv)

    def block(self, block_id: int) -> torch.Tensor:
        """One staged block (a view), e.g. to checksum it."""
        return self.pool.tensor[block_id]
