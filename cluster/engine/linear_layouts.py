"""Which of four ways a linear of a given row count runs, measured per machine.

``linear(x, W, b, layout)`` is ``F.linear`` computed as ``x @ W^T`` (``PLAIN``), as
``(W @ x^T)^T`` (``TRANSPOSED``), or with MKL's packed sgemm over a copy of ``W``
packed once (``PACKED``: ``torch.ops.mkl._mkl_linear``, what torch's own CPU
compiler uses for float32 linears): the same float32 products, results within
float32 rounding of each other (no reduced precision in any), speeds that flip
between CPUs: MKL reads the weights of a few-row ``x @ W^T`` far slower than it
streams them for a few-column ``W @ x^T`` on one CPU and faster on another, and the
packed copy wins some row counts on some CPUs only (docs/engine.md, "Measurements
behind the CPU runtime choices"). So ``tuned`` times the layouts over a
model's own weights, one group at a time (the layers' linears, the head), for each
of ``TUNED_ROWS``, and keeps the answer per CPU, torch version, thread count, dtype
and weight shapes: in this process and in ``linear-layouts.json`` under
``PREFIX_CACHE_TUNING_DIR`` (default ``~/.cache/prefix-cache``), so a machine
measures once, not every replica that starts (replicas start together, and would
time each other's loading). A packed copy costs memory (2-5x its weight: MKL pads
it), so a model packs only the weights of a group some row count runs packed.

``PACKED`` is opt-in (``PREFIX_CACHE_MKL_PACKED=1``): its sums run in another order
than ``x @ W^T``, the order transformers' own forward uses, and through the 30 layers
of SmolLM2-135M the difference can grow past the 1e-4 the engine's logits are held
to (``x @ W^T`` is bitwise equal).

``BLOCKED`` runs the compiled kernel of ``cluster/engine/kernels/blocked_linear.cpp``
over a copy of ``W`` cut into column panels: it sums each output in the order MKL's
sgemm uses for a large batch (K in parts as MKL's threads split it, each part in
balanced blocks of at most ``kc``, one FMA after the other within a block), so at
every row count it gives the numbers ``x @ W^T`` gives for a prompt of a few dozen
tokens, bit for bit, and it reads each weight once a step for all rows. MKL itself
takes another path (another order, and a third to half of the memory's speed) below
4 to 16 rows. The order is not assumed: ``blocked_order`` finds the parts and block
size for which the kernel equals MKL's large-batch result bit for bit on the group's
own weight shapes, with this process's threads, and without such an order (another
CPU, another MKL, a bias added in another order) the layout is not a candidate. The
tuned row counts reach the step budget, so a prompt's chunk runs on it where it is
faster, with the same bits.
"""

from __future__ import annotations

from collections.abc import Mapping

import hashlib
import json
import os
import platform
import time
from pathlib import Path

from dataclasses import dataclass

import torch
import torch.nn.functional as F

PLAIN, TRANSPOSED, PACKED, BLOCKED = 0, 1, 2, 3
NAMES = {PLAIN: "x @ W^T", TRANSPOSED: "W @ x^T", PACKED: "packed", BLOCKED: "blocked"}
# Until a model is tuned, the row counts that take W @ x^T (the AMD VM's answer).
FEW_ROWS = range(2, 65)
# Row counts measured; a count between two takes the layout of the one below it, above the last the
# last's. They reach the default step budget (512 tokens): prefill chunks run on them too.
TUNED_ROWS = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512)
# Above this many rows a layout is timed over a sample of the group's weights (``TIME_SAMPLE``
# of them): a prompt's rows cost the whole group seconds a pass, and the shapes repeat a layer.
SAMPLE_ABOVE_ROWS, TIME_SAMPLE = 128, 8
# Each row count's candidates are timed in this many interleaved rounds (the fastest round counts),
# and another layout replaces blocked only where it is this much faster (``_fastest``).
TIME_ROUNDS, BLOCKED_MARGIN = 3, 0.1
# Part of the tuning file's key: a table measured by an older rule is measured again.
TUNING_RULE = "rounds3-margin10"
TUNING_DIR_ENV = "PREFIX_CACHE_TUNING_DIR"
PACKED_ENV = "PREFIX_CACHE_MKL_PACKED"
PACK_ROWS = 16   # the row count a weight is packed for (the packed copy serves any count)
Layouts = tuple[int, ...]   # per row count 0..TUNED_ROWS[-1], one of PLAIN, TRANSPOSED, PACKED, BLOCKED
_known: dict[str, Layouts] = {}   # this process's answers, by key
# The orders ``blocked_order`` tries: MKL's parts (its threads, or one) x block sizes.
BLOCK_SIZES = (384, 256, 512, 192, 320, 128)
CHECK_ROWS = (1024,)   # the long prompt whose numbers the blocked kernel must give (see blocked_order)
_orders: dict[str, "tuple[int, int] | None"] = {}   # this process's answers, by shapes and threads


@dataclass(frozen=True)
class Panels:
    """A weight cut into the blocked kernel's column panels, and the order to sum in."""

    panels: torch.Tensor   # [ceil(N / 64), K, 64]
    n: int
    parts: int
    kc: int


def blocked_order(pairs: "list[tuple[torch.Tensor, torch.Tensor | None]]") -> tuple[int, int] | None:
    """(parts, kc) for which the blocked kernel gives, for every (weight, bias) of
    ``pairs``, exactly what ``F.linear`` gives for batches of ``CHECK_ROWS`` rows, at
    1, 3, 5, 16 and 64 rows; None when no order tried does (or no kernel: float32 CPU only)."""
    weights = [w for w, _ in pairs]
    if weights[0].dtype != torch.float32 or weights[0].device.type != "cpu":
        return None
    from cluster.engine import kernels

    module = kernels.blocked_linear()
    if module is None:
        return None
    shapes = sorted({(tuple(w.shape), b is not None) for w, b in pairs})
    key = f"{torch.get_num_threads()}|{shapes}"
    if key in _orders:
        return _orders[key]
    sample = {}
    for w, b in pairs:   # one weight (with its bias) of each shape
        sample.setdefault((tuple(w.shape), b is not None), (w, b))
    gen = torch.Generator().manual_seed(0)
    checks = []
    for w, b in sample.values():
        x = torch.randn(max(CHECK_ROWS), w.shape[1], generator=gen)
        p = module.pack_panels(w.detach().contiguous())
        checks.extend((x, p, w, b, F.linear(x[:rows], w, b)) for rows in CHECK_ROWS)
    found = None
    for parts in dict.fromkeys((torch.get_num_threads(), 1, 2)):
        for kc in BLOCK_SIZES:
            if all(torch.equal(linear(x[:rows], w, b, BLOCKED, Panels(p, w.shape[0], parts, kc)), ref[:rows])
                   for x, p, w, b, ref in checks for rows in (1, 3, 5, 16, min(64, ref.shape[0]))):
                found = (parts, kc)
                break
        if found:
            break
    _orders[key] = found
    return found


def panels(weight: torch.Tensor, order: tuple[int, int]) -> Panels:
    """``weight`` cut into the blocked kernel's panels, to sum in ``order`` (``blocked_order``)."""
    from cluster.engine import kernels

    module = kernels.blocked_linear()
    return Panels(module.pack_panels(weight.detach().contiguous()), weight.shape[0], *order)


def packed_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether MKL's packed sgemm serves here: float32 and torch built with MKL."""
    return (dtype == torch.float32 and torch.backends.mkl.is_available()
            and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"))


def packed_enabled(dtype: torch.dtype = torch.float32) -> bool:
    """Whether ``tuned`` may pick ``PACKED``: available and asked for (``PREFIX_CACHE_MKL_PACKED=1``)."""
    return os.environ.get(PACKED_ENV, "0").strip() == "1" and packed_available(dtype)


def worker_env(environ: "Mapping[str, str] | None" = None) -> dict[str, str]:
    """``PREFIX_CACHE_MKL_PACKED`` as the environment that builds an app has it, for its
    CPU replicas' ``runtime_env`` (empty when unset)."""
    environ = os.environ if environ is None else environ
    return {PACKED_ENV: environ[PACKED_ENV]} if PACKED_ENV in environ else {}


def pack(weight: torch.Tensor) -> torch.Tensor:
    """MKL's packed copy of a ``[out, in]`` float32 CPU weight (for ``linear(..., PACKED, packed)``)."""
    return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layout: int,
           packed: "torch.Tensor | Panels | None" = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` of a 2-D ``x`` in ``layout`` (``PACKED`` needs ``packed``, ``pack(weight)``;
    ``BLOCKED`` its ``Panels``); with ``residual``, ``residual + F.linear(...)`` (the blocked
    kernel adds it inside its call: one op fewer a layer, the same bits)."""
    if layout == BLOCKED and isinstance(packed, Panels):
        from cluster.engine import kernels

        if bias is None and residual is not None:
            return kernels.blocked_linear().blocked_linear(x, packed.panels, packed.n, packed.parts, packed.kc,
                                                           residual)
        out = kernels.blocked_linear().blocked_linear(x, packed.panels, packed.n, packed.parts, packed.kc)
        out = out if bias is None else out.add_(bias)
    elif layout == PACKED and isinstance(packed, torch.Tensor):
        out = torch.ops.mkl._mkl_linear(x, packed, weight, bias, x.shape[0])
    elif layout != TRANSPOSED:
        out = F.linear(x, weight, bias)
    else:
        out = torch.mm(weight, x.t()).t().contiguous()
        out = out if bias is None else out.add_(bias)
    return out if residual is None else residual + out


def layout_for(layouts: Layouts | None, rows: int) -> int:
    """The layout ``rows`` rows take under ``layouts`` (None: not tuned, ``FEW_ROWS`` transposed)."""
    if layouts is None:
        return TRANSPOSED if rows in FEW_ROWS else PLAIN
    return layouts[min(rows, len(layouts) - 1)]


def describe(layouts: Layouts) -> dict[int, str]:
    return {rows: NAMES[layouts[rows]] for rows in TUNED_ROWS}


def tuned(weights: list[torch.Tensor], dtype: str, biases: "list[torch.Tensor | None] | None" = None) -> Layouts:
    """Per row count 0..``TUNED_ROWS[-1]``, the fastest layout for ``weights`` here:
    remembered, read from the tuning file, or measured (and stored)."""
    order = blocked_order(list(zip(weights, biases or [None] * len(weights))))
    candidates = [PLAIN, TRANSPOSED] + ([PACKED] if packed_enabled(weights[0].dtype) else []) + \
        ([BLOCKED] if order is not None else [])
    shapes = hashlib.sha256(repr([tuple(w.shape) for w in weights]).encode()).hexdigest()[:16]
    key = (f"{_cpu_name()}|torch {torch.__version__}|{torch.get_num_threads()} threads|{dtype}|{shapes}|"
           f"{'+'.join(NAMES[c] for c in candidates)}|{TUNING_RULE}")
    layouts = _known.get(key) or _load(key, candidates)
    if layouts is None:
        copies = {PACKED: [pack(w) for w in weights] if PACKED in candidates else None,
                  BLOCKED: [panels(w, order) for w in weights] if BLOCKED in candidates else None}
        fastest = {rows: _fastest(weights, rows, candidates, copies) for rows in TUNED_ROWS}
        below = [max(r for r in TUNED_ROWS if r <= rows) for rows in range(1, TUNED_ROWS[-1] + 1)]
        layouts = (PLAIN,) + tuple(fastest[r] for r in below)
        _store(key, layouts)
    _known[key] = layouts
    return layouts


def _fastest(weights: list[torch.Tensor], rows: int, candidates: list[int], copies: dict) -> int:
    """The layout ``rows`` rows take: each candidate timed in ``TIME_ROUNDS`` rounds, in turn
    within a round (a moment of load on the machine hits one round of each, not every round of
    one), its fastest round its time; the blocked layout unless another beats it by
    ``BLOCKED_MARGIN`` (with it the whole step may run in the compiled layer loop, which timing
    the linears alone does not see). One pass each, timed once, picked x @ W^T for 32-63 rows on
    a start beside other work and kept it in the tuning file: 67 ms a pass there against
    blocked's 23, the 32- to 48-token steps twice as long as 24 or 64 tokens."""
    best = {c: float("inf") for c in candidates}
    for round_ in range(TIME_ROUNDS):
        for c in candidates:
            best[c] = min(best[c], _time(weights, rows, c, copies.get(c), warm=round_ == 0))
    pick = min(candidates, key=best.__getitem__)
    if BLOCKED in best and best[pick] * (1 + BLOCKED_MARGIN) > best[BLOCKED]:
        return BLOCKED
    return pick


def _time(weights: list[torch.Tensor], rows: int, layout: int, packs: "list | None", warm: bool = True) -> float:
    """One timed pass of ``layout`` over ``weights`` (after a warm-up pass with ``warm``)."""
    if rows > SAMPLE_ABOVE_ROWS:
        weights, packs = weights[:TIME_SAMPLE], packs and packs[:TIME_SAMPLE]
    xs = [torch.randn(rows, w.shape[1], dtype=w.dtype, device=w.device) for w in weights]
    packs = packs or [None] * len(weights)
    best = float("inf")
    for _ in range(2 if warm else 1):   # the first of two passes warms up
        began = time.perf_counter()
        for w, x, p in zip(weights, xs, packs):
            linear(x, w, None, layout, p)
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


def _load(key: str, candidates: list[int]) -> Layouts | None:
    value = _read_file().get(key)
    if isinstance(value, list) and len(value) == TUNED_ROWS[-1] + 1 and \
            all(type(v) is int and v in candidates for v in value):
        return tuple(value)
    return None


def _store(key: str, layouts: Layouts) -> None:
    path = _tuning_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        known = {**_read_file(), key: list(layouts)}
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1))
        tmp.replace(path)   # atomic: a concurrent reader sees the old file or the new one
    except OSError:   # a read-only home: this process keeps its measurement
        pass
