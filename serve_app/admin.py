"""The admin and session endpoints' work: calls aimed at one worker, over its peer channel.

Per-worker stats, flush and fault drills go to each live worker's peer
channel (``actors.peer``; the directory knows their addresses), each call
bounded; a session's prefetch asks every live worker at once, and the one
that remembers the session starts it (so it works the same whichever
ingress replica the request reaches): the explicit endpoint and the one the
ingress starts when a request's ``X-Session-Id`` header arrives
(``IngressCore.prefetch_on_arrival``) both go through ``prefetch_session``.
Policy changes go to the directory.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol, TypeVar

from actors.peer import PeerClient, PeerDirectory, UnknownPeerSessionError
from serve_app.errors import APIError


class IngressCore(Protocol):
    """What the admin calls need of the ingress (``serve_app.ingress.IngressCore``):
    declared here, so this module does not import the one that imports it."""

    router: Any
    peers: PeerDirectory

    async def peer_addresses(self, max_age_s: float = 0.0) -> dict[str, str]: ...

    def session_key(self, tenant: Any, session_id: str | None) -> str | None: ...

log = logging.getLogger("ray.serve")
T = TypeVar("T")


async def _each_worker(core: "IngressCore", call: Callable[[PeerClient], Awaitable[T]], *,
                       addresses_max_age_s: float = 0.0) -> dict[str, T | BaseException]:
    """``call(client)`` on every live worker's peer client (one typed operation,
    bounded by its ``timeout_s`` or the client's): worker id -> its answer or the
    exception it raised. ``addresses_max_age_s``: the live workers' addresses may be
    that old (0: ask the directory)."""
    addresses = await core.peer_addresses(addresses_max_age_s)

    async def one(worker_id: str):
        client = await core.peers.client(worker_id)
        if client is None:
            raise LookupError(f"worker {worker_id} has no peer channel")
        return await call(client)

    answers = await asyncio.gather(*[one(w) for w in addresses], return_exceptions=True)
    return dict(zip(addresses, answers))


async def cache_stats(core: "IngressCore") -> dict:
    directory = core.router.directory
    try:
        stats = await asyncio.wait_for((await directory.ahandle()).get_stats.remote(), 10.0)
    except Exception as exc:   # restarting, or the app is going: the workers' stats still come back
        directory.forget()
        stats = {"error": f"the directory did not answer ({type(exc).__name__})"}
    try:
        answers = await _each_worker(core, lambda peer: peer.stats())
    except Exception as exc:   # the live workers' addresses come from the directory too
        return {"directory": stats, "workers": {}, "error": f"no worker list ({type(exc).__name__}: {exc})"}
    return {"directory": stats,
            "workers": {w: (a if not isinstance(a, Exception) else {"error": str(a)}) for w, a in answers.items()}}


async def flush(core: "IngressCore") -> dict:
    """Every worker drops its cached prefixes and this model's blocks in L3; the
    directory forgets what L3 held."""
    answers = await _each_worker(core, lambda peer: peer.flush())
    failed = {w: str(a) for w, a in answers.items() if isinstance(a, Exception)}
    if failed:
        log.warning("flush failed on %s", failed)
    try:
        await asyncio.wait_for((await core.router.directory.ahandle()).clear_l3.remote(), 10.0)
    except Exception as exc:   # its L3 entries go stale: fetches that miss correct them
        log.warning("the directory did not clear its L3 entries: %s", exc)
    return {"flushed_tokens": int(sum(a for a in answers.values() if not isinstance(a, Exception))),
            "workers": sorted(w for w in answers if w not in failed), "failed": failed}


async def set_policy(core: "IngressCore", policy) -> dict:
    if not isinstance(policy, str):
        raise APIError(422, "'policy' must be a string", param="policy")
    handle = await core.router.directory.ahandle()
    try:
        await asyncio.wait_for(handle.set_policy.remote(policy), 10.0)
    except Exception as exc:
        cause = getattr(exc, "cause", None) or exc
        raise APIError(422, str(cause), param="policy") from None
    return {"policy": policy}


@dataclass(slots=True)
class SessionPrefetch:
    """What asking every worker to prefetch one session found."""

    worker_id: str | None = None   # a worker that knows the session (None: none does)
    tokens: int = 0                # tokens it started bringing up to HOT (0: already HOT)
    failures: dict[str, BaseException] = field(default_factory=dict)   # workers that failed otherwise

    @property
    def outcome(self) -> str:
        """``started``, ``hot`` (nothing to bring up), ``unknown_session`` or ``failed``
        (no worker answered and some failed: the one that knows it may be among them)."""
        if self.worker_id is not None:
            return "started" if self.tokens else "hot"
        return "failed" if self.failures else "unknown_session"


async def prefetch_session(core: "IngressCore", tenant, session_id: str, *, timeout_s: float | None = None,
                           addresses_max_age_s: float = 0.0) -> SessionPrefetch:
    """Ask every live worker to start promoting the session's WARM/COLD prefix; the one
    that ran the session last remembers it (the session map lives in the workers, so
    every ingress replica finds it). The key is tenant-scoped: another tenant's id finds nothing."""
    key = core.session_key(tenant, session_id)
    answers = await _each_worker(core, lambda peer: peer.prefetch(key, timeout_s=timeout_s),
                                 addresses_max_age_s=addresses_max_age_s)
    found = SessionPrefetch()
    for worker_id, answer in answers.items():
        if isinstance(answer, UnknownPeerSessionError):
            continue
        if isinstance(answer, BaseException):
            found.failures[worker_id] = answer
        elif found.worker_id is None or answer > found.tokens:   # several know it: the one bringing most up
            found.worker_id, found.tokens = worker_id, int(answer)
    return found


async def prefetch(core: "IngressCore", tenant, session_id: str) -> dict:
    """``POST /v1/sessions/{id}/prefetch``: start promoting a returning session's prefix
    on the worker that holds it."""
    found = await prefetch_session(core, tenant, session_id)
    if found.failures:
        log.warning("prefetch of %s failed on some workers: %s", session_id, found.failures)
    if found.worker_id is not None:
        return {"session_id": session_id, "worker_id": found.worker_id, "prefetching_tokens": found.tokens}
    raise APIError(404, f"unknown session '{session_id}'", param="session_id", code="session_not_found")
