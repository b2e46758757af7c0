"""``L3ShareBook``: each tenant's L3 blocks across the cluster, as the directory counts them.

L3 is one store for every replica, so a tenant's L3 share (``tenant_quotas``'
``l3``, of ``l3_blocks``) holds across the cluster, not per replica. The
directory sees every replica's L3 writes: an L3 ``stored`` KV event names the
tenant its blocks were written for, and ``removed`` events say which blocks left
L3 (removed for a quota, failed verification, or found missing by a fetch). The
book keeps, for every block L3 holds that way, its tenant and the replica that
wrote it, and counts blocks by tenant and by writer.

Each replica asks for the counts with its event batches (``publish(...,
want_l3_shares=True)``, answered with a ``PublishReply``): ``counts_for`` gives
every tenant's blocks less those that replica wrote, which it counts exactly
itself (``TenantQuotas.set_l3_others``). A replica that starts a new life
(a new epoch) no longer holds its old blocks: they count as another's
(``forget_writer``). A flushed L3 holds nothing (``clear``).

What it cannot see it does not count: blocks L3 evicts by itself until a fetch
finds them missing (counted too high: a tenant writes less, never more), and the
events a publisher drops when its buffer overflows (counted too low until they
leave). A replica whose counts are older than ``COUNTS_TTL_S`` writes nothing new
to L3 (``cluster.cache.quotas``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable

from cluster.names import L3
from cluster.protocol import L3ShareCounts
from cluster.routing.events import EventBatch

# A replica's counts are stale this long after they arrived: its event batches and
# heartbeats go every 20-500 ms, and the directory drops a worker silent for 3 s.
COUNTS_TTL_S = 3.0
_NOBODY = ""   # the writer of blocks whose replica started a new life (worker ids are non-empty)


class L3ShareBook:
    def __init__(self, max_blocks: int = 1 << 22):
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[int, tuple[Hashable, str]] = OrderedDict()   # hash -> (tenant, writer)
        self._by_tenant: dict[Hashable, int] = {}
        self._by_writer: dict[str, dict[Hashable, int]] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    # --------------------------------------------------------------- events
    def apply(self, worker_id: str, batch: EventBatch) -> None:
        """The L3 events of one accepted batch of ``worker_id``."""
        for ev in batch.events:
            if ev.tier != L3:
                continue
            if ev.kind == "stored":
                for h in ev.hashes:
                    self._store(h, ev.tenant, worker_id)
            elif ev.kind == "removed":
                for h in ev.hashes:
                    self._remove(h)

    def _store(self, h: int, tenant: Hashable, writer: str) -> None:
        if h in self._blocks:   # written again (another replica computed the same block): one block
            self._blocks.move_to_end(h)
            return
        self._blocks[h] = (tenant, writer)
        self._add(tenant, writer, 1)
        while len(self._blocks) > self.max_blocks:
            self._remove(next(iter(self._blocks)))

    def _remove(self, h: int) -> None:
        entry = self._blocks.pop(h, None)
        if entry is not None:
            self._add(*entry, -1)

    def _add(self, tenant: Hashable, writer: str, n: int) -> None:
        _bump(self._by_tenant, tenant, n)
        mine = self._by_writer.setdefault(writer, {})
        _bump(mine, tenant, n)
        if not mine:
            del self._by_writer[writer]

    def forget_writer(self, worker_id: str) -> None:
        """``worker_id`` started a new life: the blocks it wrote stay in L3 and count,
        as another replica's (its new life counts only what it writes from now on)."""
        if worker_id not in self._by_writer:
            return
        for h, (tenant, writer) in self._blocks.items():
            if writer == worker_id:
                self._blocks[h] = (tenant, _NOBODY)
        for tenant, n in self._by_writer.pop(worker_id).items():
            _bump(self._by_writer.setdefault(_NOBODY, {}), tenant, n)

    def clear(self) -> None:
        """L3 was flushed: it holds nothing."""
        self._blocks.clear()
        self._by_tenant.clear()
        self._by_writer.clear()

    # ---------------------------------------------------------------- reads
    def totals(self) -> dict[Hashable, int]:
        """Every tenant's L3 blocks across the cluster."""
        return dict(self._by_tenant)

    def counts_for(self, worker_id: str) -> L3ShareCounts:
        """Every tenant's L3 blocks less those ``worker_id`` wrote (it counts its own)."""
        own = self._by_writer.get(worker_id, {})
        return L3ShareCounts(tuple((t, n - own.get(t, 0)) for t, n in self._by_tenant.items()
                                   if n - own.get(t, 0) > 0))

    def check_invariants(self) -> None:
        by_tenant: dict[Hashable, int] = {}
        by_writer: dict[str, dict[Hashable, int]] = {}
        for tenant, writer in self._blocks.values():
            _bump(by_tenant, tenant, 1)
            _bump(by_writer.setdefault(writer, {}), tenant, 1)
        assert by_tenant == self._by_tenant, f"L3 tenant counts drifted: {self._by_tenant} != {by_tenant}"
        assert by_writer == self._by_writer, f"L3 writer counts drifted: {self._by_writer} != {by_writer}"


def _bump(counts: dict, key: Hashable, n: int) -> None:
    left = counts.get(key, 0) + n
    assert left >= 0, f"an L3 count went negative for {key!r}"
    if left:
        counts[key] = left
    else:
        counts.pop(key, None)
