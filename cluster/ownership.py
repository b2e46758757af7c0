"""One owner per piece of state, checked in debug mode.

The engine thread owns a worker's tree, pools and scheduler; everything else
sends it commands. ``ThreadOwner.check`` turns a break of that rule into an
``OwnershipError`` at the offending call, instead of a rare corruption later.
Checks are on when ``PREFIX_CACHE_CHECK_THREADS=1`` (the distributed and
worker tests set it) and cost one ``None`` test per guarded call otherwise.
"""

from __future__ import annotations

import os
import threading

ENV_VAR = "PREFIX_CACHE_CHECK_THREADS"


class OwnershipError(AssertionError):
    """State owned by one thread was touched from another."""


def checks_enabled() -> bool:
    return os.environ.get(ENV_VAR, "") not in ("", "0")


class ThreadOwner:
    """The thread that owns some state, once ``bind`` names it. Before ``bind``
    (construction) and after ``release`` (shutdown) any thread may touch it."""

    __slots__ = ("name", "ident", "violations")

    def __init__(self, name: str):
        self.name = name
        self.ident: int | None = None
        self.violations = 0

    def bind(self) -> None:
        self.ident = threading.get_ident()

    def release(self) -> None:
        self.ident = None

    def owned_here(self) -> bool:
        return self.ident is None or threading.get_ident() == self.ident

    def check(self, what: str) -> None:
        if self.ident is not None and threading.get_ident() != self.ident:
            self.violations += 1
            raise OwnershipError(f"{what} called on thread {threading.current_thread().name!r}; "
                                 f"it belongs to the {self.name} thread")
