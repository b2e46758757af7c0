"""`bench engine` and `bench chat` run end to end and print the rows their issue names.

Speed is not asserted (that is what the commands measure); what they compare is:
the engine's greedy tokens equal transformers' on a real (tiny, random)
checkpoint, and the chat bench's prompts extend each other turn after turn.
"""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")

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
    assert "throughput_tokens_per_s_batched" in theirs


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


def test_gpu_check_script_parses_and_runs_every_step():
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "gpu-check.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    for step in ("-m cuda", "bench tiers", "bench engine --device cuda --dtype bfloat16", "bench multiturn"):
        assert step in text, step


def test_results_file_gets_exactly_the_lines_the_command_printed(tmp_path, capsys):
    """``--results FILE``: the raw JSON lines a page quotes are written by the command itself."""
    out = tmp_path / "fragmentation.jsonl"
    out.write_text('{"earlier": "line"}\n')   # appended to, never overwritten
    assert main(["bench", "fragmentation", "--pool-tokens", "4096", "--results", str(out)]) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    written = out.read_text().splitlines()
    assert printed and written == ['{"earlier": "line"}'] + printed
    assert all(json.loads(line)["bench"] == "fragmentation" for line in printed)
