"""``prefix-cache bench tenants``: its checks, its flood's count and its summary line (the arms need Serve)."""

import argparse
import asyncio

import pytest

from lab.bench import tenants as bench_tenants
from lab.load.chat_workload import Turn


def args(**kw):
    p = argparse.ArgumentParser()
    bench_tenants.add_arguments(p)
    ns = p.parse_args([])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def test_arguments_and_quotas_are_checked_before_anything_starts():
    assert bench_tenants.check_args(args()) == {**bench_tenants.DEFAULT_QUOTAS, "step_tokens": 32}
    assert bench_tenants.check_args(args(step_tokens=0)) == bench_tenants.DEFAULT_QUOTAS
    assert bench_tenants.check_args(args(quotas='{"step_tokens": 8}'))["step_tokens"] == 8   # --quotas' own wins
    with pytest.raises(ValueError, match="--step-tokens must be >= 0"):
        bench_tenants.check_args(args(step_tokens=-1))
    with pytest.raises(ValueError, match="--flood-ratio must be > 0"):
        bench_tenants.check_args(args(flood_ratio=0))
    with pytest.raises(ValueError, match="--doc-tokens must be >= 1"):
        bench_tenants.check_args(args(doc_tokens=0))
    with pytest.raises(ValueError, match="the hot guarantees add up to 1.2"):
        bench_tenants.check_args(args(quotas='{"tenants": {"tenant-a": {"hot": {"guarantee": 0.6}}, '
                                             '"tenant-b": {"hot": {"guarantee": 0.6}}}}'))


def test_summary_ratios_and_goals():
    alone = {"b_later_turns_cached_share": 0.95, "b_ttft_ms_later_turns_p50": 100.0}
    off = {"b_later_turns_cached_share": 0.19, "b_ttft_ms_later_turns_p50": 400.0, "a_served": 9, "a_failed": 0}
    on = {"b_later_turns_cached_share": 0.9025, "b_ttft_ms_later_turns_p50": 150.0, "a_served": 9, "a_failed": 0}
    got = bench_tenants.compare(alone, off, on)
    none = {**{f"b_{k}_vs_alone_quotas": None for k in bench_tenants.SERVING_RATIOS},
            **{f"a_{k}_quotas_vs_no_quotas": None for k in bench_tenants.SERVING_RATIOS}}
    assert got == {"bench": "tenants", "arm": "summary", "cached_share_vs_alone_quotas": 0.95,
                   "cached_share_vs_alone_no_quotas": 0.2, "ttft_p50_vs_alone_quotas": 1.5,
                   "ttft_p50_vs_alone_no_quotas": 4.0, "goal_cached_share_met": True,
                   "goal_ttft_p50_met": True, "goal_a_served_met": True, **none}
    assert not bench_tenants.compare(alone, off, {**on, "a_failed": 1})["goal_a_served_met"]


def test_summary_carries_both_tenants_serving_figures():
    alone = {"b_later_turns_cached_share": 1.0, "b_ttft_ms_later_turns_p50": 60.0, "b_tpot_ms_p50": 40.0,
             "b_itl_ms_p99": 80.0, "b_e2e_ms_p50": 1000.0, "b_output_tokens_per_s": 10.0}
    off = {**alone, "a_served": 3, "a_failed": 0, "a_tpot_ms_p50": 50.0, "a_itl_ms_p99": 100.0,
           "a_e2e_ms_p50": 2000.0, "a_output_tokens_per_s": 4.0}
    on = {**off, "b_tpot_ms_p50": 50.0, "b_itl_ms_p99": 120.0, "b_e2e_ms_p50": 1250.0, "b_output_tokens_per_s": 9.0,
          "a_tpot_ms_p50": 60.0, "a_e2e_ms_p50": 3000.0, "a_output_tokens_per_s": 3.0, "a_itl_ms_p99": None}
    got = bench_tenants.compare(alone, off, on)
    assert [got[f"b_{k}_vs_alone_quotas"] for k in bench_tenants.SERVING_RATIOS] == [1.25, 1.5, 1.25, 0.9]
    assert [got[f"a_{k}_quotas_vs_no_quotas"] for k in bench_tenants.SERVING_RATIOS] == [1.2, None, 1.5, 0.75]
    runs = bench_tenants.over_runs([{**got, "b_failed": 0}, {**got, "b_tpot_ms_p50_vs_alone_quotas": 2.0,
                                                            "b_failed": 0}])
    assert runs["b_tpot_ms_p50_vs_alone_quotas_median"] == 1.625
    assert runs["b_tpot_ms_p50_vs_alone_quotas_spread"] == [1.25, 2.0]
    assert runs["a_itl_ms_p99_quotas_vs_no_quotas_median"] is None


def test_tenant_counters_sum_over_replicas():
    stats = {"workers": {"w0": {"tenants": {"tenant-b": {"lookups": 2, "hit_tokens": {"hot": 5}}}},
                         "w1": {"tenants": {"tenant-b": {"lookups": 1, "hit_tokens": {"hot": 1, "warm": 3}}}},
                         "w2": {}}}
    assert bench_tenants._tenant_counters(stats, "tenant-b") == {"lookups": 3, "hit_tokens": {"hot": 6, "warm": 3}}


def test_the_flood_sends_at_its_rate_until_stopped_and_counts_what_was_served(monkeypatch):
    sent = []

    async def fake_turn(http, model, messages, i, t, max_tokens, headers=None):
        sent.append(messages[0]["content"])
        if i == 1:
            return Turn(i, 0, False, error="HTTP 503"), ""
        return Turn(i, 0, True, ttft_s=0.1, e2e_s=0.4, completion_tokens=4, itl_s=[0.1, 0.1, 0.1]), ""

    monkeypatch.setattr(bench_tenants, "ask_turn", fake_turn)

    async def go():
        stop = asyncio.Event()
        task = asyncio.create_task(bench_tenants.flood("http://127.0.0.1:9", "m", ["doc"], 50.0, stop, 4))
        while len(sent) < 3:
            await asyncio.sleep(0.001)
        stop.set()
        return await task

    got = asyncio.run(go())
    assert got["a_sent"] == len(sent) and got["a_failed"] == 1 and got["a_served"] == len(sent) - 1
    assert sent[:3] == ["Request 0. doc", "Request 1. doc", "Request 2. doc"]   # distinct from the first token
    assert (got["a_ttft_ms_p50"], got["a_tpot_ms_p50"], got["a_e2e_ms_p50"]) == (100.0, 100.0, 400.0)
    assert set(got) == {"a_sent", "a_served", "a_failed", *("a_" + k for k in bench_tenants.SERVING_FIELDS)}


def test_b_later_turns_wait_in_engine_steps_median_max_and_detail():
    from lab.load.chat_workload import Turn

    def turn(ttft_s, steps_waited, promotion_waits):
        counts = {"steps_waited": steps_waited, "promotion_waits": promotion_waits, "prompt_steps": 1,
                  "step_tokens": 24, "step_rows": 2, "step_decodes": 1, "step_other_tokens": 0, "room_waits": 0,
                  "unreached": steps_waited - promotion_waits}
        return Turn(0, 1, True, ttft_s, timing_ms={"replica_queue": 5.0, "first_forward": 40.0}, timing_steps=counts)

    row = bench_tenants.step_counts([turn(0.05, 0, 0), turn(0.25, 4, 1), turn(0.5, 9, 2), Turn(0, 1, True, 0.1)])
    assert row["b_steps_later_turns_p50"]["steps_waited"] == 4 and row["b_steps_later_turns_max"]["unreached"] == 7
    assert row["b_later_turns_promoted"] == 2
    assert row["b_later_turns_detail_keys"][:4] == ["ttft_ms", "replica_queue_ms", "first_forward_ms", "steps_waited"]
    assert row["b_later_turns_detail"][1] == [250.0, 5.0, 40.0, 4, 1, 1, 24, 2, 1, 0, 0, 3]
    assert bench_tenants.step_counts([Turn(0, 1, True, 0.1)]) == {}   # a server without the counts
