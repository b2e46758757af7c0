"""Which of MKL's two layouts a linear of a given row count runs in, measured per machine.

``linear(x, W, b, transposed)`` is ``F.linear`` computed as ``x @ W^T`` or, transposed,
as ``(W @ x^T)^T``: the same exact sgemm, results within float32 rounding of each
other, speeds that flip between CPUs. MKL reads the weights of a few-row ``x @ W^T``
at a quarter of the speed it streams them for a few-column ``W @ x^T`` on one CPU (AMD
EPYC, AVX2, 2 cores: 139 vs 76 ms a step for 16 rows of a 135M model) and at twice it
on another (Xeon, AVX-512, 2 cores: 25 vs 59 ms for 2 rows). So ``tuned`` times both
over a model's own weights for each of ``TUNED_ROWS`` and keeps the answer per CPU,
torch version, thread count, dtype and weight shapes: in this process and in
``linear-layouts.json`` under ``PREFIX_CACHE_TUNING_DIR`` (default
``~/.cache/prefix-cache``), so a machine measures once, not every replica that starts
(replicas start together, and would time each other's loading).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# Until a model is tuned, the row counts that take W @ x^T (the AMD VM's answer).
FEW_ROWS = range(2, 65)
# Row counts measured; a count between two takes the layout of the one below it, above the last x @ W^T.
TUNED_ROWS = (1, 2, 4, 8, 16, 32, 64)
TUNING_DIR_ENV = "PREFIX_CACHE_TUNING_DIR"
_known: dict[str, tuple[bool, ...]] = {}   # this process's answers, by key


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    """``F.linear`` of a 2-D ``x`` in the layout ``transposed`` names."""
    if not transposed:
        return F.linear(x, weight, bias)
    out = torch.mm(weight, x.t()).t().contiguous()
    return out if bias is None else out.add_(bias)


def transposed(layouts: tuple[bool, ...] | None, rows: int) -> bool:
    """Whether ``rows`` rows take W @ x^T under ``layouts`` (None: not tuned, ``FEW_ROWS``)."""
    if layouts is None:
        return rows in FEW_ROWS
    return rows < len(layouts) and layouts[rows]


def describe(layouts: tuple[bool, ...]) -> dict[int, str]:
    return {rows: "W @ x^T" if layouts[rows] else "x @ W^T" for rows in TUNED_ROWS}


def tuned(weights: list[torch.Tensor], dtype: str) -> tuple[bool, ...]:
    """Per row count 0..``TUNED_ROWS[-1]``, whether W @ x^T is the faster layout for
    ``weights`` here: remembered, read from the tuning file, or measured (and stored)."""
    shapes = hashlib.sha256(repr([tuple(w.shape) for w in weights]).encode()).hexdigest()[:16]
    key = f"{_cpu_name()}|torch {torch.__version__}|{torch.get_num_threads()} threads|{dtype}|{shapes}"
    layouts = _known.get(key) or _load(key)
    if layouts is None:
        faster = {rows: _time(weights, rows, True) < _time(weights, rows, False) for rows in TUNED_ROWS}
        below = [max(r for r in TUNED_ROWS if r <= rows) for rows in range(1, TUNED_ROWS[-1] + 1)]
        layouts = (False,) + tuple(faster[r] for r in below)
        _store(key, layouts)
    _known[key] = layouts
    return layouts


def _time(weights: list[torch.Tensor], rows: int, transposed: bool, repeats: int = 1) -> float:
    xs = [torch.randn(rows, w.shape[1], dtype=w.dtype, device=w.device) for w in weights]
    best = float("inf")
    for _ in range(repeats + 1):   # the first pass warms up
        began = time.perf_counter()
        for w, x in zip(weights, xs):
            linear(x, w, None, transposed)
        best = min(best, time.perf_counter() - began)
    return best


def _tuning_file() -> Path:
    return Path(os.environ.get(TUNING_DIR_ENV) or "~/.cache/prefix-cache").expanduser() / "linear-layouts.json"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _read_file() -> dict:
    try:
        known = json.loads(_tuning_file().read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def _load(key: str) -> tuple[bool, ...] | None:
    value = _read_file().get(key)
    if isinstance(value, list) and len(value) == TUNED_ROWS[-1] + 1 and all(isinstance(v, bool) for v in value):
        return tuple(value)
    return None


def _store(key: str, layouts: tuple[bool, ...]) -> None:
    path = _tuning_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        known = {**_read_file(), key: list(layouts)}
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1))
        tmp.replace(path)   # atomic: a concurrent reader sees the old file or the new one
    except OSError:   # a read-only home: this process keeps its measurement
        pass
