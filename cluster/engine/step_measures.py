"""What the engine's steps measured (``StepMeasures``): the step counters in the engine's stats
and the prefill rate.

``steps``, ``step_ms`` (a step's forward, sampling and update, wall time), ``forward_ms``, and
for steps of decodes alone ``decode_steps``, ``decode_step_ms``, ``decode_rows``, and their
recent median (``decode_step_s``: what a running stream waits a token without prompts beside
it, the unit stall-free batching counts its stall budget in). The prefill
rate (``prefill_s_per_token``: the recent median of seconds per computed token over steps
that were mostly prompt tokens) is what a promotion's copy time is weighed against
(``TieredCache.ready``) and what time slicing and stall-free batching price a prefill at.
The scheduler records each step after applying it (``Scheduler.update``). Engine thread only.
"""

from __future__ import annotations

import time

from cluster.engine.plan import StepOutput, StepPlan
from cluster.estimators import RecentMedian

PREFILL_STEP_TOKENS = 64   # a step with at least this many prompt tokens measures the prefill rate


class StepMeasures:
    def __init__(self, stats: dict):
        self.stats = stats
        stats.update({"steps": 0, "step_ms": 0.0, "forward_ms": 0.0, "decode_steps": 0, "decode_step_ms": 0.0,
                      "decode_rows": 0})
        self._prefill_samples = RecentMedian()   # seconds per prompt token of recent prefill steps
        self.prefill_s_per_token: float | None = None
        self._decode_samples = RecentMedian()    # seconds of recent steps of decodes alone
        self.decode_step_s: float | None = None

    def record(self, plan: StepPlan, output: StepOutput) -> None:
        """One step that ran (its forward began at ``output.began`` and its update just ended)."""
        step_ms = (time.perf_counter() - output.began) * 1e3
        stats = self.stats
        stats["steps"] += 1
        stats["forward_ms"] += output.forward_ms
        stats["step_ms"] += step_ms
        if output.decodes_only:
            stats["decode_steps"] += 1
            stats["decode_step_ms"] += step_ms
            stats["decode_rows"] += len(plan.items)
            self.decode_step_s = self._decode_samples.add(step_ms / 1e3)
        computed = sum(item.num_tokens for item in plan.items)
        if computed - len(plan.items) >= PREFILL_STEP_TOKENS:   # mostly prompt tokens: a prefill's rate
            self.prefill_s_per_token = self._prefill_samples.add(output.forward_ms / 1e3 / computed)

    @property
    def prefill_tokens_per_s(self) -> float | None:
        """The measured prefill rate (None: none yet)."""
        return 1.0 / self.prefill_s_per_token if self.prefill_s_per_token else None
