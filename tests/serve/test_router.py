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


class FakeDirectory:
    def __init__(self, decision=None):
        self.decision, self.calls = decision, 0

    async def route(self, prompt, tenant, exclude):
        self.calls += 1
        return self.decision


def deciding_router(directory, follower=None):
    router = bare_router()
    router.directory, router.table = directory, follower
    router._replica_queue_len_cache = _QueueLens()
    return router


def test_a_usable_table_copy_decides_without_asking_the_directory():
    from actors.table_follower import TableFollower
    from cluster.hashing import block_hashes
    from cluster.protocol import GenerateRequest
    from cluster.routing.events import EventBatch, KVEvent
    from cluster.routing.table import ChangeLog, RoutingTable

    async def go():
        follower = TableFollower(SimpleNamespace(block_tokens=16))
        follower.ensure_started = lambda: None   # fed by hand here
        log, table = ChangeLog(), RoutingTable(policy="prefix")
        for w in ("r1", "r2"):
            table.apply("register", (w, True))
        prompt = list(range(64))
        table.apply("batch", (EventBatch("r2", 1, [KVEvent("stored", block_hashes(prompt, 16), 0)]),))
        follower.replica.apply(log.update(table, None, 0))
        directory = FakeDirectory()
        router = deciding_router(directory, follower)
        replicas = [replica("r1"), replica("r2")]
        message = GenerateRequest(prompt + [1, 2], {"max_tokens": 1})
        ranked = await router.choose_replicas(replicas, pending([message]))
        assert ranked[0] == [replicas[1]] and directory.calls == 0
        assert (message.routing.worker_id, message.routing.source) == ("r2", "router_view")
    asyncio.run(go())


def test_a_stale_copy_asks_the_directory_and_its_fallback_is_the_least_loaded():
    from actors.table_follower import TableFollower
    from cluster.protocol import GenerateRequest, RouteDecision

    async def go():
        follower = TableFollower(SimpleNamespace(block_tokens=16))
        follower.ensure_started = lambda: None   # never heard from the directory: not usable
        directory = FakeDirectory(RouteDecision.fallback())   # what DirectoryLink gives on a timeout
        router = deciding_router(directory, follower)
        replicas = [replica("r1"), replica("r2")]
        router._replica_queue_len_cache = _QueueLens({"r1": 5, "r2": 0})
        message = GenerateRequest(list(range(40)), {"max_tokens": 1})
        ranked = await router.choose_replicas(replicas, pending([message]))
        assert directory.calls == 1 and message.routing.source == "fallback"
        assert ranked == [[replicas[1]], [replicas[0]]]
    asyncio.run(go())


class _QueueLens(dict):
    """Serve's queue-length cache, keyed by replica id (``get`` as the router calls it)."""

    def get(self, replica_id):
        return super().get(getattr(replica_id, "unique_id", replica_id))
