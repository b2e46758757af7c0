"""The scheduler: continuous batching that never fails for lack of KV.

``schedule`` spends one token budget (``SchedulerConfig.max_batch_tokens``) on
one step's plan, in this order (vLLM v1's, with chunked prefill):

1. running requests that decode: one token each; beside them, prompts get the rest
   (at most what keeps the step from stalling them, where ``stall_free_steps`` asks);
2. running requests still filling their prompt: the next chunk each, in the
   policy's order, as far as the budget goes;
3. waiting requests, in the policy's order: a lease on the prompt's cached
   prefix (``TieredCache.admit``) and the first chunk of the rest. A waiting
   request whose prefix is still being promoted from WARM/COLD is passed over
   this step (the copy runs meanwhile) and joins once its KV is in HOT. A
   request is never admitted below what the tiers hold for it: when the first
   waiting request's promotion finds no room, it waits, and nothing behind it
   takes room before it; only a measured cost decision (copying slower than
   computing) admits it without its colder part, counted in
   ``recompute_chosen_tokens``. ``recomputed_held_tokens`` (by tier) counts
   what a request recomputed although a tier held it: it stays 0.

The scheduling policy (``cluster.engine.policies``, ``SchedulerConfig.policy``)
owns the choices: the waiting order, who shares the budget after the decodes
(one group, or each tenant its share: the fair share), and which running
request yields (for room, for a time slice, for a tenant without a running
slot). ``fcfs`` is first come, first served; ``fair`` (what tenant quotas
select) shares steps and running slots among tenants; ``priority`` serves a
lower ``priority`` value first.

Every planned request has reserved the HOT room of this step's tokens
(``KVLease.reserve``: real slots, after demoting or evicting unlocked
prefixes), so nothing computed is lost for lack of room. When a running
request cannot get its room, another running request, the policy's choice
(the newest under fcfs), is preempted: what it computed is committed to the
cache and it goes back to the front of the queue; admitted again, it finds what
the cache kept and recomputes only the rest, and its sampling continues
exactly (a function of seed and position). A waiting request that finds no
room waits; under the fair share it takes the room from another tenant's running
request the quotas allow, from one planned before it (a decode) before the next
step is planned (``cluster.engine.room_claims``, counted in ``room_claims``).

Two named policies of the room rules:

- **time slicing** (``time_slice_s``; workers set it): a waiting request that
  found no room takes the room of a decode that ran ``max(time_slice_s, 8
  measured steps)``, once per stream at most, only where the measured gain
  beats the cost (``cluster.engine.preemption``); the victim, its KV into the
  cache, queues right behind it. Refusals count in ``time_slice_declined``.
- **shared fills** (``shared_fills``): a waiting request whose part beyond the
  cache a running prompt fill computes (a block or more, or all but its last
  token) waits for that fill's checkpoint (taken at its prompt's end, even
  under a block when awaited) instead of computing the same KV beside it.

``update`` applies a step's result: a request that completed its prompt
checkpoints it into the tree, takes its sampled token, and ends on a stop
token, its grammar's end or ``max_tokens``; the step's measures are recorded
(``cluster.engine.step_measures``). The scheduler never runs the model: a
finished request's last token's KV is the runner's (``final_token_plan``).
Everything runs on the engine thread.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from cluster.cache.tiered import TieredCache
from cluster.engine.fair_share import chunk_tokens
from cluster.engine.plan import Sampled, ScheduledRequest, StepOutput, StepPlan
from cluster.engine.policies import ANY, POLICIES
from cluster.engine.preemption import TimeSlicer, spare_repeated
from cluster.engine.prompt_logprobs import wants_prompt_rows
from cluster.engine.request import EngineRequest, TokenEvent, count_missed, split_by_tier
from cluster.engine.room_claims import RoomClaims
from cluster.engine.scheduler_config import SchedulerConfig
from cluster.engine.stall_free import prefill_cap
from cluster.engine.step_measures import StepMeasures
from cluster.engine.tenant_work import TenantWork
from cluster.engine.waiting_checks import InlinePromotions, behind_shared_fill, logprob_cap
from cluster.errors import CacheError, PoolExhaustedError
from cluster.names import COLD, HOT, L3, WARM
from cluster.protocol import FinishReason

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Pass:
    """What one step's planning of waiting requests carries from one request to the next."""

    promoting: bool = False   # an older waiting request's prefix is on its way up
    stalled: set = field(default_factory=set)   # tenants whose oldest waiting request found no room (quotas)
    halted: bool = False      # a request found no room: nobody behind it takes room before it
    inlined: bool = False     # a promotion was waited for in this step's planning (one a step)
    looked: set = field(default_factory=set)   # looked at ahead of their tenant's fills (not again)
    ends_only: bool = False   # the rest of the step takes only prompts that end in it (``after_first``)


STAT_KEYS = ("prompt_tokens", "cached_tokens", "computed_tokens", "requests_finished", "requests_failed",
             "requests_cancelled", "finish_failures", "preemptions", "preempted_tokens", "resumed_hot_tokens",
             "resumed_warm_tokens", "resumed_cold_tokens", "resumed_l3_tokens", "recomputed_tokens",
             "swap_in_bytes", "waits_for_room", "waits_for_promotion", "recomputed_held_tokens",
             "recomputed_held_hot_tokens", "recomputed_held_warm_tokens", "recomputed_held_cold_tokens",
             "recompute_chosen_tokens", "waits_for_promotion_room", "time_slice_preemptions", "room_claims",
             "time_slice_declined", "waits_for_shared_prefix", "final_tokens_skipped", "slot_yields",
             "promotions_inline")


class Scheduler:
    """The queues and the leases: ``schedule`` plans a step, ``update`` applies its result."""

    def __init__(self, cache: TieredCache, stats: dict, config: SchedulerConfig,
                 clock: Callable[[], float] = time.perf_counter):
        self.cache = cache
        self.stats = stats
        self.config = config
        self.measures = StepMeasures(stats)   # the step counters and the prefill rate
        stats.update({key: 0 for key in STAT_KEYS})
        self.clock = clock
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []   # in admission order: the newest is preempted first
        self.events: list[TokenEvent] = []   # this step's events (tokens and ends), taken by the engine
        self.finishing: list[tuple[EngineRequest, FinishReason]] = []   # ended by a token, not yet cached
        self.slicer = TimeSlicer(stats, cache.promote_s_per_token, config.max_batch_tokens)   # its measures, its rule
        self.blocked: EngineRequest | None = None   # the waiting request that found no room last step
        self.claims = RoomClaims(stats)   # room claimed from planned requests (the fair share's)
        self.owed: list[EngineRequest] = []   # waiting requests another yielded its running slot to
        self.tenant_work, self.inline = TenantWork(cache), InlinePromotions()   # who has work; inline waits
        self._bytes_per_token = cache.layout.bytes_per_token() if cache.layout is not None else 0
        quotas = cache.quotas.config if cache.quotas is not None else None
        # Without quotas the default stays first come, first served: a tenant's request put ahead of a
        # flood's prefills in one shared LRU HOT pool pushed its own prefix out (measured: docs/engine.md).
        self.policy = POLICIES[config.policy_for(quotas is not None)](config.max_running, quotas)

    @property
    def prefill_s_per_token(self) -> float | None:
        return self.measures.prefill_s_per_token

    def add(self, req: EngineRequest) -> None:
        req.trace.added_step = self.stats["steps"]
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.events or self.finishing)

    # ------------------------------------------------------------------ planning
    def schedule(self) -> StepPlan:
        """This step's plan, every request in it with its HOT room reserved (the cache's
        finished moves taken in first, the tenants with work told to it)."""
        self.cache.poll()
        self.tenant_work.before_step(self.running, self.waiting)
        plan = StepPlan()
        self._yield_slots()
        self._yield_to_blocked()
        planned: set[int] = set()
        budget = step_budget = self.policy.step_budget(self.config.max_batch_tokens, self.running, self.waiting,
                                                       self.clock)
        budget = self._plan_running(plan, [r for r in self.running if r.to_compute == 1], budget, planned)
        budget = self._beside_decodes(budget, plan)
        # What a shortened step (step_tokens) kept out, up to one more: a waiting prompt may end past it (reach)
        spare = min(step_budget, max(0, self._beside_decodes(self.config.max_batch_tokens, plan) - step_budget))
        groups, last_pass = self.policy.groups(self.running, self.waiting, planned)
        state = _Pass()
        for last in (False, True) if last_pass else (False,):
            for i, group in enumerate(groups):
                if budget <= 0:
                    break
                share = budget if last else self.policy.share(budget, len(groups) - i)
                extra = self.policy.reach(budget, share, i == 0 and not last, spare)
                mark, fills = len(plan.items), [r for r in self.running if r.to_compute > 1 and id(r) not in planned
                    and (group is ANY or r.namespace == group) and (r.to_compute <= budget or not state.ends_only)]
                inline = self.policy.promotes_inline and not last
                ahead = self._plan_waiting(plan, share, planned, state, group, extra, inline, True) \
                    if self.policy.ending_first and group is not ANY and not last else share
                left = self._plan_running(plan, fills, ahead, planned, budget - share)   # fills: no spare
                left = self._plan_waiting(plan, left, planned, state, group, extra, inline, state.ends_only)
                budget -= share - left
                state.ends_only |= i == 0 and not last and self.policy.after_first(plan.items[mark:], len(groups))
        self._planned(plan)
        self.tenant_work.after_step(len(plan.items), self.running, self.waiting)
        return plan

    def _planned(self, plan: StepPlan) -> None:
        """The plan's bookkeeping: each tenant's service, what the cache's prefetch leaves
        alone, the step's start on the slicer's clock (or no step), the logits it returns."""
        used: dict = {}
        for item in plan.items:
            used[item.request.namespace] = used.get(item.request.namespace, 0) + item.num_tokens
        self.policy.charge(used)
        self.note_waiting()
        for req in self.waiting:
            req.trace.unreached += req.trace.looked_step != self.stats["steps"]
        if not plan.items:   # no forward: the next step's interval is no step's time
            self.slicer.steps.idle()
            return
        forward_at = self.clock()
        self.slicer.steps.forward(forward_at)   # the step time time slicing weighs
        for item in plan.items:
            if item.request.forward_at is None:
                item.request.forward_at = forward_at
                item.request.trace.first_forward(item.request, plan.items, self.stats["steps"])
        plan.all_logits = self.config.keep_logits or any(wants_prompt_rows(i.request) for i in plan.items)

    def _beside_decodes(self, budget: int, plan: StepPlan) -> int:
        """``budget`` for prompts, at most what spares the plan's decodes (if any) a stall (``prefill_cap``)."""
        if not plan.items:
            return budget
        prompts = len(self.waiting) + sum(1 for r in self.running if r.to_compute > 1)
        return prefill_cap(budget, self.measures.decode_step_s or self.slicer.steps.median(), self.prefill_s_per_token,
                           self.cache.config.block_tokens, self.config.stall_free_steps, len(plan.items), prompts)

    def _plan_running(self, plan: StepPlan, reqs: list[EngineRequest], budget: int, planned: set[int],
                      extra: int = 0) -> int:
        """Running requests into the plan in the given order, as far as ``budget`` goes
        (a decode one token, a prefill its next chunk); the budget left. ``extra``: how far
        past ``budget`` a prompt that ends within it may go (``fair_share.chunk_tokens``)."""
        for req in reqs:
            if budget <= 0:
                break
            if req not in self.running:   # preempted for an older request of this step
                continue
            n = chunk_tokens(req.to_compute, budget, extra)
            if self._reserve_or_preempt(req, n, planned):
                plan.items.append(ScheduledRequest(req, req.num_computed_tokens, n))
                planned.add(id(req))
                budget -= n
        return budget

    def _plan_waiting(self, plan: StepPlan, budget: int, planned: set[int], state: "_Pass",
                      tenant: Any = ANY, extra: int = 0, inline: bool = False, ending: bool = False) -> int:
        """Waiting requests (of ``tenant``, or all) into the plan, in the policy's order, as
        far as the budget goes; the budget left. Promotions that make room go oldest first
        and one at a time; behind it only those that fit in free blocks (started for every
        waiting request at once, their prefixes pushed each other back out of a full HOT
        pool before any was admitted: a livelock). ``state`` carries that across a step's
        calls, and whether a request that found no room stops everyone behind it. ``inline``:
        a promotion may be waited for in the step, one a step, in the policy's tenant order
        (``waiting_checks.InlinePromotions``); ``ending``: only new prompts that end in this step
        (``ending_first``, ``after_first``), and a request owed a running slot, whole or not."""
        for req in self.policy.waiting_order(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_running or state.halted:
                break
            only_ending = ending and req not in self.owed
            if (tenant is not ANY and req.namespace != tenant) or req.namespace in state.stalled or id(req) in \
                    state.looked or not self._slot_free(req) or (only_ending and req.admitted_at is not None):
                continue
            if req.yielded_to is not None:   # it gave its room to an older request: not back before it
                if req.yielded_to in self.waiting:
                    continue
                req.yielded_to = None
            req.trace.looked_step = self.stats["steps"]
            readiness = self.cache.ready(req.tokens, req.namespace, make_room=not state.promoting,
                                         recompute_s_per_token=self.prefill_s_per_token)
            if req.first_look is None:   # where its KV comes from, before any promotion
                req.first_look = readiness.tiers
            if only_ending and readiness.ready and \
                    len(req.tokens) - sum(readiness.tiers[:3]) + readiness.recompute > budget + extra:
                continue   # a prompt that cannot end in this step goes later
            if ending:
                state.looked.add(id(req))
            if not readiness.ready and not readiness.blocked and inline and not state.inlined:
                again = self.inline.promote(self.cache, req, readiness, self.slicer.steps.median(),
                                            self.prefill_s_per_token)   # ready in this step where the copy is short
                state.inlined = again is not None
                readiness = again or readiness
                self.stats["promotions_inline"] += state.inlined
            if not readiness.ready:
                if readiness.blocked:   # the oldest one's promotion found no room: nobody takes room before it
                    self.stats["waits_for_promotion_room"] += 1
                    req.trace.room_waits += 1
                    self.blocked = req
                    state.halted = self._preempt_for(req, planned) or not self._stall_tenant(req, state.stalled)
                    continue
                self.stats["waits_for_promotion"] += 1   # on its way up to HOT: the others go meanwhile
                req.trace.promotion_waits += 1
                state.promoting = True
                continue
            if self.config.shared_fills and behind_shared_fill(self.running, req, sum(readiness.tiers),
                                                               self.cache.config.block_tokens):
                self.stats["waits_for_shared_prefix"] += 1
                continue
            if req.scheduled_at is None:
                req.scheduled_at, req.trace.steps_waited = self.clock(), self.stats["steps"] - req.trace.added_step
            n = self._admit(req, budget, promote=not readiness.recompute, extra=extra)
            if n is None:
                if req.finished:   # the cache refused its prompt
                    self.waiting.remove(req)
                    continue
                self.stats["waits_for_room"] += 1
                req.trace.room_waits += 1
                self.blocked = req
                # no room: it waits for running requests to finish, yield or give way (its tenant's alone under quotas)
                state.halted = self._preempt_for(req, planned) or not self._stall_tenant(req, state.stalled)
                continue
            self.waiting.remove(req)
            self.running.append(req)
            if req is self.blocked:
                self.blocked = None
            if req in self.owed:
                self.owed.remove(req)
            plan.items.append(ScheduledRequest(req, req.num_computed_tokens, n))
            planned.add(id(req))
            budget -= n
        return budget

    def _stall_tenant(self, req: EngineRequest, stalled: set) -> bool:
        """Under tenant quotas the room a blocked request waits for may be another tenant's
        guarantee, which that tenant's own waiting requests may use (else both wait
        forever): only its own tenant's later requests wait behind it. False without quotas."""
        if self.cache.quotas is None:
            return False
        stalled.add(req.namespace)
        return True

    def note_waiting(self) -> None:
        """A session prefetch leaves alone what the still-waiting requests touched at their
        submit (``TieredCache.prefetch``): tell the cache since when (None: nobody waits)."""
        self.cache.waiting_since = min((r.touched_at for r in self.waiting if r.touched_at is not None),
                                       default=None)

    def _yield_to_blocked(self) -> None:
        """Time slicing: the request that found no room last step may take a decode's room
        (``TimeSlicer.victim``, among the decodes past their slice the policy's pick), one a step."""
        if self.blocked is not None and self.blocked not in self.waiting:
            self.blocked = None
        head, hot = self.blocked, self.cache.hot.allocator
        slice_s = self.config.time_slice_s
        asked = 0 if head is None or slice_s is None else self.cache.hot_asks(head.tokens, head.namespace)
        victim = None if head is None or slice_s is None else self.slicer.victim(
            head, [r for r in self.policy.slice_candidates(head, self.running)
                   if self.cache.may_preempt(head.namespace, r.namespace, asked)],
            self.clock(), slice_s, self.prefill_s_per_token,
            hot.free_blocks * hot.block_tokens, self.policy.slice_victim(self.running),
            not self.policy.preempts_across_tenants)   # the fair share's slices need not cover (preemption.py)
        if victim is not None:
            self.preempt(victim, at=self.waiting.index(head) + 1)
            victim.yielded_to = head
            self.stats["time_slice_preemptions"] += 1
            self.claims.skip()
        else:
            self.claims.claim(self.cache, self.policy, self.waiting, self.running, self.preempt)

    def _yield_slots(self) -> None:
        """Running slots under the policy (the fair share: a tenant with waiting work and no
        running request while every slot is taken gets one from the tenant most over its
        share): each victim into the cache, back only after the request it yielded to."""
        self.owed = [r for r in self.owed if r in self.waiting]
        for victim, head in self.policy.slot_yields(self.running, self.waiting):
            self.preempt(victim)
            victim.yielded_to = head
            self.owed.append(head)
            self.stats["slot_yields"] += 1

    def _slot_free(self, req: EngineRequest) -> bool:
        """A running slot for ``req``: one of ``max_running`` neither taken nor owed to another waiting
        request (yielded to it, kept until it is admitted), the policy's to give (``takes_slot``)."""
        free = self.config.max_running - len(self.running) - sum(1 for r in self.owed if r is not req)
        return free > 0 and self.policy.takes_slot(req, free, self.running, self.waiting, self.owed)

    def _preempt_for(self, req: EngineRequest, planned: set[int]) -> bool:
        """Under the fair share, a waiting request that found no room (for its chunk or its
        prefix's promotion) takes it from a running request of another tenant that
        ``may_preempt`` allows (over its HOT guarantee, the requester under its cap), of the
        tenant served most, newest first, not one in this step's plan: the room rules hold
        for admission as for running requests. True: one was preempted (the room is free
        for the next step)."""
        if not self.policy.preempts_across_tenants:
            return False
        asked = self.cache.hot_asks(req.tokens, req.namespace)
        victim = self.policy.room_victim(spare_repeated(
            r for r in reversed(self.running) if id(r) not in planned and r.namespace != req.namespace
            and self.cache.may_preempt(req.namespace, r.namespace, asked)))
        if victim is None:
            self.claims.note(req)   # a victim may be in the plan: claimed before the next one is planned
            return False
        self.preempt(victim)
        return True

    def _reserve_or_preempt(self, req: EngineRequest, n: int, planned: set[int]) -> bool:
        """Room for ``n`` more tokens of ``req``; preempts the policy's pick of the running requests
        not in this step's plan (``spare_repeated``) until there is room (False: ``req`` itself was it)."""
        while True:
            try:
                req.lease.reserve(n)
                return True
            except PoolExhaustedError:
                victim = self.policy.room_victim(spare_repeated(
                    r for r in reversed(self.running) if id(r) not in planned
                    and self.cache.may_preempt(req.namespace, r.namespace, n)))
                if victim is None:   # everyone else is in this step already: this one yields
                    victim = req
                self.preempt(victim)
                if victim is req:
                    return False

    def _admit(self, req: EngineRequest, budget: int, promote: bool = True, extra: int = 0) -> int | None:
        """Lease the sequence's cached prefix and reserve the first chunk; the chunk's length,
        or None when it cannot run now (no room: it waits, holding nothing; or the cache
        refused its prompt: it ended). ``promote=False``: the scheduler chose to recompute
        the prefix's colder part (``Readiness.recompute``)."""
        seq = req.tokens
        try:
            lease = self.cache.admit(seq, req.namespace, validate=False, max_cached=logprob_cap(req),
                                     promote=promote)
        except CacheError as exc:
            req.finished, req.finish_reason, req.error = True, FinishReason.ERROR, str(exc)
            self.events.append(TokenEvent(req, None, True))
            return None
        n = chunk_tokens(len(seq) - lease.cached_tokens, budget, extra)
        try:
            lease.reserve(n)
        except PoolExhaustedError:
            lease.release()
            return None
        count_missed(self.stats, lease.missed_by_tier, promote)
        self._note_admission(req, lease)
        req.lease = lease
        req.num_computed_tokens = lease.cached_tokens
        return n

    def _note_admission(self, req: EngineRequest, lease) -> None:
        """What the cache gave ``req`` and from which tier: at its first admission, its
        cached tokens; back after a preemption, what the cache kept of it."""
        tiers = split_by_tier(lease.cached_tokens, req.first_look or list(lease.tier_hits))
        if req.admitted_at is None:
            req.cached_tokens = lease.cached_tokens
            req.tier_hits = tiers
            found = list(req.first_look or lease.held_by_tier)
            req.tiers_found = (found + [0, 0, 0, 0])[:4]
            req.admitted_at = req.running_since = self.clock()
            self.stats["prompt_tokens"] += len(req.prompt)
            self.stats["cached_tokens"] += lease.cached_tokens
            return
        req.running_since = self.clock()
        for tier, key in ((HOT, "resumed_hot_tokens"), (WARM, "resumed_warm_tokens"),
                          (COLD, "resumed_cold_tokens"), (L3, "resumed_l3_tokens")):
            self.stats[key] += tiers[tier]
        self.stats["swap_in_bytes"] += (tiers[WARM] + tiers[COLD] + tiers[L3]) * self._bytes_per_token
        self.stats["recomputed_tokens"] += max(0, req.preempted_len - lease.cached_tokens)

    # ------------------------------------------------------------------ results
    def update(self, plan: StepPlan, output: StepOutput, sampled: list[Sampled]) -> None:
        """Apply a step's result (its KV is in the leases' slots, confirmed by the runner):
        each request's progress, its checkpoint once its prompt is done, its token and its end;
        then the step's measures. A failed forward fails its requests, never the cache."""
        if output.error is not None:
            self.fail_plan(plan, output.error)
            return
        block = self.cache.config.block_tokens
        for item, result in zip(plan.items, sampled):
            req = item.request
            if req.finished:
                continue
            req.num_computed_tokens = item.start + item.num_tokens
            self.stats["computed_tokens"] += item.num_tokens
            if result.error is not None:   # this request fails; the batch, the engine and the cache go on
                self.finish(req, FinishReason.ERROR, keep=False, error=result.error)
                continue
            if not item.samples:   # a chunk of a prompt that is not done yet
                continue
            lease = req.lease
            if item.num_tokens > 1 and (lease.uncommitted >= block or (req.awaited and lease.uncommitted)):
                # Its prompt is all computed: into the tree now, for the requests that share it
                # (less than a block only for one that waits on it: a checkpoint seals a block).
                try:
                    lease.checkpoint(req.tokens[:req.num_computed_tokens])
                except Exception as exc:
                    self.finish(req, FinishReason.ERROR, keep=False, error=f"{type(exc).__name__}: {exc}")
                    continue
            req.awaited = False
            if result.logprobs is not None:
                req.token_logprobs.append(result.logprobs)
            req.output.append(result.token)
            self._emitted(req, result.token)
        self.measures.record(plan, output)

    def _emitted(self, req: EngineRequest, token: int) -> None:
        """``req`` sampled ``token``: its event, and its end when the token ends it."""
        if req.first_token_at is None:
            req.first_token_at = self.clock()
            req.trace.prompt_steps = self.stats["steps"] + 1 - req.trace.forward_step
        reason = None
        if token in req.params.stop_token_ids:
            reason = FinishReason.STOP
        elif req.matcher is not None and req.matcher.is_stopped():   # the grammar is complete
            reason = FinishReason.STOP
        elif len(req.output) >= req.params.max_tokens:
            reason = FinishReason.LENGTH
        if reason:
            req.finished, req.finish_reason = True, reason
            self.running.remove(req)
            self.finishing.append((req, reason))
        self.events.append(TokenEvent(req, token, req.finished))

    def fail_plan(self, plan: StepPlan, error: str) -> None:
        """A failed forward fails its requests, never the cache."""
        for item in plan.items:
            if not item.request.finished:
                self.finish(item.request, FinishReason.ERROR, keep=False, error=error)

    # ------------------------------------------------------------------ endings
    def preempt(self, req: EngineRequest, at: int = 0) -> None:
        """Take ``req`` off the batch: what it computed goes into the cache (for its
        return), its room is freed, and it queues at ``at`` (first)."""
        self.running.remove(req)
        lease, req.lease = req.lease, None
        req.preempted_len = req.num_computed_tokens
        try:
            if lease.length > lease.cached_tokens:
                lease.commit(req.tokens[:req.num_computed_tokens])
        finally:
            lease.release()
        self.stats["preemptions"] += 1
        self.stats["preempted_tokens"] += req.num_computed_tokens
        req.preemptions += 1
        req.num_computed_tokens = 0
        req.first_look = None   # looked at afresh when it comes back: its KV may have moved down meanwhile
        self.waiting.insert(at, req)

    def final_token_plan(self) -> StepPlan:
        """With ``cache_final_token``: the requests that ended on a token, each with the room of
        that token's KV reserved (one token, not sampled), for the runner to compute before
        ``complete_finished`` caches the whole sequence (prompt and output) for the next turn;
        without room for it the rest is cached all the same (``final_tokens_skipped``)."""
        plan = StepPlan()
        if not self.config.cache_final_token:
            return plan
        for req, _ in self.finishing:
            if req.lease is None or not req.output or req.to_compute != 1:
                continue
            try:
                req.lease.reserve(1)
            except PoolExhaustedError:
                self.stats["final_tokens_skipped"] += 1
                continue
            plan.items.append(ScheduledRequest(req, req.num_computed_tokens, 1))
        return plan

    def complete_finished(self, final_done: set[int] = frozenset()) -> None:
        """Cache the KV of the requests that ended on their last token and unlock their prefixes
        (``final_done``: the ids of those whose last token's KV the runner computed)."""
        finishing, self.finishing = self.finishing, []
        for req, reason in finishing:
            if id(req) in final_done:
                req.num_computed_tokens += 1
            try:
                self.finish(req, reason, keep=True)
            except Exception as exc:   # caching the finished sequence failed: the answer stands
                self.stats["finish_failures"] += 1
                log.warning("could not cache request %s after it finished: %s", req.request_id, exc)

    def cancel(self, req: EngineRequest, reason: FinishReason) -> None:
        if req in self.waiting:
            self.waiting.remove(req)
            self.note_waiting()
            req.finished, req.finish_reason = True, reason
            self.events.append(TokenEvent(req, None, True))
            self.stats["requests_cancelled"] += 1
        elif req in self.running:   # its KV is cached as a finished one's (``complete_finished``)
            self.running.remove(req)
            req.finished, req.finish_reason = True, reason
            self.finishing.append((req, reason))

    def fail_all(self, error: str) -> None:
        """End every queued and running request with ``error`` (their KV is not
        kept; the cache's other contents are untouched)."""
        for req in list(self.waiting):
            self.waiting.remove(req)
            req.finished, req.finish_reason, req.error = True, FinishReason.ERROR, error
            self.events.append(TokenEvent(req, None, True))
            self.stats["requests_failed"] += 1
        for req in list(self.running):
            self.finish(req, FinishReason.ERROR, keep=False, error=error)

    def take_events(self) -> list[TokenEvent]:
        out, self.events = self.events, []
        return out

    def finish(self, req: EngineRequest, reason: FinishReason, *, keep: bool, error: str | None = None) -> None:
        """End a request: cache its KV (when ``keep``) or free it, and end its lease."""
        req.finished, req.finish_reason, req.error = True, reason, error
        cancelled = reason in (FinishReason.CANCELLED, FinishReason.CLIENT_DISCONNECTED)
        if error is not None or cancelled:
            self.events.append(TokenEvent(req, None, True))
        if cancelled:
            self.stats["requests_cancelled"] += 1
        if req in self.running:
            self.running.remove(req)
        lease = req.lease
        try:
            if keep and lease is not None and lease.length > lease.cached_tokens:
                lease.commit(req.tokens[:req.num_computed_tokens], req.session_id)
        finally:
            if lease is not None:
                lease.release()   # after a commit it only ends the lease
                req.lease = None
            self.stats["requests_finished" if error is None else "requests_failed"] += 1

