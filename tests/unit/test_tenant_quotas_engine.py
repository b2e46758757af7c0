"""Per-tenant quotas through the engine (``cluster.engine`` over ``cluster.cache.quotas``):
who is preempted for whom, guarantees lent by idle tenants and reclaimed, caps at submit,
and that every request is served with the outputs of a run alone. The cache-level rules
are in ``test_tenant_quotas.py``."""

import pytest

from cluster.cache.tiered import TierConfig, TieredCache
from cluster.errors import InvalidInputError
from cluster.names import WARM
from tests.unit.test_tenant_quotas import where_tokens


def _engine(quotas, hot=16, warm=64):
    from cluster.cache.kv_pool import KVLayout
    from cluster.engine.engine import Engine
    from tests.unit.test_scheduler import BT, MODEL

    c = MODEL.config
    cache = TieredCache(TierConfig(hot_blocks=hot, warm_blocks=warm, block_tokens=BT, device="cpu",
                                   tenant_quotas=quotas),
                        KVLayout(c.num_layers, c.num_kv_heads, c.head_dim), vocab_size=c.vocab_size,
                        deterministic_io=True)
    return Engine(MODEL, cache, max_batch_tokens=64, max_running=16, cache_final_token=False)


def _drive(engine):
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        assert steps < 3000, "the engine stopped making progress"


def test_the_engine_preempts_the_tenant_over_its_guarantee_not_the_newest_request():
    """B holds an idle prefix and runs one request, within its HOT guarantee; A runs two
    requests that do not fit beside them. Without quotas the newest running request (B's)
    is preempted; with them A's own newer request gives way each time it comes back while
    the room is short (three times, under the per-tenant step order), and B loses nothing to A
    while it has work (once idle, B lends its guarantee: its prefix goes to WARM for A)."""
    from cluster.engine.engine import EngineRequest, SamplingParams
    from tests.unit.test_scheduler import reference_outputs

    b0 = ([3] * 8, SamplingParams(max_tokens=4))
    work = [([1] * 12, SamplingParams(max_tokens=14)), ([5] * 12, SamplingParams(max_tokens=14)),
            ([2] * 8, SamplingParams(max_tokens=10))]
    want = reference_outputs(work)
    for quotas, preemptions in ((None, [0, 0, 1]), ({"tenants": {"B": {"hot": {"guarantee": 0.5}}}}, [0, 3, 0])):
        engine = _engine(quotas)
        engine.submit(EngineRequest(list(b0[0]), b0[1], namespace="B"))
        _drive(engine)
        reqs = [engine.submit(EngineRequest(list(p), s, namespace=ns)) for (p, s), ns in zip(work, "AAB")]
        lost_while_working = None
        while engine.has_work():
            engine.step()
            if reqs[2].finished and lost_while_working is None:
                lost_while_working = engine.cache.tenant_stats().get("B", {}).get("evictions_suffered_from_others")
        assert [r.preemptions for r in reqs] == preemptions
        assert [r.output for r in reqs] == want   # exact all the same
        if quotas:
            assert lost_while_working["hot"] == 0
            assert engine.cache.stats["dropped_tokens"] == 0
        engine.cache.check_invariants()


def test_a_flood_over_its_guarantee_never_preempts_a_quieter_tenants_running_turns():
    """HOT 64 tokens, B guaranteed 32. A (guaranteed nothing) runs one request, then B two
    turns, and together they outgrow HOT. When the room runs out (A 20 over its guarantee,
    B 8 over its own) A's request gives way, not B's newest turn: under the rule before
    2026-12-07 (any tenant under its cap could preempt one over its guarantee) A preempted
    B's. Every output is the reference's exactly."""
    from cluster.engine.engine import EngineRequest, SamplingParams
    from tests.unit.test_scheduler import reference_outputs

    work = [([3] * 12, SamplingParams(max_tokens=14)), ([4] * 12, SamplingParams(max_tokens=14)),
            ([1] * 12, SamplingParams(max_tokens=14))]
    want = reference_outputs(work)
    engine = _engine({"tenants": {"B": {"hot": {"guarantee": 0.5}}}})
    reqs = [engine.submit(EngineRequest(list(p), s, namespace=ns)) for (p, s), ns in zip(work, "ABB")]
    _drive(engine)
    assert [r.output for r in reqs] == want
    assert [r.preemptions for r in reqs] == [1, 0, 0]
    engine.cache.check_invariants()


def test_a_request_past_its_tenants_hot_cap_is_refused_at_submit_and_guarantees_are_no_bound():
    from cluster.engine.engine import EngineRequest, SamplingParams

    quotas = {"default": {"hot": {"cap": 0.5}}, "tenants": {"B": {"hot": {"guarantee": 0.5}}}}
    engine = _engine(quotas, hot=14)   # 56 tokens: A's cap 28, less a block of slack
    with pytest.raises(InvalidInputError, match=r"HOT cap \(tenant_quotas hot.cap\) lets it hold \(23 tokens\)"):
        engine.submit(EngineRequest([1] * 12, SamplingParams(max_tokens=16), namespace="A"))
    engine.submit(EngineRequest([1] * 12, SamplingParams(max_tokens=8), namespace="A"))   # fits under the cap
    b = engine.submit(EngineRequest([2] * 12, SamplingParams(max_tokens=16), namespace="B"))   # B's cap is 1
    _drive(engine)
    assert b.error is None and len(b.output) == 16
    # B's guarantee (half of HOT) is no bound on A: lent while B is idle (no WARM here: dropped)
    engine = _engine({"tenants": {"B": {"hot": {"guarantee": 0.5}}}}, hot=14, warm=0)
    engine.submit(EngineRequest([2] * 24, SamplingParams(max_tokens=2), namespace="B"))
    _drive(engine)
    a = engine.submit(EngineRequest([1] * 12, SamplingParams(max_tokens=36), namespace="A"))
    _drive(engine)
    assert a.error is None and len(a.output) == 36
    assert engine.cache.tenant_stats()["B"]["evictions_suffered_from_others"]["hot"] > 0


def _idle_b_and_c(warm=64):
    """B and C (``default`` HOT guarantee 0.4: 25 of 64 tokens each) leave idle 23-token
    sequences under their guarantees (a 22-token prompt and its first output token); 16
    tokens of HOT are left. The engine, and the committed sequences by tenant."""
    from cluster.engine.engine import EngineRequest, SamplingParams

    engine = _engine({"default": {"hot": {"guarantee": 0.4}}}, warm=warm)
    kept = {}
    for ns, t in (("B", 3), ("C", 4)):
        req = engine.submit(EngineRequest([t] * 22, SamplingParams(max_tokens=2), namespace=ns))
        _drive(engine)
        kept[ns] = req.tokens[:-1]
    assert engine.cache.hot.allocator.free_blocks == 4
    return engine, kept


def test_idle_tenants_lend_their_guarantees_and_get_their_prefixes_back_by_promotion():
    """A's prompt needs more HOT than B's and C's guarantees leave. Idle, they lend them:
    the least recently used of their prefixes goes to WARM (demoted, not dropped), A is
    served at once, and B's next turn promotes its prefix back and finds all of it."""
    from cluster.engine.engine import EngineRequest, SamplingParams

    engine, kept = _idle_b_and_c()
    a = engine.submit(EngineRequest([1] * 20, SamplingParams(max_tokens=2), namespace="A"))
    engine.step()
    assert a.admitted_at is not None and a.cached_tokens == 0
    _drive(engine)
    cache = engine.cache
    assert where_tokens(cache, kept["B"], "B") == "warm" and where_tokens(cache, kept["C"], "C") == "hot"
    assert cache.stats["dropped_tokens"] == 0
    assert cache.tenant_stats()["B"]["evictions_suffered_from_others"]["hot"] == 23
    b = engine.submit(EngineRequest(kept["B"] + [9, 9], SamplingParams(max_tokens=2), namespace="B"))
    _drive(engine)
    assert b.cached_tokens == 23 and b.tiers_found[WARM] == 23
    cache.check_invariants()


def test_a_returning_owner_reclaims_its_guarantee_from_the_borrower():
    """B (HOT guarantee 0.5) is idle; A (no guarantee) borrows B's room, B's sequence going
    to WARM. B's next turn takes it back: A's idle sequence, over A's guarantee, goes
    down for it, and B's comes back up, found whole."""
    from cluster.engine.engine import EngineRequest, SamplingParams

    engine = _engine({"tenants": {"B": {"hot": {"guarantee": 0.5}}}})   # 64 tokens, 32 kept for B
    cache = engine.cache
    b1 = engine.submit(EngineRequest([3] * 22, SamplingParams(max_tokens=2), namespace="B"))
    _drive(engine)
    a = engine.submit(EngineRequest([1] * 44, SamplingParams(max_tokens=2), namespace="A"))
    _drive(engine)   # A's 45 tokens and B's 23 do not fit in HOT together
    assert where_tokens(cache, b1.tokens[:-1], "B") == "warm" and where_tokens(cache, a.tokens[:-1], "A") == "hot"
    b2 = engine.submit(EngineRequest(b1.tokens[:-1] + [9] * 13, SamplingParams(max_tokens=2), namespace="B"))
    _drive(engine)
    assert b2.cached_tokens == 23 and b2.tiers_found[WARM] == 23 and b2.error is None
    assert where_tokens(cache, a.tokens[:-1], "A") == "warm"    # the borrower's room went back
    assert cache.tenant_stats()["A"]["evictions_suffered_from_others"]["hot"] == 45
    assert cache.stats["dropped_tokens"] == 0
    cache.check_invariants()


def test_tenants_that_only_wait_never_block_each_other_for_good():
    """B and C each keep half of HOT (guarantee 0.5) and hold 28 tokens of it idle; each's
    next turn extends its own sequence by 20 tokens. Neither fits beside the other's kept
    sequence, neither may take it (the other waits too: its guarantee holds) and nothing
    runs that would end: after one step that planned nothing the engine lends the waiting
    tenants' guarantees too; the first is admitted at once, the other after it."""
    from cluster.engine.engine import EngineRequest, SamplingParams

    engine = _engine({"tenants": {t: {"hot": {"guarantee": 0.5}} for t in "BC"}})   # 64 tokens
    kept = {}
    for ns, t in (("B", 3), ("C", 4)):
        req = engine.submit(EngineRequest([t] * 28, SamplingParams(max_tokens=2), namespace=ns))
        _drive(engine)
        kept[ns] = req.tokens[:-1]
    reqs = [engine.submit(EngineRequest(kept[ns] + [9] * 20, SamplingParams(max_tokens=2), namespace=ns))
            for ns in "BC"]
    lent = []
    while engine.has_work():
        lent.append(engine.scheduler.tenant_work.lending_waiting)
        engine.step()
        assert len(lent) < 20
    assert lent[:3] == [False, True, False]   # one step planned nothing; lent for the next, which admits
    assert [r.error for r in reqs] == [None, None] and [r.cached_tokens for r in reqs] == [29, 29]
    assert engine.cache.stats["dropped_tokens"] == 0   # the lent sequence went to WARM and came back
    engine.cache.check_invariants()
