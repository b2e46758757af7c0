"""Helpers shared by the benchmark drivers: JSON output and percentiles."""

from __future__ import annotations

import json
import sys
from typing import Any, Sequence


def emit(record: dict[str, Any]) -> None:
    """Print one JSON line (the benchmarks' public output format) and flush."""
    sys.stdout.write(json.dumps(record, sort_keys=False) + "\n")
    sys.stdout.flush()


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    idx = min(len(ordered) - 1, max(0, int(round(q / 100 * (len(ordered) - 1)))))
    return ordered[idx]


def rounded(value: float, digits: int = 4) -> float:
    return float(round(value, digits))
