"""`bench serving --memory-mb M --working-set R`: sizing, the shared-prefix workload, the
comparison with vLLM given the same memory, and the run over working sets (arms stood in:
nothing here starts a server or is timed)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from lab.bench import equal_memory
from lab.bench import serving as bench_serving
from lab.load.chat_workload import Turn, WorkloadResult
from tests.unit.test_session_workload import FakeServer, Words, parser


def test_the_working_set_sizes_sessions_or_prefixes_to_r_times_the_memory():
    args = bench_serving.resolve_defaults(parser().parse_args(["--doc-tokens", "1300"]))
    per_session = 80 + 1300 + 4 * (20 + 96 // 2)                  # system, document, 4 turns
    assert equal_memory.session_tokens(args) == per_session == 1652
    assert equal_memory.sized_workload(args, 1.0, 8192) == {"sessions": 5}      # 8192 / 1652 = 4.96
    assert equal_memory.sized_workload(args, 4.0, 8192) == {"sessions": 20}
    assert equal_memory.sized_workload(args, 0.01, 8192) == {"sessions": 1}     # never none
    args = bench_serving.resolve_defaults(parser().parse_args(["--workload", "shared-prefix"]))
    assert equal_memory.sized_workload(args, 2.0, 8192) == {"prefixes": round(2 * 8192 / (80 + 1024 + 20))}
    assert equal_memory.memory_tokens(360, 46080) == 8192        # SmolLM2-135M in float32: 45 KiB a token


def test_the_shared_prefix_workload_reuses_each_document_and_asks_distinct_questions():
    plan = equal_memory.plan_shared_prefixes(Words(), prefixes=4, prefix_tokens=60, requests=12, arrival_s=2.0,
                                             max_tokens=32, seed=3)
    assert plan == equal_memory.plan_shared_prefixes(Words(), prefixes=4, prefix_tokens=60, requests=12,
                                                     arrival_s=2.0, max_tokens=32, seed=3)   # a pure function
    docs = [p.document for p in plan]
    assert len(set(docs)) == 4 and set(docs[:4]) == set(docs)          # each prefix once first, then reused
    assert all(len(d.split()) <= 60 for d in docs)
    questions = [p.turns[0].question for p in plan]
    assert len(set(questions)) == 12
    assert [len(p.turns) for p in plan] == [1] * 12 and {p.turns[0].max_tokens for p in plan} == {32}
    starts = [p.start_s for p in plan]
    assert starts[0] == 0.0 and starts == sorted(starts) and starts[-1] > 0
    with pytest.raises(ValueError, match="must be >= 1"):
        equal_memory.plan_shared_prefixes(Words(), prefixes=0, prefix_tokens=60, requests=1, arrival_s=1.0,
                                          max_tokens=1, seed=0)


def test_the_client_measures_every_gap_between_streamed_pieces():
    pytest.importorskip("aiohttp")
    plan = equal_memory.plan_shared_prefixes(Words(), prefixes=2, prefix_tokens=30, requests=3, arrival_s=0.0,
                                             max_tokens=8, seed=0)
    result = asyncio.run(FakeServer().run(plan, session_header=False))
    assert [len(t.itl_s) for t in result.turns] == [1, 1, 1]             # two pieces a reply: one gap
    row = result.summary()
    assert row["itl_ms_max"] == round(max(g for t in result.turns for g in t.itl_s) * 1e3, 1)
    assert row["itl_ms_p99"] is not None
    empty = WorkloadResult([Turn(0, 0, True, 0.1, 0.2, 10, 1)], 1.0).summary()
    assert empty["itl_ms_p99"] is None and empty["itl_ms_max"] is None


def row(**kw):
    base = {"workload": "sessions", "failed": 0, "requests": 20, "preemptions": 4, "tpot_ms_p50": 50.0,
            "tpot_ms_p99": 80.0, "itl_ms_p99": 90.0, "itl_ms_max": 300.0, "e2e_ms_p50": 2000.0,
            "output_tokens_per_s": 20.0, "ttft_ms_p50": 400.0, "ttft_ms_later_turns_p50": 300.0,
            "later_turns_cached_share": 0.95, "recomputed_held_tokens": 0}
    return {**base, **kw}


def test_the_comparison_gives_each_ratio_and_the_goals_of_its_working_set():
    peer = row(preemptions=0, tpot_ms_p50=60.0, itl_ms_p99=100.0, e2e_ms_p50=2500.0, output_tokens_per_s=8.0,
               ttft_ms_later_turns_p50=4000.0, recomputed_held_tokens=None)
    far = equal_memory.compare_equal_memory(row(), peer, 4.0)
    assert (far["tpot_ms_p50_vs_same_memory"], far["e2e_ms_p50_vs_same_memory"],
            far["output_tokens_per_s_vs_same_memory"], far["ttft_ms_later_turns_p50_vs_same_memory"]) == \
        (0.833, 0.8, 2.5, 0.075)
    assert (far["preemptions_per_stream"], far["peer_preemptions_per_stream"]) == (0.2, 0.0)
    assert far["goal_tpot_ms_p50_le_1x"] and far["goal_itl_ms_p99_le_1x"] and far["goal_e2e_ms_p50_le_1x"]
    assert far["goal_later_ttft_p50_le_0_1x"] and far["goal_later_cached_ge_0_9"] and far["goal_throughput_ge_2x"]
    assert "goal_later_ttft_p50_le_1x" not in far and far["goal_no_recomputed_held"]
    near = equal_memory.compare_equal_memory(row(output_tokens_per_s=7.0), peer, 1.0)
    assert near["goal_later_ttft_p50_le_1x"] and near["goal_throughput_ge_1x"] is False
    assert "goal_throughput_ge_2x" not in near
    alone = equal_memory.compare_equal_memory(row(), None, 1.0)
    assert alone["tpot_ms_p50_vs_same_memory"] is None and alone["goal_tpot_ms_p50_le_1x"] is None


def test_a_memory_sweep_runs_both_arms_at_each_working_set_with_the_same_bytes(monkeypatch, capsys):
    import cluster.engine.checkpoint as checkpoint
    import serve_app.local as local

    ran = []

    def ours(args, model, drive, hot_tokens):
        worker = bench_serving._worker_config(args, hot_tokens)
        ran.append(("prefix-cache", args.sessions, worker["kv_memory_mb"], "hot_blocks" in worker))
        return {"impl": "prefix-cache", **row(output_tokens_per_s=30.0)}

    def vllm(args, model_dir, drive, hot_tokens, arm):
        ran.append((arm, args.sessions, bench_serving.vllm_kv_tokens(args, arm, hot_tokens), model_dir))
        return {"impl": arm, **row(output_tokens_per_s=10.0, ttft_ms_later_turns_p50=9000.0)}

    monkeypatch.setattr(bench_serving, "run_ours", ours)
    monkeypatch.setattr(bench_serving, "run_vllm", vllm)
    monkeypatch.setattr(local, "prepare_model", lambda spec: "model")
    monkeypatch.setattr(checkpoint, "load_tokenizer", lambda spec: Words())
    monkeypatch.setattr(checkpoint, "resolve_checkpoint", lambda spec: Path("/weights"))
    monkeypatch.setattr(bench_serving, "kv_token_bytes", lambda model_dir: 46080)
    args = parser().parse_args(["--memory-mb", "360", "--working-set", "1,4", "--doc-tokens", "1300",
                                "--peer", "vllm", "--peer-python", "/venv/bin/python", "--replicas", "2"])
    assert bench_serving.run(args) == 0
    assert ran == [("prefix-cache", 5, 180.0, False), ("vllm-same-memory", 5, 8192, Path("/weights")),
                   ("prefix-cache", 20, 180.0, False), ("vllm-same-memory", 20, 8192, Path("/weights"))]
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    summaries = [r for r in rows if r["impl"] == "equal_memory"]
    assert [(r["working_set"], r["sessions"], r["memory_mb"]) for r in summaries] == [(1.0, 5, 360.0), (4.0, 20, 360.0)]
    assert summaries[1]["output_tokens_per_s_vs_same_memory"] == 3.0 and summaries[1]["goal_throughput_ge_2x"]
    assert all(r["working_set"] in (1.0, 4.0) for r in rows)
    with pytest.raises(ValueError, match="--working-set values must be > 0"):
        bench_serving.parse_working_sets("1,0")
    with pytest.raises(ValueError, match="vllm-same-memory arm needs --memory-mb"):
        bench_serving.run(parser().parse_args(["--arms", "prefix-cache,vllm-same-memory"]))
