"""A replica that leaves hands its cache on; one that arrives starts warm.

Scale-in (``hand_off``), within the shell's budget (Serve's
``graceful_shutdown_timeout_s`` bounds it from outside):

1. the directory marks the worker draining: no table, and no router's copy of
   it, chooses it again (the requests it is running finish: Serve drains them
   before calling the replica's destructor);
2. every cached sequence's blocks that L3 lacks are queued for writing, most
   valuable first (``cluster.cache.prefix_value``: expected reuse x recompute
   cost), COLD ones read from disk too;
3. meanwhile the most recently used sequences (``recent_prefixes``: the
   sessions under way, whose next turns come next) are offered to the surviving
   workers, least loaded first; each pulls its share over NIXL (a migration
   from this worker, as the router's migrations are); not when the whole app
   is being deleted (``to_peers=False``: no replica survives to use them);
4. once the writes are done (or the budget is), their KV events go to the
   directory, and the worker leaves it: nothing is credited to it afterwards,
   the pulled prefixes are credited to their new holders by their own events.

Scale-out (``warm_up``), before the shell reports ready: the new worker asks
its peers for their most valuable *shared* prefixes (branch points: system
prompts, few-shot headers, tool catalogues; ranked by hits x length), sums
what several peers hold, and brings the best ones in, from L3 when it holds
them, else from the peer that offered them, within a time and a byte bound.

Both are transport-agnostic: the shell gives a ``PeerOps``
(``actors.worker.ChannelPeerOps``: the peers' channels).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Awaitable, Callable, Protocol

from cluster.cache.prefix_value import recent_prefixes
from cluster.protocol import PrefixOffer

if TYPE_CHECKING:
    from actors.core import WorkerCore
    from actors.migration import PeerLink

log = logging.getLogger(__name__)


class PeerOps(Protocol):
    """How one shell reaches the other workers."""

    async def targets(self) -> list[str]:
        """Live workers other than this one that take requests, least loaded first."""

    async def ask_pull(self, target: str, offer: PrefixOffer) -> int:
        """Ask ``target`` to pull ``offer`` from its holder; the tokens it installed."""

    async def offers(self, peer: str, limit: int) -> list[PrefixOffer]:
        """``peer``'s most valuable shared prefixes."""

    async def link(self, holder: str) -> "PeerLink | None":
        """A link to pull from ``holder`` (None: gone)."""


@dataclass
class HandoffReport:
    drained: bool = False
    l3_blocks: int = 0          # blocks queued for L3 (what L3 lacked)
    l3_prefixes: int = 0
    of_prefixes: int = 0        # sequences the worker held
    l3_flushed: bool = True     # every queued write finished in time
    to_peers: bool = True       # False: the whole app was leaving (no survivor to pull): L3 only
    peer_prefixes: int = 0      # sequences a peer pulled
    peer_tokens: int = 0
    left: bool = False          # the directory forgot the worker
    seconds: float = 0.0
    budget_s: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class WarmupReport:
    peers: int = 0
    offers: int = 0
    prefixes: int = 0           # prefixes brought in
    l3_tokens: int = 0
    peer_tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0

    @property
    def tokens(self) -> int:
        return self.l3_tokens + self.peer_tokens

    def as_dict(self) -> dict:
        return {**asdict(self), "tokens": self.tokens}


async def hand_off(core: "WorkerCore", ops: PeerOps, budget_s: float, *,
                   leave: Callable[[], Awaitable[bool]] | None = None,
                   drain: Callable[[], Awaitable[bool]] | None = None, to_peers: bool = True) -> HandoffReport:
    """See the module docstring; ``drain``/``leave`` default to the core's directory link.
    ``to_peers=False`` (the whole app is being deleted): L3 only, no peer is offered anything."""
    started = time.monotonic()
    deadline = started + budget_s
    report = HandoffReport(budget_s=budget_s, to_peers=to_peers)
    if budget_s <= 0:   # hand-off off: the worker just goes (its heartbeats stop)
        return report
    directory = core.directory
    if drain is None and directory is not None:
        drain = lambda: directory.drain(core.worker_id)   # noqa: E731
    if leave is None and directory is not None:
        leave = lambda: directory.leave(core.worker_id)   # noqa: E731
    if drain is not None:
        report.drained = await drain()
    await core.wait_idle(deadline - budget_s / 2)
    link = core.cache.l3
    if link is not None:
        queued = await core.loop.run(lambda: link.queue_hand_off(started + budget_s * 0.4))
        report.l3_blocks, report.l3_prefixes, report.of_prefixes = (queued["blocks"], queued["prefixes"],
                                                                    queued["of_prefixes"])
    k = core.config.handoff_peer_prefixes if to_peers else 0
    if k:
        offers = await core.loop.run(lambda: [
            PrefixOffer(core.worker_id, p.namespace, p.tokens, p.value)
            for p in recent_prefixes(core.cache.tree, k)])
        report.of_prefixes = report.of_prefixes or len(offers)
        report.peer_prefixes, report.peer_tokens = await _offer_to_peers(ops, offers, deadline)
    if link is not None:
        left = max(0.0, deadline - time.monotonic())
        report.l3_flushed = await asyncio.to_thread(link.tier.flush, left)
    await core.publish_now()   # L3's stored events reach the directory before the worker leaves it
    if leave is not None:
        report.left = await leave()
    report.seconds = time.monotonic() - started
    if directory is not None:
        await directory.note_lifecycle(core.worker_id, "handoff", report.as_dict())
    log.info("worker %s handed off: %s", core.worker_id, report.as_dict())
    return report


async def _offer_to_peers(ops: PeerOps, offers: list[PrefixOffer], deadline: float) -> tuple[int, int]:
    """Spread ``offers`` over the targets, most valuable to the least loaded
    first; each target pulls its share one at a time. (prefixes, tokens) pulled."""
    if not offers:
        return 0, 0
    try:
        targets = await asyncio.wait_for(ops.targets(), max(0.1, deadline - time.monotonic()))
    except Exception as exc:
        log.warning("no hand-off targets (%s): the prefixes go to L3 only", exc)
        return 0, 0
    if not targets:
        return 0, 0
    shares: dict[str, list[PrefixOffer]] = {t: [] for t in targets}
    for i, offer in enumerate(offers):
        shares[targets[i % len(targets)]].append(offer)

    async def pull_share(target: str, share: list[PrefixOffer]) -> tuple[int, int]:
        done = tokens = 0
        for offer in share:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                got = await asyncio.wait_for(ops.ask_pull(target, offer), left)
            except Exception as exc:   # a target that fails gets no more of them
                log.warning("hand-off to %s failed: %s", target, exc)
                break
            done += got > 0
            tokens += got
        return done, tokens

    results = await asyncio.gather(*(pull_share(t, s) for t, s in shares.items() if s))
    return sum(r[0] for r in results), sum(r[1] for r in results)


async def warm_up(core: "WorkerCore", ops: PeerOps, *, budget_s: float, max_bytes: int,
                  max_prefixes: int) -> WarmupReport:
    """See the module docstring. Runs before the worker takes traffic."""
    started = time.monotonic()
    deadline = started + budget_s
    report = WarmupReport()
    if budget_s <= 0 or max_prefixes <= 0:
        return report
    try:
        peers = await asyncio.wait_for(ops.targets(), max(0.1, budget_s / 4))
    except Exception as exc:
        log.warning("warm-up: no peers from the directory (%s); starting cold", exc)
        return report
    report.peers = len(peers)
    if not peers:
        return report

    async def ask(peer: str) -> list[PrefixOffer]:
        try:
            return await asyncio.wait_for(ops.offers(peer, max_prefixes), max(0.1, budget_s / 4))
        except Exception as exc:
            log.warning("warm-up: no offers from %s (%s)", peer, exc)
            return []

    merged: dict[tuple, tuple[float, PrefixOffer]] = {}
    for offers in await asyncio.gather(*(ask(p) for p in peers)):
        report.offers += len(offers)
        for o in offers:   # a prefix several peers hold is worth their sum: the whole cluster uses it
            key = (o.tenant, o.tokens)
            total, first = merged.get(key, (0.0, o))
            merged[key] = (total + o.value, first)
    ranked = sorted(merged.values(), key=lambda vo: -vo[0])[:max_prefixes]
    per_token = core.layout.bytes_per_token()
    link = core.cache.l3
    for _, offer in ranked:
        if time.monotonic() > deadline or report.bytes >= max_bytes:
            break
        tokens, tenant = list(offer.tokens), offer.tenant
        if (len(tokens) * per_token) + report.bytes > max_bytes:
            continue
        got = 0
        if link is not None:
            got = await core.loop.run(lambda: link.fetch_now(tokens, tenant))
            report.l3_tokens += got
        have = await core.loop.run(lambda: sum(core.cache.tree.peek(tokens, tenant, validate=False)[1]))
        if have < len(tokens) - core.config.block_tokens:
            try:
                result = await asyncio.wait_for(
                    core.migrate_from(offer.holder, await ops.link(offer.holder), tokens, tenant),
                    max(0.1, deadline - time.monotonic()))
                report.peer_tokens += result.tokens
                got += result.tokens
            except Exception as exc:
                log.warning("warm-up: pulling from %s failed: %s", offer.holder, exc)
        report.prefixes += got > 0
        report.bytes += got * per_token
    report.seconds = time.monotonic() - started
    log.info("worker %s warmed up: %s", core.worker_id, report.as_dict())
    if core.directory is not None:
        await core.directory.note_lifecycle(core.worker_id, "warmup", report.as_dict())
    return report

