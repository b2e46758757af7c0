"""Benchmark drivers that need Ray (the pure ones live in cluster/bench)."""
