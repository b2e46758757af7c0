"""The engine: a step in three roles over the tiered radix cache.

::

    plan = scheduler.schedule()              # queues and leases -> what this step computes
    logits = runner.run(plan)                # one packed forward, KV in place in HOT
    scheduler.update(plan, sampler.sample(plan, logits), events)

``Scheduler`` (``cluster.engine.scheduler``) owns the waiting and running
queues and every request's lease: continuous batching under a token budget
that never fails for lack of KV (room reserved before the forward,
preemption into the cache, time slicing, shared fills). ``ModelRunner``
(``cluster.engine.model_runner``) runs the forward over the leases' slot
tables. ``Sampler`` (``cluster.engine.sampler``) turns logits into tokens.
``Engine`` wires them, validates what is submitted and measures the steps;
under tenant quotas it tells the cache before each step which tenants have
work (``cluster.engine.tenant_work``: an idle tenant's guarantee is lent).
Everything runs on one thread (the worker's engine thread).
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Sequence

import torch

from cluster.cache.tiered import TieredCache
from cluster.engine.model_runner import ModelRunner
from cluster.engine.request import EngineRequest, TokenEvent, position_seed
from cluster.engine.sampler import Sampler
from cluster.engine.plan import StepPlan
from cluster.engine.scheduler import Scheduler
from cluster.engine.tenant_work import TenantWork
from cluster.errors import CacheError, InvalidInputError
from cluster.estimators import RecentMedian
from cluster.ownership import ThreadOwner
from cluster.protocol import FinishReason, SamplingParams
from cluster.tokens import as_token_list

__all__ = ["Engine", "EngineRequest", "SamplingParams", "TokenEvent", "position_seed"]

# The default budget: a step computes at most this many tokens (decodes and prefill chunks
# together), so no step keeps running decodes waiting long behind a prompt.
DEFAULT_BATCH_TOKENS = 512
# What a serving worker runs with (``actors.config.WorkerConfig.time_slice_s``): the shortest time
# a decode runs before it may yield its HOT room to a waiting request, and then only where the
# measured gain beats the cost (``cluster.engine.preemption``).
DEFAULT_TIME_SLICE_S = 0.5


class Engine:
    def __init__(self, model: Any, cache: TieredCache, *, max_batch_tokens: int = DEFAULT_BATCH_TOKENS,
                 max_running: int = 64, keep_logits: bool = False, cache_final_token: bool = True,
                 decode_kernel: bool = True, cuda_graphs: bool = True, grammars: Any = None,
                 clock=time.perf_counter):
        """``max_batch_tokens``: the tokens one step computes at most. ``cache_final_token``:
        when a request ends, also compute the KV of its last sampled token (one more forward,
        alone, per finished request) so the next turn finds the whole sequence cached; workers
        turn it off (``WorkerConfig.cache_final_token``), as vLLM and SGLang do.
        ``decode_kernel``, ``cuda_graphs``: see ``ModelRunner``. ``grammars``: the tokenizer's
        ``cluster.engine.grammar.Grammars`` (None: constrained requests are refused)."""
        cfg = model.config
        lay = cache.layout
        if lay is None or (lay.num_layers, lay.num_kv_heads, lay.head_dim) != (
                cfg.num_layers, cfg.num_kv_heads, cfg.head_dim):
            raise InvalidInputError("the cache's KV layout does not match the model's")
        if max_batch_tokens < 1 or max_running < 1:
            raise InvalidInputError("max_batch_tokens and max_running must be >= 1")
        self.model = model
        self.cache = cache
        self.keep_logits = keep_logits
        self.owner: ThreadOwner | None = None   # the worker's engine thread, when ownership checks are on
        self._prefill_samples = RecentMedian()   # seconds per prompt token of recent prefill steps
        self.stats: dict = {"steps": 0, "step_ms": 0.0, "forward_ms": 0.0, "decode_steps": 0,
                            "decode_step_ms": 0.0, "decode_rows": 0}
        self.runner = ModelRunner(model, cache.hot, decode_kernel=decode_kernel, cuda_graphs=cuda_graphs)
        self.sampler = Sampler(grammars, cache.config.block_tokens, keep_logits)
        self.scheduler = Scheduler(cache, self.stats, max_batch_tokens=max_batch_tokens, max_running=max_running,
                                   cache_final_token=cache_final_token, final_token=self.runner.final_token,
                                   prompt_logprob_cache=self.sampler.prompt_logprob_cache,
                                   keep_logits=keep_logits, clock=clock)
        self.grammars = grammars
        self.tenant_work = TenantWork(cache)   # who has work, for the tenant quotas' guarantees
        self._ids = itertools.count(1)
        # What one request may hold alone: HOT, less a block of slack for a copy-on-write tail.
        self.max_request_tokens = cache.request_room_tokens()

    # ------------------------------------------------------------------ the parts' settings
    @property
    def clock(self):
        return self.scheduler.clock

    @clock.setter
    def clock(self, value) -> None:
        self.scheduler.clock = value

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def running(self) -> list[EngineRequest]:
        return self.scheduler.running

    @property
    def time_slice_s(self) -> float | None:
        return self.scheduler.time_slice_s

    @time_slice_s.setter
    def time_slice_s(self, value: float | None) -> None:
        self.scheduler.time_slice_s = value

    @property
    def shared_fills(self) -> bool:
        return self.scheduler.shared_fills

    @shared_fills.setter
    def shared_fills(self, value: bool) -> None:
        self.scheduler.shared_fills = value

    @property
    def prefill_tokens_per_s(self) -> float | None:
        """The prefill rate measured on this engine's prompt-heavy steps (None: none yet)."""
        per_token = self.scheduler.prefill_s_per_token
        return 1.0 / per_token if per_token else None

    @property
    def blocked_for_room(self) -> bool:
        """A waiting request found no HOT room for its admission (its prefix's promotion or its
        own KV) on its last look and still waits."""
        blocked = self.scheduler.blocked
        return blocked is not None and not blocked.finished

    @property
    def decode_kernel(self) -> bool:
        return self.runner.decode_kernel

    @property
    def cuda_graphs(self) -> bool:
        return self.runner.cuda_graphs

    @property
    def linear_layouts(self) -> dict:
        return self.runner.linear_layouts

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
        room = self.cache.hot_room_for(request.namespace) - self.cache.config.block_tokens
        if need + 1 > room:   # the tenant's HOT cap (tenant quotas: the others' guarantees are lent to it)
            raise InvalidInputError(
                f"prompt ({len(request.prompt)} tokens) + max_tokens ({request.params.max_tokens}) needs more KV "
                f"than its tenant's HOT cap (tenant_quotas hot.cap) lets it hold ({room - 1} tokens); "
                f"shorten the prompt or lower max_tokens")
        spec = request.params.grammar
        if spec is not None:
            if self.grammars is None:
                raise InvalidInputError("structured output is not available on this worker (pip install llguidance)")
            prior = request.params.prior_output
            request.matcher = self.grammars.matcher(spec, request.prompt[len(request.prompt) - prior:] if prior
                                                    else ())
        request.request_id = request.request_id or next(self._ids)
        request.submitted_at = self.clock()
        request.touched_at = self.cache.touch(request.prompt, request.namespace)   # no prefetch pushes it out
        if request.params.seed is not None and not request.params.greedy:
            request.generator = torch.Generator()
        self.scheduler.waiting.append(request)
        return request

    def cancel(self, request: EngineRequest, reason: FinishReason = FinishReason.CANCELLED) -> None:
        if self.owner is not None:
            self.owner.check("Engine.cancel")
        self.scheduler.cancel(request, FinishReason(reason))

    def has_work(self) -> bool:
        s = self.scheduler
        return bool(s.waiting or s.running or s.ended or s.finishing)

    def generate(self, prompt: Sequence[int], params: SamplingParams | None = None, **kw) -> EngineRequest:
        """Run one request to completion (convenience for tests and tools)."""
        req = self.submit(EngineRequest(list(prompt), params or SamplingParams(), **kw))
        while not req.finished:
            self.step()
        self.complete_finished()
        if req.error:
            raise CacheError(req.error)
        return req

    def step(self, defer_finish: bool = False) -> list[TokenEvent]:
        """One iteration: plan the batch under the budget, run one forward, sample, apply.

        A request that ends on the token it just sampled is finished (its KV
        cached, its prefix unlocked) before ``step`` returns; with
        ``defer_finish`` that work waits for ``complete_finished``, so the
        caller can deliver the last token first. The next step does it first
        in any case."""
        if self.owner is not None:
            self.owner.check("Engine.step")
        self.complete_finished()
        self.cache.poll()
        s = self.scheduler
        self.tenant_work.before_step(s.running, s.waiting)
        plan = s.schedule()
        self.tenant_work.after_step(len(plan.items), s.running, s.waiting)
        events = self.scheduler.take_ended()
        if not plan.items:
            return events
        forward_at = self.clock()
        self.scheduler.slicer.steps.forward(forward_at)   # the step time time slicing weighs
        for item in plan.items:
            if item.request.forward_at is None:
                item.request.forward_at = forward_at
        began = time.perf_counter()   # wall time, whatever ``clock`` is: what a step really costs
        try:
            logits = self.runner.run(plan)
        except Exception as exc:  # a failed step fails its requests, never the cache
            self.scheduler.fail_plan(plan, f"model forward failed: {exc}")
            return events + self.scheduler.take_ended()
        forward_ms = (time.perf_counter() - began) * 1e3
        decodes_only = plan.decodes_only   # before the update appends the step's tokens
        self.scheduler.update(plan, self.sampler.sample(plan, logits), events)
        if not defer_finish:
            self.complete_finished()
        self._measured(plan, decodes_only, forward_ms, (time.perf_counter() - began) * 1e3)
        return events + self.scheduler.take_ended()

    def complete_finished(self) -> None:
        """Cache the KV of the requests that ended on their last token and unlock
        their prefixes (``step(defer_finish=True)`` leaves this to the caller)."""
        self.scheduler.complete_finished()

    def fail_all(self, error: str) -> None:
        """End every queued and running request with ``error`` (the cache's contents stay)."""
        self.scheduler.fail_all(error)

    def drain_ended(self) -> list[TokenEvent]:
        return self.scheduler.take_ended()

    def _measured(self, plan: StepPlan, decodes_only: bool, forward_ms: float, step_ms: float) -> None:
        """The step's times, and the prefill rate a promotion's copy time is weighed against."""
        stats = self.stats
        stats["steps"] += 1
        stats["forward_ms"] += forward_ms
        stats["step_ms"] += step_ms
        if decodes_only:
            stats["decode_steps"] += 1
            stats["decode_step_ms"] += step_ms
            stats["decode_rows"] += len(plan.items)
        computed = sum(item.num_tokens for item in plan.items)
        if computed - len(plan.items) >= 64:   # mostly prompt tokens: a prefill's rate (the recent median)
            self.scheduler.prefill_s_per_token = self._prefill_samples.add(forward_ms / 1e3 / computed)
