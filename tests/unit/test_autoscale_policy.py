"""The autoscaling policy without Ray (``cluster.routing.autoscale``): exact decisions over
an injected clock and sequences of replica signals, and the TTFT window the replicas keep."""

import dataclasses

import pytest

from cluster.errors import InvalidInputError
from cluster.routing.autoscale import AutoscaleConfig, AutoscaleState, decide
from cluster.routing.autoscale_signals import ReplicaSignals, TtftWindow

CONFIG = AutoscaleConfig()   # ttft_slo_s 2, 1 s of queued prefill, window 60 s, intervals 10 s out / 30 s in
RATE = 2000.0                # prefill tokens/s: the queue threshold is 2,000 tokens a replica
IDLE = ReplicaSignals(0, 0, 0.0, 0, RATE)


def busy(queued=0, blocked=0.0, ttft=0.0, running=0, rate=RATE):
    return ReplicaSignals(queued, blocked, ttft, running, rate)


def run(signals, target, now, state=AutoscaleState(), running=None, lo=1, hi=8, config=CONFIG):
    return decide(config, signals, target=target, running=target if running is None else running,
                  min_replicas=lo, max_replicas=hi, now=now, state=state)


def test_queued_prefill_past_the_mean_threshold_scales_out_to_what_keeps_each_replica_at_it():
    d = run([busy(queued=3000), busy(queued=2000)], target=2, now=100.0)   # 1.5 + 1.0 replicas of queue
    assert (d.replicas, d.reason) == (3, "scale_out_queue")
    assert d.state == AutoscaleState(last_scale_at=100.0, low_since=None)
    # The same tokens at the mean threshold exactly: no scale-out (and not low: a replica is past half).
    d = run([busy(queued=2000), busy(queued=2000)], target=2, now=100.0)
    assert (d.replicas, d.reason) == (2, "hold")


def test_without_a_measured_rate_the_token_threshold_applies():
    d = run([busy(queued=4097, rate=0.0)], target=1, now=5.0)
    assert (d.replicas, d.reason) == (2, "scale_out_queue")
    assert run([busy(queued=4096, rate=0.0)], target=1, now=5.0).reason == "hold"
    small = AutoscaleConfig(scale_out_queued_tokens=100)
    assert run([busy(queued=250, rate=0.0)], target=1, now=5.0, config=small).replicas == 3


def test_a_scale_out_adds_at_most_max_scale_out_step_and_never_passes_max_replicas():
    flood = [busy(queued=20_000)]   # ten replicas' worth of queue
    assert run(flood, target=1, now=0.0).replicas == 3
    assert run(flood, target=1, now=0.0, config=AutoscaleConfig(max_scale_out_step=5)).replicas == 6
    assert run(flood, target=1, now=0.0, hi=2).replicas == 2
    d = run(flood, target=8, now=0.0)
    assert (d.replicas, d.reason) == (8, "at_max")


def held(readings, rate=400.0):
    """A replica's signals as Serve hands them over: the look-back's mean and its own readings."""
    return ReplicaSignals(sum(readings) / len(readings), 0.0, 0.0, 0, rate, tuple(readings))


def test_a_burst_the_replica_cleared_holds_and_a_queue_that_persists_scales_out():
    # Threshold 400 tokens (1 s at 400 tokens/s). Both look-backs' means pass it; only the
    # second's queue stayed above it for half the readings. The burst is the cool-phase flap of
    # `bench autoscale` (3 sessions in 2 s, cleared in 2 s); the ramp is the peak's onset.
    burst = held([20, 571, 1543, 89, 0])          # mean 444.6: 2 of 5 readings above
    d = run([burst], target=1, hi=2, now=200.0, state=AutoscaleState(last_scale_at=150.0, low_since=190.0))
    assert (d.replicas, d.reason) == (1, "queue_brief")
    assert d.state == AutoscaleState(last_scale_at=150.0, low_since=None)   # not low either
    ramp = held([581, 1288, 1961, 1262, 72])      # mean 1032.8: 4 of 5 above
    d = run([ramp], target=1, hi=2, now=200.0, state=AutoscaleState(last_scale_at=150.0))
    assert (d.replicas, d.reason, d.state) == (2, "scale_out_queue", AutoscaleState(last_scale_at=200.0))
    assert run([ramp], target=1, hi=8, now=200.0).replicas == 3   # ceil(2.58) replicas of queue
    # Without readings (Serve gave no series) the look-back mean alone decides, as before.
    assert run([busy(queued=444.6, rate=400.0)], target=1, now=200.0).reason == "scale_out_queue"


def test_the_queue_must_stay_above_the_threshold_for_scale_out_queue_share_of_the_readings():
    assert run([held([0, 900, 900, 0])], target=1, now=0.0).reason == "scale_out_queue"   # 2 of 4: the share
    assert run([held([0, 900, 900, 400, 400])], target=1, now=0.0).reason == "queue_brief"   # at it is not above
    ramp = [held([581, 1288, 1961, 1262, 72])]   # 4 of 5 above
    assert run(ramp, target=1, now=0.0, config=AutoscaleConfig(scale_out_queue_share=0.8)).reason == "scale_out_queue"
    assert run(ramp, target=1, now=0.0, config=AutoscaleConfig(scale_out_queue_share=0.9)).reason == "queue_brief"


def test_one_replica_whose_queue_persists_is_enough_and_other_signals_are_not_held_back():
    # Two replicas, 2.6 replicas of queue on the mean: one burst, one held queue.
    d = run([held([0, 0, 2000, 1200, 0]), held([500, 500, 500, 500, 0])], target=2, now=0.0)
    assert (d.replicas, d.reason) == (3, "scale_out_queue")
    d = run([held([0, 0, 2000, 1200, 0]), held([900, 0, 0, 0, 0])], target=2, now=0.0)
    assert (d.replicas, d.reason) == (2, "queue_brief")
    # A brief queue does not hide a TTFT above the SLO or a replica out of HOT room.
    ttft = dataclasses.replace(held([20, 571, 1543, 89, 0]), ttft_p90_s=2.5)
    assert (run([ttft], target=1, now=0.0).replicas, run([ttft], target=1, now=0.0).reason) == (2, "scale_out_ttft")
    blocked = dataclasses.replace(held([20, 571, 1543, 89, 0]), blocked_for_room=0.6)
    assert run([blocked], target=1, now=0.0).reason == "scale_out_blocked"


def test_ttft_p90_above_the_slo_adds_one_replica_unless_one_is_already_starting():
    d = run([busy(ttft=2.5), busy(ttft=0.4)], target=2, now=50.0)
    assert (d.replicas, d.reason) == (3, "scale_out_ttft")
    d = run([busy(ttft=2.5)], target=2, running=1, now=50.0)   # the second replica is on its way
    assert (d.replicas, d.reason) == (2, "starting")
    assert run([busy(ttft=2.0)], target=1, now=50.0).reason == "hold"   # at the SLO is not above it


def waited(ttft, wait, prefill_share=None, running=0):
    return ReplicaSignals(0, 0.0, ttft, running, RATE, ttft_wait_p90_s=wait, prefill_share=prefill_share)


@pytest.mark.parametrize("ttft, wait, reason", [
    (2.5, 0.6, "scale_out_ttft"),     # 1.9 s of its own prefill: the wait is what puts it past the SLO
    (6.0, 1.0, "scale_out_ttft"),     # its own prefill alone is past the SLO, but the wait is half of it
    (2.5, 0.4, "ttft_own_prefill"),   # 2.1 s of its own prefill: a replica more would leave it past the SLO
    (6.0, 0.9, "ttft_own_prefill"),
    (2.5, None, "scale_out_ttft"),    # a replica that reports no wait: all of it is wait
])
def test_a_ttft_past_the_slo_scales_out_only_where_its_wait_is_what_more_replicas_shorten(ttft, wait, reason):
    # Eight requests running keep both replicas: without a scale-out, the policy holds, and says why.
    d = run([waited(ttft, wait, running=4), busy(running=4)], target=2, now=50.0)
    assert (d.replicas, d.reason) == ((3 if reason == "scale_out_ttft" else 2), reason)


def test_prompts_whose_own_prefill_is_past_the_slo_let_the_replicas_scale_in_on_their_wait():
    """Long prompts on slow replicas: every TTFT p90 past the SLO, the waits short. The old rule
    (TTFT p90 under half the SLO) never scaled in while they came; the wait is low, and the
    prefill the two replicas did (0.2 of each one's time) fits on one at half its time."""
    state, target, decisions = AutoscaleState(last_scale_at=0.0), 2, []
    for now in (100.0, 159.0, 160.0):
        d = run([waited(3.0, 0.2, prefill_share=0.2)] * target, target=target, now=now, state=state)
        decisions.append((now, d.replicas, d.reason))
        state, target = d.state, d.replicas
    assert decisions == [(100.0, 2, "low_window"), (159.0, 2, "low_window"), (160.0, 1, "scale_in")]
    # One replica's wait at half the SLO is not low: its window restarts.
    d = run([waited(3.0, 1.0, prefill_share=0.2), waited(3.0, 0.2)], target=2, now=500.0, state=AutoscaleState(low_since=0.0))
    assert (d.replicas, d.reason, d.state.low_since) == (3, "scale_out_ttft", None)


def test_scale_in_keeps_the_replicas_their_prefill_needs():
    low = AutoscaleState(low_since=0.0)
    d = run([waited(0.5, 0.1, prefill_share=0.3)] * 3, target=3, now=60.0, state=low)   # 0.9: two at half their time
    assert (d.replicas, d.reason) == (2, "scale_in")
    d = run([waited(0.5, 0.1, prefill_share=0.35)] * 3, target=3, now=60.0, state=low)  # 1.05: three
    assert (d.replicas, d.reason, d.state.low_since) == (3, "hold", 0.0)
    assert d.detail == "prefill 1.05 of a replica needs 3"   # what the controller's log says held them
    assert d.held_by == ("prefill",)   # the controller logs a hold again when this changes
    d = run([waited(0.5, 1.5, prefill_share=0.1)] * 3, target=3, now=60.0, state=low)
    assert (d.reason, d.detail, d.state.low_since) == ("hold", "wait p90 1.50 s", None)
    # Not reported (an older replica): the running requests and the queue decide, as before.
    assert run([waited(0.5, 0.1)] * 3, target=3, now=60.0, state=low).replicas == 1


def test_a_replica_out_of_hot_room_for_half_the_look_back_scales_out():
    d = run([busy(blocked=0.5), IDLE], target=2, now=50.0)
    assert (d.replicas, d.reason) == (3, "scale_out_blocked")
    assert run([busy(blocked=0.4)], target=1, now=50.0).reason == "hold"


def test_the_strongest_reason_sets_the_count():
    d = run([busy(queued=6000, ttft=3.0)], target=1, now=0.0)   # queue wants 3, TTFT 2
    assert (d.replicas, d.reason) == (3, "scale_out_queue")


def test_scale_outs_are_rate_limited_by_the_last_scale_event():
    state = run([busy(ttft=3.0)], target=1, now=100.0).state
    assert state.last_scale_at == 100.0
    d = run([busy(ttft=3.0)] * 2, target=2, now=109.0, state=state)
    assert (d.replicas, d.reason, d.state) == (2, "rate_limited", state)
    d = run([busy(ttft=3.0)] * 2, target=2, now=110.0, state=state)
    assert (d.replicas, d.reason, d.state.last_scale_at) == (3, "scale_out_ttft", 110.0)


def test_scale_in_waits_for_every_signal_to_stay_low_for_the_window_then_goes_to_min():
    state = AutoscaleState(last_scale_at=0.0)
    decisions = []
    # (time, signals): TTFT at 1.5 s is under the SLO but not low (over half of it): the window restarts.
    sequence = [(100.0, [IDLE] * 3), (130.0, [IDLE, busy(ttft=1.5), IDLE]), (131.0, [IDLE] * 3),
                (190.0, [IDLE] * 3), (191.0, [IDLE] * 3)]
    target = 3
    for now, signals in sequence:
        d = run(signals, target=target, now=now, state=state)
        decisions.append((now, d.replicas, d.reason, d.state.low_since))
        state, target = d.state, d.replicas
    assert decisions == [(100.0, 3, "low_window", 100.0), (130.0, 3, "hold", None), (131.0, 3, "low_window", 131.0),
                         (190.0, 3, "low_window", 131.0), (191.0, 1, "scale_in", None)]
    assert state.last_scale_at == 191.0


@pytest.mark.parametrize("signal", [busy(queued=1001), busy(blocked=0.1), busy(ttft=1.01)])
def test_any_signal_above_low_keeps_the_replicas(signal):
    state = AutoscaleState(low_since=0.0)
    d = run([IDLE, signal], target=2, now=1000.0, state=state)
    assert (d.replicas, d.reason, d.state.low_since) == (2, "hold", None)


def test_scale_in_keeps_what_the_running_requests_and_the_queue_need():
    low = AutoscaleState(low_since=0.0)
    signals = [busy(running=2), busy(running=2), busy(running=1), IDLE]   # 5 running: 2 replicas of 4
    assert run(signals, target=4, now=60.0, state=low).replicas == 2
    d = run([busy(running=4)] * 4, target=4, now=60.0, state=low)   # 16 running need all 4
    assert (d.replicas, d.reason, d.state.low_since) == (4, "hold", 0.0)
    queued = [busy(queued=900)] * 4   # 4 x 0.45 replicas of queue, kept at half a threshold: 4
    assert run(queued, target=4, now=60.0, state=low).replicas == 4
    assert run([busy(queued=400)] * 4, target=4, now=60.0, state=low).replicas == 2


def test_a_burst_in_the_look_back_does_not_hold_a_scale_in_and_a_queue_that_stays_does():
    """Issue 52: on a slow replica one request's prompt is half the queue threshold; the cool
    phase of `bench autoscale` held two replicas to the end of its load on look-back means
    of 0.52-0.87 of the threshold (the controller's log). The scale-in reads the median."""
    low = AutoscaleState(low_since=0.0)
    burst = held([0, 0, 0, 1500, 0])   # threshold 400 tokens: the mean is 0.75 of it, the median 0
    d = run([burst, held([0] * 5)], target=2, now=60.0, state=low)
    assert (d.replicas, d.reason) == (1, "scale_in")
    stays = held([300, 300, 300, 0, 0])   # the median 0.75 of the threshold: not low
    d = run([stays, held([0] * 5)], target=2, now=60.0, state=low)
    assert (d.replicas, d.reason, d.detail, d.state.low_since) == (2, "hold", "queue 0.75 of its threshold", None)
    # Without readings the mean decides, as before.
    d = run([busy(queued=300, rate=400.0), IDLE], target=2, now=60.0, state=low)
    assert (d.replicas, d.reason) == (2, "hold")


def test_scale_in_is_rate_limited_by_the_last_scale_event():
    state = AutoscaleState(last_scale_at=50.0, low_since=0.0)
    d = run([IDLE] * 2, target=2, now=79.0, state=state)
    assert (d.replicas, d.reason) == (2, "rate_limited")
    assert run([IDLE] * 2, target=2, now=80.0, state=state).replicas == 1


def test_never_below_min_or_above_max_and_no_signals_holds():
    assert run([IDLE] * 3, target=3, now=100.0, state=AutoscaleState(low_since=0.0), lo=2).replicas == 2
    d = run([IDLE], target=1, now=100.0, state=AutoscaleState(low_since=0.0), lo=1)
    assert (d.replicas, d.reason) == (1, "hold")
    assert run([IDLE], target=0, now=1.0, lo=1).replicas == 1
    d = run([IDLE] * 9, target=9, now=1.0, hi=8)
    assert (d.replicas, d.reason) == (8, "bounds")
    d = run([], target=3, now=1.0, state=AutoscaleState(low_since=0.0))
    assert (d.replicas, d.reason, d.state.low_since) == (3, "no_signals", None)


def test_idle_returns_to_min_within_three_minutes_with_the_defaults():
    """A ramp to 4 replicas, then idle: back at min_replicas one window (60 s) after the signals
    went quiet, on the policy's own clock; the replicas' 30 s TTFT window and Serve's 5 s
    look-back come before it (95 s in all, under 180)."""
    state, target, t, events = AutoscaleState(), 1, 0.0, []
    while t < 400.0:
        if t < 100.0:
            signals = [busy(queued=5000)] * target
        elif t < 140.0:   # the load stopped at 100 s; the TTFT window still shows its tail
            signals = [busy(ttft=2.0)] * target
        else:
            signals = [IDLE] * target
        d = run(signals, target=target, now=t, state=state)
        if d.replicas != target:
            events.append((t, d.replicas, d.reason))
        state, target = d.state, d.replicas
        t += 1.0
    assert events == [(0.0, 3, "scale_out_queue"), (10.0, 5, "scale_out_queue"), (20.0, 7, "scale_out_queue"),
                      (30.0, 8, "scale_out_queue"), (200.0, 1, "scale_in")]


def test_the_state_round_trips_through_serves_policy_state():
    state = AutoscaleState(last_scale_at=12.5, low_since=3.0)
    kept = {"__decision_counters": 2, **state.as_policy_state()}
    assert AutoscaleState.from_policy_state(kept) == state
    assert AutoscaleState.from_policy_state({}) == AutoscaleState() == AutoscaleState.from_policy_state(None)


def test_bad_options_fail_naming_the_key():
    with pytest.raises(InvalidInputError, match="unknown autoscaling policy option\\(s\\) ttft_slo "):
        AutoscaleConfig.from_kwargs({"ttft_slo": 1.0})
    with pytest.raises(InvalidInputError, match="ttft_slo_s must be a number, got 'fast'"):
        AutoscaleConfig.from_kwargs({"ttft_slo_s": "fast"})
    with pytest.raises(InvalidInputError, match="ttft_slo_s must be > 0"):
        AutoscaleConfig.from_kwargs({"ttft_slo_s": 0})
    with pytest.raises(InvalidInputError, match="max_scale_out_step must be an integer, got 1.5"):
        AutoscaleConfig.from_kwargs({"max_scale_out_step": 1.5})
    with pytest.raises(InvalidInputError, match="downscale_window_s must be >= 0 seconds"):
        AutoscaleConfig.from_kwargs({"downscale_window_s": -1})
    with pytest.raises(InvalidInputError, match="low_fraction must be in \\(0, 1\\]"):
        AutoscaleConfig.from_kwargs({"low_fraction": 1.5})
    with pytest.raises(InvalidInputError, match="scale_out_queue_share must be in \\(0, 1\\]"):
        AutoscaleConfig.from_kwargs({"scale_out_queue_share": 0})
    with pytest.raises(InvalidInputError, match="scale_out_blocked must be a number, got True"):
        AutoscaleConfig.from_kwargs({"scale_out_blocked": True})
    assert AutoscaleConfig.from_kwargs({"ttft_slo_s": 1, "downscale_window_s": 30}).ttft_slo_s == 1


def test_signals_round_trip_through_serve_metrics_and_an_incomplete_report_is_none():
    s = ReplicaSignals(1200, 1.0, 0.75, 3, 850.0, ttft_wait_p90_s=0.25, prefill_share=0.4)
    assert s.as_metrics() == {"queued_prompt_tokens": 1200.0, "blocked_for_room": 1.0, "ttft_p90_s": 0.75,
                              "engine_running": 3.0, "prefill_tokens_per_s": 850.0, "ttft_wait_p90_s": 0.25,
                              "prefill_share": 0.4}
    assert ReplicaSignals.from_metrics(s.as_metrics()) == s and s.wait_s == 0.25
    metrics = s.as_metrics()
    for optional in ("prefill_tokens_per_s", "ttft_wait_p90_s", "prefill_share"):   # unknown rate, not reported
        del metrics[optional]
    older = ReplicaSignals.from_metrics(metrics)
    assert (older.prefill_tokens_per_s, older.ttft_wait_p90_s, older.prefill_share, older.wait_s) == (0.0, None, None, 0.75)
    assert set(older.as_metrics()) == set(metrics) | {"prefill_tokens_per_s"}   # None is not sent as a number
    assert ReplicaSignals.from_metrics({**s.as_metrics(), "ttft_wait_p90_s": float("inf")}) is None
    del metrics["ttft_p90_s"]
    assert ReplicaSignals.from_metrics(metrics) is None
    assert ReplicaSignals.from_metrics({**s.as_metrics(), "blocked_for_room": float("nan")}) is None


def test_the_ttft_window_keeps_the_last_window_and_its_nearest_rank_p90():
    w = TtftWindow(window_s=30.0, max_samples=100)
    assert w.p90(0.0) == 0.0
    for i in range(10):   # 0.1 .. 1.0 s at t = 0 .. 9
        w.add(float(i), (i + 1) / 10)
    assert w.p90(9.0) == 0.9   # the 9th of 10
    w.add(20.0, 5.0)
    assert w.p90(20.0) == 1.0   # the 10th of 11 (5.0 is the 11th)
    assert w.p90(35.0) == 5.0 and len(w) == 5   # t <= 5 expired: 0.7 .. 1.0 and 5.0 remain
    assert w.p90(50.0) == 0.0 and len(w) == 0
    small = TtftWindow(window_s=30.0, max_samples=3)
    for i in range(5):
        small.add(0.0, float(i))
    assert len(small) == 3 and small.p90(0.0) == 4.0


def test_the_ttft_window_splits_each_ttft_into_its_wait_and_its_own_prefill():
    w = TtftWindow(window_s=10.0, max_samples=100)
    assert (w.p90(0.0), w.wait_p90(0.0), w.prefill_share(0.0)) == (0.0, 0.0, 0.0)
    w.add(1.0, 3.0, 2.5)    # waited 0.5 s
    w.add(2.0, 1.0, 0.25)   # waited 0.75 s
    w.add(3.0, 0.5, 2.0)    # its prefill estimate past its TTFT: no wait, 0.5 s of prefill
    w.add(4.0, 2.0)         # the rate unknown: all wait, no prefill counted
    assert (w.p90(4.0), w.wait_p90(4.0), w.prefill_share(4.0)) == (3.0, 2.0, 0.325)   # (2.5+0.25+0.5) / 10
    assert (w.p90(11.5), w.wait_p90(11.5), w.prefill_share(11.5)) == (2.0, 2.0, 0.075)  # t <= 1.5 expired
