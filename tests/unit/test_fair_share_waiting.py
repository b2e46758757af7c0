"""How the fair share plans a tenant's waiting request beside another tenant's flood: a new
prompt that ends in the step goes before its own tenant's running fill (``ending_first``), the
least-served tenant's request whose prefix is in WARM is admitted in the step that starts its
promotion (``cluster.engine.waiting_checks.InlinePromotions``), and the step in which the
least-served tenant's prompt ends takes no chunk of another tenant's longer prompt
(``first_token_alone``); exactly which tokens each step's plan holds."""

from __future__ import annotations

from cluster.cache.kv_pool import KVLayout
from cluster.cache.tiered import TierConfig, TieredCache
from cluster.engine.engine import Engine, EngineRequest, SamplingParams
from cluster.names import WARM
from tests.unit.test_fair_share import Clock, drive, seq, step, submit
from tests.unit.test_fair_share import make_engine as fair_engine
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
    3 new tokens run in that very step (alone: A's chunk waits, ``first_token_alone``); its
    answer is the one it gets alone."""
    clock = Clock()
    engine = make_engine(clock, quotas={})
    b = b_in_warm_beside_a_flood(engine, clock)
    assert ticking_step(engine, clock) == [("B", 12, 3)]
    assert engine.stats["promotions_inline"] == 1 and engine.stats["waits_for_promotion"] == 1   # the warm-up's
    assert b.tier_hits[:2] == [0, 12] and b.trace.promotion_waits == 0 and b.trace.steps_waited == 0
    assert ticking_step(engine, clock) == [("B", 15, 1), ("A", 32, 15)]
    assert b.finished and b.output == reference_outputs([(b.prompt, SamplingParams(max_tokens=2))])[0]
    while engine.has_work():
        ticking_step(engine, clock)
    check_drained(engine)


def test_a_promotion_is_waited_for_in_the_step_whichever_tenant_goes_first():
    """B served more recently than A (A's group goes first): B's promotion is still waited for
    in the step's planning (one a step, in the fair order), and B's 3 tokens run beside A's
    chunk in that very step. Only the least-served tenant's was, before: B was passed over a
    step (measured beside a flood, a third of the quiet tenant's later turns lost a step so)."""
    clock = Clock()
    engine = make_engine(clock, quotas={})
    b = b_in_warm_beside_a_flood(engine, clock)
    engine.scheduler.policy.shares.charge({"B": 100})
    assert engine.scheduler.policy.shares.order(["A", "B"]) == ["A", "B"]
    assert ticking_step(engine, clock) == [("A", 32, 8), ("B", 12, 3)]
    assert engine.stats["promotions_inline"] == 1 and engine.stats["waits_for_promotion"] == 1   # the warm-up's
    assert b.trace.promotion_waits == 0 and b.trace.steps_waited == 0
    assert ticking_step(engine, clock) == [("B", 15, 1), ("A", 40, 15)]
    assert b.finished and b.output == reference_outputs([(b.prompt, SamplingParams(max_tokens=2))])[0]
    while engine.has_work():
        ticking_step(engine, clock)
    check_drained(engine)


def test_first_come_first_served_also_waits_for_a_short_promotion_in_the_step_that_reaches_it():
    """Without the fair share (fcfs, no quotas) B waits behind A's prompt; the step that reaches
    it starts its promotion and waits for that short copy in its planning, so B's 3 tokens run
    beside A's chunk in that very step. Before, fcfs passed B over a whole step while the copy
    ran (in `bench serving --workload shared-prefix` at R = 1, 10 of 32 requests lost a step so)."""
    clock = Clock()
    engine = make_engine(clock)
    b = b_in_warm_beside_a_flood(engine, clock)
    assert ticking_step(engine, clock) == [("A", 32, 16)]
    assert ticking_step(engine, clock) == [("A", 48, 12), ("B", 12, 3)]   # B's promotion, waited for
    assert engine.stats["promotions_inline"] == 1 and engine.stats["waits_for_promotion"] == 1   # the warm-up's
    assert b.tier_hits[:2] == [0, 12] and b.trace.promotion_waits == 0 and b.trace.steps_waited == 1
    assert ticking_step(engine, clock) == [("B", 15, 1)]
    assert b.finished and b.output == reference_outputs([(b.prompt, SamplingParams(max_tokens=2))])[0]
    while engine.has_work():
        ticking_step(engine, clock)
    check_drained(engine)


def b_fills_a_long_prompt_beside_a_flood(engine):
    """A's 60-token prompt, then B's 40-token one (chunked: B's running fill), then B's
    3-token request. Returns B's short request."""
    submit(engine, "A", seq(0, 60))
    assert step(engine) == [("A", 0, 16)]
    submit(engine, "B", seq(10, 40))
    assert step(engine) == [("B", 0, 8), ("A", 16, 8)]
    return submit(engine, "B", seq(30, 3))


def test_a_new_prompt_that_ends_in_the_step_goes_before_its_own_tenants_running_fill():
    """B's 3 tokens run in the very next step, ahead of B's own 40-token fill, which takes the
    rest of B's share and A's (B's prompt ends: A's chunk waits a step, ``first_token_alone``):
    B's first token comes 3 steps sooner (``FairSharePolicy.ending_first``, on by default)."""
    engine = fair_engine(budget=16)
    assert engine.scheduler.policy.ending_first is True
    b = b_fills_a_long_prompt_beside_a_flood(engine)
    assert step(engine) == [("B", 0, 3), ("B", 8, 5)]
    assert step(engine) == [("B", 3, 1), ("B", 13, 8), ("A", 24, 7)]
    assert b.finished and b.trace.steps_waited == 0 and b.trace.unreached == 0
    assert b.output == reference_outputs([(b.prompt, SamplingParams(max_tokens=2))])[0]


def test_without_ending_first_the_new_prompt_waits_for_its_own_tenants_fill():
    """The same steps with ``ending_first`` off: B's short request is not reached while
    B's fill takes B's share, and runs after the fill ends."""
    engine = fair_engine(budget=16)
    engine.scheduler.policy.ending_first = False
    b = b_fills_a_long_prompt_beside_a_flood(engine)
    assert step(engine) == [("B", 8, 8), ("A", 24, 8)]
    assert step(engine) == [("B", 16, 8), ("A", 32, 8)]
    assert step(engine) == [("B", 24, 16)]
    assert step(engine) == [("B", 40, 1), ("A", 40, 8), ("B", 0, 3)]
    assert b.trace.steps_waited == 3 and b.trace.unreached == 3


def test_a_time_slice_takes_room_only_from_its_own_tenant_or_one_served_as_much():
    """The fair share's time-slice candidates for a waiting request of A (served most): A's own
    decodes only, never quieter B's (which would queue behind A's backlog); for B's request,
    everyone's. First come, first served: every running request, as before."""
    from cluster.engine.policies import POLICIES

    fair = POLICIES["fair"](max_running=8)
    fair.shares.charge({"A": 30, "B": 4})
    running = [EngineRequest(seq(5 * i, 4), namespace=ns) for i, ns in enumerate("ABAB")]
    head_a, head_b = EngineRequest(seq(9, 4), namespace="A"), EngineRequest(seq(9, 4), namespace="B")
    assert fair.slice_candidates(head_a, running) == [running[0], running[2]]
    assert fair.slice_candidates(head_b, running) == running
    assert POLICIES["fcfs"](max_running=8).slice_candidates(head_a, running) == running


def a_decode_and_a_flood_then_two_quiet_tenants(first_token_alone: bool):
    """A decodes a short request beside its 40-token prompt; B (4 tokens) and C (3) arrive."""
    engine = fair_engine(budget=16)
    engine.scheduler.policy.first_token_alone = first_token_alone
    reqs = [submit(engine, "A", [1, 2], max_tokens=6), submit(engine, "A", seq(0, 40))]
    assert step(engine) == [("A", 0, 2), ("A", 0, 14)]
    return engine, reqs + [submit(engine, "B", seq(9, 4)), submit(engine, "C", seq(20, 3))]


def test_a_quiet_tenants_first_token_comes_from_a_step_without_the_floods_chunk():
    """``first_token_alone``: B (served least) ends its prompt, so the step takes no chunk of A's
    longer prompt; A's decode stays, and so does C's prompt, which ends in the step too. A's
    chunk runs in the next step; every answer is the one it gets alone."""
    engine, reqs = a_decode_and_a_flood_then_two_quiet_tenants(True)
    assert step(engine) == [("A", 2, 1), ("B", 0, 4), ("C", 0, 3)]
    assert step(engine) == [("A", 3, 1), ("B", 4, 1), ("C", 3, 1), ("A", 14, 13)]
    assert step(engine) == [("A", 4, 1), ("A", 27, 13)]
    drive(engine)
    assert [r.output for r in reqs] == reference_outputs([(r.prompt, r.params) for r in reqs])


def test_without_first_token_alone_the_floods_chunk_shares_the_quiet_tenants_step():
    """The same steps with the rule off: A's chunk takes what B and C leave of the step."""
    engine, reqs = a_decode_and_a_flood_then_two_quiet_tenants(False)
    assert step(engine) == [("A", 2, 1), ("B", 0, 4), ("C", 0, 3), ("A", 14, 8)]
    assert step(engine) == [("A", 3, 1), ("B", 4, 1), ("C", 3, 1), ("A", 22, 13)]
    assert step(engine) == [("A", 4, 1), ("A", 35, 5)]
    drive(engine)
    assert [r.output for r in reqs] == reference_outputs([(r.prompt, r.params) for r in reqs])


def test_a_time_slice_for_a_tenant_at_its_slot_share_takes_room_from_its_own_tenant_only():
    """4 slots, tenants A, B and C at work (a slot share of 1): B already holds its one slot, so
    its waiting request's time slice may take room from B's own decode only (another tenant's
    slot, freed for it, went to B's next request while a tenant with no slot waited: the tenant
    state machine). D, with no slot, may take room from everyone served at least as much."""
    from cluster.engine.policies import POLICIES

    fair = POLICIES["fair"](max_running=4)
    fair.shares.charge({"A": 30, "B": 4, "C": 10})
    running = [EngineRequest(seq(5 * i, 4), namespace=ns) for i, ns in enumerate("AABC")]
    head_b, head_d = EngineRequest(seq(9, 4), namespace="B"), EngineRequest(seq(9, 4), namespace="D")
    assert fair.slice_candidates(head_b, running) == [running[2]]
    assert fair.slice_candidates(head_d, running) == running
    assert POLICIES["fcfs"](max_running=4).slice_candidates(head_b, running) == running
