"""The fair share's inline promotion (``cluster.engine.waiting_checks.promote_inline``): beside
another tenant's flood, the least-served tenant's request whose prefix is in WARM is admitted
in the step that starts its promotion; exactly which tokens each step's plan holds."""

from __future__ import annotations

from cluster.cache.kv_pool import KVLayout
from cluster.cache.tiered import TierConfig, TieredCache
from cluster.engine.engine import Engine, EngineRequest, SamplingParams
from cluster.names import HOT, WARM
from tests.unit.test_fair_share import Clock, seq, step
from tests.unit.test_scheduler import BT, MODEL, check_drained, reference_outputs

STEP_S = 10.0   # the test clock's step: any real copy is far below a quarter of it


def make_engine(clock, quotas=None, policy=None):
    c = MODEL.config
    cache = TieredCache(TierConfig(hot_blocks=128, warm_blocks=128, block_tokens=BT, device="cpu",
                                   tenant_quotas=quotas),
                        KVLayout(c.num_layers, c.num_kv_heads, c.head_dim), vocab_size=c.vocab_size,
                        deterministic_io=True, clock=clock)
    kw = {"policy": policy} if policy else {}
    return Engine(MODEL, cache, max_batch_tokens=16, max_running=16, cache_final_token=False, clock=clock, **kw)


def ticking_step(engine, clock) -> list[tuple]:
    clock.now += STEP_S
    return step(engine)


def b_in_warm_beside_a_flood(engine, clock):
    """B's 12-token turn ends and its prefix goes down to WARM (a warm-up promotion of another
    of B's prefixes measured the copy rate); A's 60-token prompt fills the steps; B's next
    turn (the 12 tokens and 3 new) is submitted. Returns B's request."""
    for start in (30, 0):   # the first: a warm-up whose promotion measures the copy rate
        first = engine.submit(EngineRequest(seq(start, 12), SamplingParams(max_tokens=1), namespace="B"))
        while engine.has_work():
            ticking_step(engine, clock)
        assert engine.cache.demote_path(first.prompt, "B", WARM) == 12
        engine.cache.wait_all()
        if start == 30:
            warm_up = engine.submit(EngineRequest(seq(30, 14), SamplingParams(max_tokens=1), namespace="B"))
            while engine.has_work():
                ticking_step(engine, clock)
            assert warm_up.tier_hits[WARM] == 12
    assert engine.cache.promote_s_per_token[WARM] is not None
    engine.submit(EngineRequest(seq(20, 60), SamplingParams(max_tokens=1), namespace="A"))
    assert ticking_step(engine, clock) == [("A", 0, 16)]
    assert ticking_step(engine, clock) == [("A", 16, 16)]
    return engine.submit(EngineRequest(seq(0, 15), SamplingParams(max_tokens=2), namespace="B"))


def test_the_least_served_tenants_promotion_is_waited_for_in_the_step_that_admits_it():
    """Under the fair share B's prefix comes up from WARM within the step's planning and B's
    3 new tokens run in that very step (A the rest); its answer is the one it gets alone."""
    clock = Clock()
    engine = make_engine(clock, quotas={})
    b = b_in_warm_beside_a_flood(engine, clock)
    assert ticking_step(engine, clock) == [("B", 12, 3), ("A", 32, 13)]
    assert engine.stats["promotions_inline"] == 1 and engine.stats["waits_for_promotion"] == 1   # the warm-up's
    assert b.tier_hits[:2] == [0, 12] and b.trace.promotion_waits == 0 and b.trace.steps_waited == 0
    assert ticking_step(engine, clock) == [("B", 15, 1), ("A", 45, 15)]
    assert b.finished and b.output == reference_outputs([(b.prompt, SamplingParams(max_tokens=2))])[0]
    while engine.has_work():
        ticking_step(engine, clock)
    check_drained(engine)


def test_first_come_first_served_passes_the_request_over_while_its_prefix_is_promoted():
    """Without the fair share (fcfs, no quotas) nothing changed: B waits behind A's prompt, its
    promotion starts in the step that reaches it and B runs in the step after."""
    clock = Clock()
    engine = make_engine(clock)
    b = b_in_warm_beside_a_flood(engine, clock)
    assert ticking_step(engine, clock) == [("A", 32, 16)]
    assert ticking_step(engine, clock) == [("A", 48, 12)]   # B's promotion starts: B passed over
    assert ticking_step(engine, clock) == [("B", 12, 3)]
    assert engine.stats["promotions_inline"] == 0 and engine.stats["waits_for_promotion"] == 2
    assert b.tier_hits[:2] == [0, 12] and b.trace.promotion_waits == 1 and b.trace.steps_waited == 2
    while engine.has_work():
        ticking_step(engine, clock)
    check_drained(engine)
