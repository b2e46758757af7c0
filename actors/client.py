"""ClusterClient: route a request through the directory and stream it from a worker.

Used by the Serve ingress and by tests. A worker that dies mid-request is
reported to the directory and the request is retried on another worker; the
tokens the caller already received are not sent twice (greedy decoding gives
the same prefix again; sampled requests carry a seed for the same reason).
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from actors.naming import DIRECTORY_NAME, worker_actor_name
from cluster.hashing import block_hashes

log = logging.getLogger(__name__)


class NoWorkerError(RuntimeError):
    """No live worker could serve the request."""


class ClusterClient:
    def __init__(self, namespace: str = "prefix-cache", block_tokens: int = 16, max_attempts: int = 3,
                 directory_name: str = DIRECTORY_NAME):
        self.namespace = namespace
        self.block_tokens = block_tokens
        self.max_attempts = max_attempts
        self.directory = ray.get_actor(directory_name, namespace=namespace)
        self._handles: dict[str, Any] = {}

    def worker(self, worker_id: str):
        h = self._handles.get(worker_id)
        if h is None:
            h = ray.get_actor(worker_actor_name(worker_id), namespace=self.namespace)
            self._handles[worker_id] = h
        return h

    async def route(self, prompt: list[int], tenant: Any = None, exclude: list[str] | None = None) -> dict:
        hashes = block_hashes(prompt, self.block_tokens, tenant)
        return await self.directory.route.remote(hashes, len(prompt), exclude)

    async def generate(self, prompt: list[int], params: dict | None = None, tenant: Any = None,
                       session_id: Any = None, worker_id: str | None = None) -> AsyncIterator[dict]:
        """Yield result dicts (token, finished, cached_tokens, ...), each with the
        ``worker_id`` and routing ``reason`` that served it."""
        sent = 0
        failed: list[str] = []
        for attempt in range(self.max_attempts):
            if worker_id is not None and attempt == 0:
                decision = {"worker_id": worker_id, "reason": "pinned", "migrate_from": None}
            else:
                decision = await self.route(prompt, tenant, failed)
            wid = decision["worker_id"]
            seen = 0
            try:
                stream = self.worker(wid).generate.options(num_returns="streaming").remote(
                    prompt, params, tenant, session_id, decision.get("migrate_from"))
                async for ref in stream:
                    item = await ref
                    seen += 1
                    if seen <= sent and not item["finished"]:
                        continue  # already delivered before the retry
                    sent = max(sent, seen)
                    item["worker_id"], item["reason"], item["attempt"] = wid, decision["reason"], attempt
                    yield item
                    if item["finished"]:
                        return
                return
            except (ActorDiedError, ActorUnavailableError, RayActorError) as exc:
                log.warning("worker %s failed mid-request (%s); retrying", wid, type(exc).__name__)
                failed.append(wid)
                self._handles.pop(wid, None)
                try:
                    await self.directory.report_failure.remote(wid)
                except Exception:
                    pass
        raise NoWorkerError(f"request failed on {self.max_attempts} workers: {failed}")

    async def complete(self, prompt: list[int], params: dict | None = None, **kw) -> dict:
        """Run to the end; returns tokens and the final item's metadata."""
        tokens, last = [], None
        async for item in self.generate(prompt, params, **kw):
            if item["token"] is not None:
                tokens.append(item["token"])
            last = item
        return {**(last or {}), "tokens": tokens}
