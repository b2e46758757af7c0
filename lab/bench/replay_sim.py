"""One routing policy replayed over a trace (``prefix-cache replay``): the simulated cluster's
event loop, its replicas' tiers and queues, the directory's view, and each request's figures."""

from __future__ import annotations

import gc
import heapq
import math
import time
from dataclasses import replace
from types import SimpleNamespace

from cluster.cache.radix_tree import COLD, HOT, WARM
from cluster.cache.tiered import TierConfig
from cluster.errors import InvalidInputError, PoolExhaustedError
from cluster.routing.events import EVENT_INTERVAL_S
from cluster.routing.index import GlobalIndex
from cluster.routing.policies import CostModel, WorkerState, make_policy
from cluster.routing.policies.baselines import DEFAULT_APPROX_TREE_DEFAULTS
from cluster.trace import TraceRecord
from lab.bench.common import percentile, rounded
from lab.bench.replay_elastic import ScaleEvents
from lab.bench.replay_model import (
    LatencyModel,
    Replica,
    ServiceModel,
    _tiers_between,
)

_CLOCKED = ("approx_tree", "ray_prefix", "cost")   # policies that take the simulated clock


def run_policy(name: str, records: list[TraceRecord], hash_chains: list[list[int]], args,
               latency: LatencyModel, believed: CostModel | None = None, noise: list | None = None,
               scale: "ScaleEvents | None" = None) -> dict:
    """Replay ``records`` (``hash_chains[i]``: the routing hashes of record i) under one policy.

    ``believed``: the cost model the policy is given (default: the calibrated one
    built from the latency constants), to measure what misestimated constants cost.
    ``noise``: the per-request service-time draws (``ServiceModel.draws``; default
    drawn from ``--seed``), shared by every policy of a run.
    ``scale``: scale events and L3 (``lab.bench.replay_elastic``): it changes the
    replicas as the trace reaches each event and reports the windows around them."""
    replay = _PolicyReplay(name, len(records), args, latency, believed, noise, scale)
    # The simulated replicas' trees make a big heap: automatic collections
    # would land inside the timed choose() calls. Collect between requests.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for k, (rec, hashes) in enumerate(zip(records, hash_chains)):
            if k % 20_000 == 19_999:
                gc.collect()
            replay.request(k, rec, hashes)
    finally:
        if gc_was_enabled:
            gc.enable()
    return replay.summary()


class _PolicyReplay:
    """One policy's run over a trace: the simulated replicas, each router's policy and
    index copy, the event batches in flight, and what the run counts."""

    def __init__(self, name: str, n_records: int, args, latency: LatencyModel, believed: CostModel | None,
                 noise: list | None, scale: "ScaleEvents | None"):
        self.name, self.args, self.scale = name, args, scale
        self.bt, self.R = args.block_tokens, args.replicas
        cost = latency.cost_model(self.bt)
        self.oracle = bool(getattr(args, "oracle", False))
        self.interval = getattr(args, "report_interval_ms", EVENT_INTERVAL_S * 1e3) / 1e3
        self.decode_s = getattr(args, "decode_ms_per_token", 20.0) / 1e3
        if not self.oracle and (self.interval <= 0 or self.decode_s < 0):
            raise InvalidInputError("--report-interval-ms must be positive and --decode-ms-per-token >= 0")
        self.service_model = None
        if not self.oracle:
            if noise is None:
                noise = ServiceModel.draws(n_records, getattr(args, "service_noise", 0.15), getattr(args, "seed", 0))
            self.service_model = ServiceModel(cost, getattr(args, "attention_tokens", 30_500.0), noise)
        self.ideal = name == "ideal"
        self._make_replicas()
        if scale is None and latency.l3_gbps:
            latency = LatencyModel(*(getattr(latency, f) for f in ("prefill_tokens_per_s", "kv_bytes_per_token",
                                                                    "h2d_gbps", "disk_gbps", "transfer_gbps")))
            cost = latency.cost_model(self.bt)   # no L3 without scale events: the policy does not price it
        self.cost = cost
        self.now = 0.0
        self._make_routers(believed)
        self.deliveries: list = []        # heap of (due, order, replica, batch): in order per replica
        self.delivery_order = 0
        self.delay = args.event_delay_ms / 1e3
        self.prefill_rate = cost.prefill_tokens_per_s
        self.ttft: list[float] = []
        self.tot = self.hit = self.migrated = 0
        self.tier_hits = [0, 0, 0]
        n = self.nrouters
        self.choose_s, self.apply_s = [0.0] * n, [0.0] * n
        self.pending_apply = [0.0] * n     # events a router applied since its last decision
        self.lat_us: list[float] = []
        self.staged_s = 0.0
        self.reasons: dict[str, int] = {}
        self.uncacheable = 0
        self.wall0 = time.perf_counter()
        self.sim = self._scale_view() if scale is not None else None

    def _make_replicas(self) -> None:
        args, R = self.args, self.R
        per = TierConfig(hot_blocks=args.hot_blocks, warm_blocks=args.warm_blocks, cold_blocks=args.cold_blocks,
                         block_tokens=1, device="cpu")
        self.shared = None
        if self.ideal:
            self.shared = Replica("global", TierConfig(hot_blocks=R * args.hot_blocks, warm_blocks=R * args.warm_blocks,
                                                       cold_blocks=R * args.cold_blocks, block_tokens=1, device="cpu"))
        self.servers = [Replica(f"r{i}", per) for i in range(R)]
        for i, r in enumerate(self.servers):   # report clocks spread over the interval, the same in every run
            r.phase = self.interval * ((i * 0.618034) % 1.0)
        self.by_id = {r.worker_id: r for r in self.servers}
        self.states = [WorkerState(r.worker_id, 0, 0) for r in self.servers]

    def _make_routers(self, believed: CostModel | None) -> None:
        """One policy and one index copy per router (TableReplica in production):
        every copy applies every event batch, each router decides its share."""
        args, name = self.args, self.name
        nrouters = getattr(args, "routers", 1)
        if not isinstance(nrouters, int) or nrouters < 1:
            raise InvalidInputError(f"--routers must be a positive integer, got {nrouters!r}")
        self.nrouters = nrouters
        self.indexes = [GlobalIndex() for _ in range(nrouters)]
        for index in self.indexes:
            for r in ([self.shared] if self.ideal else self.servers):
                index.register_worker(r.worker_id)
        self.overrides = _policy_overrides(args, name)
        kw = {"cost": believed or self.cost} | self.overrides
        if name == "approx_tree":
            kw["defaults"] = getattr(args, "approx_tree_defaults", DEFAULT_APPROX_TREE_DEFAULTS)
        if name in _CLOCKED:
            kw["clock"] = lambda: self.now
        if self.scale is not None and not self.scale.l3_on:
            kw["cost"] = replace(kw["cost"], l3_fetch_tokens_per_s=0.0)
        self.policies = [make_policy(name, **kw) for _ in range(nrouters)]
        if nrouters > 1:   # each router breaks exact ties from its own place, as deployed routers do
            for i, policy in enumerate(self.policies):
                policy.tie_salt = 1 + i * 7919

    def _scale_view(self) -> SimpleNamespace:
        """What the scale events change: the replicas, their states and the index copies."""
        def new_state(worker_id: str) -> WorkerState:
            r = self.by_id.get(worker_id)
            if r is not None:
                r.phase = self.interval * ((len(self.servers) * 0.618034) % 1.0)
            return WorkerState(worker_id, 0, 0)

        def publish(replica) -> None:   # its pending events, sent now (after a hand-off or warm-up)
            self._send(replica.publisher.drain(), replica, self.now + self.delay)

        return SimpleNamespace(servers=self.servers, states=self.states, by_id=self.by_id, indexes=self.indexes,
                               new_state=new_state, publish=publish)

    def _send(self, batch, replica, due_at: float) -> None:
        if batch is not None:
            heapq.heappush(self.deliveries, (due_at, self.delivery_order, replica, batch))
            self.delivery_order += 1

    def request(self, k: int, rec: TraceRecord, hashes: list[int]) -> None:
        """Route record ``k`` and serve it on the chosen replica."""
        now = self.now = rec.timestamp / 1e3 * self.args.time_scale
        if self.scale is not None:
            self.scale.before(now, self.sim)
        self._apply_due_events(now)
        self._refresh_loads(now)
        d = self._decide(k, rec, hashes)
        server = self.by_id[d.worker_id]
        if not self.oracle:   # the directory counts what it sent until the worker's next report (RoutingTable.route)
            st = self.states[self.servers.index(server)]
            st.queued_tokens += max(0, rec.input_length - d.cached_tokens)
        self._serve(k, rec, hashes, d, server)

    def _apply_due_events(self, now: float) -> None:
        due = []
        while self.deliveries and self.deliveries[0][0] <= now:
            due.append(heapq.heappop(self.deliveries))
        if not due:
            return
        for i, index in enumerate(self.indexes):
            t0 = _cpu()
            for _, _, rep, batch in due:
                if index.apply(batch) in ("gap", "resync"):
                    snapshot = rep.publisher.snapshot()
                    index.load_snapshot(rep.worker_id, snapshot.seq, snapshot.entries)
            applied = _cpu() - t0
            self.apply_s[i] += applied
            self.pending_apply[i] += applied

    def _refresh_loads(self, now: float) -> None:
        for r, st in zip(self.servers, self.states):
            r.advance(now)
            if self.oracle:   # the exact simulated drain time
                st.queued_tokens = int(max(0.0, r.free_at - now) * self.prefill_rate)
                st.running = len(r.finishes)
                continue
            # The newest report that reached the directory: sent at the replica's last tick
            # before now - delay. It replaces the directory's view, bumps included.
            tick = math.floor((now - self.delay - r.phase) / self.interval) * self.interval + r.phase
            if tick != r.seen_tick:
                r.seen_tick = tick
                st.queued_tokens, st.running = r.report(tick) if tick >= 0 else (0, 0)

    def _decide(self, k: int, rec: TraceRecord, hashes: list[int]):
        router = k % self.nrouters
        t0 = _cpu()
        d = self.policies[router].choose(hashes, rec.input_length, self.states, self.indexes[router])
        dt = _cpu() - t0
        self.choose_s[router] += dt
        self.lat_us.append((dt + self.pending_apply[router]) * 1e6)
        self.pending_apply[router] = 0.0
        self.reasons[d.reason] = self.reasons.get(d.reason, 0) + 1
        return d

    def _pull(self, k: int, ids: list[int], d, usable: int) -> tuple[int, int, float]:
        """Blocks pulled from the holder the decision names: (pulled, of them COLD, staging seconds)."""
        if d.migrate_from is None or self.ideal or usable >= len(ids):
            return 0, 0, 0.0
        holder = self.by_id[d.migrate_from]
        sm = holder.cache.tree.match_prefix(ids, validate=False)
        pulled = max(0, min(sm.length, usable + d.migrate_blocks) - usable)
        if not pulled:
            return 0, 0, 0.0
        tiers = _tiers_between(sm.nodes, usable, usable + pulled)
        # The holder stages its HOT blocks into host blocks first, between its
        # own batches: its queue is delayed by that, and the target waits for it.
        stage = self.cost.stage_s(tiers[HOT])
        if self.service_model is not None:
            stage *= self.service_model.noise[k][2]
        if stage:
            holder.advance(self.now)
            holder.free_at = max(holder.free_at, self.now) + stage
            holder.busy_s += stage
            self.staged_s += stage
        return pulled, tiers[COLD], stage

    def _serve(self, k: int, rec: TraceRecord, hashes: list[int], d, server) -> None:
        now, bt, ids = self.now, self.bt, rec.hash_ids
        rep = self.shared if self.ideal else server
        lease = rep.cache.admit(ids, compute_last=False, validate=False)
        usable = lease.cached_tokens            # HOT after promotion
        # Tiers before promotion; a promotion that found no room leaves only the HOT part usable.
        local_tiers = list(lease.tier_hits)
        pulled, pulled_cold, stage = self._pull(k, ids, d, usable)
        # L3 holds blocks past what the replica has and pulled: read before the prefill
        # (like pulled blocks, they enter the tree with the request's own at its commit).
        l3_blocks = self.scale.extend(hashes, usable + pulled) if self.scale is not None else 0
        n_new = len(ids) - usable
        if n_new:
            try:
                lease.extend(n_new)
                lease.commit(ids)
            except PoolExhaustedError:
                self.uncacheable += 1   # longer than what the HOT tier can hold: served, not cached
        lease.release()
        cached_tok = min((usable + pulled + l3_blocks) * bt, rec.input_length)
        local_tok = min(usable * bt, rec.input_length)
        l3_s = l3_blocks * bt / self.cost.l3_fetch_tokens_per_s if l3_blocks else 0.0
        service = self._service_s(k, rec, local_tiers, stage, self.cost.transfer_s(pulled, pulled_cold), l3_s,
                                  cached_tok)
        start = max(now, server.free_at)
        server.free_at = start + service
        server.finishes.append(server.free_at)
        server.busy_s += service
        if self.oracle or self.ideal:   # sent when routed (ideal's one shared publisher must stay in order)
            due_at = now + self.delay
        else:   # checkpointed when its prefill ends, sent on the replica's next tick
            due_at = (math.ceil((server.free_at - server.phase) / self.interval) * self.interval + server.phase
                      + self.delay)
        self._send(rep.publisher.drain(), rep, due_at)
        if not self.oracle:
            server.add_job(now, start, server.free_at, server.free_at + self.decode_s * rec.output_length,
                           rec.input_length, rec.output_length)
        self.ttft.append((server.free_at - now) * 1e3)
        l3_tok = min(l3_blocks * bt, cached_tok - local_tok)
        if self.scale is not None:
            self.scale.committed(hashes, self.sim)
            self.scale.record(now, rec.input_length, cached_tok, l3_tok, self.ttft[-1])
        self._count(rec.input_length, cached_tok, local_tok, l3_tok, local_tiers)

    def _service_s(self, k: int, rec: TraceRecord, local_tiers: list[int], stage: float, transfer_s: float,
                   l3_s: float, cached_tok: int) -> float:
        """The request's service time: promotion, staging, pulls and L3 reads, prefill."""
        cost = self.cost
        if self.service_model is None:   # oracle: the policy's own formulas
            return (cost.promote_s(local_tiers[WARM], local_tiers[COLD]) + stage + transfer_s + l3_s
                    + cost.prefill_s(max(1, rec.input_length - cached_tok)))
        draw = self.service_model.noise[k]
        return (cost.promote_s(local_tiers[WARM], local_tiers[COLD]) * draw[1] + stage
                + (transfer_s + l3_s) * draw[3]
                + self.service_model.prefill_s(k, rec.input_length - cached_tok, cached_tok))

    def _count(self, tokens: int, cached_tok: int, local_tok: int, l3_tok: int, local_tiers: list[int]) -> None:
        bt = self.bt
        self.tot += tokens
        self.hit += cached_tok
        self.migrated += cached_tok - local_tok - l3_tok
        hot_tok = min(local_tiers[HOT] * bt, local_tok)
        warm_tok = min((local_tiers[HOT] + local_tiers[WARM]) * bt, local_tok) - hot_tok
        self.tier_hits[HOT] += hot_tok
        self.tier_hits[WARM] += warm_tok
        self.tier_hits[COLD] += local_tok - hot_tok - warm_tok

    def summary(self) -> dict:
        """The run's JSON line."""
        R, tot, tier_hits, ttft = self.R, self.tot, self.tier_hits, self.ttft
        choose_s, apply_s = self.choose_s, self.apply_s
        end = max([self.now] + [r.free_at for r in self.servers])
        for r in self.servers:
            r.advance(end)
        areas = [r.area for r in self.servers]
        busy = [r.busy_s for r in self.servers]
        n = len(ttft)
        out = {"bench": "replay", "policy": self.name, "information": "oracle" if self.oracle else "production",
               "records": n, "replicas": R,
               "hit_rate": rounded(self.hit / tot if tot else 0.0),
               "hot_hit_rate": rounded(tier_hits[HOT] / tot if tot else 0.0),
               "warm_hit_rate": rounded(tier_hits[WARM] / tot if tot else 0.0),
               "migrated_rate": rounded(self.migrated / tot if tot else 0.0),
               "load_imbalance": rounded(max(areas) / (sum(areas) / R)) if sum(areas) else 1.0,
               "ttft_ms_p50": rounded(percentile(ttft, 50), 1), "ttft_ms_p99": rounded(percentile(ttft, 99), 1),
               "decisions_per_s": round(n / sum(choose_s)) if sum(choose_s) else 0,
               # choose() plus one index copy's event batches, per decision
               "directory_decisions_per_s": (round(n / (sum(choose_s) + sum(apply_s) / self.nrouters))
                                             if sum(choose_s) + sum(apply_s) else 0),
               "decision_us_p99": rounded(percentile(self.lat_us, 99), 1), "decision_clock": "thread_time",
               "routers": self.nrouters,
               # What the routers sustain together, each on its own core applying every
               # event batch: the busiest router's CPU time bounds the rate.
               "aggregate_decisions_per_s": (round(n / max(c + a for c, a in zip(choose_s, apply_s)))
                                             if sum(choose_s) + sum(apply_s) else 0)}
        if self.args.cold_blocks:
            out["cold_hit_rate"] = rounded(tier_hits[COLD] / tot if tot else 0.0)
        out |= {"ttft_ms_mean": rounded(sum(ttft) / n if n else 0.0, 1),
                "busy_imbalance": rounded(max(busy) / (sum(busy) / R)) if sum(busy) else 1.0,
                "utilization": rounded(sum(busy) / (R * end)) if end else 0.0,
                "reasons": self.reasons, "uncacheable_requests": self.uncacheable,
                "staging_s": rounded(self.staged_s, 2),
                "index": {k: self.indexes[0].stats[k] for k in ("batches", "gaps", "resyncs")},
                "sim_seconds": rounded(end, 1), "wall_seconds": rounded(time.perf_counter() - self.wall0, 1)}
        if self.overrides:
            out["policy_args"] = self.overrides   # what --policy-arg changed for this policy
        if self.name == "approx_tree":   # which router release the port followed
            out["approx_tree_defaults"] = self.policies[0].defaults
            out["approx_tree_source"] = self.policies[0].source
        return out


# CPU time of this thread, not wall time: the machine is shared, and wall
# time would count other processes' turns on the core as decision time.
_cpu = time.thread_time


def _policy_overrides(args, name: str) -> dict:
    out = {}
    for item in getattr(args, "policy_arg", None) or []:
        key, _, value = item.partition("=")
        pol, _, param = key.rpartition(".")
        if pol in ("", name):
            out[param] = float(value) if "." in value or "e" in value else int(value)
    return out
