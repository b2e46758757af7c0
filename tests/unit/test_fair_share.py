"""Each tenant's fair share of an engine step (``cluster.engine.fair_share``): step by step,
exactly which tenant's tokens a plan holds, and that the tokens produced do not change."""

from __future__ import annotations

import pytest

from cluster.cache.kv_pool import KVLayout
from cluster.cache.quota_config import QuotaConfig
from cluster.cache.tiered import TierConfig, TieredCache
from cluster.engine.engine import Engine, EngineRequest, SamplingParams
from cluster.engine.fair_share import TenantShares
from cluster.errors import InvalidInputError
from tests.unit.test_scheduler import BT, MODEL, reference_outputs


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_engine(budget=16, hot_blocks=256, quotas=(), clock=None):
    """Tenant quotas on (the fair share comes with them; ``()``: none listed), or None: off."""
    quotas = {} if quotas == () else quotas
    c = MODEL.config
    cache = TieredCache(TierConfig(hot_blocks=hot_blocks, warm_blocks=0, block_tokens=BT, device="cpu",
                                   tenant_quotas=quotas),
                        KVLayout(c.num_layers, c.num_kv_heads, c.head_dim), vocab_size=c.vocab_size,
                        deterministic_io=True)
    kw = {"clock": clock} if clock is not None else {}
    return Engine(MODEL, cache, max_batch_tokens=budget, max_running=16, cache_final_token=False, **kw)


def seq(start: int, n: int) -> list[int]:
    """``n`` token ids of the test model's vocabulary (64), from ``start + 1`` on."""
    return [(start + i) % 63 + 1 for i in range(n)]


def submit(engine, ns, prompt, max_tokens=2):
    return engine.submit(EngineRequest(list(prompt), SamplingParams(max_tokens=max_tokens), namespace=ns))


def step(engine) -> list[tuple]:
    """One engine step; its plan as (tenant, start, tokens) per item."""
    plan = engine.scheduler.schedule()
    items = [(i.request.namespace, i.start, i.num_tokens) for i in plan.items]
    engine.scheduler.schedule = lambda: plan   # the step runs exactly this plan
    try:
        engine.step()
    finally:
        del engine.scheduler.schedule
    return items


def drive(engine, limit=2000):
    n = 0
    while engine.has_work():
        engine.step()
        n += 1
        assert n < limit, "the engine stopped making progress"


def test_a_lone_tenant_gets_the_whole_budget_first_come_first_served():
    engine = make_engine(budget=16)
    submit(engine, "A", range(1, 41))
    submit(engine, "A", range(41, 51))
    assert step(engine) == [("A", 0, 16)]
    assert step(engine) == [("A", 16, 16)]
    assert step(engine) == [("A", 32, 8), ("A", 0, 8)]   # its own later request fills the rest


def test_a_short_request_of_another_tenant_runs_whole_in_the_next_step_beside_a_flood():
    """A fills the budget with a long prompt and has two more queued; B's 6-token prompt,
    submitted after all of them, is planned whole in the very next step (first come, first
    served it would wait for A's 104 tokens), alone: A's chunk waits a step
    (``first_token_alone``), then takes the rest of the budget beside B's decode."""
    engine = make_engine(budget=16)
    submit(engine, "A", seq(0, 40))
    submit(engine, "A", seq(40, 32))
    submit(engine, "A", seq(20, 32))
    assert step(engine) == [("A", 0, 16)]
    submit(engine, "B", [7, 8, 9, 10, 11, 12])
    assert step(engine) == [("B", 0, 6)]
    # B decodes next: its token first, then the rest to A, least served
    assert step(engine) == [("B", 6, 1), ("A", 16, 15)]
    assert step(engine) == [("A", 31, 9), ("A", 0, 7)]


@pytest.mark.parametrize("b_tokens, want", [
    (11, [("B", 0, 11)]),                  # past its equal part (8) but within the step: whole, A's chunk out
    (16, [("B", 0, 16)]),                  # the whole step: whole, A waits a step
    (20, [("B", 0, 8), ("A", 16, 8)]),     # longer than the step: an equal part, chunked
])
def test_a_prompt_that_can_end_in_this_step_ends_in_it(b_tokens, want):
    """B's prompt goes whole where the step's budget holds it, even past B's equal part (its
    first token a step sooner), without A's chunk beside it (``first_token_alone``); a longer
    one is chunked at the equal part, and its rest (12, B still the less served of the two)
    ends whole in the next step, alone."""
    engine = make_engine(budget=16)
    submit(engine, "A", seq(0, 60))
    assert step(engine) == [("A", 0, 16)]
    submit(engine, "B", seq(5, b_tokens))
    assert step(engine) == want
    if b_tokens == 20:
        assert step(engine) == [("B", 8, 12)]


def test_two_backlogged_tenants_split_the_budget_exactly():
    """Both with long prompts: half each, the tenant with the older request first (ties), and
    the one served less last step first after that; the odd token to the earlier one."""
    engine = make_engine(budget=17)
    submit(engine, "A", range(1, 61))
    submit(engine, "B", range(2, 62))
    assert step(engine) == [("A", 0, 9), ("B", 0, 8)]   # a tie: A's request is older; it gets the odd token
    assert step(engine) == [("B", 8, 9), ("A", 9, 8)]   # B served less: B first, B the odd token
    assert step(engine) == [("A", 17, 9), ("B", 17, 8)]


def test_three_tenants_share_and_what_one_leaves_goes_to_the_next():
    engine = make_engine(budget=30)
    submit(engine, "A", range(1, 61))
    submit(engine, "B", [5, 6, 7, 8])          # needs 4 of its 10
    submit(engine, "C", range(3, 63))
    # A: 30/3 = 10; B: ceil(20/2) = 10, uses 4; C: the 16 left
    assert step(engine) == [("A", 0, 10), ("B", 0, 4), ("C", 0, 16)]


def test_every_tenants_decodes_ride_in_every_step():
    engine = make_engine(budget=8)
    submit(engine, "B", [1, 2, 3], max_tokens=6)
    submit(engine, "C", [4, 5, 6], max_tokens=6)
    step(engine)                        # both prompts
    submit(engine, "A", range(1, 61))
    for _ in range(4):
        items = step(engine)
        assert [(ns, n) for ns, _, n in items] == [("B", 1), ("C", 1), ("A", 6)]


def test_fair_order_changes_no_token():
    """Three tenants, interleaved prompts sharing prefixes within a tenant and a small HOT
    (preemptions): each request's tokens are exactly those of a run alone."""
    prompts = [("A", list(range(1, 30))), ("B", [9, 8, 7]), ("A", list(range(1, 20)) + [50, 51]),
               ("C", list(range(30, 60))), ("B", [9, 8, 7, 6, 5]), ("C", list(range(30, 45)))]
    work = [(p, SamplingParams(max_tokens=7, temperature=0.8, seed=i)) for i, (_, p) in enumerate(prompts)]
    want = reference_outputs(work)
    engine = make_engine(budget=12, hot_blocks=20)
    reqs = [engine.submit(EngineRequest(list(p), s, namespace=ns)) for (ns, _), (p, s) in zip(prompts, work)]
    drive(engine)
    assert [r.output for r in reqs] == want
    assert engine.stats["preemptions"] > 0   # the small HOT did make requests give way
    engine.cache.check_invariants()


def test_step_tokens_shorten_steps_while_another_tenant_was_active_within_the_window():
    clock = Clock()
    engine = make_engine(budget=32, clock=clock, quotas={"step_tokens": 8, "active_window_s": 10})
    submit(engine, "A", seq(0, 100), max_tokens=1)
    assert step(engine) == [("A", 0, 32)]      # A alone: the whole budget
    submit(engine, "B", [3, 4, 5], max_tokens=1)
    assert step(engine) == [("B", 0, 3)]       # two tenants: 8 tokens a step, B's first token alone
    clock.now = 5.0
    assert step(engine) == [("A", 32, 8)]      # B done 5 s ago: still within the window
    clock.now = 10.5
    assert step(engine) == [("A", 40, 32)]     # B quiet for longer than the window: A's whole budget again


def test_the_least_served_tenant_ends_a_prompt_past_the_shortened_step_the_flood_is_chunked():
    """Steps of 8 while two tenants work (``step_tokens``), budget 32: B's 14-token request
    (B served least) ends in one step, past the 8 by up to one more step of 8; A's prompt goes
    on in the short steps' chunks, and B's next prompt, longer than 16, is chunked too."""
    engine = make_engine(budget=32, quotas={"step_tokens": 8})
    submit(engine, "A", seq(0, 100), max_tokens=1)
    assert step(engine) == [("A", 0, 32)]
    submit(engine, "B", seq(40, 14), max_tokens=1)
    assert step(engine) == [("B", 0, 14)]                  # B first (least served), whole: 14 <= 8 + 8
    assert step(engine) == [("A", 32, 8)]                  # A's 8-token chunks go on, never past 8
    assert step(engine) == [("A", 40, 8)]
    submit(engine, "B", seq(7, 20), max_tokens=1)
    assert step(engine) == [("B", 0, 4), ("A", 48, 4)]     # 20 > 16: B's equal part of 8


def test_tenant_shares_order_and_allot():
    shares = TenantShares()
    assert shares.order(["A", "B"]) == ["A", "B"]
    shares.charge({"A": 10})
    assert shares.order(["A", "B"]) == ["B", "A"]
    shares.charge({"B": 20})   # A 9, B 20
    assert shares.served == pytest.approx({"A": 9.0, "B": 20.0})
    assert shares.order(["A", "B"]) == ["A", "B"]
    assert [TenantShares.allot(17, 2), TenantShares.allot(8, 1), TenantShares.allot(30, 3)] == [9, 8, 10]
    assert shares.budget(512, ["A"], 0.0) == 512   # no step_tokens: always the whole budget
    capped = TenantShares(step_tokens=64, window_s=5)
    assert capped.budget(512, ["A"], 0.0) == 512
    assert capped.budget(512, ["A", "B"], 1.0) == 64
    assert capped.budget(32, ["A"], 2.0) == 32   # never above max_batch_tokens
    assert capped.budget(512, ["A"], 6.5) == 512   # B last seen at 1.0: out of the window


def test_step_tokens_config_is_checked_and_round_trips():
    config = QuotaConfig.parse({"step_tokens": 48, "active_window_s": 12.5})
    assert (config.step_tokens, config.active_window_s) == (48, 12.5)
    assert QuotaConfig.parse(config.to_dict()) == config
    assert "step_tokens" not in QuotaConfig.parse({}).to_dict()
    for bad, match in (({"step_tokens": 0}, "step_tokens must be an integer >= 1"),
                       ({"step_tokens": True}, "step_tokens must be an integer >= 1"),
                       ({"active_window_s": 0}, r"active_window_s must be a number of seconds in \(0, 86400\]")):
        with pytest.raises(InvalidInputError, match=match):
            QuotaConfig.parse(bad)


def test_under_quotas_a_waiting_request_without_room_preempts_the_flooding_tenant():
    """A (no guarantee) decodes one request and fills another; HOT has one free block. B
    (guaranteed a quarter of HOT, holding nothing) sends a 20-token prompt: it finds no room,
    so A's filling request gives way (preempted, its KV into the cache) instead of B waiting
    for A's requests to end, and B runs in the next step. Every token is that of a run alone."""
    work = [(seq(i * 30, 28), SamplingParams(max_tokens=4)) for i in range(2)]
    b_work = (seq(5, 20), SamplingParams(max_tokens=2))
    want = reference_outputs(work + [b_work])
    engine = make_engine(budget=16, hot_blocks=14, quotas={"tenants": {"B": {"hot": {"guarantee": 0.25}}}})
    reqs = [engine.submit(EngineRequest(list(p), s, namespace="A")) for p, s in work]
    assert [step(engine) for _ in range(3)] == [[("A", 0, 16)], [("A", 16, 12), ("A", 0, 4)],
                                                [("A", 28, 1), ("A", 4, 15)]]
    assert engine.cache.hot.allocator.free_blocks == 1
    b = engine.submit(EngineRequest(list(b_work[0]), b_work[1], namespace="B"))
    assert step(engine) == [("A", 29, 1)]          # B found no room: A's filling request gave it
    assert [r.preemptions for r in reqs] == [0, 1]
    assert step(engine) == [("A", 30, 1), ("B", 0, 8), ("A", 0, 7)]   # B first, A's back from its cache
    drive(engine)
    assert [r.output for r in reqs + [b]] == want
    engine.cache.check_invariants()


def test_a_waiting_request_claims_room_held_by_decodes_planned_before_it():
    """A decodes two requests and HOT is full; B's 20-token prompt finds no room, and every
    running request is already in that step's plan (decodes go first), so none could give
    it then. Before the next step is planned B claims it: A's newer request is preempted
    (its KV into the cache) and B runs in that step, not once A's own growth next needs a
    block (a step later here; 5-26 steps beside a flood whose blocks hold 16-32 tokens).
    Every token is that of a run alone."""
    work = [(seq(i * 30, 22), SamplingParams(max_tokens=14)) for i in range(2)]
    b_work = (seq(5, 20), SamplingParams(max_tokens=2))
    want = reference_outputs(work + [b_work])
    engine = make_engine(budget=16, hot_blocks=14, quotas={"tenants": {"B": {"hot": {"guarantee": 0.25}}}})
    reqs = [engine.submit(EngineRequest(list(p), s, namespace="A")) for p, s in work]
    assert [step(engine) for _ in range(4)][-1] == [("A", 23, 1), ("A", 22, 1)]   # both decode
    assert engine.cache.hot.allocator.free_blocks == 1
    b = engine.submit(EngineRequest(list(b_work[0]), b_work[1], namespace="B"))
    assert step(engine) == [("A", 24, 1), ("A", 23, 1)]   # B found no room; no victim outside the plan
    assert engine.scheduler.stats["room_claims"] == 0 and [r.preemptions for r in reqs] == [0, 0]
    assert ("B", 0, 8) in step(engine)   # claimed: A's newer request gave way before the plan
    assert engine.scheduler.stats["room_claims"] == 1 and [r.preemptions for r in reqs] == [0, 1]
    drive(engine)
    assert [r.output for r in reqs + [b]] == want
    engine.cache.check_invariants()


def test_the_claim_goes_to_the_waiting_tenant_least_over_its_guarantee_first():
    """A decodes two requests in a full HOT (56 tokens; A guaranteed a quarter, 14, and 35
    over it). C (no guarantee, a 40-token prompt) and then B (guaranteed a quarter; a 20-token
    prompt) each find no room with every running request in the plan. The claim is B's,
    least over its guarantee: C would be 40 over with its prompt, further than A, so the
    quotas give C nothing of A's, and B, 6 over with its prompt, A's newer request. Taken for
    the step's first unmet request only (C's, as before 2026-12-07), the claim would find no
    victim and B would wait for A's decodes to end. Every token is that of a run alone."""
    work = [(seq(i * 30, 22), SamplingParams(max_tokens=14)) for i in range(2)]
    c_work, b_work = (seq(40, 40), SamplingParams(max_tokens=2)), (seq(5, 20), SamplingParams(max_tokens=2))
    want = reference_outputs(work + [c_work, b_work])
    engine = make_engine(budget=16, hot_blocks=14, quotas={"tenants": {"A": {"hot": {"guarantee": 0.25}}, "B": {"hot": {"guarantee": 0.25}}}})
    reqs = [engine.submit(EngineRequest(list(p), s, namespace="A")) for p, s in work]
    assert [step(engine) for _ in range(4)][-1] == [("A", 23, 1), ("A", 22, 1)]
    c = engine.submit(EngineRequest(list(c_work[0]), c_work[1], namespace="C"))
    b = engine.submit(EngineRequest(list(b_work[0]), b_work[1], namespace="B"))
    assert step(engine) == [("A", 24, 1), ("A", 23, 1)]   # neither found room; no victim out of the plan
    assert [engine.cache.quotas.excess(ns, 0) for ns in "ABC"] == [35, -14, 0]
    assert not engine.cache.may_preempt("C", "A", 40) and engine.cache.may_preempt("B", "A", 20)
    # Claimed for B: A's newer request gave way before the plan; B's first chunk and C's fit
    # in the room it left, A's comes back behind B (its KV from the cache).
    assert step(engine) == [("A", 25, 1), ("C", 0, 5), ("B", 0, 5), ("A", 0, 5)]
    assert engine.scheduler.stats["room_claims"] == 1 and [r.preemptions for r in reqs] == [0, 1]
    drive(engine)
    assert [r.output for r in reqs + [c, b]] == want
    engine.cache.check_invariants()


def test_the_claim_takes_what_the_quotas_allow_from_the_tenant_served_most_newest_first():
    """The claim takes from another tenant's running request that ``may_preempt`` allows (the
    quotas: further over its HOT guarantee than the claimant would be), the tenant served most
    first, newest first; never from the claimant's own tenant."""
    from types import SimpleNamespace

    from cluster.engine.policies.fair import FairSharePolicy

    policy = FairSharePolicy(4, None)
    policy.shares.served.update({"A": 40.0, "B": 2.0, "C": 2.0})
    running = [SimpleNamespace(namespace=ns, preemptions=0) for ns in ("B", "A", "A", "C")]
    allow = lambda requester, victim: True
    assert policy.claim_victim(SimpleNamespace(namespace="B"), running, allow) is running[2]   # A's newest
    assert policy.claim_victim(SimpleNamespace(namespace="A"), running, allow) is running[3]   # C's, newer than B's
    assert policy.claim_victim(SimpleNamespace(namespace="A"), running[:3], allow) is running[0]
    assert policy.claim_victim(SimpleNamespace(namespace="B"), running, lambda r, v: v != "A") is running[3]
    assert policy.claim_victim(SimpleNamespace(namespace="B"), running, lambda r, v: False) is None


def test_without_tenant_quotas_tenants_stay_first_come_first_served():
    """No ``tenant_quotas``: the plan is the one-queue order of before (B behind A's backlog)."""
    engine = make_engine(budget=16, quotas=None)
    submit(engine, "A", seq(0, 40))
    submit(engine, "A", seq(40, 32))
    assert step(engine) == [("A", 0, 16)]
    submit(engine, "B", [7, 8, 9, 10, 11, 12])
    assert step(engine) == [("A", 16, 16)]
    assert step(engine) == [("A", 32, 8), ("A", 0, 8)]


@pytest.mark.parametrize("need, budget, extra, want", [
    (11, 8, 8, 11),   # ends within the share and what is left after it: whole
    (17, 8, 8, 8),    # does not: a chunk of the share
    (5, 8, 0, 5),     # within the share
    (9, 8, -3, 8),    # nothing past the share to take
])
def test_chunk_tokens(need, budget, extra, want):
    from cluster.engine.fair_share import chunk_tokens
    assert chunk_tokens(need, budget, extra) == want
