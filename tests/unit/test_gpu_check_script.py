"""scripts/gpu-check.sh tells the truth: one summary line per step, every step run whatever
failed before, a non-zero exit when any step failed. No GPU needed: ``GPU_CHECK_DRY=1`` skips
the steps' commands and ``GPU_CHECK_FORCE_FAIL`` fails the named ones; the figure checks of
``lab/gpu_check/report.py`` run on recorded outputs (the first H200 run's among them)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu-check.sh"
STEPS = ["gpu", "install", "torch", "model", "cuda-tests", "bench-tiers", "exactness-float32", "exactness-bfloat16",
         "bench-engine", "bench-multiturn", "serve", "nixl-device", "mooncake-cuda"]


def _report_module():
    spec = importlib.util.spec_from_file_location("gpu_check_report", REPO / "lab" / "gpu_check" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_check(tmp_path: Path, **env: str) -> tuple[int, list[dict]]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
    done = subprocess.run(["bash", str(SCRIPT)], env={**base, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable,
                                                     "GPU_CHECK_DRY": "1", **env},
                          capture_output=True, text=True, timeout=120)
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert (tmp_path / "out" / "summary.jsonl").read_text().splitlines() == done.stdout.splitlines()
    return done.returncode, lines


def test_a_dry_run_reports_every_step_and_passes(tmp_path):
    rc, lines = run_check(tmp_path)
    assert rc == 0
    assert [line["gpu_check"] for line in lines] == STEPS + ["total"]
    for line in lines[:-1]:
        assert (line["ok"], line["skipped"], line["rc"]) == (None, "dry run (GPU_CHECK_DRY=1)", 3)
        assert isinstance(line["seconds"], int)
    assert lines[-1]["ok"] is True and lines[-1]["failed_steps"] == []


def test_a_forced_failure_fails_the_check_and_the_steps_after_it_still_run(tmp_path):
    rc, lines = run_check(tmp_path, GPU_CHECK_FORCE_FAIL="gpu,bench-tiers")
    assert rc == 1
    assert [line["gpu_check"] for line in lines] == STEPS + ["total"]   # nothing stopped at the first failure
    by_step = {line["gpu_check"]: line for line in lines}
    for name in ("gpu", "bench-tiers"):
        assert (by_step[name]["ok"], by_step[name]["rc"]) == (False, 97)
        assert by_step[name]["failed"] == ["forced to fail by GPU_CHECK_FORCE_FAIL (not run)"]
    assert all(line["ok"] is None for name, line in by_step.items() if name not in ("gpu", "bench-tiers", "total"))
    assert by_step["total"]["ok"] is False and by_step["total"]["failed_steps"] == ["gpu", "bench-tiers"]


def test_the_h200_runs_copy_figures_fail_the_goals():
    """The first GPU run's `bench tiers` lines: copies at 0.72x and 0.67x a plain copy and an
    11.9% stall, each below the design's goal, so the step fails and says why."""
    report = _report_module()
    recorded = (REPO / "docs" / "results" / "gpu-check-h200.jsonl").read_text()
    line = report.report("bench-tiers", 0, 40, recorded, "")
    assert line["ok"] is False
    assert (line["d2h_ratio"], line["h2d_ratio"], line["stall_pct"]) == (0.717, 0.67, 11.92)
    assert line["failed"] == ["d2h_ratio 0.717 < 0.9 (a plain pinned copy of the same bytes)",
                              "h2d_ratio 0.67 < 0.9 (a plain pinned copy of the same bytes)",
                              "forward-pass stall under offload 11.92% >= 2.0%"]
    good = [{"bench": "tiers", "direction": "d2h", "ratio": 0.95, "gb_per_s": 50.0},
            {"bench": "tiers", "direction": "h2d", "ratio": 0.93, "gb_per_s": 49.0},
            {"bench": "tiers", "stall_pct": 1.2}]
    assert report.report("bench-tiers", 0, 40, "\n".join(map(json.dumps, good)), "")["ok"] is True


@pytest.mark.parametrize("row, rc, ok, failed", [
    ({"bench": "exactness", "max_abs_diff": 3e-5, "tolerance": 1e-4, "within_tolerance": True,
      "graphs_captured_while_serving": 0}, 0, True, None),
    ({"bench": "exactness", "max_abs_diff": 2e-3, "tolerance": 1e-4, "within_tolerance": False,
      "graphs_captured_while_serving": 0}, 1, False,
     ["exited 1", "float32 logits differ from transformers' by 0.002 (> 0.0001)"]),
    ({"bench": "exactness", "max_abs_diff": 3e-5, "tolerance": 1e-4, "within_tolerance": True,
      "graphs_captured_while_serving": 2}, 0, False,
     ["2 CUDA graph(s) captured while serving (all should be captured at start-up)"]),
])
def test_float32_exactness_is_checked(row, rc, ok, failed):
    line = _report_module().report("exactness-float32", rc, 30, json.dumps(row), "")
    assert line["ok"] is ok and line.get("failed") == failed and line["max_abs_diff"] == row["max_abs_diff"]


def test_bfloat16_differences_are_reported_not_checked():
    row = {"bench": "exactness", "max_abs_diff": 0.4, "tolerance": None, "within_tolerance": None,
           "greedy_tokens_agree": 0.875, "graphs_captured_while_serving": 0}
    line = _report_module().report("exactness-bfloat16", 0, 30, json.dumps(row), "")
    assert line["ok"] is True and (line["max_abs_diff"], line["greedy_tokens_agree"]) == (0.4, 0.875)


def test_a_timeout_a_skip_and_a_missing_arm_say_what_happened():
    report = _report_module()
    timed_out = report.report("bench-engine", 124, 75, "", "loading the model\n")
    assert timed_out["ok"] is False and timed_out["failed"][0] == "timed out (loading the model)"
    skipped = report.report("mooncake-cuda", 3, 2, json.dumps({"skipped": "cannot install it here: no index"}), "")
    assert (skipped["ok"], skipped["skipped"]) == (None, "cannot install it here: no index")
    rows = [{"policy": "drop", "prefetch_trigger": "none", "hit_rate": 0.6, "ttft_ms_p50": 120.0,
             "failed_requests": 0},
            {"policy": "tiered", "prefetch_trigger": "none", "hit_rate": 0.9, "ttft_ms_p50": 40.0,
             "failed_requests": 0}]
    line = report.report("bench-multiturn", 0, 60, "\n".join(map(json.dumps, rows)), "")
    assert line["ok"] is False and line["failed"] == ["no tiered+prefetch row"]
    assert line["drop_vs_tiered_ttft_p50"] == 3.0 and line["tiered"]["hit_rate"] == 0.9
    no_tests = report.report("cuda-tests", 0, 5, "5 deselected in 0.1s\n", "")
    assert no_tests["ok"] is False and no_tests["failed"] == ["no CUDA test ran (all skipped or none collected)"]


ROWS = {   # what each stand-in command prints: figures that meet every check
    "bench tiers": [{"bench": "tiers", "direction": "d2h", "ratio": 0.95, "gb_per_s": 52.0},
                    {"bench": "tiers", "direction": "h2d", "ratio": 0.92, "gb_per_s": 50.1},
                    {"bench": "tiers", "stall_pct": 1.1}],
    "bench exactness": [{"bench": "exactness", "max_abs_diff": 4e-5, "tolerance": 1e-4, "within_tolerance": True,
                         "greedy_tokens_agree": 1.0, "graphs_captured_while_serving": 0}],
    "bench engine": [{"bench": "engine", "impl": "prefix-cache", "ttft_ms_cold": 20.0, "graph_replays": 90},
                     {"bench": "engine", "impl": "transformers", "ttft_ms_cold": 25.0}],
    "bench multiturn": [{"policy": arm, "prefetch_trigger": "arrival" if arm.endswith("prefetch") else "none",
                         "hit_rate": 0.8, "ttft_ms_p50": 50.0, "failed_requests": 0}
                        for arm in ("drop", "tiered", "tiered+prefetch")],
    "lab.gpu_check.serve": [{"replicas": 2, "replicas_on_gpu": 2, "failed": []}],
    "lab.gpu_check.nixl": [{"exact": True, "gb_per_s": 20.0, "failed": []}],
}


def _stand_ins(folder: Path, gpu: bool) -> dict:
    """The commands the GPU check calls, as scripts that log their arguments: ``nvidia-smi`` (a
    GPU, or none), ``bash`` (the install step's) and the Python interpreter, which passes the
    summary lines' helper to the real one, prints rows that meet every check, fails the CUDA
    tests and skips the Mooncake wheel, so the steps after a failed one must still run."""
    import shlex

    log = folder / "calls.log"
    folder.mkdir()
    cases = "\n".join(f"    *{shlex.quote(key)}*) printf '%s\\n' {' '.join(shlex.quote(json.dumps(r)) for r in rows)} ;;"
                      for key, rows in ROWS.items())
    scripts = {
        "nvidia-smi": "echo 'GPU 0: NVIDIA Stand-in (UUID: GPU-0)'" if gpu else "exit 9",
        "bash": f'echo "bash $*" >> {log}',
        "python": f'''case "$1" in
  -m) if [ "$2" = lab.gpu_check.report ]; then exec {shlex.quote(sys.executable)} "$@"; fi ;;
  -c) echo "python -c" >> {log}; echo '{{"failed": []}}'; exit 0 ;;
esac
echo "python $*" >> {log}
case "$*" in
  *"-m pytest"*) echo "1 failed, 2 passed in 0.5s"; echo "E   a cuda test failed" >&2; exit 1 ;;
  *lab.gpu_check.mooncake*) echo '{{"skipped": "cannot install mooncake-transfer-engine here: no index"}}'; exit 3 ;;
{cases}
esac''',
    }
    for name, body in scripts.items():
        (folder / name).write_text(f"#!/bin/sh\n{body}\n")
        (folder / name).chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
    return {**base, "PATH": f"{folder}:{os.environ['PATH']}", "PYTHON": str(folder / "python"),
            "OUT": str(folder.parent / "out")}


def test_every_step_runs_in_order_past_a_failed_one(tmp_path):
    """With stand-in commands (no GPU needed): every step runs, in order, each with its output
    kept and its summary line; the failed CUDA tests fail the check (exit 1) and say why, the
    steps after them still run and pass on their figures, the Mooncake wheel says why it skipped."""
    env = _stand_ins(tmp_path / "bin", gpu=True)
    done = subprocess.run(["/bin/bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    calls = (tmp_path / "bin" / "calls.log").read_text().splitlines()
    assert [c.split()[:4] if " -m cluster.cli" in c else c.split()[:3] if " -m lab." in c else c.split()[:2] for c in calls] == [
        ["bash", ".ci/install"], ["python", "-c"], ["python", "-c"], ["python", "-m"],
        ["python", "-m", "cluster.cli", "bench"], ["python", "-m", "cluster.cli", "bench"],
        ["python", "-m", "cluster.cli", "bench"], ["python", "-m", "cluster.cli", "bench"],
        ["python", "-m", "cluster.cli", "bench"], ["python", "-m", "lab.gpu_check.serve"],
        ["python", "-m", "lab.gpu_check.nixl"], ["python", "-m", "lab.gpu_check.mooncake"]]
    assert "-m cuda" in calls[3] and "tests/unit/test_cuda_engine.py" in calls[3].split()
    assert [c.split()[4] for c in calls if " -m cluster.cli" in c] == ["tiers", "exactness", "exactness", "engine",
                                                                      "multiturn"]
    assert "--device cuda --dtype float32" in calls[5] and "--device cuda --dtype bfloat16" in calls[6]
    assert "--policies drop,tiered,tiered+prefetch" in calls[8] and "--expect-gpu" in calls[9]
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [line["gpu_check"] for line in lines] == STEPS + ["total"]
    by_step = {line["gpu_check"]: line for line in lines}
    assert by_step["cuda-tests"]["ok"] is False and by_step["cuda-tests"]["failed"] == ["exited 1 (E   a cuda test failed)"]
    assert (by_step["cuda-tests"]["passed"], by_step["cuda-tests"]["tests_failed"]) == (2, 1)
    mooncake = dict(by_step["mooncake-cuda"], seconds=0)
    assert mooncake == {"gpu_check": "mooncake-cuda", "ok": None, "seconds": 0, "rc": 3,
                        "skipped": "cannot install mooncake-transfer-engine here: no index"}
    assert all(by_step[s]["ok"] is True for s in STEPS if s not in ("cuda-tests", "mooncake-cuda")), lines
    assert by_step["gpu"]["gpu"] == "NVIDIA Stand-in" and by_step["bench-tiers"]["stall_pct"] == 1.1
    assert by_step["total"]["failed_steps"] == ["cuda-tests"]
    assert "cuda-tests: E   a cuda test failed" in done.stderr   # its stderr's tail, shown
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        [f"{s}.{ext}" for s in STEPS for ext in ("out", "err")] + ["summary.jsonl"])


def test_without_a_gpu_it_stops_before_installing_anything(tmp_path):
    env = _stand_ins(tmp_path / "bin", gpu=False)
    done = subprocess.run(["/bin/bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "no NVIDIA GPU here" in done.stderr
    assert not (tmp_path / "bin" / "calls.log").exists()   # nothing installed, nothing run
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(line["gpu_check"], line["ok"]) for line in lines] == [("gpu", False), ("total", False)]
