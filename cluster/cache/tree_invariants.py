"""``RadixTree.check_invariants``: recount a tree from its nodes and check every
counter, lock, tier order, cached block hash and extent ownership (tests and
state machines call it after each step)."""

from __future__ import annotations

from array import array
from typing import Any

from cluster.cache.tree_node import LowerCopy, TreeNode
from cluster.names import HOT, WARM
from cluster.hashing import block_hashes


def check_tree(tree: Any) -> None:
    """``tree``: a ``RadixTree`` (not imported: the tree imports this module)."""
    ntiers = len(tree.allocators)
    evictable, protected = [0] * ntiers, [0] * ntiers
    owned = [set() for _ in range(ntiers)]
    lower_tokens = lower_nodes = 0
    for root in tree.roots.values():
        assert root.lock_ref >= 1 and root.parent is None and not root.key
        stack = [(root, array("I"))]
        while stack:
            node, path = stack.pop()
            child_locks = 0
            for first, child in node.children.items():
                assert child.parent is node, "child's parent pointer is wrong"
                assert child.key and child.key[0] == first, "child not keyed by its first token"
                assert child.tier >= node.tier or node.parent is None, "child hotter than its parent"
                child_locks += child.lock_ref
                stack.append((child, path + child.key))
            if node.parent is None:
                continue
            if tree.hash_block_tokens is not None:
                bt = tree.hash_block_tokens
                start = len(path) - len(node.key)
                want = block_hashes(path[:len(path) // bt * bt], bt, tree.namespace_of(node))[start // bt:]
                assert node.hashes == want, "cached block hashes differ from the path's"
            assert node.lock_ref >= child_locks, "lock count below the sum of the children's"
            assert sum(e.length for e in node.extents) == len(node.key), (
                f"extents cover {sum(e.length for e in node.extents)} tokens, key has {len(node.key)}")
            alloc = tree.allocators[node.tier]
            for e in node.extents:
                assert alloc.owner_of(e) is node, f"extent {tuple(e)} not owned by its node"
                owned[node.tier].add((e.block_id, e.offset))
            (protected if node.lock_ref else evictable)[node.tier] += len(node.key)
            if node.lower is not None:
                assert node.tier == HOT, "a node outside HOT keeps a lower copy"
                assert tree.lower_copies.get(id(node)) is node.lower, "lower copy not registered"
                assert node.lower.node is node
                assert sum(e.length for e in node.lower.extents) == len(node.key), "lower copy's length differs"
                for e in node.lower.extents:
                    assert tree.allocators[WARM].owner_of(e) is node.lower, "lower extent not owned by its copy"
                    owned[WARM].add((e.block_id, e.offset))
                lower_tokens += len(node.key)
                lower_nodes += 1
    assert lower_tokens == tree.lower_tokens, f"lower copies hold {lower_tokens} tokens, counter {tree.lower_tokens}"
    assert lower_nodes == len(tree.lower_copies), "a registered lower copy is not on a live node"
    assert evictable == tree.evictable, f"evictable counters {tree.evictable} != recount {evictable}"
    assert protected == tree.protected, f"protected counters {tree.protected} != recount {protected}"
    for tier, alloc in enumerate(tree.allocators):
        alloc.check_invariants()
        for b in range(alloc.num_blocks):
            for off, (_, owner) in alloc.extents_at(b).items():
                if isinstance(owner, (TreeNode, LowerCopy)):
                    assert (b, off) in owned[tier], f"extent ({b},{off}) owned by a node not in the tree"
