"""Chained block hashes kept on the radix tree's nodes (``RadixTree(hash_block_tokens=...)``).

Each node carries the hashes (``cluster.hashing``) of the blocks whose last token it
holds, computed once for the new tokens at insert and cut or joined at split and
merge (``cluster.cache.radix_tree``), so KV events and snapshots never re-hash a path
from the root. A root holds its namespace's chain seed as its one "hash".
"""

from __future__ import annotations

from array import array
from typing import Any

from cluster.cache.tree_node import TreeNode
from cluster.errors import InvalidInputError
from cluster.hashing import chain_hashes_u32, salt_seed


def new_hashes(bt: int, data: bytes, start: int, end: int, parent: TreeNode) -> list[int]:
    """Hashes of the ``bt``-token blocks ending in tokens ``[start, end)`` of ``data``,
    chained from the last block hash above ``parent`` (or the seed)."""
    first = start // bt
    if end // bt <= first:
        return []
    holder = parent
    while not holder.hashes:  # the root always has its seed
        holder = holder.parent
    return chain_hashes_u32(data, first * bt, (end // bt) * bt, bt, holder.hashes[-1])


def hash_whole_tree(tree: Any, block_tokens: int) -> None:
    """Start keeping ``block_tokens``-token block hashes on every node of ``tree`` (a
    ``RadixTree``), computed now for what it caches."""
    if not isinstance(block_tokens, int) or block_tokens <= 0:
        raise InvalidInputError(f"hash block_tokens must be a positive integer, got {block_tokens!r}")
    if tree.hash_block_tokens is not None:
        if tree.hash_block_tokens != block_tokens:
            raise InvalidInputError(
                f"this tree already keeps {tree.hash_block_tokens}-token block hashes, not {block_tokens}")
        return
    tree.hash_block_tokens = block_tokens
    for namespace, root in tree.roots.items():
        root.hashes = [salt_seed(namespace)]
        stack = [(c, array("I")) for c in root.children.values()]
        while stack:
            node, prefix = stack.pop()
            path = prefix + node.key
            node.hashes = new_hashes(block_tokens, path.tobytes(), len(prefix), len(path), node.parent)
            stack.extend((c, path) for c in node.children.values())
