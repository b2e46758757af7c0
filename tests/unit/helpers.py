"""Shared test helpers (plain code, imported by the unit tests)."""


class TickClock:
    """Injectable time that advances one unit a call, so LRU order in tests is exact."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 1.0
        return self.t
