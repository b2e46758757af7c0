"""The engine: a step in three roles over the tiered radix cache.

::

    plan = scheduler.schedule()              # queues and leases -> what this step computes
    output = runner.execute(plan)            # one packed forward, KV in place in HOT
    scheduler.update(plan, output, sampler.sample(plan, output))

``Scheduler`` (``cluster.engine.scheduler``) owns the waiting and running
queues and every request's lease: continuous batching under a token budget
that never fails for lack of KV (room reserved before the forward,
preemption into the cache, time slicing, shared fills), its choices made by
a scheduling policy (``cluster.engine.policies``: fcfs, the tenants' fair
share, priority), its settings a ``SchedulerConfig``. ``ModelRunner``
(``cluster.engine.model_runner``) runs the forward over the leases' slot
tables, and a finished request's last token (``cache_final_token``).
``Sampler`` (``cluster.engine.sampler``) turns logits into tokens. The plan
types they pass are in ``cluster.engine.plan``. ``Engine`` wires them and
validates what is submitted. Everything runs on one thread (the worker's
engine thread).
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
from cluster.engine.scheduler import Scheduler
from cluster.engine.scheduler_config import DEFAULT_BATCH_TOKENS, DEFAULT_TIME_SLICE_S, SchedulerConfig
from cluster.errors import CacheError, InvalidInputError
from cluster.ownership import ThreadOwner
from cluster.protocol import FinishReason, SamplingParams
from cluster.tokens import as_token_list

__all__ = ["DEFAULT_BATCH_TOKENS", "DEFAULT_TIME_SLICE_S", "Engine", "EngineRequest", "SamplingParams",
           "SchedulerConfig", "TokenEvent", "position_seed"]


class Engine:
    def __init__(self, model: Any, cache: TieredCache, config: SchedulerConfig | None = None, *,
                 decode_kernel: bool = True, cuda_graphs: bool = True, grammars: Any = None,
                 clock=time.perf_counter, **settings):
        """``config``: the scheduler's settings (``SchedulerConfig``), or its fields as keywords
        (``settings``: ``Engine(model, cache, max_batch_tokens=64)``). ``decode_kernel``,
        ``cuda_graphs``: see ``ModelRunner``. ``grammars``: the tokenizer's
        ``cluster.engine.grammar.Grammars`` (None: constrained requests are refused). ``clock``:
        the engine's clock (its timestamps, the scheduler's slices), read at each use."""
        if config is not None and settings:
            raise InvalidInputError("pass either a SchedulerConfig or its fields, not both")
        config = config if config is not None else SchedulerConfig(**settings)
        cfg = model.config
        lay = cache.layout
        if lay is None or (lay.num_layers, lay.num_kv_heads, lay.head_dim) != (
                cfg.num_layers, cfg.num_kv_heads, cfg.head_dim):
            raise InvalidInputError("the cache's KV layout does not match the model's")
        self.model = model
        self.cache = cache
        self.clock = clock
        self.owner: ThreadOwner | None = None   # the worker's engine thread, when ownership checks are on
        self.stats: dict = {}
        self.runner = ModelRunner(model, cache.hot, decode_kernel=decode_kernel, cuda_graphs=cuda_graphs)
        self.sampler = Sampler(grammars, cache.config.block_tokens, config.keep_logits)
        self.scheduler = Scheduler(cache, self.stats, config, clock=lambda: self.clock())
        self.grammars = grammars
        self._ids = itertools.count(1)
        # What one request may hold alone: HOT, less a block of slack for a copy-on-write tail.
        self.max_request_tokens = cache.request_room_tokens()

    # ------------------------------------------------------------------ what it measured
    @property
    def prefill_tokens_per_s(self) -> float | None:
        """The prefill rate measured on this engine's prompt-heavy steps (None: none yet)."""
        return self.scheduler.measures.prefill_tokens_per_s

    @property
    def blocked_for_room(self) -> bool:
        """A waiting request found no HOT room for its admission (its prefix's promotion or its
        own KV) on its last look and still waits."""
        blocked = self.scheduler.blocked
        return blocked is not None and not blocked.finished

    # ------------------------------------------------------------------ what the runner runs
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
    def _owned(self, what: str) -> None:
        if self.owner is not None:   # the worker's engine thread, when ownership checks are on
            self.owner.check(what)

    def submit(self, request: EngineRequest) -> EngineRequest:
        self._owned("Engine.submit")
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
        self.sampler.prepare(request)
        self.scheduler.add(request)
        return request

    def cancel(self, request: EngineRequest, reason: FinishReason = FinishReason.CANCELLED) -> None:
        self._owned("Engine.cancel")
        self.scheduler.cancel(request, FinishReason(reason))
        self.complete_finished()   # a running request's KV into the cache now, its prefix unlocked

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def new_fill_waiting(self) -> bool:
        """Whether a waiting request's prompt is mostly beyond the cache: a fill that requests
        following it closely may share (a burst behind one new system prompt or document). A
        prompt mostly cached (a session's next turn) computes only its own tail, which nothing
        shares: waiting for followers gains nothing and delays its first token."""
        self._owned("Engine.new_fill_waiting")
        for req in self.scheduler.waiting:
            cached = sum(self.cache.tree.peek(req.tokens, req.namespace, validate=False)[1])   # touches nothing
            if 2 * cached < len(req.tokens):
                return True
        return False

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
        """One iteration: schedule -> run -> update (``defer_finish``: see ``complete_finished``)."""
        self._owned("Engine.step")
        self.complete_finished()
        plan = self.scheduler.schedule()
        if plan.items:
            output = self.runner.execute(plan)
            self.scheduler.update(plan, output, self.sampler.sample(plan, output))
        if not defer_finish:
            self.complete_finished()
        return self.scheduler.take_events()

    def complete_finished(self) -> None:
        """Cache the KV of the requests that ended on their last token (with
        ``cache_final_token``, the runner computes that token's KV first) and unlock their
        prefixes. ``step`` does it before it returns, and ``step(defer_finish=True)`` leaves it
        to the caller (which delivers the last token first); the next step does it first in
        any case."""
        plan = self.scheduler.final_token_plan()
        self.scheduler.complete_finished(self.runner.final_tokens(plan) if plan.items else frozenset())

    def fail_all(self, error: str) -> None:
        """End every queued and running request with ``error`` (the cache's contents stay)."""
        self.scheduler.fail_all(error)

    def drain_ended(self) -> list[TokenEvent]:
        return self.scheduler.take_events()
