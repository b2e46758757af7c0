"""What a CPU worker's process (a Serve replica, a worker actor) is started with.

Three choices must be in place when the process starts, each its own module:
the memory allocator (``malloc``: tcmalloc), the OpenMP runtime
(``openmp``: Intel's) and the opt-in to MKL's packed linears
(``linear_layouts``). Whoever starts a CPU worker passes ``cpu_worker_env()``
as its ``runtime_env`` ``env_vars``; the allocator goes first in
``LD_PRELOAD``, as vLLM's CPU setup orders them.
"""

from __future__ import annotations

import os
from typing import Mapping

from cluster.engine import linear_layouts, malloc, openmp


def cpu_worker_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment variables for a CPU worker's process (empty: nothing to change)."""
    environ = os.environ if environ is None else environ
    alloc, omp = malloc.worker_env(environ), openmp.worker_env(environ)
    env = {**linear_layouts.worker_env(environ), **omp, **alloc}
    if "LD_PRELOAD" in alloc:   # openmp's already carries what the environment preloads
        rest = omp.get("LD_PRELOAD", environ.get("LD_PRELOAD", ""))
        env["LD_PRELOAD"] = f"{alloc['LD_PRELOAD']}:{rest}" if rest else alloc["LD_PRELOAD"]
    return env
