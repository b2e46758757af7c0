"""Route a request through the directory and stream it, retrying on a dead worker.

``stream_with_retry`` is the one route-and-retry path: it asks a
``DirectoryLink`` for a decision, opens the stream on the chosen worker, and
when that worker dies mid-request, reports it, excludes it and goes on from
another worker without repeating the items already delivered (greedy decoding
gives the same prefix again; sampled requests carry a seed for the same
reason). It takes the way to open a stream as a function, so any transport
can use it.

``ClusterClient`` is that path over the worker shell run as named Ray actors
(``actors.worker.start_worker``: tests and drills). The Serve ingress does not use it: its requests reach a
replica through Serve's handle and ``serve_app.router.DirectoryRouter``, which
asks the directory through the same ``DirectoryLink``.
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Callable, NamedTuple

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from actors.directory_link import DirectoryLink
from actors.engine_loop import EngineWedgedError
from cluster.names import DIRECTORY_NAME, worker_actor_name
from cluster.protocol import GenerateRequest, RouteDecision, SamplingParams, StreamItem, Tenant

log = logging.getLogger(__name__)

# A worker that died, or whose watchdog declared its engine wedged (it failed the
# request; the worker is dropped from the directory and must not be asked again).
WORKER_DIED = (ActorDiedError, ActorUnavailableError, RayActorError, EngineWedgedError)


class NoWorkerError(RuntimeError):
    """No live worker could serve the request."""


class Attempted(NamedTuple):
    """One item of a routed stream and the attempt (0: the first worker) that produced it."""

    item: StreamItem
    attempt: int


async def stream_with_retry(directory: DirectoryLink, prompt: list[int], tenant: Tenant | None,
                            open_stream: Callable[[RouteDecision], AsyncIterator[StreamItem]], *,
                            max_attempts: int = 3, first: RouteDecision | None = None,
                            died: tuple[type[BaseException], ...] = WORKER_DIED) -> AsyncIterator[Attempted]:
    """Yield the request's items (each names the worker and reason that produced it), with the attempt."""
    sent = 0
    failed: list[str] = []
    for attempt in range(max_attempts):
        decision = first if (first is not None and attempt == 0) else \
            await directory.route(prompt, tenant, failed)
        seen = 0
        try:
            async for item in open_stream(decision):
                seen += 1
                if seen <= sent and not item.finished:
                    continue  # already delivered before the retry
                sent = max(sent, seen)
                yield Attempted(item, attempt)
                if item.finished:
                    return
            return
        except died as exc:
            log.warning("worker %s failed mid-request (%s); retrying", decision.worker_id, type(exc).__name__)
            failed.append(decision.worker_id)
            await directory.report_failure(decision.worker_id)
    raise NoWorkerError(f"request failed on {max_attempts} workers: {failed}")


class ClusterClient:
    def __init__(self, namespace: str = "prefix-cache", block_tokens: int = 16, max_attempts: int = 3,
                 directory_name: str = DIRECTORY_NAME):
        self.namespace = namespace
        self.block_tokens = block_tokens
        self.max_attempts = max_attempts
        self.directory = DirectoryLink(namespace, name=directory_name, block_tokens=block_tokens)
        self.directory.handle()   # fail now if there is no directory
        self._handles: dict[str, Any] = {}

    def worker(self, worker_id: str):
        h = self._handles.get(worker_id)
        if h is None:
            h = ray.get_actor(worker_actor_name(worker_id), namespace=self.namespace)
            self._handles[worker_id] = h
        return h

    async def route(self, prompt: list[int], tenant: Tenant | None = None,
                    exclude: list[str] | None = None) -> RouteDecision:
        return await self.directory.route(prompt, tenant, exclude)

    async def generate(self, prompt: list[int], params: SamplingParams | None = None, tenant: Tenant | None = None,
                       session_id: str | None = None, worker_id: str | None = None) -> AsyncIterator[Attempted]:
        """Yield ``(item, attempt)`` pairs; each item names the worker and routing
        reason that served it; ``worker_id`` pins the first attempt."""

        async def open_stream(decision: RouteDecision):
            try:
                request = GenerateRequest(prompt, params or SamplingParams(), tenant, session_id, decision)
                stream = self.worker(decision.worker_id).generate.options(num_returns="streaming").remote(request)
                async for ref in stream:
                    yield await ref
            except WORKER_DIED:
                self._handles.pop(decision.worker_id, None)
                raise

        first = RouteDecision.pinned(worker_id) if worker_id is not None else None
        async for pair in stream_with_retry(self.directory, prompt, tenant, open_stream,
                                            max_attempts=self.max_attempts, first=first):
            yield pair

    async def complete(self, prompt: list[int], params: SamplingParams | None = None, **kw) -> Completion:
        """Run to the end; returns the tokens and the final item."""
        tokens, last, attempt = [], None, 0
        async for item, attempt in self.generate(prompt, params, **kw):
            if item.token is not None:
                tokens.append(item.token)
            last = item
        return Completion(tokens, last, attempt)


class Completion(NamedTuple):
    """A whole request as ``ClusterClient.complete`` ran it."""

    tokens: list[int]
    last: StreamItem | None
    attempt: int              # retries it took (0: the first worker served it all)

    @property
    def worker_id(self) -> str | None:
        return self.last.worker_id if self.last else None

    @property
    def reason(self) -> str | None:
        return self.last.reason if self.last else None

    @property
    def cached_tokens(self) -> int:
        return self.last.cached_tokens if self.last else 0

    @property
    def tier_hits(self) -> tuple[int, ...]:
        """Cached tokens by where they came from (``SOURCE_NAMES``: hot, warm, cold, l3)."""
        return self.last.tier_hits if self.last else (0, 0, 0, 0)
