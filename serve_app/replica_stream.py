"""ReplicaStream: one request's generation on the cache replicas, in one object.

It routes (``RoutingClient``: the ingress's copy of the directory's routing
table, else the directory), sends one typed ``GenerateRequest`` per attempt to
the replicas' deployment handle (Serve's ``DirectoryRouter`` carries the
decision out), reads the replica's ``StreamItem``s, counts the request's
metrics, and resumes on another replica when one fails. It holds the request's
choices too (``n``, or ``best_of`` candidates): ``items(i)`` is choice ``i``'s
stream. The response (``serve_app.responses``) is rendered from those items
alone: nothing here calls back into the ingress, and nothing writes into an
item or into a request once sent.

A replica that dies (or whose watchdog trips) mid-request does not end the
request: it is resumed on another replica from the tokens already sent
(prompt + sent tokens, ``max_tokens`` reduced, same seed: sampling is a
function of (seed, position), so the continuation is what the first replica
would have produced), up to ``max_resumes`` times, never on a replica it
already failed on. When it cannot be resumed the caller gets an
``APIError`` (503 with Retry-After), never a bare exception.

The choices are forks of one prefill: they go to one replica together (the
first is routed, the others are pinned to it), where the first computes the
prompt and checkpoints it into the tree and the others find it cached; each
samples with its own seed (choice 0 with the request's, so ``n: 1`` answers as
before).
"""

from __future__ import annotations

import dataclasses
import logging
import struct
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncIterator

import xxhash
from ray.exceptions import RayActorError

from actors.engine_loop import EngineWedgedError, QueueFullError
from cluster.errors import CacheError, InvalidInputError
from cluster.names import SOURCE_NAMES
from cluster.protocol import FinishReason, GenerateRequest, RouteDecision, SamplingParams, StreamItem, Tenant
from serve_app import metrics
from serve_app.errors import APIError
from serve_app.parse import ApiRequest
from serve_app.timing import RequestClock

log = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class ReplicaCalls:
    """How requests reach the replicas: their deployment handle, the router that
    decides for each attempt, how often one request may resume."""

    workers: Any
    router: Any
    max_resumes: int = 2
    retry_after_s: int = 1

    def error_of(self, exc: BaseException) -> APIError:
        """What the client sees for a failure that resuming cannot fix."""
        cause = _root_cause(exc)
        retry = {"Retry-After": str(self.retry_after_s)}
        if isinstance(exc, APIError):
            return exc
        if isinstance(cause, QueueFullError) or type(exc).__name__ == "BackPressureError":
            return APIError(429, "the server is at capacity; retry later", type_="rate_limit_error",
                            code="queue_full", headers=retry)
        if isinstance(cause, InvalidInputError):   # a parameter the worker refused: the client's to fix
            return APIError(400, f"invalid request: {cause}", code="invalid_request")
        if isinstance(cause, CacheError):   # e.g. a prompt the KV cache can never hold
            return APIError(503, f"the request could not be served: {cause}", type_="server_error",
                            code="kv_cache_unavailable", headers=retry)
        log.error("request failed: %s: %s", type(exc).__name__, exc)
        return APIError(503, f"the request failed on the server ({type(cause).__name__}); retry later",
                        type_="server_error", code="server_error", headers=retry)


def choice_seed(seed: int, index: int) -> int:
    """Choice ``index``'s seed: the request's own for the first, a hash of (seed, index) after."""
    if index == 0:
        return seed
    return xxhash.xxh3_64_intdigest(struct.pack("<QQ", seed % (1 << 64), index)) >> 1


def session_key(tenant: Tenant | None, session_id: str | None) -> str | None:
    return None if session_id is None else f"{tenant}:{session_id}"


class ReplicaStream:
    """One request on the replicas: its choices, where they run, their items."""

    def __init__(self, calls: ReplicaCalls, gen: ApiRequest, tenant: Tenant | None, endpoint: str,
                 clock: RequestClock | None = None):
        self.calls, self.gen, self.tenant, self.endpoint, self.clock = calls, gen, tenant, endpoint, clock
        body = gen.body
        self.n = body.n
        self.best_of = body.candidates          # None: the n choices are the answer
        self.count = self.best_of or self.n     # choices run
        self.echo = body.echo
        self.want_logprobs = body.logprobs_k    # what the answer shows (None: no logprobs)
        # best_of ranks by cumulative logprob: ask for the sampled tokens' own at least.
        self.logprobs = 0 if self.best_of and self.want_logprobs is None else self.want_logprobs
        self.prompt_logprobs = self.want_logprobs if self.echo else None
        self.session = session_key(tenant, gen.session_id)
        self._shared_route: RouteDecision | None = None

    async def decide(self) -> None:
        """With several choices, one routing decision for all (they share the prefill)."""
        if self.count > 1:
            self._shared_route = await self._route(self.gen.prompt, [])

    def items(self, index: int = 0, whole: bool = False) -> AsyncIterator[StreamItem]:
        """Choice ``index``'s items. Leaving early (a stop string, a client that went
        away) cancels it on the worker, which caches what it computed and releases
        its locks.

        ``whole``: the caller reads every item before answering (a non-streamed
        request without stop strings), so the replica returns them all from one call
        (``generate_all``) instead of a stream: one message back instead of one per
        token. A failed call then sent nothing, and resuming it starts over on
        another replica (with the same seed: the same answer)."""
        seed = self.gen.seed if self.gen.seed is None else choice_seed(self.gen.seed, index)
        params = dataclasses.replace(self.gen.params, seed=seed, logprobs=self.logprobs,
                                     prompt_logprobs=self.prompt_logprobs if index == 0 else None)
        route = self._shared_route
        if route is not None and index > 0 and route.worker_id is not None:
            route = RouteDecision.pinned(route.worker_id)
        return self._run(params, route, whole, self.clock if index == 0 else None)

    async def _route(self, prompt: list[int], failed_on: list[str]) -> RouteDecision:
        return await self.calls.router.route(prompt, self.tenant, failed_on or None)

    async def _run(self, params: SamplingParams, first_route: RouteDecision | None, whole: bool,
                   clock: RequestClock | None) -> AsyncIterator[StreamItem]:
        """The attempts of one choice: each routed away from the replicas it failed on."""
        prompt = self.gen.prompt
        progress = _Progress(self.endpoint, clock, whole)
        metrics.prompt_tokens.inc(len(prompt))
        failed_on: list[str] = []
        for attempt in range(self.calls.max_resumes + 1):
            sent = progress.sent
            if attempt:
                metrics.resumed_requests.inc()
                log.warning("resuming a request after %d tokens (failed on %s)", len(sent), failed_on or "?")
            if len(sent) >= params.max_tokens:   # everything was sent but the end: end it here
                yield StreamItem(None, True, FinishReason.LENGTH, prompt_tokens=len(prompt))
                return
            routed = time.perf_counter()
            route = first_route if attempt == 0 and first_route is not None else \
                await self._route(prompt + sent, failed_on)
            progress.route, progress.route_s = route, time.perf_counter() - routed
            # A resumed request: what it sent is prompt now, its own tokens for penalties and
            # min_tokens; the prompt's logprobs went with the first item already.
            message = GenerateRequest(prompt + sent, dataclasses.replace(
                params, max_tokens=params.max_tokens - len(sent), prior_output=len(sent),
                prompt_logprobs=params.prompt_logprobs if progress.last is None else None),
                self.tenant, self.session, route, tuple(failed_on))
            failure = None
            async with aclosing(self._attempt(message, whole, progress)) as outcome:   # closed: the call cancelled
                async for item in outcome:
                    if isinstance(item, BaseException):
                        failure = item
                        break
                    yield item
                    if item.finished:
                        return
            if not _resumable(failure):
                raise self.calls.error_of(failure)
            worker = progress.worker or route.worker_id   # failed before its first item: the one chosen
            if worker is not None:
                failed_on.append(worker)
        raise APIError(503, f"the replicas serving this request failed ({len(failed_on)} tried) and it could "
                            f"not be resumed; retry later", type_="server_error", code="replica_failed",
                       headers={"Retry-After": str(self.calls.retry_after_s)})

    async def _attempt(self, message: GenerateRequest, whole: bool, progress: "_Progress") -> AsyncIterator[Any]:
        """One call's items, then the failure that ended it early (the call is then cancelled)."""
        if self.count > 1 or self.gen.batched:
            _own_request_id()
        if whole:
            call = self.calls.workers.generate_all.remote(message)
            items = _items_of(call)
        else:
            call = items = self.calls.workers.options(stream=True).generate.remote(message)
        progress.begin()
        finished = False
        try:
            async for item in items:
                progress.observe(item)
                finished = item.finished
                yield item
                if finished:
                    return
            failure: BaseException = ConnectionError("the replica's stream ended without its last item")
        except Exception as exc:
            failure = exc
        finally:
            if not finished:   # stop string, client gone, or an error: stop generating
                call.cancel()
        yield failure


class _Progress:
    """What one choice has received so far, across attempts, and its metrics."""

    __slots__ = ("endpoint", "clock", "whole", "start", "last", "sent", "worker", "route", "route_s", "call_wall")

    def __init__(self, endpoint: str, clock: RequestClock | None, whole: bool):
        self.endpoint, self.clock, self.whole = endpoint, clock, whole
        self.start = time.perf_counter()
        self.last: float | None = None
        self.sent: list[int] = []
        self.worker: str | None = None
        self.route: RouteDecision | None = None
        self.route_s = 0.0
        self.call_wall = 0.0

    def begin(self) -> None:
        self.worker, self.call_wall = None, time.time()

    def observe(self, item: StreamItem) -> None:
        now = time.perf_counter()
        self.worker = item.worker_id
        if self.last is None:
            if self.clock is not None:
                self.clock.mark_first(self.call_wall, self.route_s, item.timing, self.route)
            metrics.ttft.observe(now - self.start, tags={"endpoint": self.endpoint})
            for tier, n in zip(SOURCE_NAMES, item.tier_hits):
                if n:
                    metrics.cached_tokens.inc(n, tags={"tier": tier})
        elif not self.whole:
            metrics.inter_token.observe(now - self.last, tags={"endpoint": self.endpoint})
        self.last = now
        if item.token is not None:
            self.sent.append(item.token)


def _own_request_id() -> None:
    """Give the next replica call an internal request id of its own. Serve's router
    keeps pending calls by the id of the HTTP request they serve (a context variable),
    so concurrent calls for one request (the choices of ``n``) would be taken for one
    and wait forever; ids are only for tracking, so each choice may have its own (a
    uuid, as Serve makes them)."""
    from ray.serve.context import _set_request_context

    _set_request_context(_internal_request_id=str(uuid.uuid4()))


async def _items_of(call) -> AsyncIterator[StreamItem]:
    """The items of a ``generate_all`` call, as the stream would give them."""
    for item in await call:
        yield item


def _resumable(exc: BaseException) -> bool:
    """A failure of the replica, not of the request: another replica can go on."""
    cause = _root_cause(exc)
    return isinstance(cause, (RayActorError, EngineWedgedError, ConnectionError)) or isinstance(exc, RayActorError)


def _root_cause(exc: BaseException) -> BaseException:
    cause = getattr(exc, "cause", None) or exc.__cause__
    return _root_cause(cause) if cause is not None and cause is not exc else exc
