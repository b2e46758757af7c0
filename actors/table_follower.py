"""TableFollower: a copy of the directory's routing table in the ingress's own process.

A background task long-polls the directory (``DirectoryImpl.subscribe``)
and applies each answer to a ``TableReplica``, so a routing decision is a
local ``choose`` on that copy: no remote call on the request path. Events
reach the copy one long-poll answer after they reach the directory (the
directory answers as soon as something changed; ``min_interval_s`` spaces
the polls so a busy cluster costs the router a bounded number of calls a
second).

Every poll has a timeout (``wait_s`` + ``call_timeout_s``). While the
directory does not answer, or answered last more than ``max_age_s`` ago,
``route`` returns None and the caller asks the directory itself (which has
its own timeout and fallback): a stale copy never decides.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from actors.directory_link import DirectoryLink
from cluster.hashing import block_hashes
from cluster.protocol import RouteDecision, Tenant
from cluster.routing.policies import NoLiveWorkerError
from cluster.routing.table import TableReplica

log = logging.getLogger(__name__)


class TableFollower:
    def __init__(self, link: DirectoryLink, *, wait_s: float = 2.0, call_timeout_s: float = 2.0,
                 max_age_s: float = 5.0, min_interval_s: float = 0.005, retry_s: float = 0.25):
        self.link = link
        self.wait_s, self.call_timeout_s = wait_s, call_timeout_s
        self.min_interval_s, self.retry_s = min_interval_s, retry_s
        self.replica = TableReplica(max_age_s=max_age_s)
        self._task: asyncio.Task | None = None
        self.stats = {"local_decisions": 0, "poll_failures": 0}

    def ensure_started(self) -> None:
        """Start following on the running event loop (once; again if the task ended)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._follow())

    async def _follow(self) -> None:
        while True:
            try:
                directory = await self.link.ahandle()
                ref = directory.subscribe.remote(self.replica.epoch, self.replica.seq, self.wait_s)
                self.replica.apply(await asyncio.wait_for(ref, self.wait_s + self.call_timeout_s))
                await asyncio.sleep(self.min_interval_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:   # gone, restarting, slow: decide remotely until it answers again
                self.stats["poll_failures"] += 1
                self.replica.stale()
                self.link.forget()
                log.info("routing table copy is stale (%s: %s); retrying", type(exc).__name__, exc)
                await asyncio.sleep(self.retry_s)

    def route(self, prompt: list[int], tenant: Tenant | None = None, exclude: list[str] | None = None) -> RouteDecision | None:
        """The decision on the local copy, or None when the copy may not decide."""
        if not self.replica.usable():
            return None
        hashes = block_hashes(prompt, self.link.block_tokens, tenant)
        try:
            d = self.replica.table.route(hashes, len(prompt), exclude)
        except NoLiveWorkerError:   # everyone excluded: let the directory say so
            return None
        self.stats["local_decisions"] += 1
        return dataclasses.replace(d, source="router_view", decision_us=self.replica.table.decision_s[-1] * 1e6)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
