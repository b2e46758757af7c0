"""The admin and session endpoints' work: calls aimed at one worker, over its peer channel.

Per-worker stats, flush and fault drills go to each live worker's peer
channel (``actors.peer``; the directory knows their addresses), each call
bounded; a session's prefetch asks every live worker at once, and the one
that remembers the session starts it (so it works the same whichever
ingress replica the request reaches). Policy changes go to the directory.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from actors.peer import UnknownPeerSessionError
from serve_app.protocol import APIError

if TYPE_CHECKING:
    from serve_app.ingress import IngressCore

log = logging.getLogger("ray.serve")


async def _each_worker(core: "IngressCore", op: str, **args) -> dict:
    """``op`` on every live worker: worker id -> its answer or the exception it raised."""
    directory = core.router.directory
    addresses = await directory.peer_addresses()

    async def one(worker_id: str):
        client = await core.peers.client(worker_id)
        if client is None:
            raise LookupError(f"worker {worker_id} has no peer channel")
        return await client.call(op, **args)

    answers = await asyncio.gather(*[one(w) for w in addresses], return_exceptions=True)
    return dict(zip(addresses, answers))


async def cache_stats(core: "IngressCore") -> dict:
    directory = core.router.directory
    handle = await directory.ahandle()
    stats = await asyncio.wait_for(handle.get_stats.remote(), 10.0)
    answers = await _each_worker(core, "stats")
    return {"directory": stats,
            "workers": {w: (a if not isinstance(a, Exception) else {"error": str(a)}) for w, a in answers.items()}}


async def flush(core: "IngressCore") -> dict:
    answers = await _each_worker(core, "flush")
    failed = {w: str(a) for w, a in answers.items() if isinstance(a, Exception)}
    if failed:
        log.warning("flush failed on %s", failed)
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


async def prefetch(core: "IngressCore", tenant, session_id: str) -> dict:
    """Start promoting a returning session's prefix on the worker that holds it."""
    key = core.session_key(tenant, session_id)
    answers = await _each_worker(core, "prefetch", session_id=key)
    for worker_id, answer in answers.items():
        if not isinstance(answer, Exception):
            return {"session_id": session_id, "worker_id": worker_id, "prefetching_tokens": answer}
    other = [a for a in answers.values() if not isinstance(a, UnknownPeerSessionError)]
    if other:
        log.warning("prefetch of %s failed on some workers: %s", session_id, other)
    raise APIError(404, f"unknown session '{session_id}'", param="session_id", code="session_not_found")
