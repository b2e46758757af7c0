import json

import pytest

from cluster.cli import main
from cluster.trace import write_trace
from lab.bench.replay import ORDER, synthetic_chat_trace

KEYS = {"bench", "policy", "records", "hit_rate", "hot_hit_rate", "warm_hit_rate", "migrated_rate",
        "load_imbalance", "ttft_ms_p50", "ttft_ms_p99", "decisions_per_s"}


def replay(capsys, *argv):
    assert main(["replay", *argv]) == 0
    return {r["policy"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}


def test_replay_all_policies_small(capsys, tmp_path):
    out = replay(capsys, "--records", "2000", "--replicas", "4", "--hot-blocks", "48", "--warm-blocks", "96",
                 "--policy", "all", "--plot", str(tmp_path / "replay.png"))
    assert list(out) == list(ORDER)
    for res in out.values():
        assert KEYS <= set(res)
        assert res["bench"] == "replay" and res["records"] == 2000
        assert 0.0 <= res["hot_hit_rate"] + res["warm_hit_rate"] + res["migrated_rate"] <= res["hit_rate"] + 1e-3
        assert res["hit_rate"] <= 1.0 and res["load_imbalance"] >= 1.0
        assert res["ttft_ms_p50"] <= res["ttft_ms_p99"]
        assert res["decisions_per_s"] > 0
        assert res["index"]["gaps"] == 0
    assert out["ideal"]["hit_rate"] >= out["cost"]["hit_rate"] > out["round_robin"]["hit_rate"]
    assert out["cost"]["hit_rate"] > out["least_loaded"]["hit_rate"]
    assert out["round_robin"]["migrated_rate"] == 0.0
    assert (tmp_path / "replay.png").stat().st_size > 0


def test_replay_reads_a_mooncake_trace(capsys, tmp_path):
    path = tmp_path / "trace.jsonl"
    write_trace(synthetic_chat_trace(300, seed=3), path)
    out = replay(capsys, "--trace", str(path), "--format", "mooncake", "--records", "200", "--replicas", "2",
                 "--policy", "cost,round_robin")
    assert list(out) == ["cost", "round_robin"] and out["cost"]["records"] == 200


def test_replay_rejects_an_unknown_policy(capsys):
    with pytest.raises(SystemExit) as info:
        main(["replay", "--records", "10", "--policy", "random"])
    assert info.value.code == 2
    assert "unknown policy 'random'" in capsys.readouterr().err


def test_synthetic_trace_shape():
    recs = synthetic_chat_trace(3000, seed=1)
    assert len(recs) == 3000
    assert all(a.timestamp <= b.timestamp for a, b in zip(recs, recs[1:]))
    for r in recs:
        assert len(r.hash_ids) == -(-r.input_length // 512)
    # Turns of one session extend its previous turn's full blocks.
    by_session = {}
    for r in recs:
        prev = by_session.get(r.session)
        if prev is not None:
            full = prev.input_length // 512
            assert r.hash_ids[:full] == prev.hash_ids[:full]
        by_session[r.session] = r
    # Skewed popularity: the most common first block opens many requests.
    firsts = {}
    for r in recs:
        firsts[r.hash_ids[0]] = firsts.get(r.hash_ids[0], 0) + 1
    assert max(firsts.values()) > 0.1 * len(recs)


def test_a_request_longer_than_the_hot_tier_is_served_uncached(capsys, tmp_path):
    from cluster.trace import TraceRecord

    path = tmp_path / "long.jsonl"
    long_ids = list(range(1000, 1040))   # 40 blocks, the HOT tier holds 16
    write_trace([TraceRecord(0.0, 40 * 512, 10, long_ids), TraceRecord(10.0, 2 * 512, 10, [1, 2])], path)
    out = replay(capsys, "--trace", str(path), "--format", "mooncake", "--replicas", "2",
                 "--hot-blocks", "16", "--warm-blocks", "32", "--policy", "cost")
    assert out["cost"]["records"] == 2 and out["cost"]["uncacheable_requests"] == 1


def test_trace_shapes_are_mooncake_chains():
    from lab.bench.traces import SHAPES, shape_trace

    for name in [*SHAPES, "mixed"]:
        recs = shape_trace(name, 400, seed=2)
        assert len(recs) == 400 and all(a.timestamp <= b.timestamp for a, b in zip(recs, recs[1:]))
        for r in recs:
            assert len(r.hash_ids) == -(-r.input_length // 512)
    mixed = shape_trace("mixed", 2000, seed=2)
    assert max(h for r in mixed for h in r.hash_ids) < 2 ** 32      # the cache's uint32 keys
    bursts = shape_trace("bursts", 400, seed=2)
    first = bursts[0]
    siblings = [r for r in bursts if r.timestamp == first.timestamp]
    assert 4 <= len(siblings) <= 16
    shared = min(r.input_length // 512 for r in siblings)
    assert all(r.hash_ids[:shared - 1] == first.hash_ids[:shared - 1] for r in siblings)


def test_replay_shape_and_misestimate_sweep(capsys):
    assert main(["replay", "--records", "600", "--replicas", "2", "--hot-blocks", "48", "--warm-blocks", "96",
                 "--shape", "bursts", "--policy", "approx_tree,ray_prefix,cost", "--misestimate", "0.5"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["policy"] for x in lines[:3]] == ["approx_tree", "ray_prefix", "cost"]
    assert all(x["shape"] == "bursts" and x["decision_clock"] == "thread_time" for x in lines[:3])
    sweep = [x for x in lines if "misestimate" in x]
    assert len(sweep) == 5 and {x["misestimate"]["constants"] for x in sweep} >= {"all", "prefill_tokens_per_s"}
    summary = lines[-1]
    assert summary["bench"] == "replay_misestimate" and summary["runs"] == 5
    assert set(summary["baselines_hit_rate"]) == {"approx_tree", "ray_prefix"}
    ports = summary["baselines_hit_rate"]
    assert summary["above_baselines"] == (summary["worst_hit_rate"] > max(ports.values()))


def test_misestimate_sweep_without_the_ports_does_not_claim_to_beat_them(capsys):
    assert main(["replay", "--records", "300", "--replicas", "2", "--hot-blocks", "48", "--warm-blocks", "96",
                 "--policy", "cost", "--misestimate", "2"]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert summary["bench"] == "replay_misestimate"
    assert summary["baselines_hit_rate"] == {} and summary["above_baselines"] is None


def test_replay_with_several_routers_feeds_every_copy_every_batch(capsys):
    one = replay(capsys, "--records", "600", "--replicas", "4", "--policy", "cost", "--oracle")["cost"]
    three = replay(capsys, "--records", "600", "--replicas", "4", "--policy", "cost", "--routers", "3",
                   "--oracle")["cost"]
    assert (one["routers"], three["routers"]) == (1, 3)
    # One batch per request reaches each copy (the last one is still in flight at the end).
    assert one["index"] == three["index"] == {"batches": 599, "gaps": 0, "resyncs": 0}
    # With production information batches leave when prefills end: the same ones reach every
    # copy, in order, and only the last few are still in flight at the end.
    one_p = replay(capsys, "--records", "600", "--replicas", "4", "--policy", "cost")["cost"]
    three_p = replay(capsys, "--records", "600", "--replicas", "4", "--policy", "cost", "--routers", "3")["cost"]
    assert one_p["index"]["gaps"] == three_p["index"]["gaps"] == 0
    assert one_p["index"]["resyncs"] == three_p["index"]["resyncs"] == 0
    assert 590 <= one_p["index"]["batches"] < 600 and 590 <= three_p["index"]["batches"] < 600
    assert sum(three["reasons"].values()) == 600
    assert one["aggregate_decisions_per_s"] == one["directory_decisions_per_s"]
    with pytest.raises(SystemExit) as info:
        main(["replay", "--records", "10", "--routers", "0"])
    assert info.value.code == 2 and "--routers must be a positive integer" in capsys.readouterr().err


def test_replay_replicates_hot_shared_prefixes(capsys):
    # Oracle information: the replication mechanism alone, without the index's lag (under
    # production information a lagging index makes cost pull now and then with replication off).
    argv = ["--records", "1500", "--replicas", "8", "--shape", "long_system", "--policy", "prefix,cost", "--oracle"]
    off = replay(capsys, *argv, "--policy-arg", "cost.replicate_share=0")
    on = replay(capsys, *argv, "--policy-arg", "cost.replicate_budget_s=0.5")
    assert "policy_args" not in on["prefix"]
    assert (off["cost"]["policy_args"], on["cost"]["policy_args"]) == ({"replicate_share": 0},
                                                                       {"replicate_budget_s": 0.5})
    assert "replicate" not in off["cost"]["reasons"] and off["cost"]["migrated_rate"] == 0.0
    # Each replication is a pull the simulator executes: the pulled prefix counts as a hit.
    assert on["cost"]["reasons"]["replicate"] > 0 and on["cost"]["migrated_rate"] > 0.0
    assert on["cost"]["hit_rate"] == off["cost"]["hit_rate"]


def _lines(capsys, *argv):
    assert main(["replay", *argv]) == 0
    return list(map(json.loads, capsys.readouterr().out.splitlines()))


SMALL = ("--shape", "conversation", "--records", "400", "--replicas", "2", "--hot-blocks", "24",
         "--warm-blocks", "48", "--policy", "prefix,cost")


def test_replay_seeds_summarises_each_policy_over_the_seeds(capsys):
    lines = _lines(capsys, *SMALL, "--seeds", "0,3")
    runs = [r for r in lines if r["bench"] == "replay"]
    assert [(r["policy"], r["seed"]) for r in runs] == [("prefix", 0), ("cost", 0), ("prefix", 3), ("cost", 3)]
    summary = {r["policy"]: r for r in lines if r["bench"] == "replay_seeds"}
    assert list(summary) == ["prefix", "cost"]
    run = {(r["policy"], r["seed"]): r for r in runs}
    for policy, other in (("prefix", "cost"), ("cost", "prefix")):
        s = summary[policy]
        assert s["seeds"] == [0, 3] and s["shape"] == "conversation" and s["replicas"] == 2
        for m in ("hit_rate", "load_imbalance", "busy_imbalance", "ttft_ms_p99"):
            values = [run[(policy, 0)][m], run[(policy, 3)][m]]
            assert s[f"{m}_by_seed"] == values
            assert (s[f"{m}_min"], s[f"{m}_max"]) == (min(values), max(values))
            assert s[f"{m}_mean"] == round(sum(values) / 2, 1 if m == "ttft_ms_p99" else 4)
        versus = s["versus"][other]
        assert versus == {
            "higher_hit_rate": sum(run[(policy, k)]["hit_rate"] > run[(other, k)]["hit_rate"] for k in (0, 3)),
            "lower_load_imbalance": sum(run[(policy, k)]["load_imbalance"] < run[(other, k)]["load_imbalance"]
                                        for k in (0, 3)),
            "lower_ttft_ms_p99": sum(run[(policy, k)]["ttft_ms_p99"] < run[(other, k)]["ttft_ms_p99"]
                                     for k in (0, 3))}
    # The seed-3 lines of the sweep are the run of --seed 3 alone (wall-clock fields aside).
    alone = {r["policy"]: r for r in _lines(capsys, *SMALL, "--seed", "3")}
    for policy in ("prefix", "cost"):
        for key in ("hit_rate", "load_imbalance", "ttft_ms_p99", "reasons", "seed"):
            assert alone[policy][key] == run[(policy, 3)][key]
    assert not any(r["bench"] == "replay_seeds" for r in alone.values())


@pytest.mark.parametrize("argv, message", [
    (("--seeds", "0,x"), "--seeds takes integers like 0,1,2, got '0,x'"),
    (("--seeds", "2,2"), "--seeds lists a seed twice: '2,2'"),
    (("--seeds", "0,1", "--plot", "out.png"), "--plot draws one run; give it one seed (--seed), not --seeds"),
    (("--seeds", "0,1", "--trace", "t.jsonl"), "--seeds needs a generated trace (--shape or the default), not --trace"),
])
def test_replay_seeds_rejects_what_it_cannot_do(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        main(["replay", "--records", "10", *argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_replay_seeds_runs_the_misestimate_sweep_on_each_seed(capsys):
    lines = _lines(capsys, "--records", "300", "--replicas", "2", "--hot-blocks", "24", "--warm-blocks", "48",
                   "--policy", "cost", "--misestimate", "2", "--seeds", "1,2")
    summaries = [x for x in lines if x["bench"] == "replay_misestimate"]
    assert [x["seed"] for x in summaries] == [1, 2]
    sweep = [x for x in lines if "misestimate" in x]
    assert [x["seed"] for x in sweep] == [1] * 5 + [2] * 5
    runs = {x["seed"]: x for x in lines if x["bench"] == "replay" and "misestimate" not in x}
    assert [s["cost_hit_rate"] for s in summaries] == [runs[1]["hit_rate"], runs[2]["hit_rate"]]
    assert lines[-1]["bench"] == "replay_seeds" and lines[-1]["seeds"] == [1, 2]


# ---- production information (the default) against --oracle ------------------------------------

def test_every_line_says_which_information_it_had(capsys):
    prod = replay(capsys, "--records", "300", "--replicas", "2", "--policy", "cost,round_robin")
    oracle = replay(capsys, "--records", "300", "--replicas", "2", "--policy", "cost,round_robin", "--oracle")
    assert {r["information"] for r in prod.values()} == {"production"}
    assert {r["information"] for r in oracle.values()} == {"oracle"}
    # Same trace, same routing of round robin: only the service times differ (noise, attention).
    assert prod["round_robin"]["hit_rate"] == oracle["round_robin"]["hit_rate"]
    assert prod["round_robin"]["ttft_ms_p50"] != oracle["round_robin"]["ttft_ms_p50"]


def test_load_report_is_what_the_engine_measures():
    """Waiting requests count their whole prompt, running ones their remaining output
    tokens (all of them during the prefill, fewer as the decode goes), finished ones nothing."""
    from cluster.cache.tiered import TierConfig
    from lab.bench.replay import Replica

    r = Replica("r0", TierConfig(hot_blocks=4, warm_blocks=0, block_tokens=1, device="cpu"))
    # (routed, start, prefill_end, decode_end, prompt tokens, output tokens)
    r.add_job(0.0, 0.0, 1.0, 3.0, 900, 200)      # prefilling until 1.0, decoding until 3.0
    r.add_job(0.1, 1.0, 1.5, 2.0, 400, 50)       # waiting until 1.0
    r.add_job(2.5, 3.0, 3.2, 4.0, 700, 80)       # not yet routed before 2.5
    assert r.report(0.5) == (200 + 400, 1)
    assert r.report(1.25) == (round(200 * 1.75 / 2) + 50, 2)   # the first decodes, the second prefills
    assert r.report(2.0) == (100, 1)             # halfway through the first decode; the second is done
    assert r.report(2.6) == (40 + 700, 1)         # a fifth of the decode left; the third waits
    assert r.report(3.5) == (50, 1)               # the third decodes: 0.5 of its 0.8 s left
    assert r.report(5.0) == (0, 0)


def test_prefill_service_grows_with_context_and_noise_is_shared_by_policies():
    from cluster.routing.policies import CostModel
    from lab.bench.replay import ServiceModel

    model = ServiceModel(CostModel(prefill_tokens_per_s=1000.0), 1000.0, [(1.0, 1.0, 1.0, 1.0), (2.0, 1.0, 1.0, 1.0)])
    assert model.prefill_s(0, 100, 0) == pytest.approx(0.1 * (1 + 50 / 1000))
    assert model.prefill_s(0, 100, 2000) == pytest.approx(0.1 * (1 + 2050 / 1000))
    assert model.prefill_s(1, 100, 0) == pytest.approx(2 * 0.1 * 1.05)
    assert ServiceModel.draws(5, 0.15, 3) == ServiceModel.draws(5, 0.15, 3) != ServiceModel.draws(5, 0.15, 4)
    assert ServiceModel.draws(2, 0.0, 3) == [(1.0, 1.0, 1.0, 1.0)] * 2


def test_the_index_learns_a_prefix_only_after_its_prefill(capsys, tmp_path):
    """A request that shares a long prefix with one still in its prefill: with oracle
    information the index already shows the prefix (sent when routed), with production
    information it does not (checkpointed when the prefill ends), so prefix routing cannot
    find it and the second request is a miss."""
    from cluster.trace import TraceRecord

    ids = list(range(8))   # 8 blocks of 512 tokens: a 0.4 s prefill at 10,000 tokens/s
    records = [TraceRecord(0.0, 8 * 512, 10, ids, 0), TraceRecord(100.0, 8 * 512, 10, ids, 1)]
    path = tmp_path / "trace.jsonl"
    write_trace(records, path)
    argv = ("--trace", str(path), "--replicas", "2", "--policy", "prefix", "--service-noise", "0")
    oracle = replay(capsys, *argv, "--oracle")["prefix"]
    prod = replay(capsys, *argv)["prefix"]
    assert oracle["hit_rate"] == 0.5          # the second request found all 8 blocks
    assert prod["hit_rate"] == 0.0


def test_production_flags_are_checked(capsys):
    for flags, message in ((["--report-interval-ms", "0"], "--report-interval-ms must be positive"),
                           (["--service-noise", "-1"], "--service-noise and --attention-tokens must be >= 0")):
        with pytest.raises(SystemExit) as info:
            main(["replay", "--records", "10", *flags])
        assert info.value.code == 2 and message in capsys.readouterr().err
