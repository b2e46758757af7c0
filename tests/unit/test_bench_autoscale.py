"""``bench autoscale``: the figures that need no cluster, on synthetic inputs.

No time is measured here: what is asserted is the phase schedule and its
arrivals, the refused arguments, each arm's app args, the replica-seconds
integral, SLO attainment, the scale-out reaction, which turns crossed a
scale-in and what they kept, the idle time to the minimum, and the summary's goals."""

import argparse

import pytest

from lab.bench import autoscale
from lab.bench.autoscale_figures import (
    Phase,
    ReplicaSample,
    arrival_times,
    by_phase,
    crossing_figures,
    crossing_turns,
    gone_times,
    idle_to_min,
    left_times,
    overload_onset,
    phase_at,
    phase_bounds,
    phases_of,
    replica_seconds,
    scale_events,
    scale_out_reaction,
    slo_attainment,
    summary,
)
from lab.load.chat_workload import Turn

T0 = 1000.0   # the load's monotonic start in these tests


def parse(argv):
    p = argparse.ArgumentParser()
    autoscale.add_arguments(p)
    return p.parse_args(argv)


def turn(session, k, *, at, ttft=0.5, ok=True, worker="a", prompt=100, completion=10, cached=0, by_tier=None):
    return Turn(session, k, ok, ttft_s=ttft if ok else None, e2e_s=ttft + 1.0 if ok else None,
                prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached,
                started_at=T0 + at, worker_id=worker, cached_by_tier=dict(by_tier or {}))


def sample(at, running, live=("a",), starting=0):
    return ReplicaSample(at, running, starting, tuple(live))


# ------------------------------------------------------------------ schedule
def test_the_phases_are_base_peak_cool_with_the_ramp_in_the_middle():
    phases = phases_of([40, 80, 90], 0.125, 4)
    assert phases == [Phase("base", 40.0, 0.125), Phase("peak", 80.0, 0.5), Phase("cool", 90.0, 0.125)]
    assert phase_bounds(phases) == [("base", 0.0, 40.0), ("peak", 40.0, 120.0), ("cool", 120.0, 210.0)]
    assert [phase_at(phases, t) for t in (-1, 0, 39.9, 40, 119.9, 120, 209.9, 500)] == \
        ["base", "base", "base", "peak", "peak", "cool", "cool", "cool"]


@pytest.mark.parametrize("durations, rate, ramp", [([40, 80], 0.1, 4), ([40, 0, 90], 0.1, 4),
                                                   ([40, 80, 90], 0, 4), ([40, 80, 90], 0.1, 0.5)])
def test_a_bad_schedule_is_refused(durations, rate, ramp):
    with pytest.raises(ValueError):
        phases_of(durations, rate, ramp)


def test_arrivals_follow_the_phase_rates_and_the_seed():
    phases = phases_of([1000, 1000, 1000], 0.1, 4)
    arrivals = arrival_times(phases, seed=3)
    assert arrivals == arrival_times(phases, seed=3)
    assert arrivals != arrival_times(phases, seed=4)
    assert arrivals == sorted(arrivals) and 0 < arrivals[0] and arrivals[-1] < 3000
    counts = [sum(1 for t in arrivals if lo <= t < hi) for _, lo, hi in phase_bounds(phases)]
    # Poisson counts of mean 100, 400, 100: each within 4 standard deviations of its mean.
    assert abs(counts[0] - 100) < 40 and abs(counts[1] - 400) < 80 and abs(counts[2] - 100) < 40


def test_a_flat_schedule_has_no_step_in_its_arrivals():
    assert arrival_times(phases_of([10, 10, 10], 0.5, 1), seed=1) == \
        arrival_times(phases_of([10, 10, 10], 0.5, 1), seed=1)


@pytest.mark.parametrize("argv", [["--arms", "prefix_cache,bogus"], ["--min-replicas", "3", "--max-replicas", "2"],
                                  ["--phase-s", "10,20"], ["--phase-s", "a,b,c"], ["--turns", "0"],
                                  ["--ttft-slo-s", "0"], ["--ramp", "0.5"]])
def test_bad_arguments_are_refused_before_anything_starts(argv):
    with pytest.raises(ValueError):
        autoscale.check(parse(argv))


def test_both_arms_get_the_same_bounds_and_their_own_policy():
    args = parse(["--max-replicas", "3", "--scale-in-idle", "25", "--ttft-slo-s", "1.5"])
    ours = autoscale.app_args("prefix_cache", args, {"torch_threads": 1})
    theirs = autoscale.app_args("serve_default", args, {"torch_threads": 1})
    assert ours["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 3}
    assert ours["autoscaling_policy"] == "prefix_cache"
    assert ours["autoscaling_policy_args"] == {"ttft_slo_s": 1.5, "downscale_window_s": 25.0}
    assert theirs["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 3, "downscale_delay_s": 25.0}
    assert theirs["autoscaling_policy"] == "serve_default" and "autoscaling_policy_args" not in theirs
    assert ours["worker"] == theirs["worker"] == {"torch_threads": 1}


# ------------------------------------------------------------------ replicas
def test_replica_seconds_hold_each_sample_until_the_next():
    samples = [sample(0, 1), sample(10, 2), sample(30, 1)]
    assert replica_seconds(samples, 0, 40) == 1 * 10 + 2 * 20 + 1 * 10
    assert replica_seconds(samples, 5, 35) == 1 * 5 + 2 * 20 + 1 * 5
    assert replica_seconds(list(reversed(samples)), 0, 40) == 60   # order of arrival does not matter
    assert replica_seconds(samples, 40, 40) == 0.0
    assert replica_seconds([], 0, 40) == 0.0
    assert replica_seconds([sample(5, 2)], 0, 10) == 20   # the first sample also counts back to the start


def test_scale_events_are_the_changes_of_the_running_count():
    samples = [sample(0, 1), sample(1, 1), sample(2, 2), sample(3, 2), sample(9, 1)]
    assert scale_events(samples) == [(2, 1, 2), (9, 2, 1)]


def test_scale_out_reaction_from_the_step_to_more_running_and_to_the_new_replicas_first_token():
    samples = [sample(0, 1, ("a",)), sample(40, 1, ("a",)), sample(45, 1, ("a",), starting=1),
               sample(52.5, 2, ("a", "b"))]
    turns = [turn(0, 0, at=41, worker="a"), turn(1, 0, at=53, ttft=0.25, worker="b"),
             turn(2, 0, at=54, ttft=0.1, worker="b")]
    assert scale_out_reaction(samples, turns, step_at=40, t0=T0) == {
        "replicas_at_step": 1, "scale_out_started_s": 5, "scale_out_running_s": 12.5,
        "scale_out_first_served_s": 13.25}
    assert scale_out_reaction(samples[:2], turns[:1], step_at=40, t0=T0) == {
        "replicas_at_step": 1, "scale_out_started_s": None, "scale_out_running_s": None,
        "scale_out_first_served_s": None}


def test_overload_onset_is_the_first_request_after_the_step_over_the_slo_and_the_reaction_after_it():
    turns = [turn(0, 0, at=35, ttft=3.0), turn(1, 0, at=41, ttft=0.2), turn(2, 0, at=44.5, ttft=2.5),
             turn(3, 0, at=43.5, ok=False), turn(4, 0, at=46, ttft=4.0), turn(5, 0, at=42, ttft=2.0)]
    # before the step (35 s) and at the SLO (2.0 s) are no miss; the failed one at 43.5 s is the first
    assert overload_onset(turns, step_at=40, t0=T0, slo_s=2.0, scale_out_running_s=12.5) == {
        "first_slo_miss_after_step_s": 3.5, "scale_out_running_after_miss_s": 9.0}
    assert overload_onset(turns, step_at=40, t0=T0, slo_s=2.0, scale_out_running_s=None) == {
        "first_slo_miss_after_step_s": 3.5, "scale_out_running_after_miss_s": None}
    assert overload_onset(turns[:2], step_at=40, t0=T0, slo_s=2.0, scale_out_running_s=12.5) == {
        "first_slo_miss_after_step_s": None, "scale_out_running_after_miss_s": None}


def test_a_replica_already_up_at_the_step_is_no_reaction_to_it():
    samples = [sample(0, 1, ("a",)), sample(30, 2, ("a", "b"))]
    turns = [turn(0, 0, at=45, worker="b")]
    assert scale_out_reaction(samples, turns, step_at=40, t0=T0) == {
        "replicas_at_step": 2, "scale_out_started_s": None, "scale_out_running_s": None,
        "scale_out_first_served_s": None}


def test_idle_to_min_is_the_first_sample_at_the_minimum_with_none_starting_after_the_last_answer():
    samples = [sample(100, 2), sample(110, 1, starting=1), sample(150, 1), sample(160, 1)]
    assert idle_to_min(samples, last_answer=90, min_replicas=1) == 60
    assert idle_to_min(samples, last_answer=155, min_replicas=1) == 5
    assert idle_to_min(samples[:2], last_answer=90, min_replicas=1) is None


# ------------------------------------------------------------------ requests
def test_slo_attainment_counts_failed_requests_as_missed():
    turns = [turn(0, 0, at=0, ttft=0.5), turn(1, 0, at=0, ttft=2.0), turn(2, 0, at=0, ttft=2.01),
             turn(3, 0, at=0, ok=False)]
    assert slo_attainment(turns, 2.0) == 0.5
    assert slo_attainment([], 2.0) is None


def test_per_phase_figures_go_by_when_each_request_was_sent():
    phases = phases_of([10, 10, 10], 0.1, 4)
    turns = [turn(0, 0, at=1, ttft=0.1), turn(1, 0, at=12, ttft=3.0), turn(2, 0, at=15, ttft=1.0),
             turn(3, 0, at=35, ttft=0.2)]   # after cool's end: counted in cool
    out = by_phase(turns, phases, T0, slo_s=2.0)
    assert out["requests_base"] == 1 and out["requests_peak"] == 2 and out["requests_cool"] == 1
    assert out["slo_attainment_base"] == 1.0 and out["slo_attainment_peak"] == 0.5
    assert out["ttft_ms_p50_peak"] == 1000.0 and out["ttft_ms_p99_peak"] == 3000.0   # the lower of two at p50
    assert out["ttft_ms_p50_cool"] == 200.0


def test_only_turns_whose_previous_replica_had_left_crossed_a_scale_in():
    samples = [sample(0, 2, ("a", "b")), sample(50, 2, ("a", "b")), sample(60, 1, ("a",))]
    gone = gone_times(samples)
    assert gone == {"b": 60}
    turns = [
        turn(0, 0, at=40, worker="b", prompt=600, completion=20),
        turn(0, 1, at=70, worker="a", prompt=650, completion=20, cached=620,    # crossed: b left at 60
             by_tier={"hot": 31, "l3": 589}),
        turn(1, 0, at=40, worker="b", prompt=500, completion=10),
        turn(1, 1, at=55, worker="b", prompt=530, completion=10, cached=510),   # b still there: not crossed
        turn(1, 2, at=65, ok=False),                                            # crossed (prev on b), failed
        turn(2, 0, at=40, worker="a"), turn(2, 1, at=70, worker="a", cached=100),   # a stayed: not crossed
    ]
    pairs = crossing_turns(turns, gone, T0)
    assert [(p.session, p.turn, t.turn) for p, t in pairs] == [(0, 0, 1), (1, 1, 2)]
    assert crossing_figures(pairs) == {"crossed_scale_in_turns": 2, "crossed_scale_in_sessions": 2,
                                       "crossed_scale_in_by_tier": {"hot": 31, "l3": 589},
                                       "crossed_scale_in_reuse": round(620 / (620 + 540), 4),
                                       "crossed_scale_in_lost": 1}
    assert crossing_figures([]) == {"crossed_scale_in_turns": 0, "crossed_scale_in_sessions": 0,
                                    "crossed_scale_in_by_tier": {},
                                    "crossed_scale_in_reuse": None, "crossed_scale_in_lost": 0}


def test_a_replica_left_when_the_scale_in_stopped_it_not_when_the_directory_dropped_it():
    samples = [sample(0, 2, ("a", "b")), sample(50, 2, ("a", "b")), sample(52, 1, ("a", "b")),
               sample(58, 1, ("a",)), sample(70, 1, ("c",))]   # c: no scale-in before a's drop at 70
    assert gone_times(samples) == {"b": 58, "a": 70}
    assert left_times(samples) == {"b": 52, "a": 70}   # one scale-in stops one replica
    assert left_times(samples[:4]) == {"b": 52}
    turns = [turn(0, 0, at=40, worker="b"), turn(0, 1, at=55, worker="a", cached=105)]   # sent while b drained
    assert [(p.turn, t.turn) for p, t in crossing_turns(turns, left_times(samples[:4]), T0)] == [(0, 1)]
    assert crossing_turns(turns, gone_times(samples[:4]), T0) == []


def test_start_figures_take_the_longest_process_to_ready_of_replicas_started_during_the_load():
    notes = [{"kind": "startup", "worker_id": "replica-aaaaaaaa", "started_at": 90.0, "ready_at": 93.0,
              "process_started_at": 88.0, "core_s": 3.0, "total_s": 3.0},
             {"kind": "warmup", "worker_id": "replica-bbbbbbbb"},
             {"kind": "startup", "worker_id": "replica-bbbbbbbb", "started_at": 150.0, "ready_at": 154.0,
              "process_started_at": 147.5, "core_s": 4.0, "total_s": 4.0},
             {"kind": "startup", "worker_id": "replica-cccccccc", "started_at": 160.0, "ready_at": 162.0,
              "process_started_at": None, "core_s": 2.0, "total_s": 2.0}]
    out = autoscale.start_figures(notes, load_wall=100.0)
    assert [s["worker_id"] for s in out["replica_starts"]] == ["aaaaaaaa", "bbbbbbbb", "cccccccc"]
    assert [s["process_to_ready_s"] for s in out["replica_starts"]] == [5.0, 6.5, None]
    assert [s["core_s"] for s in out["replica_starts"]] == [3.0, 4.0, 2.0]
    assert out["process_to_ready_s_max"] == 6.5


# ------------------------------------------------------------------ summary
ARM = {"slo_attainment": 0.97, "replica_seconds": 300.0, "scale_out_running_s": 9.0, "idle_to_min_s": 70.0,
       "lost_requests": 0, "process_to_ready_s_max": 6.0, "crossed_scale_in_reuse": 0.95,
       "crossed_scale_in_lost": 0}


def test_the_summary_states_every_goal():
    theirs = {**ARM, "slo_attainment": 0.80, "replica_seconds": 290.0}
    out = summary(ARM, theirs)
    assert out["replica_seconds_ratio"] == round(300 / 290, 4)
    assert {k: v for k, v in out.items() if k.startswith("goal_")} == {
        "goal_slo_attainment_ge_0_95": True, "goal_slo_above_serve_default": True,
        "goal_replica_seconds_le_1_1x": True, "goal_scale_out_le_15s": True,
        "goal_process_to_serving_le_8s": True, "goal_back_to_min_within_180s": True,
        "goal_crossing_reuse_ge_0_9_none_lost": True, "goal_zero_lost": True}


@pytest.mark.parametrize("ours, theirs, failed", [
    ({"slo_attainment": 0.94}, {"slo_attainment": 0.5}, "goal_slo_attainment_ge_0_95"),
    ({}, {"slo_attainment": 0.97}, "goal_slo_above_serve_default"),
    ({"replica_seconds": 331.0}, {"replica_seconds": 300.0}, "goal_replica_seconds_le_1_1x"),
    ({"scale_out_running_s": 15.5}, {}, "goal_scale_out_le_15s"),
    ({"scale_out_running_s": None}, {}, "goal_scale_out_le_15s"),
    ({"process_to_ready_s_max": 8.1}, {}, "goal_process_to_serving_le_8s"),
    ({"idle_to_min_s": None}, {}, "goal_back_to_min_within_180s"),
    ({"crossed_scale_in_reuse": 0.89}, {}, "goal_crossing_reuse_ge_0_9_none_lost"),
    ({"crossed_scale_in_lost": 1}, {}, "goal_crossing_reuse_ge_0_9_none_lost"),
    ({"crossed_scale_in_reuse": None}, {}, "goal_crossing_reuse_ge_0_9_none_lost"),
    ({"lost_requests": 2}, {}, "goal_zero_lost"),
])
def test_each_goal_fails_on_its_own_figure(ours, theirs, failed):
    out = summary({**ARM, **ours}, {**ARM, "slo_attainment": 0.5, **theirs})
    assert [k for k, v in out.items() if k.startswith("goal_") and v is False] == [failed]
