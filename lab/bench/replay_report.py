"""What ``prefix-cache replay`` prints over its runs: the per-policy summary across seeds
(``--seeds``) and the figure (``--plot``)."""

from __future__ import annotations

from lab.bench.common import rounded

SEED_METRICS = ("hit_rate", "load_imbalance", "busy_imbalance", "ttft_ms_p99")


def seed_summary(seeds: list[int], by_seed: list[list[dict]]) -> list[dict]:
    """One line per policy over the seeds: each metric's mean, min, max and
    values by seed, and against every other policy of the run the seeds on
    which it had the strictly higher hit rate, the strictly lower
    load_imbalance and the strictly lower p99 TTFT."""
    first = by_seed[0]
    lines = []
    for k, res in enumerate(first):
        runs = [results[k] for results in by_seed]
        line = {"bench": "replay_seeds", "policy": res["policy"], "information": res["information"],
                "records": res["records"],
                "replicas": res["replicas"], "seeds": seeds}
        if "shape" in res:
            line["shape"] = res["shape"]
        if res.get("policy_args"):
            line["policy_args"] = res["policy_args"]
        for m in SEED_METRICS:
            values = [r[m] for r in runs]
            line[f"{m}_mean"] = rounded(sum(values) / len(values), 1 if m.startswith("ttft_ms") else 4)
            line[f"{m}_min"], line[f"{m}_max"] = min(values), max(values)
            line[f"{m}_by_seed"] = values
        line["versus"] = {
            other["policy"]: {
                "higher_hit_rate": sum(r[k]["hit_rate"] > r[j]["hit_rate"] for r in by_seed),
                "lower_load_imbalance": sum(r[k]["load_imbalance"] < r[j]["load_imbalance"] for r in by_seed),
                "lower_ttft_ms_p99": sum(r[k]["ttft_ms_p99"] < r[j]["ttft_ms_p99"] for r in by_seed)}
            for j, other in enumerate(first) if j != k}
        lines.append(line)
    return lines


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["policy"] for r in results]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax1.bar(names, [r["hit_rate"] for r in results], color="tab:blue")
    ax1.set_ylabel("prefix hit rate (cached input tokens / input tokens)")
    ax1.set_ylim(0, 1)
    ax2.bar(names, [r["ttft_ms_p99"] for r in results], color="tab:red")
    ax2.set_ylabel("p99 TTFT (ms, log scale)")
    ax2.set_yscale("log")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=30)
        ax.grid(True, axis="y", alpha=0.3)
    r0 = results[0]
    fig.suptitle(f"Routing policies: {r0['records']:,} requests, {r0['replicas']} replicas")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
