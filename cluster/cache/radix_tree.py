"""Token-level radix tree mapping token sequences to KV extents.

One tree per worker, one owner thread. Each edge carries a token list
(``node.key``) and the extents holding the KV of exactly those tokens, in the
pool of the node's tier. Children are keyed by their first token.

- Match ending inside a node splits it: the new parent inherits lock count,
  access time and tier, and the extents are cut on the same block (no copy).
- Lock counts walk to the root; a 0<->1 transition moves the node's tokens
  between the ``evictable`` and ``protected`` counters of its tier, so both
  are known without a scan.
- Eviction candidates are kept in one lazy heap per tier: a node is pushed when
  it becomes a frontier node (no child in its own tier, unlocked); stale
  entries are skipped or re-ranked when popped. For a single-tier cache the
  frontier is exactly the set of unlocked leaves.
- After a drop leaves an internal node with exactly one child, the two are
  merged, so lookups take fewer hops.
- Namespaces (tenant cache salt, LoRA id) get separate roots: a tenant can
  never match another tenant's KV.
- Keys are ``array('I')`` and requests packed uint32 bytes
  (``cluster.cache.token_key``): an edge compare is one memcmp, and the
  garbage collector never walks per-token objects.
- With ``hash_block_tokens`` set, each node carries the chained block hashes of
  the blocks whose last token it holds (``cluster.cache.tree_hashes``).

Tiers are numbered HOT=0, WARM=1, COLD=2; along any root-to-leaf path a
node's tier is never hotter than its parent's. The tiered layer
(``cluster.cache.tiered``) moves nodes between tiers with ``retier``.

Tiers are inclusive where it is free: a HOT node promoted from WARM keeps its
WARM copy (``cluster.cache.tree_lower``); split, merge and drop carry it along.
"""

from __future__ import annotations

import heapq
import itertools
import time
from array import array
from typing import Any, Callable, Hashable, Sequence

from cluster.cache.allocator import BlockAllocator, Extent
from cluster.cache.eviction import make_policy
from cluster.cache.tree_node import InsertResult, LowerCopy, MatchResult, TreeNode, cut_extents  # noqa: F401  (re-exported)
from cluster.cache.tree_hashes import hash_whole_tree, new_hashes
from cluster.cache.tree_invariants import check_tree
from cluster.cache.tree_lower import LowerCopies
from cluster.cache.token_key import TOKEN_BYTES, encode_tokens, key_array
from cluster.errors import InvalidInputError
from cluster.hashing import salt_seed
from cluster.names import COLD, HOT, TIER_NAMES, WARM  # noqa: F401  (re-exported: the tree's tiers)


class RadixTree(LowerCopies):
    def __init__(self, allocators: BlockAllocator | Sequence[BlockAllocator], *, policy: str | Any = "lru",
                 clock: Callable[[], float] = time.monotonic, vocab_size: int | None = None,
                 hash_block_tokens: int | None = None):
        self.allocators = [allocators] if isinstance(allocators, BlockAllocator) else list(allocators)
        if not 1 <= len(self.allocators) <= 3:
            raise InvalidInputError("a tree needs one allocator per tier (1 to 3)")
        self.policy = make_policy(policy)
        self.clock = clock
        self.vocab_size = vocab_size
        self.roots: dict[Hashable, TreeNode] = {}
        ntiers = len(self.allocators)
        self.evictable = [0] * ntiers
        self.protected = [0] * ntiers
        self._heaps: list[list] = [[] for _ in range(ntiers)]
        self._seq = itertools.count()
        self.stats = {"splits": 0, "merges": 0, "evicted_tokens": 0, "evicted_nodes": 0}
        # Lower copies of HOT nodes (inclusive tiers), oldest first: WARM reclaims them in this order.
        self.lower_copies: dict[int, LowerCopy] = {}
        self.lower_tokens = 0
        # Observers of what the tree holds (KV event publishers): each gets
        # on_stored(node), on_tier(node, old_tier), on_removed(node), called after
        # the change, from the owner thread. Split and merge change no content.
        self.listeners: list[Any] = []
        self.hash_block_tokens: int | None = None
        if hash_block_tokens is not None:
            self.enable_block_hashes(hash_block_tokens)

    # ----------------------------------------------------------------- queries
    @property
    def evictable_tokens(self) -> int:
        return sum(self.evictable)

    @property
    def protected_tokens(self) -> int:
        return sum(self.protected)

    @property
    def total_tokens(self) -> int:
        return self.evictable_tokens + self.protected_tokens

    def root(self, namespace: Hashable = None) -> TreeNode:
        node = self.roots.get(namespace)
        if node is None:
            if namespace is not None and not isinstance(namespace, (str, int)):
                raise InvalidInputError(f"namespace must be a str, an int or None, got {type(namespace).__name__}")
            node = TreeNode(array("I"), [], None)
            node.lock_ref = 1  # the root is never evicted
            node.session = ("namespace", namespace)
            if self.hash_block_tokens is not None:
                node.hashes = [salt_seed(namespace)]
            self.roots[namespace] = node
        return node

    # ------------------------------------------------------------------- match
    def match_prefix(self, tokens: Sequence[int] | bytes, namespace: Hashable = None, *,
                     validate: bool = True) -> MatchResult:
        """Longest cached prefix of ``tokens``; splits the node the match ends in.

        ``tokens`` may be already encoded (``encode_tokens``: pass the same
        bytes to ``insert``). ``validate=False`` skips the vocabulary check
        for callers that validated the request once at ingress.
        """
        tokens = encode_tokens(tokens, self.vocab_size, validate=validate)
        node, pos, path = self.walk(tokens, self.root(namespace), split=True)
        now = self.clock()
        extents: list[Extent] = []
        tier_lengths = [0, 0, 0]
        for n in path:
            n.last_access = now
            n.hit_count += 1
            extents.extend(n.extents)
            tier_lengths[n.tier] += len(n.key)
        return MatchResult(pos, node, extents, tier_lengths, path)

    def walk(self, data: bytes, node: TreeNode, split: bool) -> tuple[TreeNode, int, list[TreeNode]]:
        """Follow ``data`` (encoded tokens, ``encode_tokens``) down from ``node``; returns
        the last node reached, the tokens matched and the path (root excluded). With
        ``split`` a match that ends inside an edge splits it there; without, nothing
        changes (no split, no recency): a reader's walk (L3's write path)."""
        ids = memoryview(data).cast("I")
        pos, n, path = 0, len(ids), []
        startswith = data.startswith
        while pos < n:
            child = node.children.get(ids[pos])
            if child is None:
                break
            key = child.key
            if startswith(key, pos * TOKEN_BYTES):  # one memcmp, no slice
                pos += len(key)
                node = child
                path.append(child)
                continue
            # Diverges inside the edge: binary search for the common length
            # (the first token matched through the child's dict key).
            lo, hi = 1, min(len(key), n - pos)
            if hi > lo and startswith(key[:hi], pos * TOKEN_BYTES):
                lo = hi
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if startswith(key[:mid], pos * TOKEN_BYTES):
                    lo = mid
                else:
                    hi = mid
            if split and not child.busy:
                child = self._split(child, lo, pos)
                pos += lo
                node = child
                path.append(child)
            break
        return node, pos, path

    def split_node(self, node: TreeNode, at: int) -> TreeNode:
        """Cut ``node`` after ``at`` tokens (0 < at < its length), as an insert that
        diverges there would: the head, in the same tier, becomes its parent and
        ``node`` keeps the tail. Returns the head."""
        if not 0 < at < len(node.key):
            raise ValueError(f"a split point must fall inside the node (0 < {at} < {len(node.key)})")
        start, p = 0, node.parent
        while p is not None:
            start += len(p.key)
            p = p.parent
        return self._split(node, at, start)

    def _split(self, node: TreeNode, at: int, start: int) -> TreeNode:
        """Cut ``node`` (whose first token is token ``start`` of its path) after
        ``at`` tokens; returns the new parent holding the head."""
        alloc = self.allocators[node.tier]
        head_ext, tail_ext = cut_extents(alloc, node.extents, at)
        parent = node.parent
        head = TreeNode(node.key[:at], head_ext, parent, node.tier, node.last_access)
        head.lock_ref = node.lock_ref
        head.hit_count = node.hit_count
        head.session = node.session
        if node.hashes is not None:
            bt = self.hash_block_tokens
            k = (start + at) // bt - start // bt  # blocks whose last token is in the head
            head.hashes, node.hashes = node.hashes[:k], node.hashes[k:]
        alloc.set_owners(head_ext, head)
        if node.lower is not None:   # its WARM copy is cut at the same token
            low_alloc = self.allocators[WARM]
            low_head, low_tail = cut_extents(low_alloc, node.lower.extents, at)
            node.lower.extents = low_tail
            low_alloc.set_owners(low_tail, node.lower)
            head.lower = LowerCopy(head, low_head)
            low_alloc.set_owners(low_head, head.lower)
            self.lower_copies[id(head)] = head.lower
        node.key = node.key[at:]
        node.extents = tail_ext
        node.parent = head
        head.children[node.key[0]] = node
        parent.children[head.key[0]] = head
        self.stats["splits"] += 1
        return head

    # ------------------------------------------------------------------ insert
    def insert(self, tokens: Sequence[int] | bytes, extents: Sequence[Extent], namespace: Hashable = None, *,
               start: int = 0, validate: bool = True) -> InsertResult:
        """Add the KV of ``tokens``; ``extents`` (in the HOT pool) cover ``tokens[start:]``.

        ``tokens[:start]`` must already be cached (the caller matched and locked
        it). The tree takes ownership of the extents: the parts that turn out to
        be cached already (another request inserted them first) are freed here,
        and their count is returned. Cached parts that are WARM or COLD are
        re-homed onto the caller's HOT extents, keeping tiers monotone.
        """
        data = encode_tokens(tokens, self.vocab_size, validate=validate)
        ntokens = len(data) // TOKEN_BYTES
        extents = list(extents)
        alloc = self.allocators[HOT]
        if not 0 <= start <= ntokens:
            raise InvalidInputError(f"start={start} outside [0, {ntokens}]")
        covered = 0
        for e in extents:
            covered += e[2]
        if covered != ntokens - start:
            raise InvalidInputError(
                f"extents cover {covered} tokens but tokens[{start}:] has {ntokens - start}")
        if validate:
            for e in extents:
                if alloc.owner_of(e) is not None:
                    raise InvalidInputError(f"extent {tuple(e)} is already owned by the tree")
        node, present, path = self.walk(data, self.root(namespace), split=True)
        if present < start:
            raise InvalidInputError(
                f"tokens[:{start}] must be cached before inserting from start={start}; only {present} are")
        now = self.clock()
        pos, cursor = 0, extents  # cursor: caller extents not yet consumed, starting at token `start`
        freed = 0
        for n in path:
            nlen = len(n.key)
            end = pos + nlen
            if end > start:
                take_from = max(pos, start)
                mine, cursor = cut_extents(self.allocators[HOT], cursor, end - take_from)
                if n.tier != HOT and take_from == pos and not n.busy:
                    self._rehome(n, mine)
                else:
                    freed += end - take_from
                    alloc.free(mine)
            n.last_access = now
            pos = end
        if present == ntokens:
            return InsertResult(present, node, freed)
        key = key_array(memoryview(data)[present * TOKEN_BYTES:])
        if node.tier != HOT or node.busy or key[0] in node.children:
            # Cannot hang HOT KV below a colder (or moving) node, nor beside a child
            # that a move keeps from being split: keep the cache as it was.
            alloc.free(cursor)
            return InsertResult(present, node, freed, ntokens - present)
        leaf = TreeNode(key, cursor, node, HOT, now)
        if self.hash_block_tokens is not None:
            leaf.hashes = new_hashes(self.hash_block_tokens, data, present, ntokens, node)
        alloc.set_owners(cursor, leaf)
        node.children[leaf.key[0]] = leaf
        self.evictable[HOT] += len(leaf.key)
        self._consider(leaf)
        for listener in self.listeners:
            listener.on_stored(leaf)
        self._consider_parent_after_child_change(node)
        return InsertResult(present, leaf, freed)

    def peek(self, tokens: Sequence[int] | bytes, namespace: Hashable = None, *,
             validate: bool = True) -> tuple[bool, list[int]]:
        """Whether all that is cached of ``tokens`` is in HOT and not moving, and the
        cached tokens by tier, as ``match_prefix`` would find them, touching,
        splitting and locking nothing: a look that does not make the prefix recent."""
        data = encode_tokens(tokens, self.vocab_size, validate=validate)
        node, pos, path = self.walk(data, self.root(namespace), split=False)
        tiers = [0, 0, 0]
        hot = True
        for n in path:
            tiers[n.tier] += len(n.key)
            hot = hot and n.tier == HOT and not n.busy
        ids = memoryview(data).cast("I")
        if pos < len(ids):
            child = node.children.get(ids[pos])   # the edge the match ends inside
            if child is not None:
                key, lo, hi = child.key, 1, min(len(child.key), len(ids) - pos)
                while hi - lo > 0:   # the longest common length, as ``walk`` finds it
                    mid = (lo + hi + 1) // 2
                    if data.startswith(key[:mid], pos * TOKEN_BYTES):
                        lo = mid
                    else:
                        hi = mid - 1
                tiers[child.tier] += lo
                hot = hot and child.tier == HOT and not child.busy
        return hot, tiers

    def touch_path(self, tokens: Sequence[int] | bytes, namespace: Hashable = None, now: float | None = None) -> None:
        """Make the cached path of ``tokens`` the most recently used, splitting nothing."""
        data = encode_tokens(tokens, self.vocab_size, validate=False)
        _, _, path = self.walk(data, self.root(namespace), split=False)
        now = self.clock() if now is None else now
        for n in path:
            n.last_access = now

    def insert_keeps_whole(self, tokens: Sequence[int] | bytes, namespace: Hashable = None, *,
                           validate: bool = True) -> bool:
        """Whether ``insert`` of ``tokens`` now would leave all of them in the tree
        in HOT: no node on their path, nor the edge their path would split, is in
        an asynchronous move (a moving node keeps its tier, and the caller's copy
        of those tokens would be freed). Changes nothing."""
        return not self.moves_on_path(tokens, namespace, validate=validate)

    def moves_on_path(self, tokens: Sequence[int] | bytes, namespace: Hashable = None, *,
                      validate: bool = True) -> list[Any]:
        """The moves (``node.busy``) of the nodes on ``tokens``' path and of the edge
        it would split, each once: what an insert of ``tokens`` waits for."""
        data = encode_tokens(tokens, self.vocab_size, validate=validate)
        node, pos, path = self.walk(data, self.root(namespace), split=False)
        ids = memoryview(data).cast("I")
        if pos < len(ids):
            child = node.children.get(ids[pos])
            if child is not None:   # a split it cannot take while the child moves
                path = path + [child]
        out: list[Any] = []
        for n in path:
            if n.busy and not any(m is n.busy for m in out):
                out.append(n.busy)
        return out

    def enable_block_hashes(self, block_tokens: int) -> None:
        """Start keeping block hashes on every node (computed now for what is cached)."""
        hash_whole_tree(self, block_tokens)

    def _rehome(self, node: TreeNode, hot_extents: list[Extent]) -> None:
        """Replace a cold copy by freshly computed HOT KV of the same tokens (a WARM
        copy stays as the node's lower copy)."""
        old_tier, old = node.tier, node.extents
        self.retier(node, HOT, hot_extents)
        if old_tier == WARM:
            self.keep_lower(node, old)
        else:
            self.allocators[old_tier].free(old)

    # ------------------------------------------------------------------- locks
    def lock(self, node: TreeNode) -> None:
        if not node.alive and node.lock_ref == 0:
            raise InvalidInputError("cannot lock a node that is no longer in the tree")
        while node.parent is not None:
            if node.lock_ref == 0:
                n = len(node.key)
                self.evictable[node.tier] -= n
                self.protected[node.tier] += n
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        # Validate the whole path first: a bad unlock must not leave half the path changed.
        walk = node
        while walk.parent is not None:
            if walk.lock_ref <= 0:
                raise InvalidInputError("unlock of a node that is not locked")
            walk = walk.parent
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                n = len(node.key)
                self.protected[node.tier] -= n
                self.evictable[node.tier] += n
                self._consider(node)
            node = node.parent

    # ---------------------------------------------------------------- eviction
    def _consider(self, node: TreeNode) -> None:
        """Push ``node`` onto its tier's heap if it is now an eviction candidate."""
        if node.parent is None or node.lock_ref or node.busy:
            return
        tier = node.tier
        for c in node.children.values():
            if c.tier == tier:
                return
        node.stamp += 1
        heapq.heappush(self._heaps[tier], (self.policy.priority(node), next(self._seq), node.stamp, node))

    def requeue(self, node: TreeNode) -> None:
        """Offer ``node`` to its tier's eviction heap again (after a caller passed it over)."""
        self._consider(node)

    def _consider_parent_after_child_change(self, parent: TreeNode) -> None:
        # A parent that gained a same-tier child stops being a candidate: bump its
        # stamp so its old heap entry is ignored.
        parent.stamp += 1

    def pop_candidate(self, tier: int, *, leaves_only: bool,
                      allow: Callable[[TreeNode], bool] | None = None) -> TreeNode | None:
        """Lowest-priority valid candidate of ``tier`` (removed from the heap);
        ``allow``: only a node it accepts (the others stay candidates: tenant quotas)."""
        heap, skipped = self._heaps[tier], []
        found = None
        while heap:
            prio, _, stamp, node = heapq.heappop(heap)
            if (stamp != node.stamp or node.parent is None or node.lock_ref or node.busy
                    or node.tier != tier or any(c.tier == tier for c in node.children.values())):
                continue
            current = self.policy.priority(node)
            if current != prio:
                node.stamp += 1
                heapq.heappush(heap, (current, next(self._seq), node.stamp, node))
                continue
            if leaves_only and node.children:
                node.stamp += 1
                continue
            if allow is not None and not allow(node):
                skipped.append(node)
                continue
            found = node
            break
        for node in skipped:
            self._consider(node)
        return found

    def evict(self, num_tokens: int, tier: int = HOT) -> int:
        """Drop least-valuable unlocked leaves of ``tier`` until ``num_tokens`` are freed.

        Returns the number of tokens freed (less than asked when everything left
        is locked).
        """
        if not isinstance(num_tokens, int) or num_tokens < 0:
            raise InvalidInputError(f"num_tokens must be a non-negative integer, got {num_tokens!r}")
        freed = 0
        while freed < num_tokens:
            node = self.pop_candidate(tier, leaves_only=True)
            if node is None:
                break
            freed += self.drop(node)
        return freed

    def drop(self, node: TreeNode, *, merge: bool = True) -> int:
        """Remove an unlocked leaf and free its KV; merges or re-queues the parent."""
        if node.children or node.lock_ref or node.parent is None or node.busy:
            raise InvalidInputError("only an unlocked, idle leaf can be dropped")
        n = len(node.key)
        for listener in self.listeners:  # before the node leaves: they need its path
            listener.on_removed(node)
        self.drop_lower(node)
        self.allocators[node.tier].free(node.extents)
        self.evictable[node.tier] -= n
        parent = node.parent
        del parent.children[node.key[0]]
        node.parent = None
        node.extents = []
        node.stamp += 1
        self.stats["evicted_tokens"] += n
        self.stats["evicted_nodes"] += 1
        if merge and len(parent.children) == 1 and parent.parent is not None:
            (only,) = parent.children.values()
            if self._mergeable(parent, only):
                self._merge(parent, only)
                return n
        self._consider(parent)
        return n

    def drop_subtree(self, node: TreeNode) -> int:
        """Drop ``node`` and everything under it (e.g. its KV failed a checksum).

        Locked or moving descendants (and so their ancestors) are kept.
        Returns the tokens dropped."""
        order, stack = [], [node]
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(n.children.values())
        dropped = 0
        for n in reversed(order):  # children before parents
            if n.alive and not n.children and not n.lock_ref and not n.busy:
                dropped += self.drop(n, merge=False)
        return dropped

    def _mergeable(self, parent: TreeNode, child: TreeNode) -> bool:
        return (parent.lock_ref == 0 and child.lock_ref == 0 and parent.tier == child.tier
                and not parent.busy and not child.busy)

    def _merge(self, parent: TreeNode, child: TreeNode) -> None:
        if parent.lower is not None and child.lower is not None:   # one copy for the merged node
            low = parent.lower.extents + child.lower.extents
            del self.lower_copies[id(parent)]   # its tokens stay counted: they are the child's now
            parent.lower = None
            child.lower.extents = low
            self.allocators[WARM].set_owners(low, child.lower)
        elif parent.lower is not None or child.lower is not None:   # half a copy is no copy
            self.drop_lower(parent)
            self.drop_lower(child)
        alloc = self.allocators[child.tier]
        merged = list(parent.extents)
        for e in child.extents:
            joined = alloc.try_join(merged[-1], e) if merged else None
            if joined is None:
                merged.append(e)
            else:
                merged[-1] = joined
        grand = parent.parent
        child.key = parent.key + child.key
        if child.hashes is not None:
            child.hashes = parent.hashes + child.hashes
        child.extents = merged
        alloc.set_owners(merged, child)
        child.parent = grand
        child.last_access = max(child.last_access, parent.last_access)
        child.hit_count = max(child.hit_count, parent.hit_count)
        grand.children[child.key[0]] = child
        parent.parent = None
        parent.children = {}
        parent.extents = []
        parent.stamp += 1
        self.stats["merges"] += 1
        self._consider(child)

    # -------------------------------------------------------------- tier moves
    def retier(self, node: TreeNode, tier: int, extents: list[Extent]) -> None:
        """Record that ``node``'s KV now lives in ``tier`` at ``extents``.

        The caller copied the data and frees the old extents itself (after its
        copy completed). Keeps counters and candidate heaps current.
        """
        if tier != HOT:
            self.drop_lower(node)   # only a HOT node keeps one
        n = len(node.key)
        counter = self.protected if node.lock_ref else self.evictable
        counter[node.tier] -= n
        counter[tier] += n
        old_tier = node.tier
        node.tier = tier
        node.extents = extents
        self.allocators[tier].set_owners(extents, node)
        self._consider(node)
        if node.parent is not None and node.parent.parent is not None and node.parent.tier == old_tier:
            self._consider(node.parent)
        for listener in self.listeners:
            listener.on_tier(node, old_tier)

    # -------------------------------------------------------------- iteration
    def iter_nodes(self, namespace: Hashable = ...):
        roots = self.roots.values() if namespace is ... else [self.root(namespace)]
        for root in roots:
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                yield node
                stack.extend(node.children.values())

    def path_tokens(self, node: TreeNode) -> list[int]:
        parts = []
        while node.parent is not None:
            parts.append(node.key)
            node = node.parent
        path = array("I")
        for part in reversed(parts):
            path += part
        return path.tolist()

    @staticmethod
    def namespace_of(node: TreeNode) -> Hashable:
        while node.parent is not None:
            node = node.parent
        return node.session[1]

    # -------------------------------------------------------------- invariants
    def check_invariants(self) -> None:
        """Recount everything from the nodes (tests): see ``tree_invariants``."""
        check_tree(self)

