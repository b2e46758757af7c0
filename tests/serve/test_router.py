"""DirectoryRouter without a cluster: it carries out the decision the ingress put in the
request (the chosen replica first, the others least loaded first), keeps a resumed request
off the replicas it failed on, and writes nothing into the request. RoutingClient: the
ingress's decision on its table copy, or the directory's when the copy is stale."""

import asyncio
import dataclasses
from types import SimpleNamespace

from ray.serve.request_router import PendingRequest

from cluster.protocol import GenerateRequest, RouteDecision, SamplingParams
from serve_app.router import DirectoryRouter


def replica(rid):
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=rid))


class _QueueLens(dict):
    """Serve's queue-length cache, keyed by replica id (``get`` as the router calls it)."""

    def get(self, replica_id):
        return super().get(getattr(replica_id, "unique_id", replica_id))


def router_with(queue_lens=None):
    router = object.__new__(DirectoryRouter)
    router._replica_queue_len_cache = _QueueLens(queue_lens or {})
    router.initialize_state()
    return router


def pending(args):
    return PendingRequest(args=args, kwargs={}, metadata=SimpleNamespace(internal_request_id="parent-request"))


def request(route=None, exclude=()):
    return GenerateRequest(list(range(40)), SamplingParams(max_tokens=1), route=route, exclude=exclude)


def test_the_chosen_replica_comes_first_then_the_least_loaded():
    async def go():
        router = router_with({"r1": 5, "r2": 0, "r3": 2})
        replicas = [replica("r1"), replica("r2"), replica("r3")]
        message = request(RouteDecision("r1", "local"))
        before = dataclasses.replace(message)
        ranked = await router.choose_replicas(replicas, pending([message]))
        assert ranked == [[replicas[0]], [replicas[1]], [replicas[2]]]
        assert message == before   # nothing written into the request
    asyncio.run(go())


def test_without_a_usable_choice_the_least_loaded_goes_first():
    async def go():
        router = router_with({"r1": 5, "r2": 0})
        replicas = [replica("r1"), replica("r2")]
        for message in (request(RouteDecision.fallback()), request(RouteDecision("r9", "local")), request()):
            assert await router.choose_replicas(replicas, pending([message])) == [[replicas[1]], [replicas[0]]]
        assert await router.choose_replicas(replicas, pending(["not a request"])) == [[replicas[1]], [replicas[0]]]
        assert await router.choose_replicas([], pending([request()])) == []
    asyncio.run(go())


def test_a_resumed_request_never_goes_back_to_a_replica_it_failed_on():
    async def go():
        router = router_with({"r1": 0, "r2": 3})
        replicas = [replica("r1"), replica("r2")]
        message = request(RouteDecision("r1", "local"), exclude=("r1",))   # a stale choice of the failed one
        assert await router.choose_replicas(replicas, pending([message])) == [[replicas[1]]]
        alone = request(exclude=("r1", "r2"))   # the last replica standing may have restarted: still served
        assert len(await router.choose_replicas(replicas, pending([alone]))) == 2
    asyncio.run(go())


class FakeDirectory:
    def __init__(self, decision=None):
        self.decision, self.calls = decision, 0
        self.block_tokens = 16

    async def route(self, prompt, tenant, exclude):
        self.calls += 1
        return self.decision


def client_with(directory, follower):
    from actors.routing_client import RoutingClient

    client = object.__new__(RoutingClient)
    client.directory, client.table = directory, follower
    return client


def test_a_usable_table_copy_decides_without_asking_the_directory():
    from actors.table_follower import TableFollower
    from cluster.hashing import block_hashes
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
        decision = await client_with(directory, follower).route(prompt + [1, 2])
        assert (decision.worker_id, decision.source) == ("r2", "router_view") and directory.calls == 0
        assert decision.decision_us is not None
    asyncio.run(go())


def test_a_stale_copy_asks_the_directory_whose_fallback_the_router_serves_least_loaded():
    from actors.table_follower import TableFollower

    async def go():
        follower = TableFollower(SimpleNamespace(block_tokens=16))
        follower.ensure_started = lambda: None   # never heard from the directory: not usable
        directory = FakeDirectory(RouteDecision.fallback())   # what DirectoryLink gives on a timeout
        decision = await client_with(directory, follower).route(list(range(40)))
        assert directory.calls == 1 and decision.source == "fallback" and decision.worker_id is None
        router = router_with({"r1": 5, "r2": 0})
        replicas = [replica("r1"), replica("r2")]
        ranked = await router.choose_replicas(replicas, pending([request(decision)]))
        assert ranked == [[replicas[1]], [replicas[0]]]
    asyncio.run(go())
