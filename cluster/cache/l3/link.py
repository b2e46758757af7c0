"""L3Link: the tiered cache's side of L3 (``TieredCache.attach_l3`` makes one).

``cluster.cache.l3.tier.L3Tier`` does the store I/O on its own thread; this
class decides what crosses and applies what comes back, on the cache's owner
thread. It is given the tree (read only: ``RadixTree.peek`` and ``walk``), the
pools (to read KV out), an ``install`` function (KV that came back, cached
behind the tree's prefix: the cache's) and the tenants' L3 shares (None:
no quotas); never the cache itself:

- ``write_behind`` (from ``KVLease.commit``): the full blocks of a committed
  sequence that L3 lacks, and its partial last block, are copied out of
  HOT/WARM and queued for writing, at the front of the write queue.
- ``fetch_ahead`` (from ``TieredCache.ready``): a waiting request whose full
  blocks run at least ``min_fetch_blocks`` past the tree's prefix gets them
  fetched; it waits (others run) until ``apply`` installs them.
- ``queue_hand_off``: a replica leaving writes what L3 lacks, most valuable
  first (``cluster.cache.prefix_value``); the caller waits for the writes.

Reading the tree here never touches recency or hit counts: writing a
sequence to L3 is not a use of it.
"""

from __future__ import annotations

import time
from typing import Callable, Hashable, Protocol, Sequence

import torch

from cluster.cache.allocator import Extent
from cluster.cache.l3.tier import FetchResult, L3Tier
from cluster.cache.prefix_value import ValuedPrefix, valuable_prefixes
from cluster.cache.radix_tree import RadixTree, TreeNode
from cluster.cache.token_key import encode_tokens
from cluster.errors import ChecksumError
from cluster.hashing import block_hashes, tail_hash
from cluster.names import COLD, WARM

# ``install(tokens, namespace, kv, start)``: cache ``kv`` (the KV of ``tokens[start:]``) behind
# the tree's prefix of ``tokens``; the tokens new to the tree, None when it cannot land (the
# tree no longer reaches ``start``), or ``NO_ROOM`` (HOT has no room for it now).
Install = Callable[[Sequence[int], Hashable, torch.Tensor, int], "int | None"]
NO_ROOM = -1
# Fetched blocks that found no HOT room wait this long for it, looked at again with their
# request (while running requests hold HOT); then they go and the request computes. Computing
# needs the same HOT room, so waiting for it with the KV in hand is never the slower path.
INSTALL_RETRY_S = 2.0


class L3Shares(Protocol):
    """The tenants' L3 shares, as the link uses them (``TenantQuotas``)."""

    def l3_limited(self) -> bool: ...

    def l3_admit(self, namespace: Hashable, hashes: Sequence[int]) -> tuple[list[int], list[int]]: ...

    def l3_forget(self, hashes: Sequence[int]) -> None: ...


def slice_extents(extents: list[Extent], start: int, end: int) -> list[Extent]:
    """The extents covering tokens ``[start, end)`` of a node (views, nothing moved)."""
    out, pos = [], 0
    for e in extents:
        lo, hi = max(start, pos), min(end, pos + e.length)
        if lo < hi:
            out.append(e if (lo, hi) == (pos, pos + e.length) else Extent(e.block_id, e.offset + lo - pos, hi - lo))
        pos += e.length
        if pos >= end:
            break
    return out


class L3Link:
    def __init__(self, tier: L3Tier, tree: RadixTree, pools: Sequence, install: Install,
                 shares: L3Shares | None = None):
        self.tier, self.tree, self.pools, self._install_kv, self.shares = tier, tree, pools, install, shares
        self._applying = False
        self._unplaced: dict[int, tuple[FetchResult, float]] = {}   # first hash -> (fetched, since): no room yet
        self.stats = {"handoff_blocks": 0, "handoff_bytes": 0, "handoff_prefixes": 0, "handoff_s": 0.0}

    # ------------------------------------------------------------ fetches
    def fetch_ahead(self, tokens: Sequence[int], namespace: Hashable) -> int:
        """The tokens an L3 fetch is bringing for ``tokens`` (started here when
        worth it), 0 when it waits for none. Finished fetches are installed
        first, so a request whose blocks came back is ready on the next look."""
        tier = self.tier
        self.apply()
        bt = tier.block_tokens
        full = len(tokens) // bt
        least = tier.config.min_fetch_blocks
        if full < least:
            return 0
        local = sum(self.tree.peek(tokens, namespace, validate=False)[1])
        first = local // bt
        if full - first < least:
            return 0
        hashes = block_hashes(tokens[:full * bt], bt, salt=namespace)
        waiting = self._unplaced.get(hashes[first])
        if waiting is not None:   # fetched, waiting for HOT room: the request waits with it
            return waiting[0].blocks * bt + waiting[0].tail_tokens
        if not tier.fetching(hashes, first):
            if not tier.wants_fetch(hashes, first):
                return 0
            tier.start_fetch(namespace, tokens, hashes, first)
        return tier.fetching(hashes, first) * bt

    def apply(self) -> int:
        """Report stored blocks to the listeners and install fetched ones; returns
        tokens installed. Not reentrant (installing admits, which polls)."""
        if self._applying:
            return 0
        self._applying = True
        try:
            self.tier.take_written()
            unplaced, self._unplaced = self._unplaced, {}
            done = [(r, since) for r, since in unplaced.values()]
            done += [(r, None) for r in self.tier.take_fetched() if r.blocks or r.tail_tokens]
            return sum(self._install(r, since) for r, since in done)
        finally:
            self._applying = False

    def _install(self, r: FetchResult, since: float | None = None) -> int:
        """Cache blocks read from L3 behind the tree's prefix of the same tokens (the
        ``install`` function, with KV that starts at block ``r.first_block``). Where HOT
        has no room now, they are kept and tried again at the next ``apply`` (their request
        keeps waiting), for ``INSTALL_RETRY_S`` since they first found none. Nothing is
        installed when the tree no longer reaches that block (evicted meanwhile) or that
        time passed: counted, and the request computes."""
        new = self._install_kv(r.tokens, r.namespace, r.kv, r.first_block * self.tier.block_tokens)
        now = time.monotonic()
        first_wait, since = since is None, now if since is None else since
        if new == NO_ROOM and now - since < INSTALL_RETRY_S:
            self._unplaced[r.first_hash] = (r, since)
            self.tier.stats.install_retries += first_wait
            return 0
        if new is None or new == NO_ROOM:
            self._not_installed(r)
            return 0
        self.tier.stats.installed_tokens += new
        return new

    def _not_installed(self, r: FetchResult) -> None:
        """Counted, and not fetched again for a while: the request computes
        instead of waiting on fetches that find no place to land."""
        self.tier.stats.install_failures += 1
        self.tier.note_missing(r.first_hash)

    # ------------------------------------------------------------- writes
    def write_behind(self, tokens: Sequence[int], namespace: Hashable) -> int:
        """Queue the full blocks of a just-committed ``tokens`` that L3 lacks (as
        far as this replica knows) and its partial last block; their KV is copied
        out of HOT/WARM here. The write goes to the front of the queue (the
        session's next turn may land on another replica at once). Returns the
        blocks queued."""
        if not self.tier.writes:
            return 0
        return self._write(tokens, namespace, allow_cold=False, front=True)

    def _write(self, tokens: Sequence[int], namespace: Hashable, *, allow_cold: bool, front: bool = False) -> int:
        tier = self.tier
        bt = tier.block_tokens
        full = len(tokens) // bt
        if not full:
            return 0
        hashes = block_hashes(tokens[:full * bt], bt, salt=namespace)
        todo = tier.unwritten(hashes)
        tail = self._unwritten_tail(tokens, hashes)
        if not todo and tail is None:
            return 0
        remove: list[int] = []
        shares = self.shares
        if shares is not None and todo:   # the tenant's L3 share: what it may add, what goes to make room
            take, remove = shares.l3_admit(namespace, [hashes[i] for i in todo])
            todo = [todo[j] for j in take]
            if not todo and tail is None:
                return 0
        ranges = [(i * bt, (i + 1) * bt) for i in todo]
        kv = self._read_blocks(tokens, namespace, ranges + [(full * bt, len(tokens))], allow_cold) \
            if tail is not None else None
        if kv is None:   # no partial block, or its KV is not all cached here: the full blocks alone
            tail = None
            kv = self._read_blocks(tokens, namespace, ranges, allow_cold) if todo else None
        if kv is None:
            if shares is not None:
                shares.l3_forget([hashes[i] for i in todo])
            return 0
        queued = tier.write(tokens[:full * bt] if tail is None else tokens, hashes, todo, kv, remove,
                            tail=tail, front=front, namespace=namespace)
        if not queued and shares is not None:   # dropped (the write queue is full): not held
            shares.l3_forget([hashes[i] for i in todo])
        return queued

    def _unwritten_tail(self, tokens: Sequence[int], hashes: list[int]) -> int | None:
        """The ``tail_hash`` of ``tokens``' partial last block when it is worth writing:
        there is one, after at least one full block, L3 lacks it (as far as this replica
        knows), and no tenant has an L3 quota (quotas count full blocks only)."""
        start = len(hashes) * self.tier.block_tokens
        if not hashes or start == len(tokens) or (self.shares is not None and self.shares.l3_limited()):
            return None
        h = tail_hash(hashes[-1], tokens[start:])
        return None if h in self.tier.written_tails else h

    def _spans(self, tokens: Sequence[int], namespace: Hashable) -> list[tuple[int, TreeNode]]:
        """(first token, node) of every node the cached path of ``tokens`` runs
        through, the edge it ends inside included; nothing touched or split."""
        tree = self.tree
        data = encode_tokens(tokens, validate=False)
        node, pos, path = tree.walk(data, tree.root(namespace), split=False)
        spans, at = [], 0
        for n in path:
            spans.append((at, n))
            at += len(n.key)
        if at < len(tokens):
            child = node.children.get(tokens[at])
            if child is not None:   # the match ends inside this edge: as far as it agrees
                spans.append((at, child))
        return spans

    def _read_blocks(self, tokens: Sequence[int], namespace: Hashable, ranges: list[tuple[int, int]],
                     allow_cold: bool) -> torch.Tensor | list[torch.Tensor] | None:
        """The KV of token ranges ``[lo, hi)`` of ``tokens`` (whole blocks, and a
        partial last one) as one token-major CPU tensor (a copy), in order; None when
        part of them is not cached, or only on disk without ``allow_cold`` (no disk
        read on the request path). Under a compressed tier codec HOT's parts are
        model-dtype and the lower tiers' stored bytes: then a list of copied parts,
        which L3's write thread encodes."""
        if not ranges:
            return None
        spans = self._spans(tokens, namespace)
        parts = []
        for lo, hi in ranges:
            covered = lo
            for first, node in spans:
                end = first + len(node.key)
                if end <= lo or first >= hi:
                    continue
                if node.tier == COLD and not allow_cold:
                    return None
                if node.busy and node.tier > WARM:   # its disk slot may be in use by a move
                    return None
                a, z = max(lo, first) - first, min(hi, end) - first
                if list(node.key[a:z]) != list(tokens[first + a:first + z]):
                    return None   # the edge the match ended in diverges inside the block
                try:
                    parts.append(self.pools[node.tier].read(slice_extents(node.extents, a, z)))
                except ChecksumError:
                    return None
                covered = first + z
            if covered < hi:
                return None
        if len({(p.dtype, p.shape[-1]) for p in parts}) > 1:
            return [p.to("cpu", copy=True) for p in parts]
        return torch.cat([p.to("cpu") for p in parts], dim=2)   # always a copy: a one-extent read is a view of the pool

    # ------------------------------------------------------------ hand-off
    def valuable_prefixes(self, limit: int | None = None) -> list[ValuedPrefix]:
        return valuable_prefixes(self.tree, limit)

    def queue_hand_off(self, deadline: float, order: str = "value") -> dict:
        """Queue every cached sequence's blocks that L3 lacks for writing (COLD
        ones read from disk too), most valuable first (``order="lru"``: most
        recently used first), until ``deadline`` (``time.monotonic``). The caller
        waits for the writes (``tier.flush``) and then ``apply``s them."""
        prefixes = self.valuable_prefixes()
        if order == "lru":
            prefixes.sort(key=lambda p: p.idle_s)
        blocks = done = 0
        for p in prefixes:
            if time.monotonic() > deadline:
                break
            blocks += self._write(p.tokens, p.namespace, allow_cold=True)
            done += 1
        self.stats["handoff_blocks"] += blocks
        self.stats["handoff_prefixes"] += done
        return {"blocks": blocks, "prefixes": done, "of_prefixes": len(prefixes)}

    def fetch_now(self, tokens: Sequence[int], namespace: Hashable) -> int:
        """Read what L3 holds of ``tokens`` past the tree's prefix and install it,
        here and now (a replica warming up before it takes traffic: nothing
        else runs on its engine). Returns the tokens installed."""
        tier = self.tier
        bt = tier.block_tokens
        full = len(tokens) // bt
        first = sum(self.tree.peek(tokens, namespace, validate=False)[1]) // bt
        if full <= first:
            return 0
        hashes = block_hashes(tokens[:full * bt], bt, salt=namespace)
        if tier.fetching(hashes, first):
            return 0
        tier.start_fetch(namespace, tokens, hashes, first)
        tier.wait_fetches(tier.config.max_fetch_blocks * 0.05 + 5.0)
        return self.apply()
