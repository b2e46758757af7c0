"""Inclusive tiers in the radix tree: a HOT node's WARM lower copy (``LowerCopies``,
a part of ``RadixTree``).

A node promoted from WARM keeps its WARM copy (``node.lower``, a ``LowerCopy``) until
WARM needs the room (``reclaim_lower``), so pushing it back out of HOT is no copy at all
(``demote_to_lower``). The tree keeps every lower copy, oldest first
(``lower_copies``: WARM reclaims them in this order) and their tokens (``lower_tokens``);
split, merge and drop carry the copy along with the node (``cluster.cache.radix_tree``).
"""

from __future__ import annotations

from typing import Any

from cluster.cache.allocator import Extent
from cluster.cache.tree_node import LowerCopy, TreeNode
from cluster.names import HOT, WARM


class LowerCopies:
    """The lower-copy operations of ``RadixTree`` (which holds ``allocators``,
    ``lower_copies``, ``lower_tokens`` and ``retier``)."""

    allocators: list[Any]
    lower_copies: dict[int, LowerCopy]
    lower_tokens: int

    def retier(self, node: TreeNode, tier: int, extents: list[Extent]) -> None:
        raise NotImplementedError

    def keep_lower(self, node: TreeNode, extents: list[Extent]) -> None:
        """Keep ``extents`` (WARM, the same tokens' KV) as HOT ``node``'s lower copy."""
        assert node.tier == HOT and node.lower is None, "only a HOT node without one keeps a lower copy"
        node.lower = LowerCopy(node, list(extents))
        self.allocators[WARM].set_owners(node.lower.extents, node.lower)
        self.lower_copies[id(node)] = node.lower
        self.lower_tokens += len(node.key)

    def drop_lower(self, node: TreeNode, *, free: bool = True) -> int:
        """Forget ``node``'s lower copy (freeing its WARM extents unless ``free`` is
        False); returns its tokens (0 when it had none)."""
        low = node.lower
        if low is None:
            return 0
        node.lower = None
        del self.lower_copies[id(node)]
        n = sum(e.length for e in low.extents)
        self.lower_tokens -= n
        if free:
            self.allocators[WARM].free(low.extents)
        return n

    def demote_to_lower(self, node: TreeNode) -> None:
        """Move a HOT node with a lower copy down to WARM at no copy: its HOT
        extents are freed and the node takes its lower copy's."""
        low = node.lower
        assert node.tier == HOT and low is not None and not node.busy and not node.lock_ref
        self.drop_lower(node, free=False)
        hot = node.extents
        self.retier(node, WARM, low.extents)
        self.allocators[HOT].free(hot)

    def reclaim_lower(self, blocks_wanted: int) -> int:
        """Free lower copies, oldest first, until WARM has ``blocks_wanted`` free
        blocks or none is left; returns the tokens freed (nothing is lost: each
        node still has its HOT copy)."""
        alloc, freed = self.allocators[WARM], 0
        while alloc.free_blocks < blocks_wanted and self.lower_copies:
            low = next(iter(self.lower_copies.values()))
            freed += self.drop_lower(low.node)
        return freed
