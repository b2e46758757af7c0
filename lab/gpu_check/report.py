"""One step's summary line for scripts/gpu-check.sh: did it pass, how long, its key figures.

    python3 lab/gpu_check/report.py STEP RC SECONDS OUT ERR [NOTE]

reads the step's output (OUT: its stdout, JSON lines where the step prints them; ERR: its
stderr) and prints one JSON line: ``{"gpu_check": STEP, "ok": true|false|null, "seconds": S,
"rc": RC, ...figures}``, with ``failed`` (why) when ``ok`` is false and ``skipped`` (why)
when the step did not run (``ok`` null). A step fails when its command failed (RC != 0:
124 is its timeout, 97 a forced failure) or when a figure misses what the step checks
(``CHECKS`` below); exit status 0 passed, 1 failed, 3 skipped. No third-party imports: it
runs before anything is installed.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

FORCED_RC, SKIPPED_RC, TIMEOUT_RCS = 97, 3, (124, 137)
COPY_RATIO_GOAL, STALL_PCT_GOAL, FLOAT32_TOLERANCE = 0.9, 2.0, 1e-4
ARMS = ("drop", "tiered", "tiered+prefetch")


def json_lines(text: str) -> list[dict]:
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                rows.append(value)
    return rows


def _gpu(out: str, rows: list[dict]) -> tuple[dict, list[str]]:
    gpus = [line for line in out.splitlines() if line.startswith("GPU ")]
    return {"gpus": len(gpus), "gpu": gpus[0].split(":", 1)[1].split("(")[0].strip() if gpus else None}, \
        ([] if gpus else ["nvidia-smi lists no GPU"])


def _pytest(out: str, rows: list[dict]) -> tuple[dict, list[str]]:
    tail = out.strip().splitlines()[-1] if out.strip() else ""
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected)", tail)}
    figures = {"passed": counts.get("passed", 0), "tests_failed": counts.get("failed", 0) + counts.get("error", 0)
               + counts.get("errors", 0), "skipped": counts.get("skipped", 0)}
    return figures, ([] if figures["passed"] else ["no CUDA test ran (all skipped or none collected)"])


def _tiers(out: str, rows: list[dict]) -> tuple[dict, list[str]]:
    figures, failed = {}, []
    for row in rows:
        if row.get("direction") in ("d2h", "h2d"):
            figures[f"{row['direction']}_ratio"] = row.get("ratio")
            figures[f"{row['direction']}_gb_per_s"] = row.get("gb_per_s")
        if "stall_pct" in row:
            figures["stall_pct"] = row["stall_pct"]
    for name in ("d2h_ratio", "h2d_ratio"):
        value = figures.get(name)
        if value is None or value < COPY_RATIO_GOAL:
            failed.append(f"{name} {value} < {COPY_RATIO_GOAL} (a plain pinned copy of the same bytes)")
    stall = figures.get("stall_pct")
    if stall is None or stall >= STALL_PCT_GOAL:
        failed.append(f"forward-pass stall under offload {stall}% >= {STALL_PCT_GOAL}%")
    return figures, failed


EXACTNESS_KEYS = ("dtype", "max_abs_diff", "tolerance", "within_tolerance", "greedy_tokens_agree", "argmax_agree",
                  "cold_max_abs_diff", "cached_max_abs_diff", "later_max_abs_diff", "cached_cached_tokens",
                  "graphs_captured_at_start", "graphs_captured_while_serving", "graph_replays")


def _exactness(out: str, rows: list[dict], asserted: bool) -> tuple[dict, list[str]]:
    row = next((r for r in rows if r.get("bench") == "exactness"), None)
    if row is None:
        return {}, ["no exactness row printed"]
    figures = {k: row.get(k) for k in EXACTNESS_KEYS}
    failed = []
    if asserted and row.get("within_tolerance") is not True:
        failed.append(f"float32 logits differ from transformers' by {row.get('max_abs_diff')} "
                      f"(> {row.get('tolerance')})")
    if asserted and row.get("graphs_captured_while_serving") != 0:
        failed.append(f"{row.get('graphs_captured_while_serving')} CUDA graph(s) captured while serving "
                      f"(all should be captured at start-up)")
    return figures, failed


def _engine(out: str, rows: list[dict]) -> tuple[dict, list[str]]:
    ours = next((r for r in rows if r.get("impl") == "prefix-cache"), None)
    theirs = next((r for r in rows if r.get("impl") == "transformers"), None)
    if ours is None or theirs is None:
        return {}, ["bench engine printed no rows for both arms"]
    figures = {"ttft_ms_cold": ours.get("ttft_ms_cold"), "ttft_ms_cached": ours.get("ttft_ms_cached"),
               "decode_tokens_per_s": ours.get("decode_tokens_per_s"),
               "throughput_tokens_per_s": ours.get("throughput_tokens_per_s"),
               "greedy_match": ours.get("greedy_match"), "graph_replays": ours.get("graph_replays"),
               "transformers_ttft_ms_cold": theirs.get("ttft_ms_cold"),
               "transformers_ttft_ms_cached": theirs.get("ttft_ms_cached"),
               "transformers_decode_tokens_per_s": theirs.get("decode_tokens_per_s")}
    return figures, ([] if ours.get("graph_replays") else ["no decode step replayed a CUDA graph"])


def _multiturn(out: str, rows: list[dict]) -> tuple[dict, list[str]]:
    arms = {r["policy"]: r for r in rows if "policy" in r and r.get("prefetch_trigger") in ("none", "arrival")}
    figures = {arm: {k: arms[arm].get(k) for k in ("hit_rate", "ttft_ms_p50", "ttft_ms_mean", "requests",
                                                   "failed_requests")} for arm in ARMS if arm in arms}
    failed = [f"no {arm} row" for arm in ARMS if arm not in arms]
    failed += [f"{arm}: {row.get('failed_requests')} failed requests" for arm, row in arms.items()
               if row.get("failed_requests")]
    drop, tiered = arms.get("drop", {}).get("ttft_ms_p50"), arms.get("tiered", {}).get("ttft_ms_p50")
    if drop and tiered:
        figures["drop_vs_tiered_ttft_p50"] = round(drop / tiered, 2)
    return figures, failed


def _own_row(out: str, rows: list[dict]) -> tuple[dict, list[str]]:
    """A step script of this folder: its last JSON row, whose ``failed`` list says what missed."""
    if not rows:
        return {}, ["the step printed no JSON row"]
    row = dict(rows[-1])
    return row, list(row.pop("failed", None) or [])


CHECKS = {
    "gpu": _gpu,
    "cuda-tests": _pytest,
    "bench-tiers": _tiers,
    "exactness-float32": lambda out, rows: _exactness(out, rows, asserted=True),
    "exactness-bfloat16": lambda out, rows: _exactness(out, rows, asserted=False),
    "bench-engine": _engine,
    "bench-multiturn": _multiturn,
    "serve": _own_row,
    "nixl-device": _own_row,
    "mooncake-cuda": _own_row,
    "torch": _own_row,
}


def report(step: str, rc: int, seconds: int, out: str, err: str, note: str = "") -> dict:
    line: dict = {"gpu_check": step, "ok": None, "seconds": seconds, "rc": rc}
    rows = json_lines(out)
    if rc == FORCED_RC:
        line.update(ok=False, failed=[note or "forced to fail (GPU_CHECK_FORCE_FAIL)"])
        return line
    if rc == SKIPPED_RC:
        reason = note or next((r["skipped"] for r in reversed(rows) if "skipped" in r), None) or \
            (err.strip().splitlines() or ["skipped"])[-1]
        line["skipped"] = reason
        return line
    figures, failed = ({}, [])
    check = CHECKS.get(step)
    if check is not None:
        try:
            figures, failed = check(out, rows)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
            failed = [f"its output could not be read: {type(exc).__name__}: {exc}"]
    line.update(figures)
    if rc != 0:
        why = "timed out" if rc in TIMEOUT_RCS else f"exited {rc}"
        # The last line of its stderr, else of its stdout that is not a JSON row (those give the figures).
        text = [line for line in out.strip().splitlines() if not line.lstrip().startswith("{")]
        tail = (err.strip().splitlines() or text or [""])[-1][:300]
        failed = [f"{why}{': ' + note if note else ''}{' (' + tail + ')' if tail else ''}"] + failed
    line["ok"] = not failed
    if failed:
        line["failed"] = failed
    return line


def main(argv: list[str]) -> int:
    if len(argv) not in (5, 6):
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    step, rc, seconds, out_path, err_path = argv[:5]
    read = lambda p: Path(p).read_text(errors="replace") if Path(p).is_file() else ""  # noqa: E731
    line = report(step, int(rc), int(seconds), read(out_path), read(err_path), argv[5] if len(argv) == 6 else "")
    print(json.dumps(line), flush=True)
    return 3 if line["ok"] is None else 0 if line["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
