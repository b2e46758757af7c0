"""Scale events in the routing replay: ``prefix-cache replay ... --scale-events SPEC``.

``SPEC`` lists events at simulated times, e.g. ``scale_in@1200,scale_out@2400,kill@3600``
(seconds from the trace's start):

- ``scale_in``: the least loaded replica leaves;
- ``scale_out``: a new, empty replica joins;
- ``kill``: the most loaded replica dies (nothing of it is handed on).

Each run replays the trace once per arm (``--scale-arms``):

- ``elastic``: L3 with write-behind (every committed block reaches L3; a request
  reads the blocks L3 holds past its local prefix at ``--l3-gbps``, and the cost
  policy prices that), hand-off at scale-in (every block of the leaving replica
  to L3 in value order, its ``handoff_peer_prefixes`` most recently used
  sequences to the least loaded survivors, as ``actors.elastic`` offers them), warm-up at scale-out (the survivors' most valuable shared
  prefixes);
- ``baseline``: none of it: a replica's cache is its own and goes with it;
- ``handoff_value`` / ``handoff_lru``: no write-behind, and a hand-off that may
  write only ``--handoff-blocks`` blocks to L3, in value order
  (``cluster.cache.prefix_value``) or in plain LRU order (most recent first):
  what the order is worth when the budget runs out.

One ``replay_scale`` line per arm and event: requests, recomputed tokens, hit
rate, L3's share and TTFT p99 in the ``--scale-window-s`` after the event and
in the same length before it, what the hand-off and warm-up moved.
"""

from __future__ import annotations

import argparse
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

from cluster.cache.prefix_value import recent_prefixes, shared_prefixes, valuable_prefixes
from cluster.cache.tiered import TierConfig
from cluster.errors import InvalidInputError
from cluster.hashing import block_hashes
from lab.bench.common import emit, percentile, rounded
from lab.bench.replay_model import LatencyModel, Replica, ServiceModel

EVENT_KINDS = ("scale_in", "scale_out", "kill")
ARMS = ("elastic", "baseline", "handoff_value", "handoff_lru")
HANDOFF_PEER_PREFIXES = 16
WARMUP_PREFIXES = 32


def parse_events(spec: str) -> list[tuple[float, str]]:
    """``kind@seconds,...`` -> [(seconds, kind)], in time order."""
    out = []
    for item in spec.split(","):
        kind, _, at = item.strip().partition("@")
        if kind not in EVENT_KINDS:
            raise InvalidInputError(f"--scale-events: unknown event {kind!r}; choose from {', '.join(EVENT_KINDS)}")
        try:
            t = float(at)
        except ValueError:
            raise InvalidInputError(f"--scale-events: {item!r} needs a time in seconds, e.g. {kind}@1200") from None
        if t < 0:
            raise InvalidInputError(f"--scale-events: {item!r} is before the trace starts")
        out.append((t, kind))
    return sorted(out)


@dataclass
class _Window:
    requests: int = 0
    tokens: int = 0
    cached: int = 0
    l3: int = 0
    ttft_ms: list[float] = field(default_factory=list)

    def add(self, tokens: int, cached: int, l3: int, ttft_ms: float) -> None:
        self.requests += 1
        self.tokens += tokens
        self.cached += cached
        self.l3 += l3
        self.ttft_ms.append(ttft_ms)

    def row(self, suffix: str) -> dict:
        return {f"requests_{suffix}": self.requests, f"recomputed_tokens_{suffix}": self.tokens - self.cached,
                f"hit_rate_{suffix}": rounded(self.cached / self.tokens, 4) if self.tokens else None,
                f"l3_hit_rate_{suffix}": rounded(self.l3 / self.tokens, 4) if self.tokens else None,
                f"ttft_ms_p99_{suffix}": rounded(percentile(self.ttft_ms, 99), 1) if self.ttft_ms else None}


class ScaleEvents:
    """The scale events of one replay run, and L3 (``lab.bench.replay`` calls it)."""

    def __init__(self, events: list[tuple[float, str]], arm: str, *, window_s: float, l3_blocks: int,
                 handoff_blocks: int | None, make_replica):
        if arm not in ARMS:
            raise InvalidInputError(f"--scale-arms: unknown arm {arm!r}; choose from {', '.join(ARMS)}")
        self.events = list(events)
        self.arm = arm
        self.window_s = window_s
        self.write_behind = arm == "elastic"
        self.l3_on = arm != "baseline"
        self.handoff_budget = None if arm == "elastic" else handoff_blocks
        self.make_replica = make_replica   # (worker_id) -> Replica
        self.l3: OrderedDict[int, None] = OrderedDict()   # chained hashes L3 holds, oldest first
        self.l3_capacity = l3_blocks
        self._next = 0
        self._added = 0
        self.done: list[dict] = []          # per event applied: what it did
        # Per event: the windows before and after it (a request counts by its arrival time).
        self._windows = [(at, _Window(), _Window()) for at, _ in self.events]

    # ------------------------------------------------------------- events
    def before(self, now: float, sim: Any) -> None:
        """Apply every event due by ``now`` to the simulation (``sim``: servers, states,
        by_id, indexes, the delivery queue)."""
        while self._next < len(self.events) and self.events[self._next][0] <= now:
            at, kind = self.events[self._next]
            self._next += 1
            alive = [(r, st) for r, st in zip(sim.servers, sim.states) if st.alive]
            facts = {"event": kind, "at_s": at, "replicas_before": len(alive)}
            if kind == "scale_out":
                facts |= self._add(sim, alive)
            elif len(alive) > 1:
                key = (lambda rs: rs[1].queued_tokens) if kind == "scale_in" else (lambda rs: -rs[1].queued_tokens)
                victim, state = min(alive, key=key)
                if kind == "scale_in" and self.arm != "baseline":
                    facts |= self._hand_off(sim, victim, [rs for rs in alive if rs[0] is not victim])
                state.alive = False
                for index in sim.indexes:
                    index.drop_worker(victim.worker_id)
            facts["replicas_after"] = sum(st.alive for st in sim.states)
            self.done.append(facts)

    def _add(self, sim: Any, alive: list) -> dict:
        self._added += 1
        replica = self.make_replica(f"new{self._added}")
        sim.servers.append(replica)
        sim.states.append(sim.new_state(replica.worker_id))
        sim.by_id[replica.worker_id] = replica
        for index in sim.indexes:
            index.register_worker(replica.worker_id)
        if self.arm != "elastic":
            return {"warmup_blocks": 0}
        # Warm-up: the survivors' most valuable shared prefixes, summed over the replicas that hold them.
        merged: dict[tuple, float] = {}
        for r, _ in alive:
            for p in shared_prefixes(r.cache.tree, WARMUP_PREFIXES):
                merged[p.tokens] = merged.get(p.tokens, 0.0) + p.value
        room = replica.cache.hot.allocator.capacity_tokens // 2
        moved = 0
        for tokens, _ in sorted(merged.items(), key=lambda kv: -kv[1])[:WARMUP_PREFIXES]:
            if moved + len(tokens) > room:
                continue
            moved += _install(replica, tokens)
        sim.publish(replica)
        return {"warmup_blocks": moved}

    def _hand_off(self, sim: Any, victim: Any, survivors: list) -> dict:
        tree = victim.cache.tree
        order = valuable_prefixes(tree)
        if self.arm == "handoff_lru":
            order.sort(key=lambda p: p.idle_s)
        budget = self.handoff_budget
        written = 0
        for p in order:
            if budget is not None and written >= budget:
                break
            hashes = block_hashes(p.tokens, 1)
            new = [h for h in hashes if h not in self.l3]
            if budget is not None:
                new = new[:budget - written]
            self._store(new, sim)
            written += len(new)
        peers = sorted(survivors, key=lambda rs: rs[1].queued_tokens)
        pulled = 0
        # The peers pull the sessions under way (most recent first), as the product offers them.
        for i, p in enumerate(recent_prefixes(tree, HANDOFF_PEER_PREFIXES)):
            if not peers:
                break
            target = peers[i % len(peers)][0]
            pulled += _install(target, p.tokens)
        for r, _ in peers:
            sim.publish(r)
        return {"handoff_l3_blocks": written, "handoff_peer_blocks": pulled}

    # ----------------------------------------------------------------- L3
    def _store(self, hashes: list[int], sim: Any) -> None:
        if not hashes:
            return
        l3 = self.l3
        for h in hashes:
            l3[h] = None
            l3.move_to_end(h)
        evicted = []
        while len(l3) > self.l3_capacity:
            evicted.append(l3.popitem(last=False)[0])
        for index in sim.indexes:   # the writer's events (the directory's L3 set, as in production)
            index.note_l3("stored", hashes)
            if evicted:
                index.note_l3("removed", evicted)

    def committed(self, hashes: list[int], sim: Any) -> None:
        """A request's whole chain is in its replica's tree: write behind."""
        if self.write_behind:
            self._store([h for h in hashes if h not in self.l3], sim)

    def extend(self, hashes: list[int], have: int) -> int:
        """Blocks past ``have`` that L3 holds (read before the prefill)."""
        if not self.l3_on:
            return 0
        l3, n = self.l3, have
        while n < len(hashes) and hashes[n] in l3:
            n += 1
        return n - have

    # -------------------------------------------------------------- windows
    def record(self, now: float, tokens: int, cached: int, l3: int, ttft_ms: float) -> None:
        for at, before, after in self._windows:
            if at - self.window_s <= now < at:
                before.add(tokens, cached, l3, ttft_ms)
            elif at <= now < at + self.window_s:
                after.add(tokens, cached, l3, ttft_ms)

    def rows(self, base: dict) -> list[dict]:
        return [{**base, "bench": "replay_scale", "arm": self.arm, **facts, "window_s": self.window_s,
                 **before.row("before"), **after.row("after")}
                for facts, (_, before, after) in zip(self.done, self._windows)]


def _install(replica: Any, tokens: tuple[int, ...]) -> int:
    """Cache ``tokens`` on ``replica`` (a pull or a fetch): the blocks it lacked."""
    cache = replica.cache
    lease = cache.admit(list(tokens), compute_last=False, validate=False)
    try:
        new = len(tokens) - lease.cached_tokens
        if new > 0:
            lease.extend(new)
            lease.commit(list(tokens))
        return max(new, 0)
    except Exception:   # no room (HOT full of locked work): not pulled
        return 0
    finally:
        lease.release()


def run_scale_events(args: argparse.Namespace, names: list[str], latency: LatencyModel, seeds: list[int], *,
                     records_of: Callable[[argparse.Namespace, int], list], run_policy: Callable[..., dict]) -> int:
    """``--scale-events``: every policy under every arm of ``--scale-arms`` (see this module's
    docstring), one replay line and one replay_scale line per event each. ``records_of`` and
    ``run_policy`` are ``lab.bench.replay``'s (it calls this; this module does not import it)."""

    events = parse_events(args.scale_events)
    arms = args.scale_arms.split(",")
    per = args.hot_blocks + args.warm_blocks + args.cold_blocks
    l3_blocks = args.l3_blocks or args.replicas * (args.hot_blocks + args.warm_blocks)
    handoff = args.handoff_blocks if args.handoff_blocks is not None else per // 8
    if args.scale_window_s <= 0 or args.l3_gbps <= 0 or l3_blocks <= 0 or handoff < 0:
        raise InvalidInputError("--scale-window-s, --l3-gbps and --l3-blocks must be positive, --handoff-blocks >= 0")
    tiers = TierConfig(hot_blocks=args.hot_blocks, warm_blocks=args.warm_blocks, cold_blocks=args.cold_blocks,
                       block_tokens=1, device="cpu")
    for seed in seeds:
        records = records_of(args, seed)
        hash_chains = [block_hashes(r.hash_ids, 1) for r in records]
        noise = None if args.oracle else ServiceModel.draws(len(records), args.service_noise, seed)
        for name in names:
            for arm in arms:
                scale = ScaleEvents(events, arm, window_s=args.scale_window_s, l3_blocks=l3_blocks,
                                    handoff_blocks=handoff, make_replica=lambda wid: Replica(wid, tiers))
                res = run_policy(name, records, hash_chains, args, latency, noise=noise, scale=scale)
                res["arm"] = arm
                if not args.trace:
                    res["seed"] = seed
                emit(res)
                base = {"policy": name, "information": res["information"], "replicas": args.replicas,
                        **({} if args.trace else {"seed": seed})}
                for row in scale.rows(base):
                    emit(row)
    return 0
