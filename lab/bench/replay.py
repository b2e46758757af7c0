"""``prefix-cache replay``: routing policies on a request trace, side by side.

Drives the real routing layer (``GlobalIndex``, the policies, one
``TieredCache`` per replica in payload-free simulation mode, KV events through
``KVEventPublisher``) through a Mooncake-format trace in simulated time, once
per policy, and prints one JSON line per policy.

Model of a replica. Its cache is a block-level radix tree: each trace hash id
is one "token" of a tree with ``block_tokens=1``, so capacities are in blocks
(``--hot-blocks`` device, ``--warm-blocks`` host, ``--cold-blocks`` disk,
watermark demotion HOT -> WARM -> COLD as in production). Its compute is one
FIFO server: a request starts when the previous one is done and takes

    promotion of its WARM/COLD hit blocks + pull of migrated blocks
    + prefill of the tokens not cached (at least one)

Latency constants (flags; defaults for Llama-3-8B in bf16 on one H100-class GPU):
- prefill 10,000 tokens/s per replica (``--prefill-tokens-per-s``);
- KV bytes per token 131,072 = 32 layers x 2 (K, V) x 8 KV heads x 128 dims
  x 2 bytes (``--kv-bytes-per-token``);
- host -> device 20 GB/s (``--h2d-gbps``): WARM promotion ~152,600 tokens/s;
- disk read 3 GB/s then host -> device (``--disk-gbps``): COLD ~19,900 tokens/s;
- replica -> replica transfer 10 GB/s (``--transfer-gbps``, NIXL/RDMA): ~76,300 tokens/s.
Decode is not modeled as compute (the server does prefill only), so TTFT =
queueing + promotion + transfer + prefill. The cost policy is given these
constants, as a worker's calibration would measure them.

Information (every line says which: ``"information"``).

``production`` (the default): what a deployed router really knows.
- Load: each replica sends ``(queued_tokens, running)`` as the engine computes
  it (``EngineLoop.measure_load``): waiting requests count their whole prompt,
  running ones their remaining output tokens; a request runs from its start
  until ``output_length x --decode-ms-per-token`` after its prefill. Reports
  leave every ``--report-interval-ms`` (20 ms, the workers' event interval; the
  replicas' clocks are offset) and arrive ``--event-delay-ms`` later; between
  two reports the router adds what it sent there itself (``RoutingTable.route``).
- KV events: a request's blocks are checkpointed when its prefill ends (as the
  engine checkpoints prompts) and leave on the replica's next report tick.
- Service times are the simulator's own (``ServiceModel``), not the policy's
  formulas: a prefill token's cost grows with its context as attention does
  (``--attention-tokens``), and every time gets lognormal noise
  (``--service-noise``), the same draws for every policy.

``oracle`` (``--oracle``, the replay before production information): each
replica's ``queued_tokens`` is its exact simulated drain time x the prefill
rate, ``running`` its requests not finished, a request's KV events leave when
it is routed, and service times are the cost policy's own formulas.

Model of the directory. A replica's batch of events reaches the index
``--event-delay-ms`` after it leaves; a gap or resync reloads the replica's
snapshot. The cache effects of a request (match, promotion, pull, insert of its
blocks) are applied to the replica's own tree when it is routed, in its FIFO
order (its KV is reserved at once, as a real engine reserves a running
request's blocks); only what the index learns waits for the events. Only the policies' ``choose`` calls are
timed for ``decisions_per_s``, in CPU time of the replaying thread
(``time.thread_time``), so other processes on a shared machine do not count;
``directory_decisions_per_s`` and ``decision_us_p99`` add the event batches
applied before each decision. With ``--routers N`` each of N routers has its
own policy and its own copy of the index, every copy applies every batch,
and request k is decided by router k mod N (as ingress replicas following
the directory's log do); ``aggregate_decisions_per_s`` is the decisions over
the busiest router's CPU time, what the N routers sustain on N cores.

Metrics:
- ``hit_rate``: input tokens served from any cache tier, local or pulled, over
  all input tokens; ``hot_hit_rate``/``warm_hit_rate``/``cold_hit_rate`` split
  the local hits, ``migrated_rate`` is the pulled part;
- ``load_imbalance``: max over replicas of the *time-averaged* queued work
  (tokens of prefill-equivalent waiting or running) divided by its mean over
  replicas; ``busy_imbalance`` the same for total service time;
- TTFT percentiles over all requests.

``ideal`` (upper bound): one global cache of R x (H, W, C) blocks that every
replica reads for free, each request served on the least loaded replica.

Without ``--trace`` the trace is synthetic (``synthetic_chat_trace``):
100,000 requests at 20 per second (83 minutes); 40 system prompts of 500 to
3,000 tokens picked with Zipf(1) popularity; 20% single requests, the other
sessions a geometric number of turns (mean 8); user messages ~250 and replies
~450 tokens (lognormal medians); think time exponential, mean 60 s. Mean input
8,700 tokens, close to Mooncake's published traces. Default capacity per
replica: 512 HOT blocks (256k tokens: 32 GiB of Llama-3-8B KV) and 2,560 WARM
blocks (160 GiB of host memory).
"""

from __future__ import annotations

import argparse
import gc
import heapq
import math
import time
from dataclasses import replace
from types import SimpleNamespace

from cluster.cache.radix_tree import COLD, HOT, WARM
from cluster.cache.tiered import TierConfig
from cluster.errors import InvalidInputError, PoolExhaustedError
from cluster.hashing import block_hashes
from cluster.routing.events import EVENT_INTERVAL_S
from cluster.routing.index import GlobalIndex
from cluster.routing.policies import POLICIES, RATE_FIELDS, CostModel, WorkerState, make_policy
from cluster.routing.policies.baselines import APPROX_TREE_DEFAULTS, DEFAULT_APPROX_TREE_DEFAULTS
from cluster.trace import MOONCAKE_BLOCK_TOKENS, TraceRecord, load_trace
from lab.bench.common import emit, percentile, rounded
from lab.bench.replay_elastic import ScaleEvents, run_scale_events

# The trace and the model of a replica; Replica, ServiceModel and synthetic_chat_trace are re-exported.
from lab.bench.replay_model import (  # noqa: F401
    LatencyModel,
    Replica,
    ServiceModel,
    _tiers_between,
    synthetic_chat_trace,
)
from lab.bench.replay_report import plot, seed_summary
from lab.bench.traces import SHAPES, shape_trace

ORDER = ("round_robin", "least_loaded", "prefix", "approx_tree", "ray_prefix", "cost", "ideal")
_CLOCKED = ("approx_tree", "ray_prefix", "cost")   # policies that take the simulated clock


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default=None, help="Mooncake JSONL trace (default: a synthetic chat trace)")
    p.add_argument("--format", default="mooncake", choices=["mooncake"])
    p.add_argument("--block-tokens", type=int, default=MOONCAKE_BLOCK_TOKENS, help="tokens per hash id (512)")
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--hot-blocks", type=int, default=512, help="device blocks per replica (512)")
    p.add_argument("--warm-blocks", type=int, default=2560, help="host blocks per replica (2,560)")
    p.add_argument("--cold-blocks", type=int, default=0, help="disk blocks per replica")
    p.add_argument("--records", type=int, default=None, help="replay the first N records (synthetic: 100,000)")
    p.add_argument("--policy", default="all", help=f"one of {', '.join(ORDER)}, or a comma list, or all")
    p.add_argument("--rate", type=float, default=20.0, help="synthetic trace: requests per second (20)")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival times (< 1: more load)")
    p.add_argument("--event-delay-ms", type=float, default=20.0, help="worker -> directory event latency")
    p.add_argument("--prefill-tokens-per-s", type=float, default=10_000.0)
    p.add_argument("--kv-bytes-per-token", type=int, default=131_072)
    p.add_argument("--h2d-gbps", type=float, default=20.0)
    p.add_argument("--disk-gbps", type=float, default=3.0)
    p.add_argument("--transfer-gbps", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", default=None, metavar="S[,S...]",
                   help="generated traces only: replay every policy on the trace of each seed, then print one "
                        "replay_seeds line per policy (mean, min, max over the seeds, and per seed against "
                        "every other policy in the run)")
    p.add_argument("--policy-arg", action="append", metavar="[POLICY.]NAME=VALUE",
                   help="override a policy parameter, e.g. cost.dup_weight=0.5 (repeatable)")
    p.add_argument("--approx-tree-defaults", choices=list(APPROX_TREE_DEFAULTS), default=DEFAULT_APPROX_TREE_DEFAULTS,
                   help="the SGLang router release whose defaults and rules the approx_tree baseline follows ("
                        + "; ".join(f"{k}: {d.source}" for k, d in APPROX_TREE_DEFAULTS.items())
                        + f"; default {DEFAULT_APPROX_TREE_DEFAULTS}); --policy-arg values still override single ones")
    p.add_argument("--plot", default=None, help="write hit rate and p99 TTFT per policy to this PNG")
    p.add_argument("--shape", default=None, choices=[*SHAPES, "mixed"],
                   help="synthetic trace of this shape (lab/bench/traces.py) instead of the default chat trace")
    p.add_argument("--routers", type=int, default=1,
                   help="independent routers, each with its own policy and copy of the index fed every "
                        "event batch; request k is decided by router k mod N (default 1)")
    p.add_argument("--oracle", action="store_true",
                   help="the old, optimistic information: each replica's load is its exact simulated drain time, "
                        "its KV events leave when the request is routed, and service times are the cost "
                        "policy's own formulas (default: production information, see the module docstring)")
    p.add_argument("--report-interval-ms", type=float, default=EVENT_INTERVAL_S * 1e3,
                   help="production information: how often a replica sends its load and events (20, as workers do)")
    p.add_argument("--decode-ms-per-token", type=float, default=20.0,
                   help="production information: how long a request stays running after its prefill, per output "
                        "token (its remaining tokens count in the load it reports; decode does not delay prefills)")
    p.add_argument("--attention-tokens", type=float, default=30_500.0,
                   help="production information: the context length at which attention doubles a prefill token's "
                        "cost in the simulator's service times (30,500 for Llama-3-8B; 0: no attention term)")
    p.add_argument("--service-noise", type=float, default=0.15,
                   help="production information: sigma of the lognormal noise on every simulated service time")
    p.add_argument("--scale-events", default=None, metavar="SPEC",
                   help="scale events at simulated seconds, e.g. scale_in@1200,scale_out@2400,kill@3600: each arm of "
                        "--scale-arms replays the trace with them and prints replay_scale lines (windows before and "
                        "after each event; lab/bench/replay_elastic.py)")
    p.add_argument("--scale-arms", default="elastic,baseline",
                   help="with --scale-events: elastic (L3, hand-off, warm-up), baseline (none), handoff_value and "
                        "handoff_lru (no write-behind, a hand-off of --handoff-blocks blocks in value or LRU order)")
    p.add_argument("--scale-window-s", type=float, default=300.0, help="with --scale-events: the measured window")
    p.add_argument("--l3-gbps", type=float, default=5.0,
                   help="with --scale-events: L3 -> replica bandwidth (Mooncake Store over RDMA; 5)")
    p.add_argument("--l3-blocks", type=int, default=None,
                   help="with --scale-events: L3 capacity in blocks (default: the replicas' HOT + WARM together)")
    p.add_argument("--handoff-blocks", type=int, default=None,
                   help="with --scale-events: the hand-off's L3 budget in blocks for the handoff_* arms "
                        "(default: an eighth of a replica's HOT + WARM)")
    p.add_argument("--misestimate", default=None, metavar="F[,F...]",
                   help="also run cost with each of its rate constants (and all of them) multiplied by each "
                        "factor, e.g. 0.5,2; the simulator keeps the true rates")


# ------------------------------------------------------------ the simulation
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
                    index.load_snapshot(rep.worker_id, *rep.publisher.snapshot())
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


def run(args: argparse.Namespace) -> int:
    if args.replicas <= 0 or args.block_tokens <= 0:
        raise InvalidInputError("--replicas and --block-tokens must be positive")
    if args.time_scale <= 0:
        raise InvalidInputError("--time-scale must be positive")
    if args.service_noise < 0 or args.attention_tokens < 0:
        raise InvalidInputError("--service-noise and --attention-tokens must be >= 0")
    names = list(ORDER) if args.policy == "all" else args.policy.split(",")
    for name in names:
        if name not in POLICIES:
            raise InvalidInputError(f"unknown policy {name!r}; choose from {', '.join(ORDER)} or all")
    seeds = _seeds(args)
    latency = LatencyModel(args.prefill_tokens_per_s, args.kv_bytes_per_token, args.h2d_gbps, args.disk_gbps,
                           args.transfer_gbps, getattr(args, "l3_gbps", 0.0) if getattr(args, "scale_events", None)
                           else 0.0)
    if getattr(args, "scale_events", None):
        return run_scale_events(args, names, latency, seeds, records_of=_records, run_policy=run_policy)
    by_seed = []
    for seed in seeds:
        records = _records(args, seed)
        # Routing hashes: the chain over hash ids, as the replicas' publishers compute it (block of 1 id).
        hash_chains = [block_hashes(r.hash_ids, 1) for r in records]
        noise = None if args.oracle else ServiceModel.draws(len(records), args.service_noise, seed)
        results = []
        for name in names:
            res = run_policy(name, records, hash_chains, args, latency, noise=noise)
            if args.shape:
                res["shape"] = args.shape
            if not args.trace:
                res["seed"] = seed
            results.append(res)
            emit(res)
        if args.misestimate:
            misestimate_sweep(records, hash_chains, args, latency, results, None if args.trace else seed, noise)
        by_seed.append(results)
    if len(seeds) > 1:
        for line in seed_summary(seeds, by_seed):
            emit(line)
    if args.plot:
        plot(by_seed[0], args.plot)
    return 0


def _seeds(args: argparse.Namespace) -> list[int]:
    if args.seeds is None:
        return [args.seed]
    if args.trace:
        raise InvalidInputError("--seeds needs a generated trace (--shape or the default), not --trace")
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        raise InvalidInputError(f"--seeds takes integers like 0,1,2, got {args.seeds!r}") from None
    if len(set(seeds)) != len(seeds):
        raise InvalidInputError(f"--seeds lists a seed twice: {args.seeds!r}")
    if args.plot and len(seeds) > 1:
        raise InvalidInputError("--plot draws one run; give it one seed (--seed), not --seeds")
    return seeds


def _records(args: argparse.Namespace, seed: int) -> list[TraceRecord]:
    if args.trace:
        records = load_trace(args.trace, limit=args.records)
    elif args.shape:
        records = shape_trace(args.shape, args.records or 100_000, seed=seed, block_tokens=args.block_tokens,
                              rate=args.rate)
    else:
        records = synthetic_chat_trace(args.records or 100_000, seed=seed, block_tokens=args.block_tokens,
                                       rate=args.rate)
    if not records:
        raise InvalidInputError("the trace has no records")
    records.sort(key=lambda r: r.timestamp)
    return records


def misestimate_sweep(records, hash_chains, args, latency: LatencyModel, results: list[dict],
                      seed: int | None = None, noise: list | None = None) -> None:
    """``cost`` given wrong rate constants (each alone, then all together, times each
    factor) while the simulator keeps the true ones; one line per run and a summary."""
    try:
        factors = [float(f) for f in args.misestimate.split(",")]
    except ValueError:
        raise InvalidInputError(f"--misestimate takes factors like 0.5,2, got {args.misestimate!r}") from None
    if not factors or any(f <= 0 for f in factors):
        raise InvalidInputError("--misestimate factors must be positive")
    true = latency.cost_model(args.block_tokens)
    base = next((r for r in results if r["policy"] == "cost"), None)
    if base is None:
        base = run_policy("cost", records, hash_chains, args, latency, noise=noise)
    runs = []
    for f in factors:
        for fields in [(name,) for name in RATE_FIELDS] + [RATE_FIELDS]:
            res = run_policy("cost", records, hash_chains, args, latency, noise=noise,
                             believed=true.scaled(**dict.fromkeys(fields, f)))
            res["misestimate"] = {"factor": f, "constants": "all" if len(fields) > 1 else fields[0]}
            if seed is not None:
                res["seed"] = seed
            runs.append(res)
            emit(res)
    worst = min(runs, key=lambda r: r["hit_rate"])
    others = {r["policy"]: r["hit_rate"] for r in results if r["policy"] in ("approx_tree", "ray_prefix", "prefix")}
    ports = {k: v for k, v in others.items() if k != "prefix"}
    emit({"bench": "replay_misestimate", "information": base["information"],
          **({} if seed is None else {"seed": seed}), "factors": factors, "runs": len(runs), "cost_hit_rate": base["hit_rate"],
          "worst_hit_rate": worst["hit_rate"], "worst": worst["misestimate"],
          "max_loss_points": rounded(100 * (base["hit_rate"] - worst["hit_rate"]), 2),
          "worst_ttft_ms_p99": max(r["ttft_ms_p99"] for r in runs), "baselines_hit_rate": others,
          # null when the run had neither port to compare with (--policy without them)
          "above_baselines": (all(worst["hit_rate"] > v for k, v in ports.items()) if ports else None)})
