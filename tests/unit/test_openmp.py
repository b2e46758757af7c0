"""The OpenMP runtime a CPU worker's process is started with (cluster/engine/openmp.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cluster.engine import openmp
from tests.requirements import require_intel_openmp


@pytest.fixture
def library(monkeypatch, tmp_path):
    lib = tmp_path / "libiomp5.so"
    lib.write_bytes(b"")
    monkeypatch.setattr(openmp, "intel_openmp_library", lambda: str(lib))
    return str(lib)


def test_intel_is_the_default_with_a_short_wait(library) -> None:
    assert openmp.worker_env({}) == {"LD_PRELOAD": library, "KMP_BLOCKTIME": "1"}


def test_a_preload_and_a_wait_already_set_are_kept(library) -> None:
    env = openmp.worker_env({"LD_PRELOAD": "/opt/libtcmalloc.so", "KMP_BLOCKTIME": "50"})
    assert env == {"LD_PRELOAD": f"{library}:/opt/libtcmalloc.so", "KMP_BLOCKTIME": "50"}
    assert "LD_PRELOAD" not in openmp.worker_env({"LD_PRELOAD": "/x/libiomp5.so"})


def test_gnu_keeps_the_process_as_it_is(library) -> None:
    assert openmp.worker_env({"PREFIX_CACHE_OPENMP": "gnu"}) == {}
    assert openmp.worker_env({"PREFIX_CACHE_OPENMP": " GNU "}) == {}


def test_an_unknown_choice_names_the_variable(library) -> None:
    with pytest.raises(ValueError, match="PREFIX_CACHE_OPENMP must be one of"):
        openmp.worker_env({"PREFIX_CACHE_OPENMP": "llvm"})


def test_without_the_library_nothing_is_preloaded(monkeypatch) -> None:
    monkeypatch.setattr(openmp, "intel_openmp_library", lambda: None)
    assert openmp.worker_env({}) == {}


def test_a_process_started_with_it_runs_intel_openmp() -> None:
    require_intel_openmp()   # fails under CI where the project ships it, skips elsewhere
    code = ("import torch; torch.set_num_threads(2); (torch.ones(1 << 20) * 2).sum(); "
            "from cluster.engine import openmp; print(openmp.runtime())")
    for env, expected in ((openmp.worker_env({}), "intel"), ({"PREFIX_CACHE_OPENMP": "gnu"}, "gnu")):
        base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "KMP_BLOCKTIME")}
        out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip().splitlines()[-1] == expected
