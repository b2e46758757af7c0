"""RoutingClient: where a request is decided, in the caller's own process.

The ingress asks it for every request, before calling any replica: a
decision on the local copy of the directory's routing table
(``TableFollower``: no remote call) while that copy is fresh, else the
directory's own answer (``DirectoryLink.route``, bounded by
``directory_timeout_s``), else a fallback (the least loaded replica, which
Serve's router picks). Its answer is always a ``RouteDecision``; how long
it took is the caller's to measure.
"""

from __future__ import annotations

from actors.directory_link import DirectoryLink
from actors.table_follower import TableFollower
from cluster.protocol import RouteDecision, Tenant


class RoutingClient:
    def __init__(self, namespace: str, *, block_tokens: int = 16, directory_timeout_s: float = 0.5,
                 local_table: bool = True):
        self.directory = DirectoryLink(namespace, block_tokens=block_tokens, route_timeout_s=directory_timeout_s)
        # ``local_table=False``: ask the directory every time (for comparisons).
        self.table = TableFollower(self.directory) if local_table else None

    async def route(self, prompt: list[int], tenant: Tenant | None = None,
                    exclude: list[str] | None = None) -> RouteDecision:
        if self.table is not None:
            self.table.ensure_started()
            decision = self.table.route(prompt, tenant, exclude)
            if decision is not None:
                return decision
        return await self.directory.route(prompt, tenant, exclude)

    def close(self) -> None:
        if self.table is not None:
            self.table.close()
