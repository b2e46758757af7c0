"""The memory allocator a CPU worker's process runs, chosen before it starts.

Each op of a forward on the CPU returns a new tensor, and a prefill's are
large: a 440-token prefill of the 135M default model allocates and frees a
few hundred 1-3 MB tensors (the norms', RoPE's and SwiGLU's elementwise
outputs). glibc's malloc serves a block that size with ``mmap`` and gives it
back with ``munmap`` on free (its dynamic threshold rises only so far, and a
thread other than the first allocates from an arena that trims itself), so
every such tensor's pages fault in again, and a prefill's time spreads with
the faults. Keeping freed memory (glibc with ``MALLOC_MMAP_THRESHOLD_`` and
``MALLOC_TRIM_THRESHOLD_`` raised, or tcmalloc, which keeps it in its own
caches) removes most of them; decode steps, whose tensors are small, do not
care (docs/engine.md, "Measurements behind the CPU runtime choices").

tcmalloc is what vLLM's CPU backend documents (``LD_PRELOAD`` of the system's
``libtcmalloc_minimal``; Debian's ``libtcmalloc-minimal4``). Like the OpenMP
runtime it must be in place when the process starts, so ``worker_env()``
gives the variables to start a CPU worker's process with:

- ``PREFIX_CACHE_MALLOC=tcmalloc`` (default): preload tcmalloc where the
  system has it, else glibc kept as below;
- ``glibc``: glibc with ``MALLOC_MMAP_THRESHOLD_`` and
  ``MALLOC_TRIM_THRESHOLD_`` set, so freed blocks stay in the process;
- ``system``: nothing set, the allocator the process starts with.

The allocator changes no number a forward computes, only where its tensors
live. A worker's stats say which it runs (``worker.malloc``).
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from pathlib import Path
from typing import Mapping

ENV_VAR = "PREFIX_CACHE_MALLOC"
CHOICES = ("tcmalloc", "glibc", "system")
TCMALLOC_PATHS = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib64/libtcmalloc_minimal.so.4",
                  "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/libtcmalloc_minimal.so.4")
# glibc's largest mmap threshold on 64-bit (4 * 1024 * 1024 * sizeof(long)); a larger value is ignored.
GLIBC_MMAP_THRESHOLD = str(32 << 20)
GLIBC_TRIM_THRESHOLD = str(1 << 30)


def tcmalloc_library() -> str | None:
    """The system's tcmalloc (the minimal build, as vLLM preloads it), or None."""
    for path in TCMALLOC_PATHS:
        if Path(path).is_file():
            return path
    name = ctypes.util.find_library("tcmalloc_minimal")   # a soname the loader finds on its own paths
    return name or None


def worker_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment variables to start a CPU worker's process with (empty: as it starts).
    ``LD_PRELOAD`` here holds only the allocator: ``cluster.engine.worker_env`` puts it first."""
    environ = os.environ if environ is None else environ
    picked = environ.get(ENV_VAR, "tcmalloc").strip().lower() or "tcmalloc"
    if picked not in CHOICES:
        raise ValueError(f"{ENV_VAR} must be one of {list(CHOICES)}, got {environ.get(ENV_VAR)!r}")
    if picked == "system" or not sys.platform.startswith("linux"):
        return {}
    if picked == "tcmalloc":
        if "tcmalloc" in environ.get("LD_PRELOAD", ""):
            return {}
        library = tcmalloc_library()
        if library is not None:
            return {"LD_PRELOAD": library}
    return {"MALLOC_MMAP_THRESHOLD_": environ.get("MALLOC_MMAP_THRESHOLD_", GLIBC_MMAP_THRESHOLD),
            "MALLOC_TRIM_THRESHOLD_": environ.get("MALLOC_TRIM_THRESHOLD_", GLIBC_TRIM_THRESHOLD)}


def runtime() -> str:
    """The allocator this process runs: 'tcmalloc', 'glibc' (with the thresholds above set,
    'glibc-kept'), or 'unknown'."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    if "tcmalloc" in maps:
        return "tcmalloc"
    return "glibc-kept" if "MALLOC_MMAP_THRESHOLD_" in os.environ else "glibc"
