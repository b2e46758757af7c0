"""The radix tree's node and result types (``cluster.cache.radix_tree`` holds the tree)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

from cluster.cache.allocator import Extent
from cluster.names import HOT, TIER_NAMES


class TreeNode:
    __slots__ = ("children", "parent", "key", "extents", "lock_ref", "last_access",
                 "hit_count", "tier", "stamp", "busy", "session", "hashes", "lower")

    def __init__(self, key: array, extents: list[Extent], parent: "TreeNode | None",
                 tier: int = HOT, now: float = 0.0):
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.extents = extents
        self.lock_ref = 0
        self.last_access = now
        self.hit_count = 0
        self.tier = tier
        self.stamp = 0          # heap entry generation: only the newest entry is valid
        self.busy = False       # an asynchronous tier move owns this node's storage
        self.session = None
        self.hashes: list[int] | None = None  # block hashes ending in this node (see the module doc)
        self.lower: LowerCopy | None = None   # a HOT node's WARM copy, kept since its promotion

    @property
    def alive(self) -> bool:
        return self.parent is not None

    def replace_extent(self, old: Extent, new: Extent) -> None:
        """Called by compaction when this node's KV moved."""
        self.extents[self.extents.index(old)] = new

    def __repr__(self) -> str:
        return (f"TreeNode(len={len(self.key)}, tier={TIER_NAMES[self.tier]}, lock={self.lock_ref}, "
                f"children={len(self.children)})")


class LowerCopy:
    """The WARM copy a HOT node keeps after its promotion (inclusive tiers).

    The same tokens' KV, in the WARM pool, owned by this object (not the node:
    a HOT and a WARM extent may be equal tuples). Demoting a node that has one
    costs no copy: its HOT extents are freed and the node takes these. WARM
    reclaims it first when it needs room (it duplicates what HOT holds)."""

    __slots__ = ("node", "extents")

    def __init__(self, node: TreeNode, extents: list[Extent]):
        self.node = node
        self.extents = extents

    def replace_extent(self, old: Extent, new: Extent) -> None:
        """Called by compaction when this copy's KV moved."""
        self.extents[self.extents.index(old)] = new

    def __repr__(self) -> str:
        return f"LowerCopy(tokens={sum(e.length for e in self.extents)})"


@dataclass(slots=True)
class MatchResult:
    length: int
    last_node: TreeNode
    extents: list[Extent]
    tier_lengths: list[int] = field(default_factory=lambda: [0, 0, 0])
    nodes: list[TreeNode] = field(default_factory=list)

    @property
    def hot_length(self) -> int:
        return self.tier_lengths[HOT]


@dataclass(slots=True)
class InsertResult:
    existing_length: int     # tokens that were already cached before this insert
    node: TreeNode           # node holding the last inserted token
    freed_duplicate_tokens: int
    discarded_tokens: int = 0   # new tokens not inserted (their path ends at a moving or colder node)


def cut_extents(alloc: Any, extents: list[Extent], at: int) -> tuple[list[Extent], list[Extent]]:
    """``extents`` cut after ``at`` tokens (an extent across the cut is split on its block)."""
    head, tail, covered = [], [], 0
    for e in extents:
        if covered >= at:
            tail.append(e)
        elif covered + e.length <= at:
            head.append(e)
        else:
            first, second = alloc.split(e, at - covered)
            head.append(first)
            tail.append(second)
        covered += e.length
    return head, tail
