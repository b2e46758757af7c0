"""``bench multiturn``: its arms, when each one prefetches, and what every row says about it.

No TTFT is asserted (that is what the command measures): what is asserted is
the schedule (the arrival arm prefetches at its request's arrival, less the
header lead; the foresight arm ``--prefetch-lead-s`` before) and the labels."""

import argparse
import json

import pytest

from actors.pytest_plugin import TEST_MODEL
from cluster.cli import main
from cluster.engine.checkpoint import ModelSpec, load_model
from lab.bench import multiturn

TINY = ["--sessions", "3", "--turns", "3", "--group-size", "2", "--system-tokens", "32,48",
        "--message-tokens", "8,12", "--decode-tokens", "2", "--think-s", "5,10", "--seed", "3"]


def parse(argv):
    p = argparse.ArgumentParser()
    multiturn.add_arguments(p)
    return p.parse_args(argv)


def test_default_arms_put_arrival_first_and_keep_foresight():
    assert multiturn.arms(parse([])) == [("drop", "none"), ("tiered", "none"), ("tiered+prefetch", "arrival"),
                                         ("tiered+prefetch", "foresight")]
    assert multiturn.arms(parse(["--prefetch-trigger", "foresight"]))[-1] == ("tiered+prefetch", "foresight")
    assert multiturn.arms(parse(["--policies", "drop,tiered"])) == [("drop", "none"), ("tiered", "none")]
    with pytest.raises(ValueError, match="unknown prefetch trigger 'header'"):
        multiturn.arms(parse(["--prefetch-trigger", "header"]))
    with pytest.raises(ValueError, match="--header-lead-s"):
        multiturn.arms(parse(["--header-lead-s", "-1"]))


@pytest.fixture(scope="module")
def small_model():
    return load_model(ModelSpec.parse(TEST_MODEL), device="cpu").model


def run_arm(small_model, tmp_path, policy, trigger, extra=()):
    args = parse(TINY + list(extra))
    work = multiturn.Workload(args, small_model.config.vocab_size)
    trace = []
    row = multiturn.run_policy(policy, small_model, work, args, str(tmp_path), 1000.0, trigger, trace=trace)
    return row, trace


def prefetch_leads(trace):
    """(session, turn) -> (arrival's scheduled time - its prefetch's), checking the prefetch was handled first."""
    arrivals = {(s, t): (at, i) for i, (kind, s, t, at, _) in enumerate(trace) if kind == "arrive"}
    leads = {}
    for i, (kind, s, t, at, _) in enumerate(trace):
        if kind == "prefetch":
            arrive_at, arrive_index = arrivals[(s, t)]
            assert i < arrive_index
            leads[(s, t)] = round(arrive_at - at, 9)
    return leads


def test_arrival_arm_prefetches_when_its_request_arrives(small_model, tmp_path):
    row, trace = run_arm(small_model, tmp_path, "tiered+prefetch", "arrival")
    assert (row["policy"], row["prefetch_trigger"], row["prefetch_lead_s"]) == ("tiered+prefetch", "arrival", 0.0)
    leads = prefetch_leads(trace)
    assert sorted(leads) == [(s, t) for s in range(3) for t in range(3)]   # every request, none extra
    assert set(leads.values()) == {0.0}
    # At a lead of 0 the prefetch is handled in the same event batch as its request, just before it.
    handled = {(k, s, t): now for k, s, t, _, now in trace}
    assert all(handled[("prefetch", s, t)] == handled[("arrive", s, t)] for s, t in leads)


def test_header_lead_moves_only_the_arrival_arms_prefetch(small_model, tmp_path):
    row, trace = run_arm(small_model, tmp_path, "tiered+prefetch", "arrival", ["--header-lead-s", "0.25"])
    assert row["prefetch_lead_s"] == 0.25 and set(prefetch_leads(trace).values()) == {0.25}


def test_foresight_arm_prefetches_its_lead_before_a_known_arrival(small_model, tmp_path):
    row, trace = run_arm(small_model, tmp_path, "tiered+prefetch", "foresight", ["--prefetch-lead-s", "2"])
    assert (row["prefetch_trigger"], row["prefetch_lead_s"]) == ("foresight", 2.0)
    assert set(prefetch_leads(trace).values()) == {2.0}


def test_arms_without_prefetch_say_none_and_prefetch_nothing(small_model, tmp_path):
    row, trace = run_arm(small_model, tmp_path, "tiered", "none")
    assert (row["prefetch_trigger"], row["prefetch_lead_s"], row["prefetches"]) == ("none", None, 0)
    assert {kind for kind, *_ in trace} == {"arrive"} and len(trace) == 9
    with pytest.raises(ValueError, match="tiered\\+prefetch takes one of arrival, foresight"):
        run_arm(small_model, tmp_path, "tiered+prefetch", "none")
    with pytest.raises(ValueError):
        run_arm(small_model, tmp_path, "tiered", "arrival")


def test_command_prints_one_labelled_row_per_arm(tmp_path, capsys):
    out = tmp_path / "multiturn.jsonl"
    assert main(["bench", "multiturn", *TINY, "--results", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["policy"], r["prefetch_trigger"], r["prefetch_lead_s"]) for r in rows] == [
        ("drop", "none", None), ("tiered", "none", None), ("tiered+prefetch", "arrival", 0.0),
        ("tiered+prefetch", "foresight", 2.0)]
    assert all(r["requests"] == 9 and r["failed_requests"] == 0 for r in rows)
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [json.loads(line) for line in printed] == rows
