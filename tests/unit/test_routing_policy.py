import pytest

from cluster.cache.radix_tree import HOT, WARM
from cluster.errors import InvalidInputError
from cluster.routing.events import EventBatch, KVEvent
from cluster.routing.index import GlobalIndex, PrefixHit
from cluster.protocol import RouteDecision
from cluster.routing.policies import (POLICIES, CostModel, CostOptions, NoLiveWorkerError, WorkerState,
                                    make_policy)

# Round numbers: 100-token blocks, prefill 1,000 tokens/s, WARM promotion 10x, transfer 5x faster.
COST = CostModel(prefill_tokens_per_s=1000, warm_promote_tokens_per_s=10_000, cold_promote_tokens_per_s=2000,
                 transfer_tokens_per_s=5000, block_tokens=100)
CHAIN = [11, 12, 13, 14, 15, 16]        # a 600-token request: 6 blocks


def index_with(**holdings):
    """holdings: worker -> (blocks of CHAIN held, tier)."""
    ix = GlobalIndex()
    for w, (n, tier) in holdings.items():
        ix.register_worker(w)
        if n:
            ix.apply(EventBatch(w, 1, [KVEvent("stored", CHAIN[:n], tier)]))
    return ix


def cost_policy(**kw):
    """The cost policy without its in-flight memory (tested on its own below)."""
    return make_policy("cost", cost=kw.pop("cost", COST), inflight_s=0, **kw)


def workers(**queued):
    return [WorkerState(w, q, 1 if q else 0) for w, q in queued.items()]


# ------------------------------------------------------------------ cost model
def test_cost_model_components():
    w = WorkerState("a", 2000, 1)
    assert COST.wait_s(w) == 2.0
    assert COST.prefill_s(600) == 0.6
    assert COST.promote_s(warm_blocks=5, cold_blocks=1) == pytest.approx(0.05 + 0.05)
    assert COST.transfer_s(5) == pytest.approx(0.1)
    assert COST.cached_tokens(7, 600) == 600
    assert COST.ttft_s(w, PrefixHit(2, 3, 0), 600) == pytest.approx(2.0 + 0.03 + 0.1)
    # Pull blocks 2..5 from a holder whose last one is COLD: it stages its one HOT block
    # among them (device -> host at the promotion rate), transfer 4, disk-read 1.
    assert COST.stage_s(1) == pytest.approx(0.01)
    assert COST.migrate_ttft_s(w, PrefixHit(2, 0, 0), PrefixHit(3, 2, 1), 600) == pytest.approx(
        2.0 + 100 / 10_000 + 400 / 5000 + 100 / 2000 + 0.0)


def test_cost_model_validates():
    with pytest.raises(InvalidInputError, match="prefill_tokens_per_s"):
        CostModel(prefill_tokens_per_s=0)
    with pytest.raises(InvalidInputError, match="block_tokens"):
        CostModel(block_tokens=0)


class FakeTime:
    """Injectable clock: each operation advances it by what it would take."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t

    def op(self, seconds, tokens):
        def run():
            self.t += seconds
            return tokens
        return run


def test_measure_uses_the_callables_and_keeps_the_best_run():
    clock = FakeTime()
    durations = iter([9.0, 0.5, 0.4, 0.8])      # warm-up, then three timed runs
    clock_prefill = lambda: (setattr(clock, "t", clock.t + next(durations)), 2000)[1]  # noqa: E731
    model = CostModel.measure(block_tokens=16, prefill=clock_prefill, warm_promote=clock.op(0.01, 1000),
                              transfer=clock.op(0.02, 1000), clock=clock)
    assert model.prefill_tokens_per_s == pytest.approx(5000)          # 2000 / 0.4
    assert model.warm_promote_tokens_per_s == pytest.approx(100_000)
    assert model.transfer_tokens_per_s == pytest.approx(50_000)
    assert model.cold_promote_tokens_per_s == CostModel().cold_promote_tokens_per_s   # not measured
    assert model.block_tokens == 16
    with pytest.raises(InvalidInputError, match="return the tokens"):
        CostModel.measure(block_tokens=16, prefill=clock.op(1.0, 0), clock=clock)


# --------------------------------------------------------------------- cost
def test_cost_prefers_the_hot_holder():
    ix = index_with(a=(5, WARM), b=(5, HOT), c=(0, HOT))
    d = make_policy("cost", cost=COST).choose(CHAIN, 600, workers(a=0, b=0, c=0), ix)
    assert d == RouteDecision("b", "local", pytest.approx(0.1), 500)


def test_cost_recomputes_on_an_idle_worker_when_the_holder_is_busy_and_transfer_is_slow():
    slow = CostModel(prefill_tokens_per_s=1000, transfer_tokens_per_s=500, block_tokens=100)
    ix = index_with(a=(5, HOT), b=(0, HOT))
    d = make_policy("cost", cost=slow).choose(CHAIN, 600, workers(a=10_000, b=0), ix)
    # holder: 10 s wait + 0.1 s; pull: 500 / 500 + 0.1 = 1.1 s; recompute: 0.6 s
    assert d == RouteDecision("b", "recompute", pytest.approx(0.6), 0)


def test_cost_migrates_when_transfer_beats_waiting_and_recomputing():
    ix = index_with(a=(5, HOT), b=(0, HOT))
    d = make_policy("cost", cost=COST).choose(CHAIN, 600, workers(a=10_000, b=0), ix)
    # a stages 5 HOT blocks (0.05 s), b pulls them at 5,000 tokens/s (0.1 s), then prefills 100 tokens (0.1 s)
    assert d == RouteDecision("b", "migrate", pytest.approx(0.25), 500, migrate_from="a", migrate_blocks=5)


def test_cost_migration_pulls_only_what_the_target_lacks():
    ix = index_with(a=(6, HOT), b=(2, HOT), c=(0, HOT))
    d = make_policy("cost", cost=COST).choose(CHAIN, 600, workers(a=10_000, b=10, c=0), ix)
    # b: 0.01 s wait + stage and pull 4 blocks (0.04 + 0.08 s); c: all 6 (0.06 + 0.12 s)
    assert (d.worker_id, d.reason, d.migrate_from, d.migrate_blocks) == ("b", "migrate", "a", 4)
    assert d.expected_ttft_s == pytest.approx(0.01 + 0.04 + 400 / 5000)


def test_cost_duplication_weight_keeps_a_short_wait_local():
    ix = index_with(a=(5, HOT), b=(0, HOT))
    ws = workers(a=300, b=0)            # 0.3 s of queue on the holder: local costs 0.4 s, a pull 0.2 s
    d = make_policy("cost", cost=COST, dup_weight=0).choose(CHAIN, 600, ws, ix)
    assert (d.worker_id, d.reason) == ("b", "migrate")
    d = make_policy("cost", cost=COST, dup_weight=0.5).choose(CHAIN, 600, ws, ix)
    assert (d.worker_id, d.reason) == ("a", "local")   # + 5 copied blocks x 0.1 s x 0.5 = 0.45 s > 0.4 s


def test_cost_copies_a_shared_prefix_freely():
    ix = index_with(a=(3, HOT), b=(0, HOT))
    ws = workers(a=300, b=0)            # local: 0.3 + 0.3 s; stage and pull 3 blocks: 0.03 + 0.06 + 0.3 s
    fresh = cost_policy(dup_weight=2)
    assert fresh.choose(CHAIN, 600, ws, ix).reason == "local"         # 3 private blocks x 0.2 s
    seen = cost_policy(dup_weight=2)
    for other in ([11, 12, 13, 90], [11, 12, 13, 91]):                # 13 continued two ways
        seen.choose(other, 400, ws, ix)
    d = seen.choose(CHAIN, 600, ws, ix)
    assert (d.worker_id, d.reason, d.migrate_from, d.migrate_blocks) == ("b", "migrate", "a", 3)
    assert d.expected_ttft_s == pytest.approx(0.39)


def test_cost_spreads_requests_nobody_holds_over_idle_workers():
    policy = cost_policy()
    ix = index_with(a=(0, HOT), b=(0, HOT), c=(0, HOT))
    picks = [policy.choose(CHAIN, 600, workers(a=0, b=0, c=0), ix).worker_id for _ in range(4)]
    assert picks == ["a", "b", "c", "a"]


def test_cost_places_near_ties_by_recent_work():
    ix = index_with(a=(5, HOT), b=(5, WARM))          # a: 0.1 s, b: 0.15 s (WARM promotion)
    policy = cost_policy(tie_s=0.1)
    first = policy.choose(CHAIN, 600, workers(a=0, b=0), ix)
    assert (first.worker_id, first.reason) == ("a", "local")
    assert policy.recent_work_s("a") == pytest.approx(0.1) and policy.recent_work_s("b") == 0.0
    second = policy.choose(CHAIN, 600, workers(a=0, b=0), ix)
    assert (second.worker_id, second.expected_ttft_s) == ("b", pytest.approx(0.15))
    strict = cost_policy(tie_s=0.0)
    assert [strict.choose(CHAIN, 600, workers(a=0, b=0), ix).worker_id for _ in range(2)] == ["a", "a"]


def test_cost_tie_window_widens_with_the_mean_queue():
    # a holds the HOT prefix (0.1 s), b holds it WARM (0.15 s); both have
    # 0.4 s of queue, c has 0.3 s and holds nothing (0.9 s). b is 0.05 s
    # worse than a: past tie_s=0.01, but within the mean queue wait (0.367 s),
    # which the next arrivals will change anyway, so the worker sent less
    # work lately wins the second request.
    ix = index_with(a=(5, HOT), b=(5, WARM), c=(0, HOT))
    policy = cost_policy(tie_s=0.01)
    picks = [policy.choose(CHAIN, 600, workers(a=400, b=400, c=300), ix) for _ in range(2)]
    assert [(d.worker_id, d.reason) for d in picks] == [("a", "local"), ("b", "local")]
    idle = cost_policy(tie_s=0.01)      # no queue anywhere: the window is tie_s alone
    assert [idle.choose(CHAIN, 600, workers(a=0, b=0, c=0), ix).worker_id for _ in range(2)] == ["a", "a"]


def test_cost_replicates_a_hot_shared_prefix():
    # a holds a 5-block prefix; two requests continuing it two ways make it a
    # shared prefix (a branch point) and give a all the recent work (0.1 s each).
    ix = index_with(a=(5, HOT), b=(0, HOT), c=(0, HOT))
    first, second = [11, 12, 13, 14, 15, 90], [11, 12, 13, 14, 15, 91]

    def decide(policy):
        return [policy.choose(chain, 600, workers(a=0, b=0, c=0), ix) for chain in (first, second)]

    d = decide(cost_policy(replicate_budget_s=0.2))
    assert d[0] == RouteDecision("a", "local", pytest.approx(0.1), 500)             # not yet known as shared
    # a got 0.1 s, the mean is 0.033 s (3x, past the default 1.5x): b pulls the prefix
    # (stage 0.05 + pull 0.1 + prefill 0.1 s), 0.15 s more than serving on a.
    assert d[1] == RouteDecision("b", "replicate", pytest.approx(0.25), 500, migrate_from="a", migrate_blocks=5)
    assert decide(cost_policy())[1].reason == "local"                         # past the default budget, 0.1 s
    assert decide(cost_policy(replicate_share=3.5, replicate_budget_s=0.2))[1].reason == "local"  # 3x < 3.5x
    assert decide(cost_policy(replicate_share=0, replicate_budget_s=0.2))[1].reason == "local"    # off
    # A conversation's own history (no branch point) is never replicated, however busy its holder.
    private = cost_policy(replicate_budget_s=0.2)
    assert {private.choose(CHAIN, 600, workers(a=0, b=0, c=0), ix).reason for _ in range(4)} == {"local"}
    with pytest.raises(InvalidInputError, match="replicate_share"):
        CostOptions(replicate_share=-1)


# ------------------------------------------------------------------ baselines
def test_round_robin_cycles_over_live_workers():
    policy = make_policy("round_robin", cost=COST)
    ix = index_with(a=(0, HOT))
    ws = [WorkerState("a", 0), WorkerState("b", 0, alive=False), WorkerState("c", 0), WorkerState("d", 0)]
    assert [policy.choose(CHAIN, 600, ws, ix).worker_id for _ in range(4)] == ["a", "c", "d", "a"]


def test_least_loaded_takes_the_shortest_queue():
    ix = index_with(a=(3, HOT))
    d = make_policy("least_loaded", cost=COST).choose(CHAIN, 600, workers(a=500, b=20, c=400), ix)
    assert (d.worker_id, d.reason, d.cached_tokens) == ("b", "load", 0)


def test_prefix_takes_the_longest_prefix():
    ix = index_with(a=(3, HOT), b=(5, WARM), c=(0, HOT))
    d = make_policy("prefix", cost=COST).choose(CHAIN, 600, workers(a=0, b=1000, c=0), ix)
    assert (d.worker_id, d.reason, d.cached_tokens) == ("b", "prefix", 500)


def test_prefix_breaks_imbalance_with_the_least_loaded():
    ix = index_with(a=(5, HOT), b=(0, HOT))
    policy = make_policy("prefix", cost=COST, imbalance_tokens=8192)
    assert policy.choose(CHAIN, 600, workers(a=8192, b=0), ix).worker_id == "a"
    d = policy.choose(CHAIN, 600, workers(a=8193, b=0), ix)
    assert (d.worker_id, d.reason, d.cached_tokens) == ("b", "balance", 0)


def test_prefix_ties_go_to_the_less_loaded():
    ix = index_with(a=(5, HOT), b=(5, HOT))
    d = make_policy("prefix", cost=COST).choose(CHAIN, 600, workers(a=900, b=100), ix)
    assert d.worker_id == "b"


def running(**counts):
    return [WorkerState(w, 0, n) for w, n in counts.items()]


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


# approx_tree (SGLang's cache_aware router, ported): tests/unit/test_approx_tree.py


def test_ray_prefix_is_rays_prefix_cache_affinity_router():
    policy = make_policy("ray_prefix", cost=COST, imbalanced_threshold=1, seed=0)
    ix = GlobalIndex()
    d = policy.choose(CHAIN, 600, running(a=0, b=0, c=0), ix)             # no match: smallest trees, shortest queue
    assert (d.worker_id, d.reason) == ("a", "capacity")
    d = policy.choose(CHAIN, 600, running(a=1, b=0, c=0), ix)             # spread 1: balanced
    assert (d.worker_id, d.reason, d.cached_tokens) == ("a", "prefix", 600)
    d = policy.choose([11, 12, 13, 90], 400, running(a=1, b=0, c=1), ix)
    assert (d.worker_id, d.reason) == ("a", "prefix")
    d = policy.choose([60, 61], 200, running(a=1, b=1, c=0), ix)          # 0 matched < 10%: c's tree is empty
    assert (d.worker_id, d.reason) == ("c", "capacity")
    d = policy.choose(CHAIN, 600, running(a=3, b=0, c=1), ix)             # imbalanced: power of two (seeded: b, c)
    assert (d.worker_id, d.reason) == ("b", "pow2")
    policy.forget_worker("a")
    assert policy.tree.deepest(CHAIN) == (6, ["b"])


def test_cost_routes_a_burst_of_siblings_together():
    clock = Clock()
    ix = index_with(a=(0, HOT), b=(0, HOT), c=(0, HOT))
    doc = [21, 22, 23, 24, 25]
    policy = make_policy("cost", cost=COST, clock=clock)
    first = policy.choose(doc + [31], 600, workers(a=0, b=0, c=0), ix)
    assert (first.worker_id, first.reason) == ("a", "recompute")
    # No KV event yet; a is computing the document (0.6 s queued). Recomputing it on b
    # would be 0.6 s too, but it is a copy of a prefix in flight: 5 blocks x 0.3 s.
    second = policy.choose(doc + [32], 600, workers(a=600, b=0, c=0), ix)
    assert (second.worker_id, second.reason, second.cached_tokens) == ("a", "local", 500)
    assert second.expected_ttft_s == pytest.approx(0.6 + 0.1)
    clock.t = 1.5                                      # past inflight_s: only the index counts
    third = policy.choose(doc + [33], 600, workers(a=600, b=0, c=0), ix)
    assert (third.worker_id, third.reason) == ("b", "recompute")
    blind = cost_policy()
    blind.choose(doc + [31], 600, workers(a=0, b=0, c=0), ix)
    assert blind.choose(doc + [32], 600, workers(a=600, b=0, c=0), ix).worker_id == "b"
    # A what-if decision (sent=False: no request follows) leaves nothing in flight.
    asked = make_policy("cost", cost=COST, clock=Clock())
    assert asked.choose(doc + [31], 600, workers(a=0, b=0, c=0), ix, sent=False).worker_id == "a"
    assert asked.choose(doc + [32], 600, workers(a=600, b=0, c=0), ix).worker_id == "b"


def test_cost_options_and_in_place_updates():
    policy = make_policy("cost", cost=COST, dup_weight=1.5)
    assert policy.options == CostOptions(dup_weight=1.5) and policy.options.dup_weight == 1.5
    with pytest.raises(InvalidInputError, match="unknown cost policy option"):
        make_policy("cost", dup_wieght=1)
    with pytest.raises(InvalidInputError, match="tie_s"):
        CostOptions(tie_s=-1)
    ix = index_with(a=(0, HOT), b=(0, HOT))
    policy.choose(CHAIN, 600, workers(a=0, b=0), ix)
    learned = policy.recent_work_s("a")
    assert learned == pytest.approx(0.6)
    policy.set_cost(COST.scaled(prefill_tokens_per_s=2))
    assert policy.cost.prefill_tokens_per_s == 2000 and policy.recent_work_s("a") == learned
    policy.forget_worker("a")
    assert policy.recent_work_s("a") == 0.0


def test_ideal_serves_the_best_hit_anywhere_on_the_least_loaded():
    ix = index_with(g=(4, HOT))
    d = make_policy("ideal", cost=COST).choose(CHAIN, 600, workers(a=300, b=100), ix)
    assert d == RouteDecision("b", "ideal", pytest.approx(0.1 + 0.2), 400)


# ------------------------------------------------------------------- plumbing
def test_make_policy_and_dead_workers():
    assert set(POLICIES) == {"round_robin", "least_loaded", "prefix", "cost", "approx_tree", "ray_prefix", "ideal"}
    assert make_policy().name == "cost"
    with pytest.raises(InvalidInputError, match="unknown routing policy 'nope'"):
        make_policy("nope")
    ix = index_with(a=(5, HOT))
    for name in POLICIES:
        with pytest.raises(NoLiveWorkerError):
            make_policy(name).choose(CHAIN, 600, [WorkerState("a", 0, alive=False)], ix)
        d = make_policy(name, cost=COST).choose(CHAIN, 600, [WorkerState("a", 0, alive=False),
                                                              WorkerState("b", 0)], ix)
        assert d.worker_id == "b"


def test_branch_memory_fast_path_learns_what_the_block_by_block_walk_learns():
    import random

    from cluster.routing.policies.cost import _BranchMemory
    rng = random.Random(7)
    fast, slow = _BranchMemory(64), _BranchMemory(64)
    prefixes = [[rng.randrange(1, 10**6) for _ in range(rng.randint(1, 6))] for _ in range(5)]
    for _ in range(400):
        chain = rng.choice(prefixes) + [rng.randrange(1, 10**6) for _ in range(rng.randint(0, 4))]
        if rng.random() < 0.3:
            prefixes.append(chain)
        full = rng.randint(0, len(chain) + 1)
        k = min(len(chain), full) - 1
        expected = slow._observe_each(chain[:max(k, 0)], chain[1:k + 1]) if k > 0 else 0
        assert fast.observe(chain, full) == expected
        assert (fast._cur, fast._old) == (slow._cur, slow._old)


# ------------------------------------------------------------------------- L3
L3_COST = CostModel(prefill_tokens_per_s=1000, warm_promote_tokens_per_s=10_000, cold_promote_tokens_per_s=2000,
                    transfer_tokens_per_s=5000, block_tokens=100, l3_fetch_tokens_per_s=4000)


def test_l3_entries_outlive_their_writer_and_go_when_found_missing():
    ix = index_with(w0=(0, HOT), w1=(6, HOT))
    ix.apply(EventBatch("w1", 2, [KVEvent("stored", CHAIN[:5], 3)]))   # w1 wrote 5 blocks to L3
    assert ix.l3_blocks(CHAIN) == 5 and ix.num_entries("w1") == 6
    assert ix.drop_worker("w1") == 6                                   # w1's own entries only
    assert ix.l3_blocks(CHAIN) == 5 and ix.match(CHAIN) == {}
    ix.apply(EventBatch("w0", 1, [KVEvent("removed", [CHAIN[2]], 3)]))   # a fetch found block 2 missing
    assert ix.l3_blocks(CHAIN) == 2
    ix.check_invariants()


def test_the_l3_set_is_bounded_oldest_first():
    ix = GlobalIndex(max_l3_entries=3)
    ix.register_worker("w0")
    ix.apply(EventBatch("w0", 1, [KVEvent("stored", CHAIN[:5], 3)]))
    assert ix.num_l3 == 3 and ix.l3_blocks(CHAIN) == 0 and ix.l3_blocks(CHAIN[2:]) == 3


def test_a_prefix_only_l3_holds_is_fetched_where_it_beats_recompute():
    ix = index_with(w0=(0, HOT), w1=(0, HOT))
    assert ix.apply(EventBatch("w0", 1, [KVEvent("stored", CHAIN[:5], 3)])) == "ok"   # what a dead replica left
    d = cost_policy(cost=L3_COST).choose(CHAIN, 600, workers(w0=0, w1=0), ix)
    assert (d.reason, d.l3_blocks, d.cached_tokens) == ("l3", 5, 500)
    # 500 tokens from L3 at 4,000/s + 100 computed at 1,000/s, against 0.6 s of prefill.
    assert d.expected_ttft_s == pytest.approx(0.125 + 0.1)
    slow = CostModel(**{**L3_COST.__dict__, "l3_fetch_tokens_per_s": 900})   # slower than prefill
    d = cost_policy(cost=slow).choose(CHAIN, 600, workers(w0=0, w1=0), ix)
    assert d.reason == "recompute" and d.l3_blocks == 0


def test_l3_tops_up_a_holder_and_loses_to_a_longer_local_hit():
    ix = index_with(w0=(2, HOT), w1=(0, HOT))
    ix.apply(EventBatch("w0", 2, [KVEvent("stored", CHAIN[:5], 3)]))
    d = cost_policy(cost=L3_COST).choose(CHAIN, 600, workers(w0=0, w1=0), ix)
    assert (d.worker_id, d.reason, d.l3_blocks) == ("w0", "l3", 3)    # its 2 blocks, 3 more from L3
    ix = index_with(w0=(6, HOT), w1=(0, HOT))
    ix.apply(EventBatch("w0", 2, [KVEvent("stored", CHAIN[:5], 3)]))
    d = cost_policy(cost=L3_COST).choose(CHAIN, 600, workers(w0=0, w1=0), ix)
    assert (d.worker_id, d.reason) == ("w0", "local")
