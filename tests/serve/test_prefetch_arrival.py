"""Predictive swap-in started by a request's ``X-Session-Id`` header, without Serve:
a Starlette request whose body arrives only when the test lets it, fake replicas,
and fake workers behind the peer channel.

What is asserted: the prefetch is asked for before the body is read, once per
request, under the tenant's own session key; the body's ``session_id`` names the
session the request runs under; without the header nothing is prefetched; a
prefetch that fails or hangs neither delays nor fails the request, and its
outcome is counted."""

import asyncio
import json

import pytest
from starlette.requests import Request

from actors.peer import PeerUnavailableError, UnknownPeerSessionError
from actors.pytest_plugin import TEST_MODEL
from cluster.protocol import FinishReason, RouteDecision, StreamItem
from serve_app import admin, ingress, metrics
from serve_app.ingress import IngressCore, handle_generation
from serve_app.errors import APIError


class Recorder:
    def __init__(self):
        self.calls = []

    def inc(self, value=1, tags=None):
        self.calls.append((value, tags))


class FakeRouter:
    def __init__(self, directory=None):
        self.directory = directory

    async def route(self, prompt, tenant, exclude):
        return RouteDecision("r1", "test")


class FakeReplicas:
    """``generate_all``: the whole answer, two tokens; every request it was sent is kept."""

    def __init__(self):
        self.requests = []

    @property
    def generate_all(self):
        return self

    def remote(self, message):
        self.requests.append(message)

        async def answer():
            return [StreamItem(5, False, worker_id="r1"),
                    StreamItem(6, True, FinishReason.LENGTH, cached_tokens=2, tier_hits=(2, 0, 0),
                               prompt_tokens=len(message.prompt), worker_id="r1")]
        return answer()


class GatedBody:
    """An ASGI ``receive`` whose body comes only once ``release`` is set, as a slow client sends it."""

    def __init__(self, body: bytes):
        self.body, self.release, self.read = body, asyncio.Event(), False

    async def __call__(self):
        await self.release.wait()
        self.read = True
        return {"type": "http.request", "body": self.body, "more_body": False}


def http_request(receive, body: dict, session: str | None, key: str = "key-a") -> Request:
    raw = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
               (b"authorization", f"Bearer {key}".encode())]
    if session is not None:
        headers.append((b"x-session-id", session.encode()))
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers,
             "query_string": b"", "http_version": "1.1", "scheme": "http", "server": ("test", 80),
             "client": ("test", 1), "root_path": ""}
    return Request(scope, receive)


def make_core(**kw) -> tuple[IngressCore, FakeReplicas]:
    replicas = FakeReplicas()
    core = IngressCore(replicas, model=TEST_MODEL, router=FakeRouter(), shared_replies=False,
                       api_keys="key-a=tenant-a,key-b=tenant-b", **kw)
    return core, replicas


@pytest.fixture
def outcomes(monkeypatch):
    recorder = Recorder()
    monkeypatch.setattr(metrics, "session_prefetches", recorder)
    return recorder


def body_of(session_id=None):
    body = {"model": "prefix-cache-byte", "prompt": [1, 2, 3, 4], "max_tokens": 2}
    if session_id is not None:
        body["session_id"] = session_id
    return body


async def serve_with_gated_body(core, body, session, asked: asyncio.Event):
    """Run one request; returns (the response, whether the body had been read when the prefetch was asked)."""
    receive = GatedBody(json.dumps(body).encode())
    task = asyncio.create_task(handle_generation(core, http_request(receive, body, session), "completions", False))
    if session is not None:
        await asyncio.wait_for(asked.wait(), 10)
    else:   # nothing will ask: let the handler run up to the body, then let the body in
        for _ in range(20):
            await asyncio.sleep(0)
    read_when_asked = receive.read
    receive.release.set()
    response = await asyncio.wait_for(task, 10)
    for pending in list(core._prefetching):
        await asyncio.wait_for(pending, 10)
    return response, read_when_asked


def test_the_header_starts_one_prefetch_before_the_body_is_read(monkeypatch, outcomes):
    core, replicas = make_core()
    asked = asyncio.Event()
    calls = []

    async def fake_prefetch_session(core_, tenant, session_id, **kw):
        calls.append((tenant, session_id))
        asked.set()
        return admin.SessionPrefetch("w1", 160)

    monkeypatch.setattr(admin, "prefetch_session", fake_prefetch_session)
    response, read_when_asked = asyncio.run(serve_with_gated_body(core, body_of(), "chat-7", asked))
    assert response.status_code == 200 and json.loads(response.body)["choices"][0]["token_ids"] == [5, 6]
    assert read_when_asked is False                  # asked while the body was still on its way
    assert calls == [("tenant-a", "chat-7")]          # once, for the caller's tenant
    assert outcomes.calls == [(1, {"outcome": "started"})]
    assert [m.session_id for m in replicas.requests] == ["tenant-a:chat-7"]   # the key the workers remember


def test_the_body_field_names_the_session_the_header_the_one_prefetched(monkeypatch, outcomes):
    core, replicas = make_core()
    asked = asyncio.Event()
    calls = []

    async def fake_prefetch_session(core_, tenant, session_id, **kw):
        calls.append(session_id)
        asked.set()
        return admin.SessionPrefetch("w1", 0)

    monkeypatch.setattr(admin, "prefetch_session", fake_prefetch_session)
    response, read_when_asked = asyncio.run(serve_with_gated_body(core, body_of("from-body"), "from-header", asked))
    assert response.status_code == 200 and read_when_asked is False
    assert calls == ["from-header"]
    assert replicas.requests[0].session_id == "tenant-a:from-body"
    assert outcomes.calls == [(1, {"outcome": "hot"})]


def test_without_the_header_nothing_is_prefetched(monkeypatch, outcomes):
    core, replicas = make_core()
    calls = []

    async def fake_prefetch_session(core_, tenant, session_id, **kw):
        calls.append(session_id)
        return admin.SessionPrefetch("w1", 160)

    monkeypatch.setattr(admin, "prefetch_session", fake_prefetch_session)
    response, _ = asyncio.run(serve_with_gated_body(core, body_of("body-only"), None, asyncio.Event()))
    assert response.status_code == 200
    assert calls == [] and outcomes.calls == []
    assert replicas.requests[0].session_id == "tenant-a:body-only"   # the body's session still runs as one


def test_a_failing_prefetch_neither_fails_nor_delays_the_request(monkeypatch, outcomes):
    core, replicas = make_core()
    asked = asyncio.Event()

    async def failing(core_, tenant, session_id, **kw):
        asked.set()
        raise ConnectionError("no directory")

    monkeypatch.setattr(admin, "prefetch_session", failing)
    response, _ = asyncio.run(serve_with_gated_body(core, body_of(), "s", asked))
    assert response.status_code == 200 and len(replicas.requests) == 1
    assert outcomes.calls == [(1, {"outcome": "failed"})]


def test_a_hanging_prefetch_is_bounded_and_the_request_does_not_wait_for_it(monkeypatch, outcomes):
    core, replicas = make_core(prefetch_timeout_s=0.05)
    never = asyncio.Event()
    asked = asyncio.Event()

    async def hanging(core_, tenant, session_id, **kw):
        asked.set()
        await never.wait()

    monkeypatch.setattr(admin, "prefetch_session", hanging)

    async def go():
        receive = GatedBody(json.dumps(body_of()).encode())
        receive.release.set()
        response = await handle_generation(core, http_request(receive, body_of(), "s"), "completions", False)
        await asyncio.wait_for(asked.wait(), 10)
        answered_while_pending = bool(core._prefetching) and not outcomes.calls
        await asyncio.wait_for(asyncio.gather(*core._prefetching), 10)
        return response, answered_while_pending

    response, answered_while_pending = asyncio.run(go())
    assert response.status_code == 200 and answered_while_pending
    assert outcomes.calls == [(1, {"outcome": "timeout"})] and not core._prefetching


# ------------------------------------------------ prefetch_session over fake peers
class FakeDirectory:
    def __init__(self, addresses):
        self.addresses, self.asked = addresses, 0

    async def peer_addresses(self):
        self.asked += 1
        return dict(self.addresses)


class FakePeer:
    """A worker's peer channel: it remembers the session keys in ``known``."""

    def __init__(self, known=None, error=None):
        self.known, self.error, self.calls = dict(known or {}), error, []

    async def prefetch(self, session_id=None, tokens=None, tenant=None, *, timeout_s=None):
        self.calls.append(("prefetch", session_id, timeout_s))
        if self.error is not None:
            raise self.error
        if session_id not in self.known:
            raise UnknownPeerSessionError("unknown session", "unknown_session")
        return self.known[session_id]


class FakePeers:
    def __init__(self, peers):
        self.peers = peers

    async def client(self, worker_id):
        return self.peers.get(worker_id)


def core_with_workers(peers):
    directory = FakeDirectory({w: f"127.0.0.1:{9000 + i}" for i, w in enumerate(peers)})
    core = IngressCore(FakeReplicas(), model=TEST_MODEL, router=FakeRouter(directory), shared_replies=False)
    core._peers = FakePeers(peers)
    return core, directory


def test_prefetch_session_finds_the_worker_that_knows_the_tenants_session():
    peers = {"w1": FakePeer(), "w2": FakePeer({"tenant-a:s1": 96})}
    core, _ = core_with_workers(peers)
    found = asyncio.run(admin.prefetch_session(core, "tenant-a", "s1", timeout_s=0.5))
    assert (found.worker_id, found.tokens, found.outcome, found.failures) == ("w2", 96, "started", {})
    other = asyncio.run(admin.prefetch_session(core, "tenant-b", "s1"))   # same id, another tenant
    assert (other.worker_id, other.outcome) == (None, "unknown_session")
    assert peers["w2"].calls == [("prefetch", "tenant-a:s1", 0.5), ("prefetch", "tenant-b:s1", None)]


def test_prefetch_session_says_failed_when_a_worker_that_may_know_it_failed():
    peers = {"w1": FakePeer(), "w2": FakePeer(error=PeerUnavailableError("gone"))}
    core, _ = core_with_workers(peers)
    found = asyncio.run(admin.prefetch_session(core, "t", "s1"))
    assert found.worker_id is None and found.outcome == "failed" and list(found.failures) == ["w2"]


def test_arrival_prefetches_reuse_recent_peer_addresses_the_endpoint_asks_afresh():
    peers = {"w1": FakePeer({"t:s": 16})}
    core, directory = core_with_workers(peers)

    async def go():
        for _ in range(3):
            await admin.prefetch_session(core, "t", "s", addresses_max_age_s=ingress.PEER_ADDRESSES_MAX_AGE_S)
        arrival_asks = directory.asked
        await admin.prefetch(core, "t", "s")
        return arrival_asks, directory.asked

    assert asyncio.run(go()) == (1, 2)


def test_the_endpoint_answers_the_worker_or_404_for_another_tenants_session():
    peers = {"w1": FakePeer({"tenant-a:s1": 0}), "w2": FakePeer(error=PeerUnavailableError("gone"))}
    core, _ = core_with_workers(peers)
    assert asyncio.run(admin.prefetch(core, "tenant-a", "s1")) == {
        "session_id": "s1", "worker_id": "w1", "prefetching_tokens": 0}
    with pytest.raises(APIError) as err:
        asyncio.run(admin.prefetch(core, "tenant-b", "s1"))
    assert err.value.status == 404 and err.value.code == "session_not_found"
