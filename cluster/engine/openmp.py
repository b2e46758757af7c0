"""The OpenMP runtime a CPU worker's torch threads run on, chosen before its process starts.

torch's CPU wheels run their intra-op threads on GNU OpenMP (libgomp). A
worker runs its forwards on its engine thread, not on the process's first
thread, and a team GNU OpenMP starts from such a thread leaves its threads
asleep between parallel regions: every region wakes them through the
kernel, and prefills and decode steps run markedly slower from a second
thread than from the first (docs/engine.md, "Measurements behind the CPU
runtime choices").

Intel's OpenMP runtime (``libiomp5`` from the ``intel-openmp`` wheel, which
provides GNU OpenMP's entry points; the setup Intel's extension and vLLM's
CPU backend document) keeps a team's threads waiting ``KMP_BLOCKTIME`` ms
whatever thread started it, with the same kernels and so the same numbers.
A millisecond of waiting is as fast as the default 200 ms and leaves the
cores to the processes beside the worker once a step is done.

The runtime must be in place when the process starts, so whoever starts a
CPU worker process (a Serve replica, a worker actor) starts it with
``worker_env()``: ``LD_PRELOAD`` of libiomp5 and ``KMP_BLOCKTIME``. Set
``PREFIX_CACHE_OPENMP=gnu`` to keep GNU OpenMP; without the wheel (another
platform) the variables are empty and GNU OpenMP serves.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from pathlib import Path
from typing import Mapping

ENV_VAR = "PREFIX_CACHE_OPENMP"
CHOICES = ("intel", "gnu")
BLOCKTIME_MS = "1"
LIBRARY = "libiomp5.so"


def intel_openmp_library() -> str | None:
    """Where the ``intel-openmp`` wheel put libiomp5 (its own record, then the prefix's lib/)."""
    try:
        for entry in importlib.metadata.files("intel-openmp") or ():
            if entry.name == LIBRARY:
                path = Path(entry.locate()).resolve()
                if path.is_file():
                    return str(path)
    except importlib.metadata.PackageNotFoundError:
        pass
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        path = Path(prefix) / "lib" / LIBRARY
        if path.is_file():
            return str(path)
    return None


def worker_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment variables to start a CPU worker's process with (empty: keep GNU OpenMP)."""
    environ = os.environ if environ is None else environ
    choice = environ.get(ENV_VAR, "intel").strip().lower() or "intel"
    if choice not in CHOICES:
        raise ValueError(f"{ENV_VAR} must be one of {list(CHOICES)}, got {environ.get(ENV_VAR)!r}")
    if choice == "gnu" or not sys.platform.startswith("linux"):
        return {}
    preload = environ.get("LD_PRELOAD", "")
    library = intel_openmp_library()
    if library is None:
        return {}
    env = {"KMP_BLOCKTIME": environ.get("KMP_BLOCKTIME", BLOCKTIME_MS)}
    if LIBRARY not in preload:
        env["LD_PRELOAD"] = f"{library}:{preload}" if preload else library
    return env


def runtime() -> str:
    """Which OpenMP runtime this process has loaded: 'intel', 'gnu', or 'none' yet."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    if LIBRARY in maps:
        return "intel"
    return "gnu" if "libgomp" in maps else "none"
