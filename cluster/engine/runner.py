"""Model runner on the tiered radix cache: continuous batching that never fails for lack of KV.

Each ``step`` spends one token budget (``max_batch_tokens``) on one packed
forward, in this order (vLLM v1's, with chunked prefill):

1. running requests that decode: one token each;
2. running requests still filling their prompt: the next chunk each, first
   come first served, as far as the budget goes;
3. waiting requests, first come first served: a lease on the prompt's cached
   prefix (``TieredCache.admit``) and the first chunk of the rest. A waiting
   request whose prefix is still being promoted from WARM/COLD is passed over
   this step (the copy runs meanwhile) and joins once its KV is in HOT. A
   request is never admitted below what the tiers hold for it: when the oldest
   waiting request's promotion finds no room, it waits, and nothing behind it
   takes room before it (first come, first served); only a measured cost
   decision (copying slower than computing) admits it without its colder part,
   counted in ``recompute_chosen_tokens``. ``recomputed_held_tokens`` (by tier)
   counts what a request recomputed although a tier held it: it stays 0.

With ``time_slice_s`` set (workers set it), a waiting request that found no
room is not left behind running decodes for as long as they take: the newest
request that has been decoding for at least that long yields (preempted: its
KV goes into the cache, mostly a free move to WARM since its prefix kept its
WARM copy) and queues last. Time to first token stops depending on
how long other answers are; the yielded request resumes exactly.

Before the forward every request reserves the HOT room for this step's
tokens (``KVLease.reserve``: real blocks, after demoting or evicting unlocked
prefixes), so nothing computed is lost for lack of room. When a running
request cannot get its room, the newest running request is preempted: what
it computed is committed to the cache (the tier machinery then keeps it in
HOT, demotes it to WARM, or drops it when WARM is full too) and it goes back
to the front of the queue; admitted again, it finds what the cache kept and
recomputes only the rest, and its sampling continues exactly (a function of
seed and position). A waiting request that finds no room waits. A request
that could not fit in HOT even alone is refused at ``submit``.

A step's length is bounded by the budget: one long prompt or a burst of new
sessions takes its turn in chunks, while running decodes keep their pace.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import time
from collections import deque
from typing import Any, Sequence

import torch

from cluster.cache.tiered import TieredCache
from cluster.engine.bursts import BurstScheduling
from cluster.engine.prompt_logprobs import PromptLogprobCache, record_prompt_logprobs, wants_prompt_rows
from cluster.engine.request import EngineRequest, TokenEvent, position_seed, split_by_tier
from cluster.engine.sampling import greedy_tokens, sample_token, token_logprobs
from cluster.engine import shared_prefix
from cluster.engine.scratch import ScratchKV
from cluster.errors import CacheError, InvalidInputError, PoolExhaustedError
from cluster.names import COLD, HOT, L3, WARM
from cluster.ownership import ThreadOwner
from cluster.protocol import FinishReason, SamplingParams
from cluster.tokens import as_token_list

__all__ = ["Engine", "EngineRequest", "SamplingParams", "TokenEvent", "position_seed"]

log = logging.getLogger(__name__)

# The default budget: on 2 CPU cores a 512-token chunk of a 135M model is about a
# second of compute, so no step keeps running decodes waiting longer than that.
DEFAULT_BATCH_TOKENS = 512
# What a serving worker runs with (``actors.config.WorkerConfig.time_slice_s``): a decode yields its
# HOT room to a waiting request after this long (the module docstring; measured in docs/benchmarks.md).
DEFAULT_TIME_SLICE_S = 0.5


class Engine(BurstScheduling):
    def __init__(self, model: Any, cache: TieredCache, *, max_batch_tokens: int = DEFAULT_BATCH_TOKENS,
                 max_running: int = 64, keep_logits: bool = False, cache_final_token: bool = True,
                 decode_kernel: bool = True, cuda_graphs: bool = True, grammars: Any = None,
                 clock=time.perf_counter,
                 scratch_arena_tokens: int | None = None):
        """``max_batch_tokens``: the tokens one step computes at most (decodes and
        prefill chunks together). ``cache_final_token``: when a request ends, also
        compute the KV of its last sampled token (one more forward, alone, per
        finished request) so the next turn finds the whole sequence cached.
        Workers turn it off (``WorkerConfig.cache_final_token``), as vLLM and
        SGLang do: the next turn computes that one token inside its own prefill.
        ``decode_kernel``: the packed decoder attends every decoding request of a
        step in one compiled call per layer (``cluster.engine.kernels``) where it
        can be built (Triton on CUDA); the torch path otherwise. ``cuda_graphs``: on
        CUDA, with that kernel, steps of decodes alone replay a graph captured per
        batch-size bucket (``cluster.engine.cuda_graphs``). ``grammars``: the tokenizer's
        ``cluster.engine.grammar.Grammars`` (None: constrained requests are refused).
        ``scratch_arena_tokens``: the working KV faulted in at start-up
        (``cluster.engine.scratch``; None: twice what HOT holds on the CPU, none on CUDA)."""
        cfg = model.config
        lay = cache.layout
        if lay is None or (lay.num_layers, lay.num_kv_heads, lay.head_dim) != (
                cfg.num_layers, cfg.num_kv_heads, cfg.head_dim):
            raise InvalidInputError("the cache's KV layout does not match the model's")
        if max_batch_tokens < 1 or max_running < 1:
            raise InvalidInputError("max_batch_tokens and max_running must be >= 1")
        self.model = model
        self.cache = cache
        self.grammars = grammars
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.keep_logits = keep_logits
        self.cache_final_token = cache_final_token
        self.clock = clock
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []   # in admission order: the newest is preempted first
        self._ended: list[TokenEvent] = []   # requests that ended outside a sampled token
        self._finishing: list[tuple[EngineRequest, FinishReason]] = []   # ended by a token, not yet cached
        self._twins: dict[int, list[EngineRequest]] = {}   # by id of a fill: waiting identical prompts
        self._ids = itertools.count(1)
        self.owner: ThreadOwner | None = None   # the worker's engine thread, when ownership checks are on
        self._last_logits_only = "last_logits_only" in inspect.signature(model.forward_batch).parameters
        # Measured seconds per computed token of steps with prefill (a moving average): what a
        # promotion's copy time is weighed against (``TieredCache.ready``).
        self.prefill_s_per_token: float | None = None
        # The packed decoder keeps each request's KV in its working buffer in place
        # (``forward_into``); other models (the transformers adapter) get the past as a view.
        self._in_place = hasattr(model, "forward_into")
        self.decode_kernel = model.use_decode_kernel(decode_kernel) if hasattr(model, "use_decode_kernel") \
            else False
        self.cuda_graphs = model.use_cuda_graphs(cuda_graphs) if hasattr(model, "use_cuda_graphs") else False
        # Requests behind a prompt filled in the same step read its KV as each layer writes it
        # (``_ride``): the CPU kernel takes such a donor, the Triton one not yet.
        self.riders = self._in_place and self.decode_kernel and torch.device(cache.kv_device).type == "cpu"
        # A request whose part beyond the cache another's prefill computes waits for it; an
        # identical prompt starts from it (``cluster.engine.bursts``). False: each computes its own.
        self.shared_fills = True
        # The faster of MKL's two linear layouts for each row count, measured on this machine.
        self.linear_layouts = model.tune_linears() if hasattr(model, "tune_linears") else {}
        hot = cache.hot.allocator
        # What one request may hold alone: HOT, less a block of slack for a copy-on-write tail.
        self.max_request_tokens = hot.capacity_tokens - hot.block_tokens
        # Working KV buffers (cluster.engine.scratch). Each running request has its whole
        # sequence in one, shared prefix included, so together they outgrow HOT: measured, 16
        # sessions of 600 tokens on a 5,824-token HOT. On the CPU they are carved from an arena
        # of twice what HOT holds, faulted in now; past it, allocated and reused, idle ones kept
        # up to as much again.
        room = 2 * max(max_batch_tokens, 4096, hot.capacity_tokens)
        if scratch_arena_tokens is None:
            scratch_arena_tokens = room if torch.device(cache.kv_device).type == "cpu" else 0
        self.scratch = ScratchKV(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cache.kv_dtype, cache.kv_device,
                                 max_idle_bytes=room * lay.bytes_per_token(), arena_tokens=scratch_arena_tokens)
        self._bytes_per_token = lay.bytes_per_token()
        # Running requests whose buffers begin with the same (checked) bytes read them from
        # one buffer in the attention kernel (cluster.engine.shared_prefix); same results.
        self.share_prefixes = True
        # Echo requests' prompt logprobs, kept beside the KV (cluster.engine.prompt_logprobs).
        self.prompt_logprob_cache = PromptLogprobCache(hot.block_tokens)
        # A decoding request yields its room to a waiting request that found none after running
        # this long (seconds; None: never). See the module docstring.
        self.time_slice_s: float | None = None
        self._blocked: EngineRequest | None = None   # the waiting request that found no room last step
        self.stats = {"prompt_tokens": 0, "cached_tokens": 0, "computed_tokens": 0, "steps": 0,
                      "requests_finished": 0, "requests_failed": 0, "requests_cancelled": 0,
                      "finish_failures": 0, "preemptions": 0, "preempted_tokens": 0, "resumed_hot_tokens": 0,
                      "resumed_warm_tokens": 0, "resumed_cold_tokens": 0, "resumed_l3_tokens": 0, "recomputed_tokens": 0,
                      "swap_in_bytes": 0, "waits_for_room": 0, "waits_for_promotion": 0,
                      "recomputed_held_tokens": 0, "recomputed_held_hot_tokens": 0,
                      "recomputed_held_warm_tokens": 0, "recomputed_held_cold_tokens": 0,
                      "recompute_chosen_tokens": 0, "waits_for_promotion_room": 0, "time_slice_preemptions": 0,
                      "waits_for_shared_prefix": 0, "step_ms": 0.0, "forward_ms": 0.0, "decode_steps": 0,
                      "decode_step_ms": 0.0, "decode_rows": 0, "shared_prefix_joins": 0,
                      "shared_prefix_reads": 0, "forked_prompts": 0,
                      "riders": 0, "riders_back": 0}

    # ------------------------------------------------------------------ API
    def submit(self, request: EngineRequest) -> EngineRequest:
        if self.owner is not None:
            self.owner.check("Engine.submit")
        request.prompt = as_token_list(request.prompt, self.model.config.vocab_size)
        limit = self.model.config.max_position
        need = len(request.prompt) + request.params.max_tokens
        if need > limit:
            raise InvalidInputError(
                f"prompt ({len(request.prompt)} tokens) + max_tokens ({request.params.max_tokens}) "
                f"exceeds the model's context of {limit}")
        if need + 1 > self.max_request_tokens:
            raise InvalidInputError(
                f"prompt ({len(request.prompt)} tokens) + max_tokens ({request.params.max_tokens}) needs more KV "
                f"than this worker's HOT cache can hold for one request ({self.max_request_tokens - 1} tokens); "
                f"shorten the prompt or lower max_tokens")
        room = self.cache.hot_room_for(request.namespace) - self.cache.hot.allocator.block_tokens
        if need + 1 > room:   # the other tenants' HOT guarantees are never its room (tenant quotas)
            raise InvalidInputError(
                f"prompt ({len(request.prompt)} tokens) + max_tokens ({request.params.max_tokens}) needs more KV "
                f"than this tenant can hold in HOT beside the other tenants' guarantees ({room - 1} tokens); "
                f"shorten the prompt or lower max_tokens")
        spec = request.params.grammar
        if spec is not None:
            if self.grammars is None:
                raise InvalidInputError("structured output is not available on this worker (pip install llguidance)")
            prior = request.params.prior_output
            request._matcher = self.grammars.matcher(spec, request.prompt[len(request.prompt) - prior:] if prior
                                                     else ())
        request.request_id = request.request_id or next(self._ids)
        request.submitted_at = self.clock()
        request._touched_at = self.cache.touch(request.prompt, request.namespace)   # no prefetch pushes it out
        if request.params.seed is not None and not request.params.greedy:
            request._generator = torch.Generator()
        self.waiting.append(request)
        return request

    def cancel(self, request: EngineRequest, reason: FinishReason = FinishReason.CANCELLED) -> None:
        if self.owner is not None:
            self.owner.check("Engine.cancel")
        reason = FinishReason(reason)
        if request in self.waiting:
            self.waiting.remove(request)
            self._note_waiting()
            request.finished, request.finish_reason = True, reason
            self._ended.append(TokenEvent(request, None, True))
            self.stats["requests_cancelled"] += 1
        elif request in self.running:
            self._finish(request, reason, keep=True)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._ended or self._finishing)

    def generate(self, prompt: Sequence[int], params: SamplingParams | None = None, **kw) -> EngineRequest:
        """Run one request to completion (convenience for tests and tools)."""
        req = self.submit(EngineRequest(list(prompt), params or SamplingParams(), **kw))
        while not req.finished:
            self.step()
        self.complete_finished()
        if req.error:
            raise CacheError(req.error)
        return req

    # ------------------------------------------------------------------ steps
    def step(self, defer_finish: bool = False) -> list[TokenEvent]:
        """One scheduler iteration: plan the batch under the budget, run one
        forward, sample.

        A request that ends on the token it just sampled is finished (its KV
        cached, its prefix unlocked) before ``step`` returns; with
        ``defer_finish`` that work waits for ``complete_finished``, so the
        caller can deliver the last token first. The next step does it first
        in any case."""
        if self.owner is not None:
            self.owner.check("Engine.step")
        self.complete_finished()
        self.cache.poll()
        plan = self._plan()
        events, self._ended = self._ended, []
        if not plan:
            return events
        forward_at = self.clock()
        for req, _ in plan:
            if req.forward_at is None:
                req.forward_at = forward_at
        began = time.perf_counter()   # wall time, whatever ``clock`` is: what a step really costs
        try:
            outputs = self._forward(plan)
        except Exception as exc:  # a failed step fails its requests, never the cache
            for req, _ in plan:
                self._finish(req, FinishReason.ERROR, keep=False, error=f"model forward failed: {exc}")
            return events + self.drain_ended()
        forward_ms = (time.perf_counter() - began) * 1e3
        self._note_prefill_rate(plan, forward_ms)
        self.stats["steps"] += 1
        self.stats["forward_ms"] += forward_ms
        decodes_only = all(n == 1 and req.output for req, n in plan)
        greedy = greedy_tokens(plan, outputs)
        for (req, n), logits in zip(plan, outputs):
            try:
                if req._rider is not None:   # its lease, now that its fill's checkpoint is in
                    if not self._seat(req):
                        continue
                    n = req.to_compute
                token = self._advance(req, n, logits, greedy.get(id(req)))
            except Exception as exc:  # this request fails; the batch, the engine and the cache go on
                self._finish(req, FinishReason.ERROR, keep=False, error=f"{type(exc).__name__}: {exc}")
                continue
            if token is not None:   # else a chunk of a prompt that is not done yet
                self._emitted(req, token, events)
        self._fork_twins(plan, outputs, events)
        if not defer_finish:
            self.complete_finished()
        step_ms = (time.perf_counter() - began) * 1e3   # forward, sampling, finishing
        self.stats["step_ms"] += step_ms
        if decodes_only:
            self.stats["decode_steps"] += 1
            self.stats["decode_step_ms"] += step_ms
            self.stats["decode_rows"] += len(plan)
        return events + self.drain_ended()

    def _note_prefill_rate(self, plan: list[tuple[EngineRequest, int]], forward_ms: float) -> None:
        computed = sum(n for _, n in plan)
        if computed - len(plan) < 64:   # mostly decodes: not a prefill's rate
            return
        per_token = forward_ms / 1e3 / computed
        old = self.prefill_s_per_token
        self.prefill_s_per_token = per_token if old is None else 0.8 * old + 0.2 * per_token

    def _emitted(self, req: EngineRequest, token: int, events: list[TokenEvent]) -> None:
        """``req`` sampled ``token``: its event, and its end when the token ends it."""
        if req.first_token_at is None:
            req.first_token_at = self.clock()
        reason = None
        if token in req.params.stop_token_ids:
            reason = FinishReason.STOP
        elif req._matcher is not None and req._matcher.is_stopped():   # the grammar is complete
            reason = FinishReason.STOP
        elif len(req.output) >= req.params.max_tokens:
            reason = FinishReason.LENGTH
        if reason:
            req.finished, req.finish_reason = True, reason
            self.running.remove(req)
            self._finishing.append((req, reason))
        events.append(TokenEvent(req, token, req.finished))

    def _forward(self, plan: list[tuple[EngineRequest, int]]) -> list[torch.Tensor]:
        """One packed forward over the plan; each request's new KV ends up in its
        working buffer. Returns each request's logits (every position's when a
        request of the step wants its prompt's logprobs, the last one's otherwise)."""
        last_only = not self.keep_logits and self._last_logits_only and not any(
            wants_prompt_rows(req) for req, _ in plan)
        tokens = [torch.tensor(req.tokens[req._len:req._len + n]) for req, n in plan]
        if self._in_place:
            shared = shared_prefix.reads(plan) if self.share_prefixes else None
            if shared is not None:
                self.stats["shared_prefix_reads"] += sum(n for _, n in filter(None, shared))
            if any(req._rider is not None for req, _ in plan):   # riders read their fill's buffer
                at = {id(req): i for i, (req, _) in enumerate(plan)}
                shared = [(at[id(req._rider[0])], req._rider[1]) if req._rider is not None else entry
                          for (req, _), entry in zip(plan, shared or [None] * len(plan))]
            return self.model.forward_into([(t, req._len, req._kv) for t, (req, _) in zip(tokens, plan)],
                                           last_logits_only=last_only, shared=shared)
        items = [(t, req._len, _past(req) if req._len else None) for t, (req, _) in zip(tokens, plan)]
        outputs = (self.model.forward_batch(items, last_logits_only=True) if last_only
                   else self.model.forward_batch(items))
        for (req, n), (_, new_kv) in zip(plan, outputs):
            req._kv[:, :, :, req._len:req._len + n] = new_kv.transpose(2, 3)
        return [logits for logits, _ in outputs]

    def _plan(self) -> list[tuple[EngineRequest, int]]:
        """This step's batch: (request, tokens to compute), every one with its HOT room reserved."""
        budget = self.max_batch_tokens
        plan: list[tuple[EngineRequest, int]] = []
        self._twins = {}
        self._yield_to_blocked()
        planned: set[int] = set()
        decoding = [r for r in self.running if r.to_compute == 1]
        filling = [r for r in self.running if r.to_compute > 1]
        for req in decoding + filling:
            if budget <= 0:
                break
            if req not in self.running:   # preempted for an older request of this step
                continue
            n = min(req.to_compute, budget)
            if self._reserve_or_preempt(req, n, planned):
                plan.append((req, n))
                planned.add(id(req))
                budget -= n
        promoting = False   # an older waiting request's prefix is on its way up
        stalled: set = set()   # tenants whose oldest waiting request found no room (tenant quotas)
        queue = list(self.waiting)
        for i, req in enumerate(queue):
            if budget <= 0 or len(self.running) >= self.max_running:
                if budget <= 0 and self.shared_fills:   # identical prompts of this step's fills start from them
                    self._twins_past_budget(plan, queue[i:])
                break
            # Promotions that make room, oldest first and one at a time; behind it only
            # those that fit in free blocks. Started for every waiting request at once,
            # their prefixes pushed each other back out of a full HOT pool before any of
            # them was admitted (measured: 20x the demoted tokens promoted; a livelock).
            if req.namespace in stalled:
                continue
            if req._yielded_to is not None:   # it gave its room to an older request: not back before it
                if req._yielded_to in self.waiting:
                    continue
                req._yielded_to = None
            readiness = self.cache.ready(req.tokens, req.namespace, make_room=not promoting,
                                         recompute_s_per_token=self.prefill_s_per_token)
            tiers = readiness.tiers
            if req._tiers_found is None:   # where its KV comes from, before any promotion
                req._tiers_found = tiers
            if not readiness.ready:
                if readiness.blocked:   # the oldest one's promotion found no room: nobody takes room before it
                    self.stats["waits_for_promotion_room"] += 1
                    self._blocked = req
                    if self._stall_tenant(req, stalled):
                        continue
                    break
                # its prefix is (or will be) on its way up to HOT: the others go meanwhile
                self.stats["waits_for_promotion"] += 1
                promoting = True
                continue
            if self._ride(req, sum(tiers), plan, budget):   # computes its rest beside a fill of this step
                budget -= plan[-1][1]
                continue
            if self.shared_fills and self._behind_shared_prefill(req, sum(tiers)):   # computed by another soon
                self.stats["waits_for_shared_prefix"] += 1
                continue
            req.scheduled_at = self.clock() if req.scheduled_at is None else req.scheduled_at
            n = self._admit(req, budget, promote=not readiness.recompute)
            if n is None:
                if req.finished:   # the cache refused its prompt
                    self.waiting.remove(req)
                    continue
                self.stats["waits_for_room"] += 1
                self._blocked = req
                if self._stall_tenant(req, stalled):
                    continue
                break              # no room: it waits for running requests to finish or yield
            self.waiting.remove(req)
            self.running.append(req)
            if req is self._blocked:
                self._blocked = None
            plan.append((req, n))
            planned.add(id(req))
            budget -= n
        self._note_waiting()
        return plan

    def _stall_tenant(self, req: EngineRequest, stalled: set) -> bool:
        """Under tenant quotas the room a blocked request waits for may be another tenant's
        guarantee, which that tenant's own waiting requests may use (else both wait
        forever): only its own tenant's later requests wait behind it. False without quotas."""
        if self.cache.quotas is None:
            return False
        stalled.add(req.namespace)
        return True

    def _note_waiting(self) -> None:
        """A session prefetch leaves alone what the still-waiting requests touched at their
        submit (``TieredCache.prefetch``): tell the cache since when (None: nobody waits)."""
        self.cache.waiting_since = min((r._touched_at for r in self.waiting if r._touched_at is not None),
                                       default=None)

    def _yield_to_blocked(self) -> None:
        """Time slicing (``time_slice_s``): the waiting request that found no room last
        step gets the room of the newest request that has decoded for a whole slice,
        which queues last (requests still waiting for their first token go first; one a
        step: what it frees usually suffices)."""
        head = self._blocked
        if head is None or self.time_slice_s is None:
            return
        if head not in self.waiting:
            self._blocked = None
            return
        now = self.clock()
        victim = next((r for r in reversed(self.running) if r.to_compute == 1 and r.output
                       and r.running_since is not None and now - r.running_since >= self.time_slice_s), None)
        if victim is not None:
            self._preempt(victim, at=len(self.waiting))
            victim._yielded_to = head
            self.stats["time_slice_preemptions"] += 1

    def _reserve_or_preempt(self, req: EngineRequest, n: int, planned: set[int]) -> bool:
        """Room for ``n`` more tokens of ``req``; preempts the newest running request
        not yet in this step's batch until there is room (False: ``req`` itself was it)."""
        while True:
            try:
                req._lease.reserve(n)
                return True
            except PoolExhaustedError:
                victim = next((r for r in reversed(self.running) if id(r) not in planned
                               and self.cache.may_preempt(req.namespace, r.namespace, r._len)), None)
                if victim is None:   # everyone else is in this step already: this one yields
                    victim = req
                self._preempt(victim)
                if victim is req:
                    return False

    def _admit(self, req: EngineRequest, budget: int, need: int = 0, promote: bool = True) -> int | None:
        """Lease the sequence's cached prefix, read it into the working buffer and
        reserve the first chunk; the chunk's length, or None when it cannot run now
        (no room: it waits, holding nothing; or the cache refused its prompt: it ended).
        ``need``: the prefix the cache must hold, else None: the whole sequence for a twin
        (``_fork_twins``), the positions a rider read (``_seat``; its buffer is kept: it holds
        the rest it computed). ``promote=False``: the scheduler chose to recompute the
        prefix's colder part (``Readiness.recompute``)."""
        seq = req.tokens
        cap = None
        k = req.params.prompt_logprobs
        if k is not None:   # positions whose logprobs are unknown are computed, even if the KV is cached
            if req.prompt_logprobs is None:
                covered, entries = self.prompt_logprob_cache.covered(req.prompt, req.namespace, k)
                req.prompt_logprobs = entries + [None] * (len(req.prompt) - covered)
            known = next((i for i, e in enumerate(req.prompt_logprobs) if e is None and i), len(req.prompt))
            cap = known - 1 if known < len(req.prompt) else None
        try:
            lease = self.cache.admit(seq, req.namespace, validate=False, max_cached=cap,
                                     compute_last=need < len(seq), promote=promote)
        except CacheError as exc:
            req.finished, req.finish_reason, req.error = True, FinishReason.ERROR, str(exc)
            self._ended.append(TokenEvent(req, None, True))
            return None
        if lease.cached_tokens < need:   # the prefix it needs (a twin's whole sequence) is not all cached: it waits
            lease.release()
            return None
        n = min(len(seq) - lease.cached_tokens, budget)
        try:
            if n:
                lease.reserve(n)
        except PoolExhaustedError:
            lease.release()
            return None
        self._count_missed(lease, promote)
        tiers = split_by_tier(lease.cached_tokens, req._tiers_found or list(lease.tier_hits))
        if req.admitted_at is None:
            req.cached_tokens = lease.cached_tokens
            req.tier_hits = tiers
            found = list(req._tiers_found or lease.held_by_tier)
            req.tiers_found = (found + [0, 0, 0, 0])[:4]
            req.admitted_at = req.running_since = self.clock()
            self.stats["prompt_tokens"] += len(req.prompt)
            self.stats["cached_tokens"] += lease.cached_tokens
        else:   # back after a preemption: what the cache kept of it, and from which tier
            req.running_since = self.clock()
            for tier, key in ((HOT, "resumed_hot_tokens"), (WARM, "resumed_warm_tokens"),
                              (COLD, "resumed_cold_tokens"), (L3, "resumed_l3_tokens")):
                self.stats[key] += tiers[tier]
            self.stats["swap_in_bytes"] += (tiers[WARM] + tiers[COLD] + tiers[L3]) * self._bytes_per_token
            self.stats["recomputed_tokens"] += max(0, req._preempted_len - lease.cached_tokens)
        req._lease = lease
        if req._len < need or not need:   # a rider keeps the buffer that holds what it computed
            self._give_scratch(req)
            req._kv = self.scratch.take(req.capacity)
        else:
            shared_prefix.forget(req)
        lease.read_prefix_into(_past(req, lease.cached_tokens))
        req._len = lease.cached_tokens
        if self.share_prefixes and self._in_place and \
                shared_prefix.join(req, self.running, lease.prefix_extents):
            self.stats["shared_prefix_joins"] += 1
        return n

    def _count_missed(self, lease, promoted: bool) -> None:
        """What the tiers held for a lease beyond what it got: recomputed by choice
        (a cost decision), or a defect (``recomputed_held_*``: must stay 0)."""
        missed = lease.missed_by_tier
        total = sum(missed)
        if not total:
            return
        if not promoted:
            self.stats["recompute_chosen_tokens"] += total
            return
        self.stats["recomputed_held_tokens"] += total
        for tier, n in zip(("hot", "warm", "cold"), missed):
            self.stats[f"recomputed_held_{tier}_tokens"] += n

    def _preempt(self, req: EngineRequest, at: int = 0) -> None:
        """Take ``req`` off the batch: what it computed goes into the cache (for its
        return), its room and working buffer are freed, and it queues at ``at`` (first)."""
        self.running.remove(req)
        lease, req._lease = req._lease, None
        req._preempted_len = req._len
        try:
            if lease.length > lease.cached_tokens:
                lease.commit(req.tokens[:req._len])
        finally:
            lease.release()
            self._give_scratch(req)
        self.stats["preemptions"] += 1
        self.stats["preempted_tokens"] += req._len
        req.preemptions += 1
        req._len = 0
        req._tiers_found = None   # looked at afresh when it comes back: its KV may have moved down meanwhile
        self.waiting.insert(at, req)

    def complete_finished(self) -> None:
        """Cache the KV of the requests that ended on their last token and unlock
        their prefixes (``step(defer_finish=True)`` leaves this to the caller)."""
        finishing, self._finishing = self._finishing, []
        for req, reason in finishing:
            try:
                self._finish(req, reason, keep=True)
            except Exception as exc:   # caching the finished sequence failed: the answer stands
                self.stats["finish_failures"] += 1
                log.warning("could not cache request %s after it finished: %s", req.request_id, exc)

    def _advance(self, req: EngineRequest, n: int, logits: torch.Tensor, greedy: int | None = None) -> int | None:
        """Store one request's new KV (from its working buffer into its lease); sample
        its next token when its sequence is all computed (None: a prompt chunk, more to come;
        ``greedy``: its token, when ``greedy_tokens`` took it already)."""
        start = req._len
        req._lease.write(req._kv[:, :, :, start:start + n].transpose(2, 3))   # into its reserved room
        req._len = start + n
        self.stats["computed_tokens"] += n
        if self.keep_logits:
            req.logits.append(logits)
        if wants_prompt_rows(req, start):
            record_prompt_logprobs(self.prompt_logprob_cache, req, start, logits)
        if req.to_compute:
            return None
        if n > 1 and (req._lease.uncommitted >= self.cache.hot.allocator.block_tokens
                      or (req._awaited and req._lease.uncommitted)):
            # Its prompt is all computed: into the tree now, for the requests that share it
            # (less than a block only for one that waits on it: a checkpoint seals a block).
            req._lease.checkpoint(req.tokens[:req._len])
        req._awaited = False
        return self._sample(req, logits, greedy)

    def _sample(self, req: EngineRequest, logits: torch.Tensor, greedy: int | None = None) -> int:
        """Sample ``req``'s next token from the last row of ``logits`` and append it."""
        generator = req._generator
        if generator is not None:   # the token at position p depends on (seed, p) only
            generator.manual_seed(position_seed(req.params.seed, len(req.tokens)))
        mask = None
        if req._matcher is not None:
            mask = self.grammars.mask(req._matcher)
            if not mask.any():   # nothing can follow (an error state): end it here
                raise CacheError(f"the grammar allows no further token: {req._matcher.get_error()[:200]}")
        token = greedy if greedy is not None else sample_token(logits[-1], req.params, req.prompt, req.output,
                                                               generator, mask)
        if req._matcher is not None:
            req._matcher.consume_token(token)
        if req.params.logprobs is not None:
            req.token_logprobs.append(token_logprobs(logits[-1], token, req.params.logprobs))
        req.output.append(token)
        return token

    def fail_all(self, error: str) -> None:
        """End every queued and running request with ``error`` (their KV is not
        kept; the cache's other contents are untouched)."""
        for req in list(self.waiting):
            self.waiting.remove(req)
            req.finished, req.finish_reason, req.error = True, FinishReason.ERROR, error
            self._ended.append(TokenEvent(req, None, True))
            self.stats["requests_failed"] += 1
        for req in list(self.running):
            self._finish(req, FinishReason.ERROR, keep=False, error=error)

    def drain_ended(self) -> list[TokenEvent]:
        out, self._ended = self._ended, []
        return out

    # -------------------------------------------------------------- internals
    def _finish(self, req: EngineRequest, reason: FinishReason, *, keep: bool, error: str | None = None) -> None:
        """End a request: cache its KV (when ``keep``) or free it, and end its lease."""
        req.finished, req.finish_reason, req.error = True, reason, error
        cancelled = reason in (FinishReason.CANCELLED, FinishReason.CLIENT_DISCONNECTED)
        if error is not None or cancelled:
            self._ended.append(TokenEvent(req, None, True))
        if cancelled:
            self.stats["requests_cancelled"] += 1
        if req in self.running:
            self.running.remove(req)
        lease = req._lease
        try:
            if keep and lease is not None and self.cache_final_token and req.output and req.to_compute == 1:
                # Compute the last sampled token's KV too, so the whole sequence
                # (prompt and output) is cached for the next turn.
                start = req._len
                _, kv = self.model.forward_one(torch.tensor(req.tokens[start:]), start, _past(req))
                lease.reserve(kv.shape[2])
                lease.write(kv)
                req._len += kv.shape[2]
            if keep and lease is not None and lease.length > lease.cached_tokens:
                lease.commit(req.tokens[:req._len], req.session_id)
        finally:
            if lease is not None:
                lease.release()   # after a commit it only ends the lease
                req._lease = None
            self._give_scratch(req)
            self.stats["requests_finished" if error is None else "requests_failed"] += 1

    def _give_scratch(self, req: EngineRequest) -> None:
        shared_prefix.forget(req)
        if req._kv is not None:
            self.scratch.give(req._kv)
            req._kv = None


def _past(req: EngineRequest, length: int | None = None) -> torch.Tensor:
    """The first ``length`` (default: every computed) positions of a request's
    working buffer, as the token-major ``[layers, 2, T, kv_heads, head_dim]`` view
    the pools and the model's ``forward_batch`` take."""
    return req._kv[:, :, :, :req._len if length is None else length].transpose(2, 3)

