"""Compiled kernels of the packed decoder: on the CPU built on first use with torch's C++
extension loader, on CUDA in Triton (``cuda_paged_attention``: ``triton_attention.py``).

``paged_attention`` (``decode_attention.cpp``): one call per layer for every sequence
of a step that decodes one token or adds a few after its cached prefix (a later turn's
prompt, a burst of sessions behind one system prompt), reading and writing K/V in place
in the engine's slotted KV pool: each sequence's positions reached through its slot table
(a slot: block * block_tokens + offset), the new tokens' K/V written at their slots,
every query head of each new token attending causally over its sequence's keys, the work
split over (sequence, KV head) on ATen's threads. In the torch path that is a handful of
small ops (or an SDPA call with a mask) per sequence per layer, whose dispatch costs more
than the arithmetic on a CPU (about 480 calls a step for 16 sequences of a 30-layer
model). Float32 on the CPU; its results equal the torch path's to about 1e-7, and do not
depend on where in the pool a sequence's slots lie (bit for bit). The same file has the
compiled ``rms_norm`` and ``rope`` (``small_ops``).

``blocked_linear`` (``blocked_linear.cpp``): a float32 linear over the weight packed
into column panels that gives, at any row count, the numbers MKL's sgemm gives for
a large batch, bit for bit, reading each weight once for all rows
(``cluster.engine.linear_layouts``, layout ``blocked``, checks it against MKL before
using it).

``prefill_attention`` (``prefill_attention.cpp``): a prompt chunk's causal attention over
its sequence's K/V (the cached prefix and its own) in one flash pass, the query heads of a
KV head tiled together, float32 with AVX-512; where SDPA's CPU flash kernel takes two calls
and a merge after a cached prefix, at about a third of the speed.

``decoder_layers_paged`` (``layers.cpp``): a step's whole layer loop in one call, for a
step whose every sequence runs on ``paged_attention`` and whose linears run blocked: the
same kernels and ATen ops in the same order as the model's Python loop, so the same
bits, without the GIL and a Python dispatch per op (``DecoderModel._layers``).

Each build takes up to a minute once per machine (cached under
``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``; concurrent
builds wait on the loader's lock). A process killed mid-build leaves that lock
behind, and torch's loader waits for it to go forever: every later start on the
machine hung. So a start first waits for the lock itself (``wait_for_build_lock``) and removes one
older than ``BUILD_LOCK_STALE_S``, far past any build's time; a live build's lock
is waited for as before. When one cannot be built (no compiler,
``PREFIX_CACHE_KERNELS=0``), its function here is None, the reason is logged
once, and the model keeps its torch path.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger(__name__)

ENV_VAR = "PREFIX_CACHE_KERNELS"
BUILD_LOCK_STALE_S = 300.0   # a build lock this old was left by a process killed mid-build (builds take ~1 min)
_lock = threading.Lock()
_state: dict[str, dict[str, Any]] = {name: {"module": None, "tried": False, "error": None}
                                     for name in ("decode_attention", "blocked_linear", "layers", "prefill_attention",
                                                 "triton_attention")}


def _load(name: str, build) -> Any:
    """``build()``'s module, built once on first use, or None when it cannot be (the reason
    logged once; ``PREFIX_CACHE_KERNELS=0`` turns every kernel off)."""
    with _lock:
        state = _state[name]
        if not state["tried"]:
            state["tried"] = True
            if os.environ.get(ENV_VAR, "1") in ("0", "false", "no"):
                state["error"] = f"{ENV_VAR}=0"
            else:
                try:
                    state["module"] = build()
                except Exception as exc:   # no compiler, headers or Triton: the torch path serves, slower
                    state["error"] = f"{type(exc).__name__}: {exc}"
            if state["error"]:
                log.warning("%s kernel unavailable (%s); using the torch path", name, state["error"])
        return state["module"]


# The sources a module's .cpp includes: the loader hashes only the listed source to decide
# whether a built module is current, so their contents go into its flags (a changed kernel
# rebuilds the layer loop that includes it).
INCLUDES = {"layers": ("blocked_linear.cpp", "decode_attention.cpp")}


def wait_for_build_lock(extension: str, stale_s: float = BUILD_LOCK_STALE_S, poll_s: float = 0.2,
                        clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep) -> str:
    """Before torch's loader builds or loads ``extension``: wait while another process's build
    holds the loader's lock file, and remove the lock once it is ``stale_s`` old (its
    builder was killed; the loader itself would wait for it forever). ``"free"``: no lock,
    or its build ended; ``"stale"``: a stale lock was removed (logged)."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(extension, verbose=False)) / "lock"
    while True:
        try:
            age = clock() - lock.stat().st_mtime
        except FileNotFoundError:
            return "free"
        if age >= stale_s:
            log.warning("removing the build lock %s, %.0f s old: its build was killed", lock, age)
            lock.unlink(missing_ok=True)
            return "stale"
        sleep(poll_s)


def _module(name: str) -> Any:
    """The compiled module of ``<name>.cpp``, built on first use, or None (see above)."""
    def build():
        import hashlib

        from torch.utils.cpp_extension import load

        here = Path(__file__).parent
        digest = hashlib.sha256(b"".join((here / f).read_bytes() for f in INCLUDES.get(name, ()))).hexdigest()
        flags = ["-O3", "-fopenmp"] + ([f"-DPREFIX_CACHE_INCLUDES={digest[:16]}"] if name in INCLUDES else [])
        wait_for_build_lock(f"prefix_cache_{name}")
        return load(name=f"prefix_cache_{name}", sources=[str(here / f"{name}.cpp")],
                    extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)
    return _load(name, build)


def paged_attention() -> Any:
    """The compiled ``paged_attention`` function (a few new tokens per sequence, over a slotted
    KV pool through per-sequence slot tables), or None."""
    module = _module("decode_attention")
    return None if module is None else module.paged_attention


def small_ops() -> Any:
    """The compiled module's ``rms_norm`` and ``rope`` (float32, CPU), or None."""
    return _module("decode_attention")


def prefill_attention() -> Any:
    """The compiled ``prefill_attention`` (a prompt chunk's causal attention over its
    sequence's head-major K/V: float32, head_dim 64, AVX-512), or None where it cannot be
    built or this CPU lacks AVX-512."""
    module = _module("prefill_attention")
    return None if module is None or not module.available() else module.prefill_attention


def cuda_paged_attention() -> Any:
    """The Triton module of the same batched attention for CUDA tensors
    (``triton_attention``: ``prepare_paged``, ``paged_attention``), or None where Triton does
    not import (a CPU build of torch ships without it)."""
    def build():
        from cluster.engine.kernels import triton_attention

        return triton_attention
    return _load("triton_attention", build)


def blocked_linear() -> Any:
    """The compiled module with ``pack_panels``, ``blocked_linear`` and ``isa``, or None."""
    return _module("blocked_linear")


def decoder_layers_paged() -> Any:
    """The compiled layer loop of a step whose sequences all run on the batched kernel and
    whose linears run blocked (``layers.cpp``: the two modules above built into one, the
    loop with the GIL released; the attention takes ``paged_attention``'s arguments), or
    None."""
    module = _module("layers")
    return None if module is None else module.decoder_layers_paged


def status(name: str = "decode_attention") -> str:
    """'compiled', 'not built yet', or why it is unavailable."""
    state = _state[name]
    if not state["tried"]:
        return "not built yet"
    return "compiled" if state["module"] is not None else f"unavailable: {state['error']}"
