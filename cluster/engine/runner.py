"""Model runner on the tiered radix cache, with continuous batching.

Per request: match the prompt's prefix (promoting WARM/COLD parts to HOT) and
lock it, compute only the uncached suffix reading the cached KV from the pool,
write the new KV into the request's own extents, decode (appending, with
copy-on-write when the tail extent shares a block), and at the end insert the
whole sequence into the tree and release the lock, also on failure or cancel.

Each ``step`` runs one batch under a token budget: decodes of every running
request plus as many waiting prefills as fit (a prompt longer than the budget
runs alone). The model sees one packed forward per step.
"""

from __future__ import annotations

import inspect
import itertools
import struct
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import torch
import xxhash

from cluster.cache.lease import KVLease
from cluster.cache.tiered import TieredCache
from cluster.engine.model import sample
from cluster.engine.scratch import ScratchKV
from cluster.errors import CacheError, InvalidInputError, PoolExhaustedError
from cluster.ownership import ThreadOwner
from cluster.protocol import FinishReason, SamplingParams

__all__ = ["Engine", "EngineRequest", "SamplingParams", "TokenEvent", "position_seed"]
from cluster.tokens import as_token_list

log = logging.getLogger(__name__)


@dataclass
class EngineRequest:
    """One request inside the engine: its tokens, its lease on the KV cache,
    its working KV buffer and its timestamps."""

    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    namespace: Hashable = None
    session_id: Any = None
    request_id: int = 0
    # Filled in by the engine.
    output: list[int] = field(default_factory=list)
    cached_tokens: int = 0          # prompt tokens served from the cache
    tier_hits: list[int] = field(default_factory=lambda: [0, 0, 0])
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    submitted_at: float = 0.0
    # Where its time to first token went, on the engine's clock: the step that
    # admitted it began matching its prefix (admit), had it in the batch with its
    # cached KV read (admitted), started the forward (forward), sampled its token.
    scheduled_at: float | None = None
    admitted_at: float | None = None
    forward_at: float | None = None
    first_token_at: float | None = None
    logits: list[torch.Tensor] = field(default_factory=list)   # kept when keep_logits
    # Private state.
    _lease: KVLease | None = None    # its hold on the cache: prefix locked, its own KV
    _kv: torch.Tensor | None = None  # working copy [L, 2, capacity, H, D]
    _len: int = 0                    # tokens whose KV is computed
    _generator: torch.Generator | None = None   # reseeded per position (see position_seed)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclass(slots=True)
class TokenEvent:
    request: EngineRequest
    token: int | None      # None: the request ended without a new token (error, cancel)
    finished: bool


class Engine:
    def __init__(self, model: Any, cache: TieredCache, *, max_batch_tokens: int = 4096, max_running: int = 64,
                 keep_logits: bool = False, cache_final_token: bool = True, clock=time.perf_counter):
        """``cache_final_token``: when a request ends, also compute the KV of its last
        sampled token (one more forward, alone, per finished request) so the next
        turn finds the whole sequence cached. Workers turn it off
        (``WorkerConfig.cache_final_token``), as vLLM and SGLang do: the next turn
        computes that one token inside its own prefill for nothing extra, while a
        lone forward per finished request costs a full pass over the weights
        (66 ms of a 135M model on one CPU thread) and delays whatever arrives
        meanwhile. On here, for tools and the exactness tests of that path."""
        cfg = model.config
        lay = cache.layout
        if lay is None or (lay.num_layers, lay.num_kv_heads, lay.head_dim) != (
                cfg.num_layers, cfg.num_kv_heads, cfg.head_dim):
            raise InvalidInputError("the cache's KV layout does not match the model's")
        if max_batch_tokens < 1 or max_running < 1:
            raise InvalidInputError("max_batch_tokens and max_running must be >= 1")
        self.model = model
        self.cache = cache
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.keep_logits = keep_logits
        self.cache_final_token = cache_final_token
        self.clock = clock
        self.waiting: deque[EngineRequest] = deque()
        self._ended: list[TokenEvent] = []   # requests that ended outside a sampled token
        self._finishing: list[tuple[EngineRequest, FinishReason]] = []   # ended by a token, not yet cached (defer_finish)
        self.running: list[EngineRequest] = []
        self._ids = itertools.count(1)
        self.owner: ThreadOwner | None = None   # the worker's engine thread, when ownership checks are on
        self._last_logits_only = "last_logits_only" in inspect.signature(model.forward_batch).parameters
        # Working KV buffers, reused: a fresh one would page-fault its way in on every request.
        self.scratch = ScratchKV(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cache.kv_dtype, cache.kv_device,
                                 max_idle_bytes=2 * max_batch_tokens * lay.bytes_per_token())
        self.stats = {"prompt_tokens": 0, "cached_tokens": 0, "computed_tokens": 0, "steps": 0,
                      "requests_finished": 0, "requests_failed": 0, "requests_cancelled": 0,
                      "finish_failures": 0}

    # ------------------------------------------------------------------ API
    def submit(self, request: EngineRequest) -> EngineRequest:
        if self.owner is not None:
            self.owner.check("Engine.submit")
        request.prompt = as_token_list(request.prompt, self.model.config.vocab_size)
        limit = self.model.config.max_position
        if len(request.prompt) + request.params.max_tokens > limit:
            raise InvalidInputError(
                f"prompt ({len(request.prompt)} tokens) + max_tokens ({request.params.max_tokens}) "
                f"exceeds the model's context of {limit}")
        request.request_id = request.request_id or next(self._ids)
        request.submitted_at = self.clock()
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
            self._give_scratch(request)
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
        """One scheduler iteration: admit prefills, run one batch, sample.

        A request that ends on the token it just sampled is finished (its KV
        cached, its prefix unlocked) before ``step`` returns; with
        ``defer_finish`` that work waits for ``complete_finished``, so the
        caller can deliver the last token first: the client does not wait
        for the final token's KV and the tree insert. The next step does it
        first in any case."""
        if self.owner is not None:
            self.owner.check("Engine.step")
        self.complete_finished()
        self.cache.poll()
        batch: list[tuple[EngineRequest, torch.Tensor, int]] = []   # (request, new tokens, start position)
        budget = self.max_batch_tokens
        for req in self.running:
            batch.append((req, torch.tensor(req.tokens[-1:]), req._len))
            budget -= 1
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            req.scheduled_at = self.clock()
            suffix = self._admit(req, check_room=bool(batch))
            if suffix is None:
                if req.finished:   # the cache refused its prompt
                    self.waiting.popleft()
                    continue
                break              # no room yet: it waits for running requests to finish
            if batch and suffix > budget:
                self._release_lease(req)   # try again next step, with a fresh match
                break
            self.waiting.popleft()
            self.running.append(req)
            req.admitted_at = self.clock()
            self.stats["prompt_tokens"] += len(req.prompt)
            self.stats["cached_tokens"] += req.cached_tokens
            batch.append((req, torch.tensor(req.prompt[req._len:]), req._len))
            budget -= suffix
        events, self._ended = self._ended, []
        if not batch:
            return events
        items = [(toks, start, req._kv[:, :, :start] if start else None) for req, toks, start in batch]
        forward_at = self.clock()
        for req, _, _ in batch:
            if req.forward_at is None:
                req.forward_at = forward_at
        try:
            outputs = (self.model.forward_batch(items) if self.keep_logits or not self._last_logits_only
                       else self.model.forward_batch(items, last_logits_only=True))
        except Exception as exc:  # a failed step fails its requests, never the cache
            for req, _, _ in batch:
                self._finish(req, FinishReason.ERROR, keep=False, error=f"model forward failed: {exc}")
            return events + self.drain_ended()
        self.stats["steps"] += 1
        for (req, toks, start), (logits, new_kv) in zip(batch, outputs):
            try:
                token = self._advance(req, toks, start, logits, new_kv)
            except PoolExhaustedError as exc:
                self._finish(req, FinishReason.ERROR, keep=False, error=f"KV cache full: {exc}")
                continue
            except Exception as exc:  # this request fails; the batch, the engine and the cache go on
                self._finish(req, FinishReason.ERROR, keep=False, error=f"{type(exc).__name__}: {exc}")
                continue
            if req.first_token_at is None:
                req.first_token_at = self.clock()
            reason = None
            if token in req.params.stop_token_ids:
                reason = FinishReason.STOP
            elif len(req.output) >= req.params.max_tokens:
                reason = FinishReason.LENGTH
            if reason:
                req.finished, req.finish_reason = True, reason
                self.running.remove(req)
                self._finishing.append((req, reason))
            events.append(TokenEvent(req, token, req.finished))
        if not defer_finish:
            self.complete_finished()
        return events + self.drain_ended()

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

    def _advance(self, req: EngineRequest, toks: torch.Tensor, start: int, logits: torch.Tensor,
                 new_kv: torch.Tensor) -> int:
        """Store one request's new KV and sample its next token."""
        self._store_kv(req, start, new_kv)
        self.stats["computed_tokens"] += len(toks)
        if self.keep_logits:
            req.logits.append(logits)
        temperature = 0.0 if req.params.greedy else req.params.temperature
        generator = req._generator
        if generator is not None:   # the token at position p depends on (seed, p) only
            generator.manual_seed(position_seed(req.params.seed, len(req.tokens)))
        token = sample(logits[-1], temperature, req.params.top_p, generator)
        req.output.append(token)
        return token

    def fail_all(self, error: str) -> None:
        """End every queued and running request with ``error`` (their KV is not
        kept; the cache's other contents are untouched)."""
        for req in list(self.waiting):
            self.waiting.remove(req)
            self._give_scratch(req)
            req.finished, req.finish_reason, req.error = True, FinishReason.ERROR, error
            self._ended.append(TokenEvent(req, None, True))
            self.stats["requests_failed"] += 1
        for req in list(self.running):
            self._finish(req, FinishReason.ERROR, keep=False, error=error)

    def drain_ended(self) -> list[TokenEvent]:
        out, self._ended = self._ended, []
        return out

    # -------------------------------------------------------------- internals
    def _admit(self, req: EngineRequest, *, check_room: bool) -> int | None:
        """Lease the prompt's cached prefix and read it into the working buffer;
        returns the suffix length to compute, or None when it cannot run now
        (no room: it waits; or the cache refused the prompt: it ended).

        Admission control (``check_room``): the HOT pool must be able to take
        this request's new KV (its prompt suffix and every token it may
        decode, plus what the running requests may still decode) once
        unlocked prefixes are evicted or demoted; otherwise it waits for
        running requests to finish rather than failing midway."""
        reserved = sum(r.params.max_tokens - len(r.output) for r in self.running)
        try:
            lease = self.cache.admit(req.prompt, req.namespace, validate=False,
                                     room_for=req.params.max_tokens + reserved if check_room else 0)
        except CacheError as exc:
            req.finished, req.finish_reason, req.error = True, FinishReason.ERROR, str(exc)
            self._ended.append(TokenEvent(req, None, True))
            return None
        if lease is None:
            return None
        req._lease = lease
        req.cached_tokens = lease.cached_tokens
        req.tier_hits = list(lease.tier_hits)
        cap = len(req.prompt) + req.params.max_tokens + 1
        self._give_scratch(req)   # admitted before, but it did not fit that step
        req._kv = self.scratch.take(cap)
        lease.read_prefix_into(req._kv[:, :, :lease.cached_tokens])
        req._len = lease.cached_tokens
        return len(req.prompt) - lease.cached_tokens

    def _store_kv(self, req: EngineRequest, start: int, new_kv: torch.Tensor) -> None:
        n = new_kv.shape[2]
        req._kv[:, :, start:start + n] = new_kv
        req._lease.append(new_kv)   # copy-on-write inside when its tail block is shared
        req._len = start + n

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
        try:
            if keep and self.cache_final_token and req.output and req._len < len(req.tokens):
                # Compute the last sampled token's KV too, so the whole sequence
                # (prompt and output) is cached for the next turn.
                start = req._len
                _, kv = self.model.forward_one(torch.tensor(req.tokens[start:]), start, req._kv[:, :, :start])
                self._store_kv(req, start, kv)
            if keep and req._lease is not None and req._lease.length > req._lease.cached_tokens:
                req._lease.commit(req.tokens[:req._len], req.session_id)
        finally:
            self._release_lease(req)
            self._give_scratch(req)
            self.stats["requests_finished" if error is None else "requests_failed"] += 1

    def _give_scratch(self, req: EngineRequest) -> None:
        if req._kv is not None:
            self.scratch.give(req._kv)
            req._kv = None

    def _release_lease(self, req: EngineRequest) -> None:
        if req._lease is not None:
            req._lease.release()   # nothing left to free after a commit: it only ends the lease
            req._lease = None


def position_seed(seed: int, position: int) -> int:
    """The sampling seed of the token at ``position`` of a sequence (prompt included).

    A function of (seed, position) only, not of how many tokens this engine
    sampled before: a request resumed elsewhere with the tokens already sent
    appended to its prompt samples exactly the tokens the first run would have.
    """
    return xxhash.xxh3_64_intdigest(struct.pack("<QQ", seed % (1 << 64), position))
