"""What a cached prefix is worth, and the tree's prefixes ranked by it.

Value = expected reuse x recompute cost:

- expected reuse: ``1 + hits`` (the requests that found it), halved every
  ``REUSE_HALF_LIFE_S`` since the last one (a session that went quiet is
  less likely to come back than one that spoke a second ago);
- recompute cost: ``n * (1 + n / ATTENTION_TOKENS)`` for ``n`` tokens (prefill
  grows faster than the token count: attention reads the whole context).

Three rankings use it. ``valuable_prefixes``: every cached sequence (each
leaf's path), with the hits of the chain only it uses: the order a replica
that leaves writes what L3 lacks (scale-in). ``recent_prefixes``: the same
sequences, the most recently used first: the ones a leaving replica's peers
pull (its live sessions). ``shared_prefixes``: the branch points (a path
several sequences continue, e.g. a system prompt), with their own hits: what
a new replica pulls before it takes traffic (scale-out). Reading the tree
here touches nothing (recency and hit counts stay as they were).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Hashable

if TYPE_CHECKING:
    from cluster.cache.radix_tree import RadixTree, TreeNode

ATTENTION_TOKENS = 4096
REUSE_HALF_LIFE_S = 600.0


def prefix_value(tokens: int, hits: int, idle_s: float) -> float:
    """Expected reuse (hits so far, decayed by the time since the last one) x
    the cost of recomputing ``tokens`` tokens."""
    reuse = (1 + hits) * math.pow(0.5, max(idle_s, 0.0) / REUSE_HALF_LIFE_S)
    return reuse * tokens * (1 + tokens / ATTENTION_TOKENS)


@dataclass(frozen=True, slots=True)
class ValuedPrefix:
    """One cached prefix and what it is worth."""
    namespace: Hashable
    tokens: tuple[int, ...]
    hits: int
    idle_s: float
    value: float


def _namespace_of(tree: "RadixTree", node: "TreeNode") -> Hashable:
    root = node
    while root.parent is not None:
        root = root.parent
    for ns, r in tree.roots.items():
        if r is root:
            return ns
    return None


def _valued(tree: "RadixTree", node: "TreeNode", hits: int, now: float) -> ValuedPrefix:
    tokens = tuple(tree.path_tokens(node))
    idle = now - node.last_access
    return ValuedPrefix(_namespace_of(tree, node), tokens, hits, idle, prefix_value(len(tokens), hits, idle))


def valuable_prefixes(tree: "RadixTree", limit: int | None = None, now: float | None = None) -> list[ValuedPrefix]:
    """Every cached sequence (each leaf's path), most valuable first. Its hits
    are those of the chain of nodes only it uses: a shared prefix's hits
    belong to every sequence under it, not to this one."""
    now = tree.clock() if now is None else now
    out = []
    for node in tree.iter_nodes():
        if node.children:
            continue
        hits, up = node.hit_count, node.parent
        while up.parent is not None and len(up.children) == 1:
            hits = max(hits, up.hit_count)
            up = up.parent
        out.append(_valued(tree, node, hits, now))
    out.sort(key=lambda p: -p.value)
    return out if limit is None else out[:limit]


def shared_prefixes(tree: "RadixTree", limit: int | None = None, now: float | None = None) -> list[ValuedPrefix]:
    """The prefixes several cached sequences continue (branch points: a system
    prompt, a few-shot header, a tool catalogue), most valuable first."""
    now = tree.clock() if now is None else now
    out = [_valued(tree, node, node.hit_count, now) for node in tree.iter_nodes() if len(node.children) >= 2]
    out.sort(key=lambda p: -p.value)
    return out if limit is None else out[:limit]


def recent_prefixes(tree: "RadixTree", limit: int | None = None, now: float | None = None) -> list[ValuedPrefix]:
    """Every cached sequence, the most recently used first (each with its value): what a
    leaving replica's peers pull, a bounded few. A conversation's next turn comes seconds
    after its last one, so the sequences used last are the sessions still under way, the
    ones whose next turn lands on a survivor in the next seconds. By value, a session that
    ended with many turns outranks one under way with fewer (its hits count, and idle time
    halves them only every ``REUSE_HALF_LIFE_S``): a replica that held 30 sessions handed
    its peers 16 finished ones, and the one still talking found none of it (issue 52)."""
    out = valuable_prefixes(tree, None, now)
    out.sort(key=lambda p: p.idle_s)
    return out if limit is None else out[:limit]
