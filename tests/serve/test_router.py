"""DirectoryRouter without a cluster: a targeted call reaches its target or fails
at once, and a replica goes to exactly the request it was chosen for."""

import asyncio
from collections import deque
from types import SimpleNamespace

import pytest
from ray.serve.request_router import PendingRequest

from cluster.protocol import PeerCall
from serve_app.router import DirectoryRouter, TargetGoneError


def replica(rid):
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=rid))


def bare_router():
    router = object.__new__(DirectoryRouter)
    router._pending_requests_to_fulfill = deque()
    router._pending_requests_by_id = {}
    router._record_queue_wait_time = lambda pending: None
    return router


def pending(args, internal_id="parent-request"):
    # Calls made while serving one HTTP request share its internal request id.
    return PendingRequest(args=args, kwargs={}, metadata=SimpleNamespace(internal_request_id=internal_id))


def test_a_replica_goes_to_the_request_it_was_chosen_for_only():
    async def go():
        router = bare_router()
        first, second = pending([PeerCall("r1")]), pending([PeerCall("r2")])
        router._pending_requests_to_fulfill.extend([first, second])
        router._pending_requests_by_id["parent-request"] = first
        r2 = replica("r2")
        router._fulfill_next_pending_request(r2, second.metadata)
        assert second.future.result() is r2 and not first.future.done()   # not the oldest: its own
        assert router._pending_requests_by_id == {"parent-request": first}
        r1 = replica("r1")
        router._fulfill_next_pending_request(r1, first.metadata)
        assert first.future.result() is r1 and router._pending_requests_by_id == {}
    asyncio.run(go())


def test_targeted_calls_reach_their_target_or_fail_fast():
    async def go():
        router = bare_router()
        replicas = [replica("r1"), replica("r2")]
        call = pending([PeerCall("r2")])
        assert await router.choose_replicas(replicas, call) == [[replicas[1]]]
        gone = pending([{"target_worker": "r9"}])
        await router.choose_replicas(replicas, gone)
        with pytest.raises(TargetGoneError, match="replica r9 is not running"):
            gone.future.result()
    asyncio.run(go())
