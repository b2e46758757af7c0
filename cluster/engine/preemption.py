"""Which running request gives up its HOT room, and when (``cluster.engine.scheduler``'s policy).

Two kinds of preemption, both into the cache (the victim's KV is committed and it
resumes exactly):

- **for room** (liveness): a running request that cannot get the HOT room of its
  next tokens preempts another, so no request fails for lack of KV. It always
  happens; where the choice is free it spares requests already preempted
  ``ROOM_SPARE_AFTER`` times (``spare_repeated``).
- **time slicing** (admission): a waiting request that found no room takes the
  room of a running decode. Measured under memory pressure with a fixed 0.5 s
  slice (issue 51: shorter than one CPU prefill step), every admission stalled a
  running stream, whose return evicted the next one's prefix: e2e 10x vLLM's, a
  stream stalled 36.7 s. So a slice fires only when all of these hold
  (``TimeSlicer``):

  1. the step time is measured: at least ``SLICE_MIN_STEPS`` intervals between
     the forwards of steps in a row (what a stream waits per token, on the
     engine's clock), their median over the last ``STEP_WINDOW`` (one outlier
     step moves it by one rank, never to the outlier);
  2. the victim has decoded for ``max(time_slice_s, SLICE_MIN_STEPS x median
     step)``, and was never preempted before (``SLICE_MAX_PREEMPTIONS``): a
     stream gives up at most one slice;
  3. the victim's room, with what is free, is all the waiting request needs
     (``SliceCosts.covers``): the gain below assumes its wait ends at the
     slice, which only then holds. Without this rule two or three decodes
     yielded for one long waiting request, each stalled behind it (a stream
     stalled 10.6 and 13.1 s in two of three runs of the sessions workload
     with every session live, ``bench serving --working-set 4 --arrival-s 1``).
     Not under the fair share, whose slices go across tenants (a quiet
     tenant's request takes the room of a flood's short decodes, one a step:
     with the rule, ``bench tenants``' quiet tenant waited for room in 5 of 20
     later turns against 1 of 30 without it; its TTFT, 1.80x and 1.59x alone
     in those two runs, moves between 1.19x and 2.02x from run to run anyway);
  4. the measured gain exceeds the measured cost (``slice_costs``):

     - gain: the waiting request's wait avoided: running requests end in order
       of their remaining steps (``max_tokens`` less what they produced, and
       their prompt's chunks), each freeing what it holds; the wait ends at the
       one that frees the HOT room the waiting request needs, x the median step;
     - cost: the victim's KV out to WARM and back (its tokens x the measured
       WARM copy rate, each way), the waiting request's promotion (its WARM and
       COLD tokens x their measured rates), and the victim's own wait: it queues
       right behind the waiting request, so it waits about that request's
       service (its uncached prompt at the measured prefill rate, then its
       ``max_tokens`` steps). Without that last term a slice only moves a wait
       from a waiting request to a running stream, plus copies: with it, a slice
       fires only where a short request would otherwise wait behind long
       decodes (shortest remaining work first).

  An unmeasured copy rate counts as the measured prefill rate (a promotion is
  never admitted slower than recomputing: ``TieredCache.ready``), else 0.

``SLICE_MIN_STEPS = 8``: a slice costs the victim at least two steps that do not
advance it (the one that runs the waiting request's prefill, on CPU several decode
steps long, and the one that brings it back with its promotion); after 8 steps of
its own that is at most a fifth of what the slice ran, where a slice under one step
(the old default on CPU) cost more than it ran. And the median of 8 samples stays
with the steady steps however slow three of them were.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from cluster.engine.request import EngineRequest
from cluster.estimators import RecentMedian
from cluster.names import COLD, HOT, WARM

SLICE_MIN_STEPS = 8          # a slice is at least this many measured steps, and needs as many measured
STEP_WINDOW = 16             # the recent step intervals whose median is the step time
SLICE_MAX_PREEMPTIONS = 1    # a request preempted this often (for any reason) never yields a slice
ROOM_SPARE_AFTER = 2         # a room victim preempted this often is passed over where another can yield


def spare_repeated(candidates: Iterable[EngineRequest]) -> list[EngineRequest]:
    """``candidates`` (in the caller's order) less those preempted ``ROOM_SPARE_AFTER`` times
    or more, unless that leaves none: liveness comes first, repeated stalls second."""
    candidates = list(candidates)
    fresh = [r for r in candidates if r.preemptions < ROOM_SPARE_AFTER]
    return fresh or candidates


def remaining_steps(req: EngineRequest, budget: int) -> int:
    """Steps ``req`` still runs at most: its prompt's chunks left, then its tokens to ``max_tokens``."""
    fill = -(-max(0, req.to_compute - 1) // budget)
    return fill + max(0, req.params.max_tokens - len(req.output))


@dataclass(slots=True, frozen=True)
class Rates:
    """What the decision weighs, all measured: seconds per step (median), per prefill token
    (None: not measured), per token copied up from WARM and from COLD (None: not measured)."""

    step_s: float
    prefill_s_per_token: float | None
    copy_s_per_token: tuple[float | None, float | None]   # WARM, COLD
    budget: int   # tokens one step computes at most

    def copy_rate(self, tier: int) -> float:
        rate = self.copy_s_per_token[tier - WARM]
        if rate is None:
            rate = self.prefill_s_per_token
        return rate or 0.0


@dataclass(slots=True, frozen=True)
class SliceCosts:
    """One time-slice decision's terms, in seconds."""

    gain_s: float            # the waiting request's wait avoided
    swap_s: float            # the victim's KV out to WARM and back up
    promote_s: float         # the waiting request's prefix up from WARM and COLD
    victim_wait_s: float     # the victim's own wait behind the waiting request
    covers: bool = True      # the victim's room (and what is free) is all the waiting request needs

    @property
    def cost_s(self) -> float:
        return self.swap_s + self.promote_s + self.victim_wait_s

    @property
    def worth(self) -> bool:
        return self.covers and self.gain_s > self.cost_s


def slice_costs(head: EngineRequest, victim: EngineRequest, running: list[EngineRequest], rates: Rates,
                free_tokens: int) -> SliceCosts:
    """The gain and cost of ``victim`` yielding its room to ``head`` (see the module docstring).
    ``free_tokens``: HOT room free now."""
    found = list(head.first_look or ())[:3] + [0, 0, 0]
    need = len(head.tokens) - found[HOT] - free_tokens
    wait_steps, freed = 0, 0
    for steps, held in sorted((remaining_steps(r, rates.budget), len(r.tokens)) for r in running):
        wait_steps, freed = steps, freed + held
        if freed >= need:
            break
    uncached = max(0, len(head.tokens) - sum(head.first_look or ()))
    if rates.prefill_s_per_token is not None:
        prefill_s = uncached * rates.prefill_s_per_token
    else:
        prefill_s = -(-uncached // rates.budget) * rates.step_s
    service_s = prefill_s + max(0, head.params.max_tokens - len(head.output)) * rates.step_s
    return SliceCosts(
        gain_s=wait_steps * rates.step_s,
        swap_s=2 * victim.num_computed_tokens * rates.copy_rate(WARM),
        promote_s=found[WARM] * rates.copy_rate(WARM) + found[COLD] * rates.copy_rate(COLD),
        victim_wait_s=service_s, covers=len(victim.tokens) >= need)


class StepTimes:
    """The median of the last ``window`` step intervals: the time between the forwards of two
    steps in a row that ran something (a step with nothing to run breaks the row: an idle
    gap is no step). The engine stamps each forward with its clock (``Engine.step``)."""

    __slots__ = ("samples", "_last")

    def __init__(self, window: int = STEP_WINDOW):
        self.samples = RecentMedian(window)
        self._last: float | None = None   # when the previous step's forward began

    def forward(self, now: float) -> None:
        """A step's forward begins at ``now``."""
        if self._last is not None and now >= self._last:
            self.samples.add(now - self._last)
        self._last = now

    def idle(self) -> None:
        """A step planned nothing to run."""
        self._last = None

    def median(self) -> float | None:
        return self.samples.value()

    def __len__(self) -> int:
        return len(self.samples)


class TimeSlicer:
    """The time-slice policy (engine thread): the measured step time, the decision, and the
    waiting request a slice was last refused for (``time_slice_declined`` counts each once).
    ``copy_rates``: the cache's measured promotion rates, read at each decision
    (``TierMoves.promote_s_per_token``); ``budget``: the tokens a step computes at most."""

    def __init__(self, stats: dict, copy_rates: list, budget: int, window: int = STEP_WINDOW):
        self.stats = stats
        self.copy_rates = copy_rates
        self.budget = budget
        self.steps = StepTimes(window)
        self.min_steps = SLICE_MIN_STEPS   # tests that drive a few short decodes through slices lower it
        self.declined_for: EngineRequest | None = None

    def slice_s(self, configured: float) -> float | None:
        """How long a decode runs before it may yield: ``max(configured, min_steps x median
        step)``; None until ``min_steps`` steps are measured (no slice yet)."""
        if len(self.steps) < self.min_steps:
            return None
        return max(configured, self.min_steps * self.steps.median())

    def candidates(self, running: list[EngineRequest], now: float, configured: float) -> list[EngineRequest]:
        """The running decodes that may yield a slice now, newest first."""
        slice_s = self.slice_s(configured)
        if slice_s is None:
            return []
        return [r for r in reversed(running) if r.to_compute == 1 and r.output and r.running_since is not None
                and now - r.running_since >= slice_s and r.preemptions < SLICE_MAX_PREEMPTIONS]

    def rates(self, prefill_s_per_token: float | None) -> Rates:
        return Rates(self.steps.median() or 0.0, prefill_s_per_token,
                     (self.copy_rates[WARM], self.copy_rates[COLD]), self.budget)

    def victim(self, head: EngineRequest, running: list[EngineRequest], now: float, configured: float,
               prefill_s_per_token: float | None, free_tokens: int,
               pick: Callable[[list[EngineRequest]], EngineRequest] | None = None,
               covering: bool = True) -> EngineRequest | None:
        """The running decode that yields its room to ``head`` now, or None: of the decodes past
        their slice, ``pick``'s choice (default: the fewest tokens to swap, newest on ties),
        if its slice is worth its cost (``slice_costs``; a refusal is counted). ``covering``
        False: the victim's room need not cover ``head``'s need (``SliceCosts.covers``; the fair
        share's slices across tenants, where a flood's short decodes yield one after another)."""
        candidates = self.candidates(running, now, configured)
        if not candidates:
            return None
        victim = pick(candidates) if pick else min(candidates, key=lambda r: r.num_computed_tokens)
        costs = slice_costs(head, victim, running, self.rates(prefill_s_per_token), free_tokens)
        if costs.worth if covering else costs.gain_s > costs.cost_s:
            return victim
        if self.declined_for is not head:
            self.declined_for = head
            self.stats["time_slice_declined"] += 1
        return None
