"""The memory allocator a CPU worker's process is started with (cluster/engine/malloc.py), and
everything such a process gets together (cluster/engine/worker_env.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cluster.engine import malloc
from cluster.engine.worker_env import cpu_worker_env

KEPT = {"MALLOC_MMAP_THRESHOLD_": malloc.GLIBC_MMAP_THRESHOLD,
        "MALLOC_TRIM_THRESHOLD_": malloc.GLIBC_TRIM_THRESHOLD}


@pytest.fixture
def tcmalloc(monkeypatch, tmp_path):
    lib = tmp_path / "libtcmalloc_minimal.so.4"
    lib.write_bytes(b"")
    monkeypatch.setattr(malloc, "TCMALLOC_PATHS", (str(tmp_path / "absent.so"), str(lib)))
    return str(lib)


from tests.unit.test_openmp import library as iomp  # noqa: E402,F401  (the same fake libiomp5 fixture)


def test_tcmalloc_is_the_default_where_the_system_has_it(tcmalloc) -> None:
    assert malloc.worker_env({}) == {"LD_PRELOAD": tcmalloc}
    assert malloc.worker_env({"PREFIX_CACHE_MALLOC": " TCMalloc "}) == {"LD_PRELOAD": tcmalloc}
    assert malloc.worker_env({"LD_PRELOAD": "/opt/libtcmalloc.so.4"}) == {}   # already preloaded


def test_without_tcmalloc_glibc_keeps_what_it_frees(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(malloc, "TCMALLOC_PATHS", (str(tmp_path / "absent.so"),))
    monkeypatch.setattr(malloc.ctypes.util, "find_library", lambda name: None)
    assert malloc.worker_env({}) == KEPT
    assert malloc.worker_env({"MALLOC_TRIM_THRESHOLD_": "7"})["MALLOC_TRIM_THRESHOLD_"] == "7"


def test_glibc_and_system_are_chosen_by_name(tcmalloc) -> None:
    assert malloc.worker_env({"PREFIX_CACHE_MALLOC": "glibc"}) == KEPT
    assert malloc.worker_env({"PREFIX_CACHE_MALLOC": "system"}) == {}
    with pytest.raises(ValueError, match="PREFIX_CACHE_MALLOC must be one of"):
        malloc.worker_env({"PREFIX_CACHE_MALLOC": "jemalloc"})


def test_a_worker_preloads_the_allocator_first_then_openmp_then_what_was_there(tcmalloc, iomp) -> None:  # noqa: F811 (a fixture)
    env = cpu_worker_env({"LD_PRELOAD": "/opt/libfoo.so", "PREFIX_CACHE_MKL_PACKED": "1"})
    assert env == {"LD_PRELOAD": f"{tcmalloc}:{iomp}:/opt/libfoo.so", "KMP_BLOCKTIME": "1",
                   "PREFIX_CACHE_MKL_PACKED": "1"}
    assert cpu_worker_env({"PREFIX_CACHE_OPENMP": "gnu"}) == {"LD_PRELOAD": tcmalloc}
    assert cpu_worker_env({"PREFIX_CACHE_OPENMP": "gnu", "LD_PRELOAD": "/opt/libfoo.so"}) == \
        {"LD_PRELOAD": f"{tcmalloc}:/opt/libfoo.so"}
    assert cpu_worker_env({"PREFIX_CACHE_MALLOC": "system"}) == {"LD_PRELOAD": iomp, "KMP_BLOCKTIME": "1"}
    assert cpu_worker_env({"PREFIX_CACHE_MALLOC": "system", "PREFIX_CACHE_OPENMP": "gnu"}) == {}


def test_a_process_started_with_it_runs_that_allocator() -> None:
    code = ("import torch; (torch.ones(1 << 20) * 2).sum(); "
            "from cluster.engine import malloc; print(malloc.runtime())")
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD",) and not k.startswith("MALLOC_")}
    cases = [({"PREFIX_CACHE_MALLOC": "glibc"}, "glibc-kept"), ({"PREFIX_CACHE_MALLOC": "system"}, "glibc")]
    if malloc.tcmalloc_library() is not None:
        cases.append(({}, "tcmalloc"))
    for choice, expected in cases:
        env = {**base, **malloc.worker_env(choice)}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip().splitlines()[-1] == expected
