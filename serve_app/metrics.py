"""Prometheus metrics through ``ray.util.metrics`` (exported by each Ray node's agent).

Names and labels (the README lists them too):

| name | type | labels |
| --- | --- | --- |
| prefix_cache_requests_total | counter | endpoint, status |
| prefix_cache_ttft_seconds | histogram | endpoint |
| prefix_cache_inter_token_seconds | histogram | endpoint |
| prefix_cache_cached_tokens_total | counter | tier |
| prefix_cache_prompt_tokens_total | counter | |
| prefix_cache_migrations_total | counter | transport |
| prefix_cache_migrated_bytes_total | counter | transport |
| prefix_cache_tier_moves_total | counter | worker, kind (demoted_to_warm, demoted_to_cold, promoted, dropped) |
| prefix_cache_tier_used_tokens | gauge | worker, tier |
| prefix_cache_router_decisions_total | counter | reason, source (router_view, directory, fallback, target) |
| prefix_cache_responses_5xx_total | counter | endpoint (completions, chat, other) |
| prefix_cache_cut_streams_total | counter | |
| prefix_cache_resumed_requests_total | counter | |
| prefix_cache_watchdog_trips_total | counter | worker |
| prefix_cache_migration_timeouts_total | counter | |
| prefix_cache_preemptions_total | counter | worker |
| prefix_cache_preempted_tokens_total | counter | worker, outcome (resumed_hot, resumed_warm, resumed_cold, recomputed) |
| prefix_cache_swap_in_bytes_total | counter | worker |
| prefix_cache_session_prefetches_total | counter | outcome (started, hot, unknown_session, failed, timeout) |
| prefix_cache_recomputed_held_tokens_total | counter | worker, tier (hot, warm, cold) |
| prefix_cache_recompute_chosen_tokens_total | counter | worker |
| prefix_cache_dropped_tokens_total | counter | worker, tier, reason (last_tier, lower_full, copy_failed, checksum, flush) |
| prefix_cache_dropped_with_room_tokens_total | counter | worker |
| prefix_cache_commit_tail_discarded_tokens_total | counter | worker |
| prefix_cache_tenant_resident_tokens | gauge | worker, tenant, tier (hot, warm, cold; l3: blocks) |
| prefix_cache_tenant_hit_tokens_total | counter | worker, tenant, tier |
| prefix_cache_tenant_lookups_total | counter | worker, tenant |
| prefix_cache_tenant_evictions_total | counter | worker, tenant, tier, role (caused, suffered, suffered_from_others) |

``recomputed_held_tokens`` counts prompt tokens a request computed although a
tier held their KV when it was admitted, outside a measured cost decision
(``recompute_chosen_tokens``); ``dropped_with_room_tokens`` counts tokens that
left a tier while the tier below had room for them, and
``commit_tail_discarded_tokens`` new KV the tree could not take. All three are
defects: they stay 0.

The ``tenant_*`` series exist only with ``tenant_quotas`` configured
(``cluster.cache.quotas``): what each tenant holds per tier, the prompt tokens
its requests found cached, and the tokens (L3: blocks) pushed down or dropped
that it caused, that it lost, and that it lost to another tenant's request.

``session_prefetches`` counts the prefetches the ingress started from a
request's ``X-Session-Id`` header (predictive swap-in), by what they found:
``started`` (a worker began promoting the session's WARM/COLD prefix), ``hot``
(nothing to bring up), ``unknown_session`` (no worker remembers it: a first
turn), ``failed`` or ``timeout`` (logged; the request went on without it).

``cut_streams`` counts streamed responses that ended early with an error
event (and ``[DONE]``) because the request could not be finished; a stream is
never cut without one.
"""

from __future__ import annotations

from ray.util.metrics import Counter, Gauge, Histogram

_LATENCY_BOUNDARIES = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]

requests = Counter("prefix_cache_requests_total", "HTTP requests by endpoint and status code",
                   tag_keys=("endpoint", "status"))
ttft = Histogram("prefix_cache_ttft_seconds", "Time to first token", boundaries=_LATENCY_BOUNDARIES,
                 tag_keys=("endpoint",))
inter_token = Histogram("prefix_cache_inter_token_seconds", "Time between streamed tokens",
                        boundaries=_LATENCY_BOUNDARIES, tag_keys=("endpoint",))
cached_tokens = Counter("prefix_cache_cached_tokens_total", "Prompt tokens served from the cache, by tier",
                        tag_keys=("tier",))
prompt_tokens = Counter("prefix_cache_prompt_tokens_total", "Prompt tokens received")
migrations = Counter("prefix_cache_migrations_total", "Prefix migrations between replicas",
                     tag_keys=("transport",))
migrated_bytes = Counter("prefix_cache_migrated_bytes_total", "KV bytes moved between replicas",
                         tag_keys=("transport",))
tier_moves = Counter("prefix_cache_tier_moves_total", "Tier moves (demotions, promotions, drops)",
                     tag_keys=("worker", "kind"))
tier_used = Gauge("prefix_cache_tier_used_tokens", "Tokens held per tier", tag_keys=("worker", "tier"))
router_decisions = Counter("prefix_cache_router_decisions_total",
                           "Router decisions by reason and by who decided (the router's table copy, the directory, "
                           "the least-loaded fallback, or a call aimed at one replica)",
                           tag_keys=("reason", "source"))

responses_5xx = Counter("prefix_cache_responses_5xx_total", "Responses with a 5xx status or a 5xx error event",
                        tag_keys=("endpoint",))
cut_streams = Counter("prefix_cache_cut_streams_total",
                      "Streamed responses ended early with an error event (the request could not be finished)")
resumed_requests = Counter("prefix_cache_resumed_requests_total",
                           "Requests resumed on another replica after theirs failed mid-request")
watchdog_trips = Counter("prefix_cache_watchdog_trips_total", "Engines declared wedged by the watchdog",
                         tag_keys=("worker",))
preemptions = Counter("prefix_cache_preemptions_total", "Running requests preempted for lack of HOT room",
                      tag_keys=("worker",))
preempted_tokens = Counter("prefix_cache_preempted_tokens_total",
                           "Tokens of preempted requests when they resumed: found in a tier, or recomputed",
                           tag_keys=("worker", "outcome"))
swap_in_bytes = Counter("prefix_cache_swap_in_bytes_total",
                        "KV bytes of preempted requests brought back from WARM/COLD", tag_keys=("worker",))
session_prefetches = Counter("prefix_cache_session_prefetches_total",
                             "Session prefetches started by a request's X-Session-Id header, by outcome",
                             tag_keys=("outcome",))
migration_timeouts = Counter("prefix_cache_migration_timeouts_total",
                             "Remote calls of a migration that ran past their bound (then recompute)")

recomputed_held = Counter("prefix_cache_recomputed_held_tokens_total",
                          "Prompt tokens recomputed although a tier held their KV (a defect: stays 0)",
                          tag_keys=("worker", "tier"))
recompute_chosen = Counter("prefix_cache_recompute_chosen_tokens_total",
                           "Prompt tokens a tier held that the scheduler chose to recompute (measured: cheaper)",
                           tag_keys=("worker",))
dropped_tokens = Counter("prefix_cache_dropped_tokens_total", "Tokens that left the cache, by tier and reason",
                         tag_keys=("worker", "tier", "reason"))
dropped_with_room = Counter("prefix_cache_dropped_with_room_tokens_total",
                            "Tokens dropped while the tier below had room (a defect: stays 0)", tag_keys=("worker",))
tail_discarded = Counter("prefix_cache_commit_tail_discarded_tokens_total",
                         "New KV the tree could not take at a commit (a defect: stays 0)", tag_keys=("worker",))

_last_moves: dict[str, dict[str, int]] = {}
_last_engine: dict[str, dict[str, int]] = {}


def replica_started(worker_id: str) -> None:
    _last_moves[worker_id] = {}
    _last_engine[worker_id] = {}
    _last_tenants[worker_id] = {}


def report_tiers(worker_id: str, summary: dict) -> None:
    for tier, info in summary.items():
        tier_used.set(info["used_tokens"], tags={"worker": worker_id, "tier": tier})


def report_engine(worker_id: str, stats: dict) -> None:
    """The engine's cumulative preemption counters as counter increments."""
    last = _last_engine.setdefault(worker_id, {})
    outcomes = {"resumed_hot_tokens": "resumed_hot", "resumed_warm_tokens": "resumed_warm",
                "resumed_cold_tokens": "resumed_cold", "recomputed_tokens": "recomputed"}
    for tier in ("hot", "warm", "cold"):
        key = f"recomputed_held_{tier}_tokens"
        _inc(recomputed_held, stats.get(key, 0) - last.get(key, 0), {"worker": worker_id, "tier": tier})
        last[key] = stats.get(key, 0)
    _inc(recompute_chosen, stats.get("recompute_chosen_tokens", 0) - last.get("recompute_chosen_tokens", 0),
         {"worker": worker_id})
    last["recompute_chosen_tokens"] = stats.get("recompute_chosen_tokens", 0)
    for key in ("preemptions", "swap_in_bytes", *outcomes):
        delta = stats.get(key, 0) - last.get(key, 0)
        if delta > 0:
            if key == "preemptions":
                preemptions.inc(delta, tags={"worker": worker_id})
            elif key == "swap_in_bytes":
                swap_in_bytes.inc(delta, tags={"worker": worker_id})
            else:
                preempted_tokens.inc(delta, tags={"worker": worker_id, "outcome": outcomes[key]})
        last[key] = stats.get(key, 0)


def report_moves(worker_id: str, stats: dict) -> None:
    """Turn the cache's cumulative counters into counter increments."""
    last = _last_moves.setdefault(worker_id, {})
    kinds = {"demoted_to_warm": "demoted_to_warm", "demoted_to_cold": "demoted_to_cold",
             "promotions": "promoted", "dropped_tokens": "dropped"}
    for key, kind in kinds.items():
        value = stats.get(key, 0)
        delta = value - last.get(key, 0)
        if delta > 0:
            tier_moves.inc(delta, tags={"worker": worker_id, "kind": kind})
        last[key] = value
    for key, value in stats.items():   # dropped_<tier>_<reason>_tokens (cluster.cache.tier_moves)
        if key.startswith("dropped_") and key.endswith("_tokens") and key.count("_") >= 3 \
                and key not in ("dropped_tokens", "dropped_with_room_tokens"):
            tier, reason = key[len("dropped_"):-len("_tokens")].split("_", 1)
            _inc(dropped_tokens, value - last.get(key, 0), {"worker": worker_id, "tier": tier, "reason": reason})
            last[key] = value
    for key, counter in (("dropped_with_room_tokens", dropped_with_room),
                         ("commit_tail_discarded_tokens", tail_discarded)):
        _inc(counter, stats.get(key, 0) - last.get(key, 0), {"worker": worker_id})
        last[key] = stats.get(key, 0)


# ----------------------------------------------------------------- L3 and elasticity
l3_blocks = Counter("prefix_cache_l3_blocks_total",
                    "L3 blocks by operation: written (behind requests and at hand-off), fetched, write_dropped",
                    tag_keys=("op",))
l3_fetch = Histogram("prefix_cache_l3_fetch_seconds", "Time of one L3 fetch (read and verify)",
                     boundaries=_LATENCY_BOUNDARIES)
handoff_blocks = Counter("prefix_cache_handoff_blocks_total",
                         "Blocks a leaving replica handed on, by destination (l3, peer)", tag_keys=("to",))
handoff_seconds = Histogram("prefix_cache_handoff_seconds", "How long a leaving replica's hand-off took",
                            boundaries=_LATENCY_BOUNDARIES)
warmup_tokens = Counter("prefix_cache_warmup_tokens_total",
                        "Tokens of KV a new replica pulled before taking traffic, by source (l3, peer)",
                        tag_keys=("source",))
_last_l3: dict[str, dict[str, int]] = {}


def report_l3(worker_id: str, stats) -> None:
    """The L3 tier's counters (``L3TierStats``) since the last report, as deltas."""
    last = _last_l3.setdefault(worker_id, {})
    for key, op in (("blocks_written", "written"), ("fetch_blocks_hit", "fetched"), ("writes_dropped", "write_dropped")):
        value = getattr(stats, key)
        if value > last.get(key, 0):
            l3_blocks.inc(value - last.get(key, 0), tags={"op": op})
        last[key] = value
    new = min(stats.fetches_timed - last.get("fetches_timed", 0), len(stats.fetch_s))
    for seconds in stats.fetch_s[len(stats.fetch_s) - new:] if new > 0 else ():
        l3_fetch.observe(seconds)
    last["fetches_timed"] = stats.fetches_timed


def _inc(counter: Counter, value: int, tags: dict) -> None:
    if value > 0:   # Ray's counters take positive increments only
        counter.inc(value, tags=tags)


def report_handoff(worker_id: str, report: dict, block_tokens: int) -> None:
    _inc(handoff_blocks, report.get("l3_blocks", 0), {"to": "l3"})
    _inc(handoff_blocks, report.get("peer_tokens", 0) // block_tokens, {"to": "peer"})
    handoff_seconds.observe(report.get("seconds", 0.0))


def report_warmup(worker_id: str, report: dict) -> None:
    _inc(warmup_tokens, report.get("l3_tokens", 0), {"source": "l3"})
    _inc(warmup_tokens, report.get("peer_tokens", 0), {"source": "peer"})


# ------------------------------------------------------------------- tenants
tenant_resident = Gauge("prefix_cache_tenant_resident_tokens",
                        "Tokens a tenant holds per tier (l3: blocks this replica keeps written for it)",
                        tag_keys=("worker", "tenant", "tier"))
tenant_hits = Counter("prefix_cache_tenant_hit_tokens_total", "Prompt tokens a tenant's requests found cached, by tier",
                      tag_keys=("worker", "tenant", "tier"))
tenant_lookups = Counter("prefix_cache_tenant_lookups_total", "Admissions of a tenant's requests",
                         tag_keys=("worker", "tenant"))
tenant_evictions = Counter("prefix_cache_tenant_evictions_total",
                           "Tokens (l3: blocks) pushed down or dropped from a tier: caused by a tenant's requests, "
                           "suffered, and suffered for another tenant's", tag_keys=("worker", "tenant", "tier", "role"))
_last_tenants: dict[str, dict[tuple, int]] = {}
_ROLES = {"evictions_caused": "caused", "evictions_suffered": "suffered",
          "evictions_suffered_from_others": "suffered_from_others"}


def report_tenants(worker_id: str, tenants: dict) -> None:
    """``TieredCache.tenant_stats()``: residency as gauges, the cumulative counters as increments."""
    last = _last_tenants.setdefault(worker_id, {})
    for tenant, row in tenants.items():
        base = {"worker": worker_id, "tenant": tenant}
        for tier, tokens in row["resident_tokens"].items():
            tenant_resident.set(tokens, tags={**base, "tier": tier})
        tenant_resident.set(row["l3_blocks"], tags={**base, "tier": "l3"})
        key = (tenant, "lookups")
        _inc(tenant_lookups, row["lookups"] - last.get(key, 0), base)
        last[key] = row["lookups"]
        for field, role in (("hit_tokens", None), *_ROLES.items()):
            for tier, value in row[field].items():
                key = (tenant, field, tier)
                if role is None:
                    _inc(tenant_hits, value - last.get(key, 0), {**base, "tier": tier})
                else:
                    _inc(tenant_evictions, value - last.get(key, 0), {**base, "tier": tier, "role": role})
                last[key] = value
