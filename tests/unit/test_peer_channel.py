"""The peer channel (``actors.peer``) between real WorkerCores on loopback, no Ray:
one typed method per operation on the client, the same-named method of the
worker's ``PeerService`` on the server, a bad argument refused naming it, and
every call bounded."""

import asyncio

import pytest

from actors.peer import OPS, PeerCallError, PeerClient, PeerTimeoutError, UnknownPeerSessionError
from cluster.protocol import GenerateRequest, PrefixOffer, SamplingParams, StagedPrefix, WorkerInfo
from tests.unit.helpers import make_worker, run_worker

SECRET = "s-peer"


@pytest.fixture(scope="module")
def worker():
    core = make_worker("p-w", peer_host="127.0.0.1", peer_secret=SECRET)
    yield core
    core.close()


def over(core, call, timeout_s=30.0):
    """``call(client)`` on a fresh client of ``core``'s channel, in its own event loop."""
    async def go():
        client = PeerClient(core.worker_id, core.peer.address, secret=SECRET, timeout_s=timeout_s)
        try:
            return await call(client)
        finally:
            client.close()
    return asyncio.run(go())


def test_each_operation_is_a_typed_method_answered_by_the_worker(worker):
    system = list(range(100, 132))   # two whole blocks every request below shares
    for tail in ([1, 2, 3], [4, 5, 6]):
        run_worker(worker, system + tail, max_tokens=1)

    info = over(worker, lambda c: c.info())
    assert isinstance(info, WorkerInfo) and info == worker.info()
    stats = over(worker, lambda c: c.stats())
    assert stats["worker_id"] == "p-w" and stats["engine"]["requests_finished"] == 2
    offers = over(worker, lambda c: c.offers(4))
    assert [(type(o), o.holder, o.tokens) for o in offers] == [(PrefixOffer, "p-w", tuple(system))]
    # A worker does not pull from itself: nothing installed.
    assert over(worker, lambda c: c.pull(offers[0])) == 0
    assert over(worker, lambda c: c.prefetch(tokens=system)) == 0   # already HOT
    with pytest.raises(UnknownPeerSessionError):
        over(worker, lambda c: c.prefetch("no-such-session"))

    async def export_fetch_release(c):
        staged = await c.export_prefix(system + [1, 2, 3], None)
        array, dtype = await c.fetch_blocks(staged.lease)
        await c._request("release", None, lease=staged.lease)
        return staged, array, dtype
    staged, array, dtype = over(worker, export_fetch_release)
    assert isinstance(staged, StagedPrefix) and (staged.holder, staged.tokens, len(staged.blocks)) == ("p-w", 35, 3)
    assert (array.nbytes, dtype) == (3 * 16 * worker.layout.bytes_per_token(), "float32"), (array.shape, array.dtype)
    assert asyncio.run(worker.stats())["tiers"]["warm"]["used_tokens"] == 0   # the lease was released

    over(worker, lambda c: c.inject_fault("nixl"))
    assert "nixl" in worker.migration.faults
    over(worker, lambda c: c.inject_fault("nixl", False))
    assert "nixl" not in worker.migration.faults
    freed = over(worker, lambda c: c.flush())
    assert freed > 0 and asyncio.run(worker.stats())["evictable_tokens"] == 0
    assert set(OPS) == {"export", "fetch", "release", "info", "stats", "flush", "prefetch", "inject_fault", "pull",
                        "offers"}


@pytest.mark.parametrize("op, args, message", [
    ("export", {"tokens": "abc"}, "tokens must be a list of non-negative integer token ids"),
    ("export", {"tokens": [1, -2]}, "tokens must be a list of non-negative integer token ids"),
    ("export", {"tokens": [1], "tenant": 7}, "tenant must be a string or null"),
    ("export", {"tokens": [1], "max_tokens": True}, "max_tokens must be a non-negative integer or null"),
    ("fetch", {"lease": 12}, "lease must be a string"),
    ("offers", {"limit": -1}, "limit must be a non-negative integer"),
    ("inject_fault", {"kind": "nixl", "on": "yes"}, "on must be true or false"),
    ("inject_fault", {"kind": "object_store"}, "unknown fault 'object_store'; choose from nixl, fallback"),
    ("pull", {"offer": {"holder": "x"}}, "prefix offer is malformed"),
    ("stats", {"colour": 1}, "peer call 'stats': got an unexpected keyword argument 'colour'"),
    ("evict_everything", {}, "unknown peer call 'evict_everything'"),
])
def test_a_bad_argument_is_refused_naming_it(worker, op, args, message):
    with pytest.raises(PeerCallError, match=message) as refused:
        over(worker, lambda c: c._request(op, None, **args))
    assert refused.value.kind == "invalid"


def test_every_call_is_bounded(worker):
    worker.inject_fault("wedge")   # the engine thread blocks: what needs it never answers
    try:
        with pytest.raises(PeerTimeoutError, match="did not answer 'stats' within 0.2 s"):
            over(worker, lambda c: c.stats(timeout_s=0.2))
        with pytest.raises(PeerTimeoutError, match="did not answer 'flush' within 0.3 s"):
            over(worker, lambda c: c.flush(), timeout_s=0.3)   # the client's own bound
    finally:
        worker.inject_fault("wedge", False)
    assert over(worker, lambda c: c.info()).worker_id == "p-w"


def test_a_session_the_worker_ran_is_prefetched_by_its_key(worker):
    async def turn():
        request = GenerateRequest(list(range(200, 240)), SamplingParams(max_tokens=1), session_id="sess-1")
        return [i async for i in worker.generate(request)]
    asyncio.run(turn())
    assert over(worker, lambda c: c.prefetch("sess-1")) == 0   # known, and HOT already
