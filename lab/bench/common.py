"""Helpers shared by the benchmark drivers: JSON output (``cluster.results.emit``), percentiles
and CDF plots."""

from __future__ import annotations

from typing import Sequence

from cluster.results import emit  # noqa: F401 - the benchmarks print through this


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    idx = min(len(ordered) - 1, max(0, int(round(q / 100 * (len(ordered) - 1)))))
    return ordered[idx]


def rounded(value: float, digits: int = 4) -> float:
    return float(round(value, digits))


def plot_cdfs(series: list[tuple[str, list[float]]], path: str, *, title: str, xlabel: str) -> None:
    """Write a PNG with one empirical CDF per (label, values), log x axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, values in series:
        xs = sorted(values)
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
