"""The CUDA Mooncake wheel: the `mooncake-cuda` step of scripts/gpu-check.sh.

``mooncake-transfer-engine`` (the ``l3-cuda`` extra, what ``.ci/install`` puts on a GPU
machine) is installed where this machine can (a package index in reach); then the L3 tests
(``tests/unit/test_l3.py``, ``tests/unit/test_worker_l3.py``: a real ``mooncake_master``,
puts and gets, a worker's write-behind and fetch) run on it with ``CI=true``, so a Mooncake
that does not import fails them instead of skipping. One JSON row: the wheel's version, the
tests passed, ``failed``; exit 3 with a ``skipped`` row where the wheel cannot be installed.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

WHEEL = "mooncake-transfer-engine"
VERSION = "0.3.13.post1"
CPU_WHEEL = "mooncake-transfer-engine-non-cuda"
ROOT = Path(__file__).resolve().parents[2]


def installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def main() -> int:
    row: dict = {"wheel": WHEEL}
    if installed(WHEEL) is None:
        pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", f"{WHEEL}=={VERSION}"],
                             capture_output=True, text=True, timeout=240)
        if pip.returncode != 0:
            tail = (pip.stderr.strip().splitlines() or ["pip failed"])[-1][:200]
            print(json.dumps({**row, "skipped": f"cannot install {WHEEL}=={VERSION} here: {tail}"}), flush=True)
            return 3
        row["installed_now"] = True
    row["version"] = installed(WHEEL)
    failed = []
    if installed(CPU_WHEEL) is not None:   # both put files under mooncake/: which one imports is luck
        failed.append(f"{CPU_WHEEL} is installed beside it: pip uninstall {CPU_WHEEL} first")
    env = {**os.environ, "CI": "true", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/unit/test_l3.py",
                            "tests/unit/test_worker_l3.py"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=600)
    tail = tests.stdout.strip().splitlines()[-1] if tests.stdout.strip() else ""
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?)", tail)}
    row.update(passed=counts.get("passed", 0), tests_failed=counts.get("failed", 0) + counts.get("error", 0)
               + counts.get("errors", 0), skipped=counts.get("skipped", 0))
    if tests.returncode != 0 or not row["passed"]:
        failed.append(f"the L3 tests on it: {tail or tests.stderr.strip()[-200:]}")
    row["failed"] = failed
    print(json.dumps(row), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
