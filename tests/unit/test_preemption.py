"""The preemption policy (``cluster.engine.preemption``): a time slice fires only where the
measured gain beats the measured cost, never before ``SLICE_MIN_STEPS`` measured steps,
at most once per stream, and one outlier step does not flip it; a room victim spares
the requests preempted often where it can. Every time is injected (a tick clock, given
step intervals and copy rates), so each decision is exact."""

from __future__ import annotations

import pytest

from cluster.engine import preemption
from cluster.engine.engine import EngineRequest, SamplingParams
from cluster.engine.preemption import (SLICE_MIN_STEPS, Rates, SliceCosts, TimeSlicer, slice_costs,
                                       spare_repeated)
from tests.unit.test_scheduler import check_drained, make_engine, reference_outputs


def decoding(prompt: int, max_tokens: int, produced: int, since: float = 0.0, preemptions: int = 0):
    """A running request that decodes: ``produced`` tokens out, all but the last one's KV computed."""
    req = EngineRequest([1] * prompt, SamplingParams(max_tokens=max_tokens))
    req.output = [2] * produced
    req.num_computed_tokens = prompt + produced - 1
    req.running_since, req.preemptions = since, preemptions
    return req


def waiting(prompt: int, max_tokens: int, found=(0, 0, 0)):
    """A waiting request whose prefix the scheduler found as ``found`` (HOT, WARM, COLD tokens)."""
    req = EngineRequest([3] * prompt, SamplingParams(max_tokens=max_tokens))
    req.first_look = list(found)
    return req


def rates(step_s=1.0, warm=0.0625, cold=None, prefill=None):
    return Rates(step_s, prefill, (warm, cold), budget=64)


def slicer_with_steps(intervals, stats=None, warm=0.0625):
    """A slicer that measured these step intervals (busy steps back to back from t=0)."""
    slicer = TimeSlicer({"time_slice_declined": 0} if stats is None else stats, [None, warm, None], 64)
    now = 0.0
    slicer.steps.forward(now)
    for dt in intervals:
        now += dt
        slicer.steps.forward(now)
    return slicer


# ------------------------------------------------------------------ the rule, term by term
def test_no_slice_for_a_request_behind_decodes_that_end_soon():
    """The decode ends in 3 steps; the waiting request's own 8-token answer (and 1 prefill
    step) would keep the victim out longer than that: gain 3 s < cost 9 s + its swap."""
    victim = decoding(prompt=20, max_tokens=12, produced=9)             # 3 steps left, 28 tokens of KV
    head = waiting(prompt=40, max_tokens=8)
    costs = slice_costs(head, victim, [victim], rates(), free_tokens=12)
    assert costs == SliceCosts(gain_s=3.0, swap_s=2 * 28 * 0.0625, promote_s=0.0, victim_wait_s=1.0 + 8.0)
    assert not costs.worth


def test_a_slice_for_a_short_request_behind_a_long_decode_when_the_copies_are_cheap():
    """51 steps left against a 4-token answer: worth it while the swap is cheap (3.5 s); the
    same slice at a copy rate of 1 s a token (56 s of swap) is refused."""
    victim = decoding(prompt=20, max_tokens=60, produced=9)
    head = waiting(prompt=40, max_tokens=4, found=(0, 32, 0))           # 32 in WARM, 8 to compute
    costs = slice_costs(head, victim, [victim], rates(), free_tokens=12)
    assert costs == SliceCosts(gain_s=51.0, swap_s=3.5, promote_s=32 * 0.0625, victim_wait_s=1.0 + 4.0)
    assert costs.worth
    slow = slice_costs(head, victim, [victim], rates(warm=1.0), free_tokens=12)
    assert (slow.swap_s, slow.promote_s, slow.cost_s, slow.worth) == (56.0, 32.0, 93.0, False)


def test_the_wait_ends_at_the_first_decode_that_frees_the_room_needed():
    """Two decodes: one ends in 2 steps holding 12 tokens, one in 40 holding 29. A waiting
    request that needs 10 tokens beyond what is free waits 2 steps (no slice); one that
    needs 30 waits for both, 40 steps. The unmeasured copy rate counts at the prefill rate."""
    short, long_ = decoding(prompt=10, max_tokens=4, produced=2), decoding(prompt=20, max_tokens=49, produced=9)
    small = waiting(prompt=14, max_tokens=1, found=(4, 0, 0))            # 10 tokens of room needed
    big = waiting(prompt=38, max_tokens=1)
    r = rates(warm=None, prefill=0.25)
    assert slice_costs(small, long_, [long_, short], r, free_tokens=0).gain_s == 2.0
    costs = slice_costs(big, long_, [long_, short], r, free_tokens=9)
    assert costs == SliceCosts(gain_s=40.0, swap_s=2 * 28 * 0.25, promote_s=0.0, victim_wait_s=38 * 0.25 + 1.0)
    assert costs.worth


def test_no_slice_whose_room_leaves_the_waiting_request_short():
    """The victim's 29 tokens and 8 free are 37 of the 38 the waiting request needs: it would
    still wait after the slice (and a second decode would yield for it too), so no slice,
    however large the gain; with 9 free it is exactly enough."""
    short, long_ = decoding(prompt=10, max_tokens=4, produced=2), decoding(prompt=20, max_tokens=49, produced=9)
    big = waiting(prompt=38, max_tokens=1)
    r = rates(warm=None, prefill=0.25)
    short_of = slice_costs(big, long_, [long_, short], r, free_tokens=8)
    assert (short_of.gain_s, short_of.covers, short_of.worth) == (40.0, False, False)
    assert slice_costs(big, long_, [long_, short], r, free_tokens=9).covers
    slicer = slicer_with_steps([1.0] * SLICE_MIN_STEPS, warm=None)
    longest = lambda candidates: max(candidates, key=lambda c: c.num_computed_tokens)   # noqa: E731
    assert slicer.victim(big, [long_, short], 50.0, 0.5, 0.25, 8, longest) is None
    # The fair share's slices across tenants need not cover: the gain still beats the cost.
    assert slicer.victim(big, [long_, short], 50.0, 0.5, 0.25, 8, longest, covering=False) is long_


# ------------------------------------------------------------------ when a slice may fire
def test_a_slice_never_fires_before_the_measured_steps():
    """Fewer than SLICE_MIN_STEPS step intervals measured: no decode may yield, however long
    it ran; with them, a decode yields after max(time_slice_s, 8 x the median step)."""
    head = waiting(prompt=40, max_tokens=4)
    victim = decoding(prompt=20, max_tokens=60, produced=9, since=0.0)
    young = slicer_with_steps([1.0] * (SLICE_MIN_STEPS - 1))
    assert young.slice_s(0.5) is None
    assert young.victim(head, [victim], 100.0, 0.5, None, 12) is None
    assert young.stats["time_slice_declined"] == 0   # no decision was made
    grown = slicer_with_steps([1.0] * SLICE_MIN_STEPS)
    assert grown.slice_s(0.5) == 8.0 and grown.slice_s(12.0) == 12.0
    assert grown.candidates([victim], 7.9, 0.5) == [] and grown.candidates([victim], 8.0, 0.5) == [victim]
    assert grown.victim(head, [victim], 8.0, 0.5, None, 12) is victim   # 12 free and its 29: the 40 needed


def test_a_stream_preempted_once_is_never_a_slice_victim():
    """The bound is by request: after one preemption (a slice or for room) a decode no longer
    yields a slice; the fresh one beside it still may."""
    slicer = slicer_with_steps([1.0] * SLICE_MIN_STEPS)
    once = decoding(prompt=20, max_tokens=60, produced=9, preemptions=1)
    fresh = decoding(prompt=24, max_tokens=60, produced=9)
    assert slicer.candidates([once], 50.0, 0.5) == []
    assert slicer.candidates([fresh, once], 50.0, 0.5) == [fresh]
    assert slicer.victim(waiting(prompt=40, max_tokens=4), [fresh, once], 50.0, 0.5, None, 12) is fresh


def test_one_outlier_step_does_not_flip_the_decision():
    """Fifteen 1 s steps and one of 50 s: the median stays 1 s, so a slice refused at 1 s a step
    (51 s of gain against 50 s of swap and 5 s of the victim's wait) stays refused. A moving
    average (0.8/0.2) would have read 10.8 s a step, and with it the gain would have won."""
    head = waiting(prompt=40, max_tokens=4)
    victim = decoding(prompt=20, max_tokens=60, produced=9)              # 28 tokens of KV
    warm = 50.0 / 56                                                     # 50 s out and back
    steady = slicer_with_steps([1.0] * 15, warm=warm)
    spiked = slicer_with_steps([1.0] * 15 + [50.0], warm=warm)
    assert spiked.steps.median() == 1.0
    for slicer in (steady, spiked):
        assert slicer.victim(head, [victim], 20.0, 0.5, None, 12) is None
        assert slicer.stats["time_slice_declined"] == 1
    ewma = 1.0 * 0.8 + 50.0 * 0.2
    assert slice_costs(head, victim, [victim], rates(step_s=ewma, warm=warm), 12).worth


def test_a_refused_slice_is_counted_once_per_waiting_request():
    slicer = slicer_with_steps([1.0] * SLICE_MIN_STEPS)
    victim = decoding(prompt=20, max_tokens=12, produced=9)
    first, second = waiting(prompt=40, max_tokens=8), waiting(prompt=40, max_tokens=8)
    for head in (first, first, first, second):
        assert slicer.victim(head, [victim], 20.0, 0.5, None, 12) is None
    assert slicer.stats["time_slice_declined"] == 2


def test_room_victims_spare_the_requests_preempted_often():
    a, b, c = (decoding(prompt=8, max_tokens=4, produced=1, preemptions=n) for n in (2, 0, 3))
    assert spare_repeated([a, b, c]) == [b]
    assert spare_repeated([a, c]) == [a, c]   # nobody else can yield: liveness first
    assert spare_repeated([]) == []


# ------------------------------------------------------------------ in the engine
def run_ticks(engine, now, submit_at=None, max_steps=500) -> dict:
    """Step one tick at a time until the engine is idle; ``submit_at``: {tick: request} to submit
    then. The tick each request sampled its last token at, by id."""
    submit_at, ended = dict(submit_at or {}), {}
    steps = 0
    while engine.has_work() or submit_at:
        now[0] += 1.0
        if now[0] in submit_at:
            engine.submit(submit_at.pop(now[0]))
        for event in engine.step():
            if event.finished:
                ended[id(event.request)] = now[0]
        steps += 1
        assert steps < max_steps
    return ended


def test_the_engine_refuses_a_slice_behind_a_decode_that_ends_soon():
    """HOT holds one 40-token session and its answer. A (12 tokens) has 3 left when its slice
    comes; B's 20-token answer behind it is not worth a stall: B waits for A's end, A is never
    preempted, and the refusal is counted once."""
    a, b = [(3 * i) % 64 for i in range(40)], [(5 * i + 1) % 64 for i in range(40)]
    params = [SamplingParams(max_tokens=12), SamplingParams(max_tokens=20)]
    now = [0.0]
    engine = make_engine(hot_blocks=20, warm_blocks=64, budget=64, time_slice_s=0.5)
    engine.clock = lambda: now[0]
    ra = engine.submit(EngineRequest(list(a), params[0]))
    engine.step()
    rb = engine.submit(EngineRequest(list(b), params[1]))
    ended = run_ticks(engine, now)
    assert [ra.output, rb.output] == reference_outputs([(a, params[0]), (b, params[1])])
    assert (ra.preemptions, engine.stats["time_slice_preemptions"], engine.stats["time_slice_declined"]) == (0, 0, 1)
    assert (ended[id(ra)], rb.first_token_at) == (11.0, 12.0)   # A's 11 further decodes, then B
    check_drained(engine)


@pytest.mark.parametrize("bound", [1, 2])
def test_one_stream_yields_at_most_the_bound_of_slices(monkeypatch, bound):
    """A long answer (A, 30 tokens) and two short ones behind it, the second arriving after A
    came back: A yields its slice to B, and with the default bound (one preemption) never
    again, so C waits for A's end; raise the bound and A yields to C too. Every answer is
    the one of unlimited memory, nothing recomputed."""
    monkeypatch.setattr(preemption, "SLICE_MAX_PREEMPTIONS", bound)
    a, b, c = ([(k * i + k) % 64 for i in range(40)] for k in (3, 5, 7))
    params = [SamplingParams(max_tokens=30), SamplingParams(max_tokens=2), SamplingParams(max_tokens=2)]
    now = [0.0]
    engine = make_engine(hot_blocks=20, warm_blocks=64, budget=64, time_slice_s=0.5)   # 80 tokens: A, its answer
    engine.clock = lambda: now[0]
    ra = engine.submit(EngineRequest(list(a), params[0]))
    engine.step()
    rb = engine.submit(EngineRequest(list(b), params[1]))
    rc = EngineRequest(list(c), params[2])
    ended = run_ticks(engine, now, submit_at={14.0: rc})
    want = reference_outputs([(a, params[0]), (b, params[1]), (c, params[2])])
    assert [ra.output, rb.output, rc.output] == want
    assert (ra.preemptions, engine.stats["time_slice_preemptions"]) == (bound, bound)
    assert rb.first_token_at == 9.0   # A's slice: 8 step intervals measured (forwards at ticks 0-8)
    assert engine.stats["recomputed_tokens"] == 0
    if bound == 1:   # C came while A ran again, and waited for all of A's answer
        assert rc.first_token_at == ended[id(ra)] + 1
    else:   # A yielded again, a slice after it came back: C before A's end
        assert rc.first_token_at < ended[id(ra)]
    check_drained(engine)
