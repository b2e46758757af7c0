"""What one engine step computes and what its sampling gave: the types the three roles pass.

The scheduler (``cluster.engine.scheduler``) fills a ``StepPlan``, the model
runner (``cluster.engine.model_runner``) computes it, the sampler
(``cluster.engine.sampler``) answers one ``Sampled`` per planned request and
the scheduler applies them (vLLM's ``sched/output.py``). Runner and sampler
import this module, never the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cluster.engine.request import EngineRequest


@dataclass(slots=True)
class ScheduledRequest:
    """One request's part of a step: ``num_tokens`` tokens from position ``start``
    (its computed tokens when the step began), their HOT room reserved."""

    request: EngineRequest
    start: int
    num_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this step completes its sequence, so it samples a token."""
        return self.start + self.num_tokens == len(self.request.tokens)

    @property
    def tokens(self) -> list[int]:
        return self.request.tokens[self.start:self.start + self.num_tokens]


@dataclass(slots=True)
class StepPlan:
    """What one step computes (vLLM's ``SchedulerOutput``, here as small as it is)."""

    items: list[ScheduledRequest] = field(default_factory=list)
    all_logits: bool = False   # every computed row's logits (prompt logprobs, keep_logits), not just the last

    @property
    def decodes_only(self) -> bool:
        return all(i.num_tokens == 1 and i.request.output for i in self.items)


@dataclass(slots=True)
class Sampled:
    """The sampler's answer for one planned request: its token (None: a prompt chunk with
    more to come), the token's logprobs entry, or why sampling failed."""

    token: int | None = None
    logprobs: Any = None
    error: str | None = None


@dataclass(slots=True)
class StepOutput:
    """The runner's answer for one plan: each planned request's logits (every computed row's
    where ``StepPlan.all_logits``, else the last row's), or why the forward failed; and what
    the step's measures need: when the forward began (``time.perf_counter``), how long it
    took, and whether the plan was decodes alone."""

    logits: list | None
    error: str | None = None
    began: float = 0.0
    forward_ms: float = 0.0
    decodes_only: bool = False
