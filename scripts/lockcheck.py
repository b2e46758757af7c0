"""Does this environment hold exactly what a lock pins? (``.ci/run`` asks before the tests.)

    python3 scripts/lockcheck.py locks/cpu.txt [--project pyproject.toml --extras test,l3]

Every pin of the lock whose environment marker holds here must be installed at exactly
its version (local labels included: ``torch==2.13.0+cpu`` is not met by the CUDA build
``2.13.0``). Prints one line per package that differs, naming it, what the lock pins and
what is installed, and exits 1; prints one summary line and exits 0 when none differs.
Packages the lock does not name (a system Python's own) are not its business. With
``--project``, the lock itself is checked first: every requirement of the project (and of
``--extras``) must be pinned in it within its range, else the lock is stale (``bash
scripts/lock``).
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable, Iterable

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version


@dataclass(frozen=True)
class Pin:
    name: str       # canonical (PEP 503)
    version: str

    def __str__(self) -> str:
        return f"{self.name}=={self.version}"


def parse_lock(lines: Iterable[str], environment: dict | None = None) -> list[Pin]:
    """The lock's pins that apply to ``environment`` (this interpreter's markers by default).
    A requirement line that is not ``name==version`` is an error naming the line."""
    pins = []
    for number, raw in enumerate(lines, 1):
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        if len(specs) != 1 or specs[0].operator != "==" or "*" in specs[0].version:
            raise ValueError(f"line {number}: {line!r} is not an exact pin (name==version)")
        if req.marker is not None and not req.marker.evaluate(environment):
            continue
        pins.append(Pin(canonicalize_name(req.name), specs[0].version))
    return pins


def stale(pins: Iterable[Pin], project: dict, extras: Iterable[str], environment: dict | None = None) -> list[str]:
    """One line per requirement of ``project`` (pyproject.toml's table, with ``extras``) that
    the lock does not pin within its range here."""
    pinned = {pin.name: pin.version for pin in pins}
    table = project["project"]
    wanted = [(line, "") for line in table.get("dependencies", [])]
    for extra in extras:
        if extra not in table.get("optional-dependencies", {}):
            raise ValueError(f"pyproject.toml has no extra named {extra!r}")
        wanted += [(line, extra) for line in table["optional-dependencies"][extra]]
    out = []
    for line, extra in wanted:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({**(environment or {}), "extra": extra}):
            continue
        have = pinned.get(canonicalize_name(req.name))
        if have is None:
            out.append(f"{req.name}: pyproject.toml asks for {line!r}, the lock does not pin it")
        elif not req.specifier.contains(have, prereleases=True):
            out.append(f"{req.name}: pyproject.toml asks for {line!r}, the lock pins {have}")
    return out


def installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def differences(pins: Iterable[Pin], installed: Callable[[str], str | None] = installed_version) -> list[str]:
    """One line per pin the environment does not meet, naming the package."""
    out = []
    for pin in pins:
        have = installed(pin.name)
        if have is None:
            out.append(f"{pin.name}: the lock pins {pin.version}, not installed")
        elif not _same(have, pin.version):
            out.append(f"{pin.name}: the lock pins {pin.version}, installed {have}")
    return out


def _same(a: str, b: str) -> bool:
    try:
        return Version(a) == Version(b)
    except InvalidVersion:
        return a == b


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="lockcheck", description=__doc__.split("\n\n")[0])
    ap.add_argument("lock", type=Path)
    ap.add_argument("--project", type=Path, help="pyproject.toml: check the lock against its ranges too")
    ap.add_argument("--extras", default="", help="the project's extras the lock was written for (a,b)")
    args = ap.parse_args(argv)
    pins = parse_lock(args.lock.read_text().splitlines())
    if args.project is not None:
        extras = [e for e in args.extras.split(",") if e]
        old = stale(pins, tomllib.loads(args.project.read_text()), extras)
        for line in old:
            print(f"lockcheck: {line}", file=sys.stderr)
        if old:
            print(f"lockcheck: {args.lock} is stale against {args.project}: bash scripts/lock", file=sys.stderr)
            return 1
    diff = differences(pins)
    for line in diff:
        print(f"lockcheck: {line}", file=sys.stderr)
    if diff:
        print(f"lockcheck: {len(diff)} of {len(pins)} packages differ from {args.lock} "
              f"(bash .ci/install installs the lock)", file=sys.stderr)
        return 1
    print(f"lockcheck: the environment matches {args.lock} ({len(pins)} packages)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
