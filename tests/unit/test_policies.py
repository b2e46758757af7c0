"""The scheduling policies (``cluster.engine.policies``): which one runs, running slots under the
fair share, and the ``priority`` order; step by step, with the tokens produced unchanged."""

from __future__ import annotations

import pytest

from actors.config import WorkerConfig
from cluster.cache.kv_pool import KVLayout
from cluster.cache.tiered import TierConfig, TieredCache
from cluster.engine.engine import Engine, EngineRequest, SamplingParams
from cluster.engine.policies import POLICIES
from cluster.engine.scheduler_config import SchedulerConfig
from cluster.errors import InvalidInputError
from tests.unit.test_fair_share import seq, step
from tests.unit.test_scheduler import BT, MODEL, check_drained, reference_outputs


def make_engine(quotas=None, max_running=4, budget=64, **kw):
    c = MODEL.config
    cache = TieredCache(TierConfig(hot_blocks=256, warm_blocks=0, block_tokens=BT, device="cpu",
                                   tenant_quotas=quotas),
                        KVLayout(c.num_layers, c.num_kv_heads, c.head_dim), vocab_size=c.vocab_size,
                        deterministic_io=True)
    return Engine(MODEL, cache, max_batch_tokens=budget, max_running=max_running, cache_final_token=False, **kw)


def submit(engine, ns, prompt, max_tokens, priority=0):
    return engine.submit(EngineRequest(list(prompt), SamplingParams(max_tokens=max_tokens, priority=priority),
                                       namespace=ns))


def steps_until(engine, done, limit=500) -> int:
    n = 0
    while not done():
        engine.step()
        n += 1
        assert n < limit
    return n


def drain(engine):
    while engine.has_work():
        engine.step()


# ---------------------------------------------------------------- which policy runs
def test_the_policy_is_what_the_config_names_else_fair_exactly_under_quotas():
    assert type(make_engine().scheduler.policy) is POLICIES["fcfs"]
    assert type(make_engine(quotas={}).scheduler.policy) is POLICIES["fair"]
    assert type(make_engine(quotas={}, policy="priority").scheduler.policy) is POLICIES["priority"]
    assert type(make_engine(policy="fair").scheduler.policy) is POLICIES["fair"]
    with pytest.raises(InvalidInputError, match="policy must be one of fcfs, fair, priority"):
        SchedulerConfig(policy="lottery")
    with pytest.raises(InvalidInputError, match="pass either a SchedulerConfig or its fields"):
        make_engine(config=SchedulerConfig())


def test_scheduling_policy_is_a_checked_worker_key_that_reaches_the_scheduler_config():
    assert WorkerConfig().scheduler_config().policy is None   # fair under tenant_quotas, else fcfs
    assert WorkerConfig.from_dict({"scheduling_policy": "priority"}).scheduler_config().policy == "priority"
    for bad in ("FIFO", 1, True):
        with pytest.raises(InvalidInputError, match=f"scheduling_policy must be one of fcfs, fair, priority .*{bad!r}"):
            WorkerConfig.from_dict({"scheduling_policy": bad})
    cfg = WorkerConfig.from_dict({"max_running": 3, "time_slice_s": None, "shared_fills": False})
    assert cfg.scheduler_config() == SchedulerConfig(max_batch_tokens=512, max_running=3, time_slice_s=None,
                                                     shared_fills=False, cache_final_token=False, policy=None)


# ---------------------------------------------------------------- running slots under the fair share
def four_long_decodes_then_a_short_request(engine):
    """Tenant A's four 40-token answers fill ``max_running`` (4); after 3 steps tenant B sends a
    2-token request. Returns A's requests, B's, and the steps B waited for its first token."""
    a = [submit(engine, "A", seq(10 * i, 8), max_tokens=40) for i in range(4)]
    for _ in range(3):
        engine.step()
    assert [len(r.output) for r in a] == [3, 3, 3, 3]
    b = submit(engine, "B", seq(50, 2), max_tokens=2)
    return a, b, steps_until(engine, lambda: b.output)


def test_a_tenant_without_a_running_slot_gets_one_at_the_next_step_beside_another_tenants_decodes():
    """Under the fair share (tenant quotas) B's request runs at the very next step: A's newest
    decode yields its slot (into the cache, back once B's request is admitted), B's answer
    ends two steps later, and every answer is the one each request gets alone."""
    engine = make_engine(quotas={})
    a, b, waited = four_long_decodes_then_a_short_request(engine)
    assert waited == 1 and engine.stats["slot_yields"] == 1
    assert [r.preemptions for r in a] == [0, 0, 0, 1]   # the newest of the tenant over its share
    assert steps_until(engine, lambda: b.finished) == 1
    drain(engine)
    assert [r.output for r in a + [b]] == reference_outputs(
        [(r.prompt, SamplingParams(max_tokens=r.params.max_tokens)) for r in a + [b]])
    assert engine.stats["recomputed_tokens"] == 0   # A's victim resumed from what the cache kept
    check_drained(engine)


def test_without_the_fair_share_the_short_request_waits_for_a_decode_to_end():
    """First come, first served (no quotas): B waits until A's first answer ends (37 more
    tokens), as before the policy object; no slot is yielded."""
    engine = make_engine()
    a, b, waited = four_long_decodes_then_a_short_request(engine)
    assert waited == 38 and engine.stats["slot_yields"] == 0
    assert [r.preemptions for r in a] == [0, 0, 0, 0]
    drain(engine)
    check_drained(engine)


def test_a_tenant_at_its_share_keeps_its_slots_and_the_owed_slot_is_kept_for_its_tenant():
    """A and B hold 2 of the 4 slots each, their share while they are alone (4 // 2). Tenant C
    comes: the share is 4 // 3 = 1, so both are over it by one, and A, served more recently
    (longer prompts), yields its newest slot to C. A's own later request cannot take that slot
    (it is owed to C): C runs at the next step and is done in it."""
    engine = make_engine(quotas={})
    a = [submit(engine, "A", seq(10 * i, 12), max_tokens=30) for i in range(2)]
    b = [submit(engine, "B", seq(40 + 10 * i, 8), max_tokens=30) for i in range(2)]
    engine.step()
    assert all(r in engine.scheduler.running for r in a + b)
    c = submit(engine, "C", seq(7, 3), max_tokens=1)
    later_a = submit(engine, "A", seq(3, 3), max_tokens=1)   # an older-tenant request that wants the slot too
    assert steps_until(engine, lambda: c.finished) == 1
    assert [r.preemptions for r in a + b] == [0, 1, 0, 0] and later_a.admitted_at is None
    drain(engine)
    check_drained(engine)


def test_a_slot_freed_for_room_does_not_go_to_a_tenant_at_its_share_while_others_have_none():
    """HOT of 9 blocks, 4 slots: A, B, C and D decode one 7-token request each (a slot share of
    1 once T comes); T's 14-token prompt and A's second, 2-token one wait. No tenant has a
    guarantee, and a running request is preempted for another tenant's only where its tenant
    holds more than the requester would with what it asks: decodes of equal tenants that find
    no room yield themselves (B twice, C twice). When C's yields, a slot is free while T has
    none; A, at its share, does not take it (``takes_slot``): before, A's request took it,
    all 4 slots were taken with A over its share, and it yielded the slot at the next step.
    The step after, C's claim preempts A's request, and T, first in the order, takes the room.
    Every answer is the one each request gets alone."""
    c = MODEL.config
    cache = TieredCache(TierConfig(hot_blocks=9, warm_blocks=0, block_tokens=BT, device="cpu", tenant_quotas={}),
                        KVLayout(c.num_layers, c.num_kv_heads, c.head_dim), vocab_size=c.vocab_size,
                        deterministic_io=True)
    engine = Engine(MODEL, cache, max_batch_tokens=16, max_running=4, cache_final_token=False)
    first = [submit(engine, ns, seq(10 * i, 7), max_tokens=8) for i, ns in enumerate("ABCD")]
    assert [step(engine) for _ in range(3)] == [
        [("A", 0, 7), ("B", 0, 7)], [("A", 7, 1), ("B", 7, 1), ("C", 0, 7), ("D", 0, 7)],
        [("A", 8, 1), ("C", 7, 1), ("D", 7, 1), ("B", 8, 1)]]
    t, a2 = submit(engine, "T", seq(50, 14), max_tokens=2), submit(engine, "A", seq(40, 2), max_tokens=2)
    assert step(engine) == [("A", 9, 1), ("D", 8, 1), ("C", 0, 9), ("B", 0, 5)]
    assert [r.preemptions for r in first] == [0, 2, 1, 0]
    assert step(engine) == [("A", 10, 1), ("D", 9, 1), ("B", 5, 5)]   # C's slot stays free
    assert [r.preemptions for r in first] == [0, 2, 2, 0] and a2.admitted_at is None
    assert [r.namespace for r in engine.scheduler.running] == ["A", "D", "B"]
    assert ("T", 0, 14) in step(engine) and engine.stats["room_claims"] == 1 and first[0].preemptions == 1
    assert engine.stats["slot_yields"] == 0
    drain(engine)
    reqs = first + [t, a2]
    assert [r.output for r in reqs] == reference_outputs(
        [(r.prompt, SamplingParams(max_tokens=r.params.max_tokens)) for r in reqs])
    check_drained(engine)


def test_takes_slot_keeps_a_free_slot_for_each_slotless_tenant_from_a_tenant_at_its_share():
    """4 slots, A, B and C run one request each, D (none running) and A wait: a slot share of 1.
    A's second request may not take the last slot (A would hold 2 while D holds none); D's may;
    with two free, A's may (one is left for D); not with D's head yielded to another, nor with the
    slot owed to A's request. First come, first served: anyone."""
    fair = POLICIES["fair"](max_running=4)
    running = [EngineRequest(seq(5 * i, 4), namespace=ns) for i, ns in enumerate("ABC")]
    a2, d = EngineRequest(seq(9, 4), namespace="A"), EngineRequest(seq(19, 4), namespace="D")
    assert fair.takes_slot(a2, 1, running, [a2, d], []) is False
    assert fair.takes_slot(d, 1, running, [a2, d], []) is True
    assert fair.takes_slot(a2, 2, running[:2], [a2, d], []) is True
    assert fair.takes_slot(a2, 1, running, [a2, d], [a2]) is True   # its own slot, owed to it
    d.yielded_to = running[1]
    assert fair.takes_slot(a2, 1, running, [a2, d], []) is True
    assert POLICIES["fcfs"](max_running=4).takes_slot(a2, 1, running, [a2], []) is True


# ---------------------------------------------------------------- priority
def test_priority_serves_a_later_lower_value_first_and_ties_in_arrival_order():
    """One running slot: while the first request runs, four arrive (priorities 5, 0, -1, 0);
    they are admitted -1, then the two 0s in arrival order, then 5."""
    engine = make_engine(max_running=1, policy="priority")
    first = submit(engine, None, seq(0, 4), max_tokens=3)
    engine.step()
    later = [submit(engine, None, seq(10 * k, 4), max_tokens=1, priority=p) for k, p in
             enumerate((5, 0, -1, 0), start=1)]
    drain(engine)
    order = sorted(later, key=lambda r: r.admitted_at)
    assert [later.index(r) for r in order] == [2, 1, 3, 0]
    assert first.admitted_at < order[0].admitted_at
    check_drained(engine)


def test_fcfs_ignores_priority():
    engine = make_engine(max_running=1)
    submit(engine, None, seq(0, 4), max_tokens=2)
    engine.step()
    later = [submit(engine, None, seq(10 * k, 4), max_tokens=1, priority=p) for k, p in enumerate((5, -1), 1)]
    drain(engine)
    assert later[0].admitted_at < later[1].admitted_at


def test_priority_picks_the_least_urgent_running_request_for_room():
    policy = POLICIES["priority"](4)
    reqs = [EngineRequest([1], SamplingParams(priority=p)) for p in (3, 7, 7, -2)]
    assert policy.room_victim(reqs) is reqs[1]   # the highest value, the first (newest) of equals
    assert policy.waiting_order(reqs) == [reqs[3], reqs[0], reqs[1], reqs[2]]
    with pytest.raises(InvalidInputError, match="priority must be an integer"):
        SamplingParams(priority=1.5)
    with pytest.raises(InvalidInputError, match="priority must be an integer"):
        SamplingParams(priority=True)
