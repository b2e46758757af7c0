"""``bench elastic``: the parts of its figures that need no cluster.

No time is asserted (that is what the command measures): what is asserted is
the arms' alternating order, the arguments it refuses, the two reuse ratios,
which fetch sizes the recompute probes take, how long the probes and the
shared system prompt are, and the summary over repeats."""

import argparse
import random
from types import SimpleNamespace

import pytest

from lab.bench import elastic as bench_elastic
from lab.bench.elastic import arm_order, fresh_messages, plan, probe_sizes, shared_prompt_tokens
from lab.bench.elastic_figures import reuse_ratio, summarize


def parse(argv):
    p = argparse.ArgumentParser()
    bench_elastic.add_arguments(p)
    return p.parse_args(argv)


class WordPrompts:
    """A prompt builder whose tokens are words: each message is its role, then its content's words;
    the prompt ends with the assistant's header."""

    def build(self, messages):
        ids = []
        for m in messages:
            ids += [m["role"], *m["content"].split()]
        return SimpleNamespace(ids=ids + ["assistant"])


def test_arms_alternate_between_repeats():
    arms = ["elastic", "baseline"]
    assert [arm_order(arms, r) for r in range(4)] == [["elastic", "baseline"], ["baseline", "elastic"],
                                                      ["elastic", "baseline"], ["baseline", "elastic"]]
    assert arms == ["elastic", "baseline"]   # not reversed in place
    assert [arm_order(["baseline"], r) for r in range(2)] == [["baseline"], ["baseline"]]


def test_defaults_touch_twelve_sessions_a_replica_and_repeat_three_times():
    args = parse([])
    assert (args.repeats, args.sessions, args.think_s) == (3, 36, 4.0)
    assert plan(args) == (["scale_in", "scale_out", "kill"], ["elastic", "baseline"])
    assert plan(parse(["--event", "kill", "--arms", "baseline"])) == (["kill"], ["baseline"])


@pytest.mark.parametrize("argv, message", [
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--repeats", "-2"], "--repeats must be >= 1, got -2"),
    (["--sessions", "0"], "--sessions must be >= 1, got 0"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
    (["--event", "kill,crash"], r"--event: unknown \['crash'\]"),
    (["--arms", "elastic,other"], "--arms takes elastic and/or baseline, got 'elastic,other'"),
])
def test_bad_arguments_are_refused_before_anything_starts(argv, message):
    with pytest.raises(ValueError, match=message):
        plan(parse(argv))


def test_reuse_ratio_with_and_without_the_shared_system_prompt():
    cached, previous = [400, 100, 0, 600], [500, 500, 450, 500]
    # min(cached, previous): 400 + 100 + 0 + 500 over 1,950
    assert reuse_ratio(cached, previous) == round(1000 / 1950, 4) == 0.5128
    # less 308 shared tokens each: 92 + 0 (below the system prompt) + 0 + 192 over 192 + 192 + 142 + 192
    assert reuse_ratio(cached, previous, 308) == round(284 / 718, 4) == 0.3955
    assert reuse_ratio([308], [500], 308) == 0.0     # only the system prompt was found
    assert reuse_ratio([500], [500], 308) == 1.0
    assert reuse_ratio([], []) is None
    assert reuse_ratio([10], [300], 308) is None     # nothing of its own to reuse
    with pytest.raises(ValueError, match="one cached count per previous turn: 1 != 2"):
        reuse_ratio([1], [2, 3])


def test_shared_prompt_tokens_is_the_common_prefix_of_every_first_prompt():
    # The workload's questions share no first word: the system turn and the user header remain.
    assert shared_prompt_tokens(WordPrompts(), "be brief and kind") == 1 + 4 + 1


def test_probe_sizes_spread_over_the_sorted_fetches():
    sizes = list(range(100, 0, -1))
    assert probe_sizes(sizes) == [1, 15, 29, 43, 58, 72, 86, 100]
    assert probe_sizes([48, 16, 32]) == [16, 32, 48]
    assert probe_sizes([]) == []
    assert probe_sizes([5, 1, 3], k=1) == [1]


def test_fresh_messages_reach_the_size_with_the_fewest_words_and_start_with_the_nonce():
    prompts = WordPrompts()
    chat = fresh_messages(prompts, 40, random.Random(0), "probe-abc")
    assert chat[0]["role"] == "system" and chat[0]["content"].split()[0] == "probe-abc"
    assert len(prompts.build(chat).ids) == 40   # one word, one token here: exactly the size
    assert fresh_messages(prompts, 40, random.Random(0), "probe-abc") == chat   # the seed decides the words
    assert fresh_messages(prompts, 40, random.Random(0), "probe-xyz") != chat


def row(arm, repeat, **figures):
    return {"bench": "elastic", "arm": arm, "event": "kill", "repeat": repeat, **figures}


def test_summary_rows_hold_median_min_max_of_each_figure_over_the_repeats():
    rows = [row("elastic", 0, l3="on", window_s=60.0, touched_sessions=12, reuse_ratio_after=0.5, handoff_s=None,
                recompute_measured_by="replica_prefix_load+first_forward", goal_touched_ge_12=True),
            row("baseline", 0, l3="off", touched_sessions=9, reuse_ratio_after=0.25, handoff_s=None,
                recompute_measured_by=None, goal_touched_ge_12=False),
            row("elastic", 1, l3="on", window_s=30.0, touched_sessions=14, reuse_ratio_after=None, handoff_s=None,
                recompute_measured_by="client_ttft", goal_touched_ge_12=True),
            row("baseline", 1, l3="off", touched_sessions=13, reuse_ratio_after=0.3, handoff_s=None,
                recompute_measured_by=None, goal_touched_ge_12=True),
            row("elastic", 2, l3="on", window_s=60.0, touched_sessions=11, reuse_ratio_after=0.7, handoff_s=None,
                recompute_measured_by="client_ttft", goal_touched_ge_12=False),
            row("baseline", 2, l3="off", touched_sessions=10, reuse_ratio_after=0.2, handoff_s=None,
                recompute_measured_by=None, goal_touched_ge_12=False)]
    elastic, baseline = summarize(rows)
    assert elastic == {"bench": "elastic", "summary": True, "arm": "elastic", "event": "kill", "repeats": 3,
                       "l3": "on", "window_s": [30.0, 60.0],   # a setting: as it was, not a median
                       "touched_sessions_median": 12, "touched_sessions_min": 11, "touched_sessions_max": 14,
                       # None (repeat 1) left out: the median of two
                       "reuse_ratio_after_median": 0.6, "reuse_ratio_after_min": 0.5, "reuse_ratio_after_max": 0.7,
                       "handoff_s_median": None, "handoff_s_min": None, "handoff_s_max": None,
                       "recompute_measured_by": ["client_ttft", "replica_prefix_load+first_forward"],
                       "goal_touched_ge_12_true": 2}
    assert baseline == {"bench": "elastic", "summary": True, "arm": "baseline", "event": "kill", "repeats": 3,
                        "l3": "off",
                        "touched_sessions_median": 10, "touched_sessions_min": 9, "touched_sessions_max": 13,
                        "reuse_ratio_after_median": 0.25, "reuse_ratio_after_min": 0.2,
                        "reuse_ratio_after_max": 0.3,
                        "handoff_s_median": None, "handoff_s_min": None, "handoff_s_max": None,
                        "recompute_measured_by": None, "goal_touched_ge_12_true": 1}


def test_summary_keeps_the_order_rows_first_appear_in_and_one_row_per_arm_and_event():
    rows = [row("baseline", 0, x=1), {**row("baseline", 0, x=3), "event": "scale_in"}, row("baseline", 1, x=2)]
    summary = summarize(rows)
    assert [(s["arm"], s["event"], s["repeats"]) for s in summary] == [("baseline", "kill", 2),
                                                                        ("baseline", "scale_in", 1)]
    assert (summary[0]["x_median"], summary[0]["x_min"], summary[0]["x_max"]) == (1.5, 1, 2)
    assert summarize([]) == []


def _rec(session, t, worker, start, e2e=1.0, previous=100):
    from lab.bench.elastic_figures import Record
    from lab.load.chat_workload import Turn
    return Record(Turn(session, t, True, e2e_s=e2e, started_at=start, worker_id=worker, prompt_tokens=previous + 10),
                  session, previous if t else 0)


def test_touched_sessions_are_those_on_the_replica_when_the_event_began():
    from lab.bench.elastic_figures import Happening, touched_turns
    h = Happening(["a", "b", "c"], at=100.0, effective=110.0, gone="c")
    recs = [_rec(1, 0, "c", 90), _rec(1, 1, "a", 104),      # moved off c while it drained: touched
            _rec(2, 0, "a", 90), _rec(2, 1, "b", 104),      # never on c
            _rec(3, 0, "c", 99.5), _rec(3, 1, "b", 104),    # its only turn on c had not ended at the start
            _rec(4, 0, "c", 80), _rec(4, 1, "c", 95),       # last turn before the start on c ...
            _rec(4, 2, "b", 200)]                           # ... but its next turn came after the window
    assert [(r.session, r.turn.turn) for r in touched_turns("scale_in", recs, h, 60.0)] == [(1, 1)]
    out = Happening(["a", "b"], at=100.0, effective=100.0, new="n")
    recs = [_rec(1, 0, "a", 90), _rec(1, 1, "a", 120), _rec(1, 2, "n", 140),   # came to n: touched
            _rec(2, 0, "n", 130),                                            # a first turn: nothing to keep
            _rec(3, 0, "b", 90), _rec(3, 1, "n", 200)]                       # after the window
    assert [(r.session, r.turn.turn) for r in touched_turns("scale_out", recs, out, 60.0)] == [(1, 2)]
