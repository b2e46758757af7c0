"""KV events: how a worker tells the directory what its cache holds.

A worker's tree is described by chained block hashes
(``cluster.hashing.block_hashes`` over the node's path tokens, block size =
the cache's ``block_tokens``, salt = the tree namespace), so the directory
can match a request's hash chain without ever seeing tokens.

Block ``i`` (tokens ``[i*B, (i+1)*B)`` of a path) belongs to the node holding
its *last* token: that node's tier is the block's tier, and the block appears
with the node and goes with it. Splits and merges change no content and emit
nothing.

Wire format (msgpack): ``{"v": 2, "w": worker_id, "p": epoch, "s": seq,
"r": resync, "e": [[kind, tier, [hash, ...]], ...]}`` with ``kind`` one of
``stored``, ``tier``, ``removed``, ``inventory``. Tier 3 (``L3``) is the
cluster-wide store, not the worker's tree: ``stored`` says the worker wrote
those blocks to L3, ``removed`` that a fetch found them missing there (or
removed them: they failed verification), ``inventory`` that L3 holds them
(a listing of the store, sent at start and with every snapshot: how a
restarted directory learns L3's content); the directory keeps them apart
from the worker's own entries (they outlive the worker). An L3 ``stored`` event
carries the tenant the blocks were written for as a fourth element
(``[kind, tier, [hash, ...], namespace]``): the directory counts each tenant's L3
blocks across the cluster from them (``cluster.routing.l3_shares``). Sequence numbers
start at 1 and grow by one per batch, so the directory sees a lost or
reordered batch as a gap.

Epochs: batches and snapshots carry their publisher's ``epoch``, and the
directory refuses any of an epoch older than the newest it has seen for that
worker: events of a previous life never credit the replica. A worker's epoch
is handed out by the directory when the worker starts (``EpochIssuer``, above
every epoch it issued or saw for that id), so a replica restarted on a node
whose clock is behind is still newer than its previous life. A publisher built
without one (unit tests, the routing replay, a worker the directory did not
answer in time) takes its wall-clock start in nanoseconds; a worker of such an
epoch that the directory refuses asks for an issued one (``adopt_epoch``).

Back-pressure: the publisher never blocks the worker and never grows without
bound. When its buffer would pass ``max_buffer_events`` it drops what it holds
and raises ``needs_resync``; the next batch carries ``resync=True`` and no
events, and the directory reloads the worker from ``snapshot()``. Replaying
events on top of a snapshot that already reflects them is harmless (each event
sets the state of its hashes, last writer wins), so a snapshot never needs to
be coordinated with batches in flight.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import msgpack

from cluster.cache.radix_tree import HOT, RadixTree, TreeNode
from cluster.errors import InvalidInputError
from cluster.names import L3
from cluster.protocol import Snapshot

KINDS = ("stored", "tier", "removed", "inventory")
INVENTORY_CHUNK = 65_536   # hashes per inventory event
# How often a worker sends (actors/reporter.py; the routing replay models the same):
# pending events with its load at most every EVENT_INTERVAL_S, a changed load alone
# every HEARTBEAT_S, and an unchanged one every IDLE_HEARTBEAT_S (liveness: the
# directory drops a worker it has not heard from for 3 s).
EVENT_INTERVAL_S = 0.02
HEARTBEAT_S = 0.1
IDLE_HEARTBEAT_S = 0.5
WIRE_VERSION = 2
_U64 = 1 << 64


class MalformedBatchError(InvalidInputError):
    """Bytes that are not a valid KV event batch (corrupt, foreign or from a buggy peer)."""


@dataclass(slots=True)
class KVEvent:
    kind: str            # "stored" | "tier" | "removed"
    hashes: list[int]    # chained block hashes, root-ward first
    tier: int            # HOT=0, WARM=1, COLD=2 (for "removed": the tier it left from); L3=3
    tenant: str | int | None = None   # L3 "stored": the namespace the blocks were written for


@dataclass(slots=True)
class EventBatch:
    worker_id: str
    seq: int
    events: list[KVEvent] = field(default_factory=list)
    resync: bool = False
    epoch: int = 0   # the publisher's epoch: see the module docstring

    def encode(self) -> bytes:
        return msgpack.packb({"v": WIRE_VERSION, "w": self.worker_id, "p": self.epoch, "s": self.seq,
                              "r": self.resync, "e": [_wire_event(e) for e in self.events]},
                             use_bin_type=True)

    @classmethod
    def decode(cls, data: Any) -> "EventBatch":
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise MalformedBatchError(f"event batch must be bytes, got {type(data).__name__}")
        try:
            obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except Exception as exc:  # msgpack raises several unrelated types
            raise MalformedBatchError(f"event batch is not msgpack ({type(exc).__name__}: {exc})") from None
        if not isinstance(obj, dict):
            raise MalformedBatchError(f"event batch must be a map, got {type(obj).__name__}")
        missing = [k for k in ("v", "w", "p", "s", "r", "e") if k not in obj]
        if missing:
            raise MalformedBatchError(f"event batch lacks field(s) {', '.join(missing)}")
        if obj["v"] != WIRE_VERSION:
            raise MalformedBatchError(f"event batch version {obj['v']!r} is not supported (want {WIRE_VERSION})")
        worker, epoch, seq, resync, raw_events = obj["w"], obj["p"], obj["s"], obj["r"], obj["e"]
        if not isinstance(worker, str) or not worker:
            raise MalformedBatchError(f"worker id must be a non-empty string, got {worker!r}")
        if type(epoch) is not int or not 0 <= epoch < _U64:
            raise MalformedBatchError(f"epoch must be an unsigned 64-bit integer, got {epoch!r}")
        if type(seq) is not int or seq < 0:
            raise MalformedBatchError(f"seq must be a non-negative integer, got {seq!r}")
        if not isinstance(resync, bool):
            raise MalformedBatchError(f"resync must be a boolean, got {resync!r}")
        if not isinstance(raw_events, list):
            raise MalformedBatchError(f"events must be a list, got {type(raw_events).__name__}")
        events = []
        for i, raw in enumerate(raw_events):
            if not isinstance(raw, list) or len(raw) not in (3, 4):
                raise MalformedBatchError(f"event {i} must be [kind, tier, hashes(, tenant)], got {raw!r:.80}")
            kind, tier, hashes = raw[:3]
            tenant = raw[3] if len(raw) == 4 else None
            if len(raw) == 4 and not (tier == L3 and kind == "stored"):
                raise MalformedBatchError(f"event {i}: only an L3 'stored' event names a tenant")
            if tenant is not None and (isinstance(tenant, bool) or not isinstance(tenant, (str, int))):
                raise MalformedBatchError(f"event {i}: tenant must be a str, an int or None, got {tenant!r:.40}")
            if kind not in KINDS:
                raise MalformedBatchError(f"event {i}: unknown kind {kind!r} (want one of {', '.join(KINDS)})")
            if type(tier) is not int or not HOT <= tier <= L3:
                raise MalformedBatchError(f"event {i}: tier {tier!r} out of range [{HOT}, {L3}]")
            if tier == L3 and kind == "tier":
                raise MalformedBatchError(f"event {i}: a 'tier' event cannot name L3 (only stored or removed)")
            if kind == "inventory" and tier != L3:
                raise MalformedBatchError(f"event {i}: an 'inventory' event names L3 only, got tier {tier}")
            if not isinstance(hashes, list):
                raise MalformedBatchError(f"event {i}: hashes must be a list, got {type(hashes).__name__}")
            for h in hashes:
                if type(h) is not int or not 0 <= h < _U64:
                    raise MalformedBatchError(f"event {i}: hash {h!r:.40} is not an unsigned 64-bit integer")
            events.append(KVEvent(kind, hashes, tier, tenant))
        return cls(worker, seq, events, resync, epoch)


def _wire_event(e: KVEvent) -> list:
    if e.tier == L3 and e.kind == "stored":
        return [e.kind, e.tier, e.hashes, e.tenant]
    return [e.kind, e.tier, e.hashes]


class EpochIssuer:
    """Publisher epochs that never go backwards (the directory owns one).

    An epoch is above the last one this issuer handed out and above the newest
    ``known`` for the worker, so a restarted worker is newer than its previous
    life whatever its node's clock says. The issuer's own wall clock (ns) is a
    floor only: it keeps a restarted directory, which remembers nothing, issuing
    above what its previous process issued (as far as its clock allows; a live
    worker's reports tell it their epochs again within a report interval)."""

    __slots__ = ("_wall_ns", "last")

    def __init__(self, wall_ns: Callable[[], int] = time.time_ns):
        self._wall_ns = wall_ns
        self.last = 0   # the latest epoch handed out

    def issue(self, known: int | None = None) -> int:
        """A new epoch, above ``known`` (the newest epoch seen for the worker, if any)."""
        epoch = max(int(self._wall_ns()), self.last + 1, (known or 0) + 1)
        if epoch >= _U64:
            raise InvalidInputError(f"publisher epochs are exhausted (next would be {epoch})")
        self.last = epoch
        return epoch


class KVEventPublisher:
    """Turns a tree's listener callbacks into event batches (one owner thread).

    Append it to ``tree.listeners``; the worker calls ``drain()`` when it wants
    to publish (after each step, or on a timer) and ships the batch.
    """

    def __init__(self, worker_id: str, tree: RadixTree, block_tokens: int, max_buffer_events: int = 10_000,
                 epoch: int | None = None):
        """``epoch``: the directory's (``EpochIssuer``); default this start's wall
        time in ns (module docstring)."""
        if not isinstance(worker_id, str) or not worker_id:
            raise InvalidInputError(f"worker_id must be a non-empty string, got {worker_id!r}")
        if not isinstance(block_tokens, int) or block_tokens <= 0:
            raise InvalidInputError(f"block_tokens must be a positive integer, got {block_tokens!r}")
        if not isinstance(max_buffer_events, int) or max_buffer_events <= 0:
            raise InvalidInputError(f"max_buffer_events must be a positive integer, got {max_buffer_events!r}")
        self.worker_id = worker_id
        self.epoch = time.time_ns() if epoch is None else epoch
        if type(self.epoch) is not int or not 0 <= self.epoch < _U64:
            raise InvalidInputError(f"epoch must be an unsigned 64-bit integer, got {epoch!r}")
        self.tree = tree
        self.block_tokens = block_tokens
        # The tree keeps each node's hashes current through insert, split and
        # merge, so events and snapshots read them instead of re-hashing paths.
        tree.enable_block_hashes(block_tokens)
        self.max_buffer_events = max_buffer_events
        self.needs_resync = False
        self._pending: list[KVEvent] = []
        self._seq = 0   # last sequence number handed out
        self.stats = {"events": 0, "batches": 0, "overflows": 0, "dropped_events": 0}

    def adopt_epoch(self, epoch: int) -> None:
        """Publish under ``epoch`` from now on (one the directory handed out after it
        refused this publisher's own). The directory reloads the worker: the next
        batch asks for a snapshot, and events pending under the old epoch go."""
        if type(epoch) is not int or not 0 <= epoch < _U64:
            raise InvalidInputError(f"epoch must be an unsigned 64-bit integer, got {epoch!r}")
        self.epoch = epoch
        self.stats["dropped_events"] += len(self._pending)
        self._pending = []
        self.needs_resync = True

    # ------------------------------------------------------- tree listener API
    def on_stored(self, node: TreeNode) -> None:
        self._emit("stored", node, node.tier)

    def on_tier(self, node: TreeNode, old_tier: int) -> None:
        self._emit("tier", node, node.tier)

    def on_removed(self, node: TreeNode) -> None:
        self._emit("removed", node, node.tier)

    # ------------------------------------------------ L3 listener API (L3Tier)
    def on_l3_stored(self, hashes: list[int], namespace: str | int | None = None) -> None:
        """Blocks this worker wrote to L3 for tenant ``namespace``."""
        self._emit_hashes("stored", list(hashes), L3, namespace)

    def on_l3_removed(self, hashes: list[int]) -> None:
        self._emit_hashes("removed", list(hashes), L3)

    def on_l3_inventory(self, hashes: list[int]) -> None:
        """Every block L3 holds (a listing), in events of ``INVENTORY_CHUNK`` hashes."""
        hashes = list(hashes)
        for i in range(0, len(hashes), INVENTORY_CHUNK):
            self._emit_hashes("inventory", hashes[i:i + INVENTORY_CHUNK], L3)
        if not hashes:   # an empty L3 is news too: the directory prices L3 from here on
            self._pending.append(KVEvent("inventory", [], L3))

    def node_hashes(self, node: TreeNode) -> list[int]:
        """Hashes of the full blocks whose last token lies in ``node`` (cached on the node)."""
        return node.hashes

    def _emit(self, kind: str, node: TreeNode, tier: int) -> None:
        self._emit_hashes(kind, node.hashes, tier)

    def _emit_hashes(self, kind: str, hashes: list[int] | None, tier: int,
                     tenant: str | int | None = None) -> None:
        if self.needs_resync:   # the snapshot will cover it (L3 events: the next writes will)
            self.stats["dropped_events"] += 1
            return
        if not hashes:
            return
        if len(self._pending) >= self.max_buffer_events:
            self.stats["overflows"] += 1
            self.stats["dropped_events"] += len(self._pending) + 1
            self._pending = []
            self.needs_resync = True
            return
        self._pending.append(KVEvent(kind, hashes, tier, tenant))
        self.stats["events"] += 1

    # ------------------------------------------------------------ publishing
    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def seq(self) -> int:
        """The last sequence number handed out (0 before the first batch)."""
        return self._seq

    def drain(self) -> EventBatch | None:
        """The pending events as one batch, or None when there is nothing to say."""
        if self.needs_resync:
            self.needs_resync = False
            self._seq += 1
            self.stats["batches"] += 1
            return EventBatch(self.worker_id, self._seq, [], resync=True, epoch=self.epoch)
        if not self._pending:
            return None
        events, self._pending = self._pending, []
        self._seq += 1
        self.stats["batches"] += 1
        return EventBatch(self.worker_id, self._seq, events, epoch=self.epoch)

    def snapshot(self) -> Snapshot:
        """``(seq, {hash: tier})``: the tree's full content as of batch ``seq``.

        Events still pending get later sequence numbers; applying them on top
        is harmless (see the module docstring).
        """
        entries: dict[int, int] = {}
        for node in self.tree.iter_nodes():
            tier = node.tier
            for h in node.hashes:
                entries[h] = tier
        return Snapshot(self._seq, entries, self.epoch)
