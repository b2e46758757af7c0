"""The kernels' build lock (``cluster.engine.kernels.wait_for_build_lock``): a lock left by a
process killed mid-build is removed once stale, where torch's loader would wait for it forever;
a live build's lock is waited for and left alone. Exact outcomes on a fake clock."""

from __future__ import annotations

import os

import pytest
from torch.utils.cpp_extension import _get_build_directory

from cluster.engine.kernels import BUILD_LOCK_STALE_S, wait_for_build_lock

NAME = "prefix_cache_lock_test"


@pytest.fixture
def lock(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    path = os.path.join(_get_build_directory(NAME, verbose=False), "lock")
    assert path.startswith(str(tmp_path))
    return path


def _made_at(path: str, t: float) -> None:
    open(path, "w").close()
    os.utime(path, (t, t))


class FakeTime:
    def __init__(self, now: float):
        self.now, self.sleeps = now, 0

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps += 1
        self.now += s


def test_no_lock_loads_at_once(lock):
    t = FakeTime(1e6)
    assert wait_for_build_lock(NAME, clock=t.clock, sleep=t.sleep) == "free" and t.sleeps == 0


def test_a_lock_left_by_a_killed_build_is_removed_once_stale(lock):
    t = FakeTime(1e6)
    _made_at(lock, t.now - BUILD_LOCK_STALE_S - 1)   # older than any build: removed at once
    assert wait_for_build_lock(NAME, clock=t.clock, sleep=t.sleep) == "stale"
    assert not os.path.exists(lock) and t.sleeps == 0
    _made_at(lock, t.now - 10.0)   # killed 10 s ago: waited for until stale, then removed
    assert wait_for_build_lock(NAME, stale_s=30.0, poll_s=1.0, clock=t.clock, sleep=t.sleep) == "stale"
    assert not os.path.exists(lock) and t.sleeps == 20


def test_a_live_builds_lock_is_waited_for_and_left_to_its_builder(lock):
    t = FakeTime(1e6)
    _made_at(lock, t.now)

    def build_ends_after_three_polls(s: float) -> None:
        t.sleep(s)
        if t.sleeps == 3:
            os.unlink(lock)   # the builder released it
    assert wait_for_build_lock(NAME, stale_s=30.0, poll_s=1.0, clock=t.clock,
                               sleep=build_ends_after_three_polls) == "free"
    assert t.sleeps == 3
