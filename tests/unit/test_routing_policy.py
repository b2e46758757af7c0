import pytest

from cluster.cache.radix_tree import HOT, WARM
from cluster.errors import InvalidInputError
from cluster.routing.events import EventBatch, KVEvent
from cluster.routing.index import GlobalIndex, PrefixHit
from cluster.routing.policy import (POLICIES, ApproxTreePolicy, CostModel, Decision, NoLiveWorkerError,
                                    WorkerState, make_policy)

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
    # Pull blocks 2..5 from a holder whose last one is COLD: transfer 4, disk-read 1.
    assert COST.migrate_ttft_s(w, PrefixHit(2, 0, 0), PrefixHit(3, 2, 1), 600) == pytest.approx(
        2.0 + 400 / 5000 + 100 / 2000 + 0.0)


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
    assert d == Decision("b", "local", pytest.approx(0.1), 500)


def test_cost_recomputes_on_an_idle_worker_when_the_holder_is_busy_and_transfer_is_slow():
    slow = CostModel(prefill_tokens_per_s=1000, transfer_tokens_per_s=500, block_tokens=100)
    ix = index_with(a=(5, HOT), b=(0, HOT))
    d = make_policy("cost", cost=slow).choose(CHAIN, 600, workers(a=10_000, b=0), ix)
    # holder: 10 s wait + 0.1 s; pull: 500 / 500 + 0.1 = 1.1 s; recompute: 0.6 s
    assert d == Decision("b", "recompute", pytest.approx(0.6), 0)


def test_cost_migrates_when_transfer_beats_waiting_and_recomputing():
    ix = index_with(a=(5, HOT), b=(0, HOT))
    d = make_policy("cost", cost=COST).choose(CHAIN, 600, workers(a=10_000, b=0), ix)
    # pull 5 blocks at 5,000 tokens/s = 0.1 s, then prefill 100 tokens = 0.1 s
    assert d == Decision("b", "migrate", pytest.approx(0.2), 500, migrate_from="a", migrate_blocks=5)


def test_cost_migration_pulls_only_what_the_target_lacks():
    ix = index_with(a=(6, HOT), b=(2, HOT), c=(0, HOT))
    d = make_policy("cost", cost=COST).choose(CHAIN, 600, workers(a=10_000, b=10, c=0), ix)
    # b: 0.01 s wait + pull 4 blocks (0.08 s); c: pull all 6 (0.12 s)
    assert (d.worker_id, d.reason, d.migrate_from, d.migrate_blocks) == ("b", "migrate", "a", 4)
    assert d.expected_ttft_s == pytest.approx(0.01 + 400 / 5000)


def test_cost_duplication_weight_keeps_a_short_wait_local():
    ix = index_with(a=(5, HOT), b=(0, HOT))
    ws = workers(a=300, b=0)            # 0.3 s of queue on the holder: local costs 0.4 s, a pull 0.2 s
    d = make_policy("cost", cost=COST, dup_weight=0).choose(CHAIN, 600, ws, ix)
    assert (d.worker_id, d.reason) == ("b", "migrate")
    d = make_policy("cost", cost=COST, dup_weight=0.5).choose(CHAIN, 600, ws, ix)
    assert (d.worker_id, d.reason) == ("a", "local")   # + 5 copied blocks x 0.1 s x 0.5 = 0.45 s > 0.4 s


def test_cost_copies_a_shared_prefix_freely():
    ix = index_with(a=(3, HOT), b=(0, HOT))
    ws = workers(a=300, b=0)            # local: 0.3 + 0.3 s; pull 3 blocks: 0.06 + 0.3 s
    fresh = make_policy("cost", cost=COST, dup_weight=2)
    assert fresh.choose(CHAIN, 600, ws, ix).reason == "local"         # 3 private blocks x 0.2 s
    seen = make_policy("cost", cost=COST, dup_weight=2)
    for other in ([11, 12, 13, 90], [11, 12, 13, 91]):                # 13 continued two ways
        seen.choose(other, 400, ws, ix)
    d = seen.choose(CHAIN, 600, ws, ix)
    assert (d.worker_id, d.reason, d.migrate_from, d.migrate_blocks) == ("b", "migrate", "a", 3)
    assert d.expected_ttft_s == pytest.approx(0.36)


def test_cost_spreads_requests_nobody_holds_over_idle_workers():
    policy = make_policy("cost", cost=COST)
    ix = index_with(a=(0, HOT), b=(0, HOT), c=(0, HOT))
    picks = [policy.choose(CHAIN, 600, workers(a=0, b=0, c=0), ix).worker_id for _ in range(4)]
    assert picks == ["a", "b", "c", "a"]


def test_cost_places_near_ties_by_recent_work():
    ix = index_with(a=(5, HOT), b=(5, WARM))          # a: 0.1 s, b: 0.15 s (WARM promotion)
    policy = make_policy("cost", cost=COST, tie_s=0.1)
    first = policy.choose(CHAIN, 600, workers(a=0, b=0), ix)
    assert (first.worker_id, first.reason) == ("a", "local")
    assert policy.recent_work_s("a") == pytest.approx(0.1) and policy.recent_work_s("b") == 0.0
    second = policy.choose(CHAIN, 600, workers(a=0, b=0), ix)
    assert (second.worker_id, second.expected_ttft_s) == ("b", pytest.approx(0.15))
    strict = make_policy("cost", cost=COST, tie_s=0.0)
    assert [strict.choose(CHAIN, 600, workers(a=0, b=0), ix).worker_id for _ in range(2)] == ["a", "a"]


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


def test_approx_tree_sticks_then_balances():
    policy = make_policy("approx_tree", cost=COST, balance_abs_tokens=1000, balance_rel=1.5)
    ix = GlobalIndex()
    first = policy.choose(CHAIN, 600, workers(a=0, b=0, c=0), ix)
    assert (first.worker_id, first.reason, first.cached_tokens) == ("a", "capacity", 0)
    again = policy.choose(CHAIN, 600, workers(a=900, b=0, c=0), ix)      # within the balance bound
    assert (again.worker_id, again.reason, again.cached_tokens) == ("a", "prefix", 600)
    other = policy.choose([77, 78], 200, workers(a=900, b=0, c=0), ix)   # no match: the emptiest tree
    assert (other.worker_id, other.reason) == ("b", "capacity")
    moved = policy.choose(CHAIN, 600, workers(a=1200, b=10, c=0), ix)    # 1200 - 0 > 1000 and > 1.5 x 0
    assert (moved.worker_id, moved.reason) == ("c", "balance")
    assert policy.matched_blocks(CHAIN) == {"a": 6, "c": 6}


def test_approx_tree_match_rate_threshold_and_lru_bound():
    policy = ApproxTreePolicy(COST, match_rate_threshold=0.5, max_blocks_per_worker=4)
    ix = GlobalIndex()
    policy.choose([1, 2], 200, workers(a=0, b=0), ix)                    # a: {1, 2}
    d = policy.choose([1, 5, 6, 7], 400, workers(a=0, b=0), ix)          # 1 of 4 matched < 50%
    assert (d.worker_id, d.reason) == ("b", "capacity")
    d = policy.choose([1, 2, 8, 9], 400, workers(a=0, b=0), ix)          # 2 of 4 on a
    assert (d.worker_id, d.reason) == ("a", "prefix")
    assert policy.tree_size("a") == 4 and policy.tree_size("b") == 4
    d = policy.choose([3], 100, workers(a=0, b=0), ix)                   # equal trees: a; its LRU drops 9
    assert d.worker_id == "a" and policy.tree_size("a") == 4
    assert policy.matched_blocks([1, 2, 8, 9]) == {"a": 3, "b": 1}


def test_ideal_serves_the_best_hit_anywhere_on_the_least_loaded():
    ix = index_with(g=(4, HOT))
    d = make_policy("ideal", cost=COST).choose(CHAIN, 600, workers(a=300, b=100), ix)
    assert d == Decision("b", "ideal", pytest.approx(0.1 + 0.2), 400)


# ------------------------------------------------------------------- plumbing
def test_make_policy_and_dead_workers():
    assert set(POLICIES) == {"round_robin", "least_loaded", "prefix", "cost", "approx_tree", "ideal"}
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
