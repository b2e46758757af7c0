"""IngressCore: one HTTP request's way to the replicas and back, without the Serve wiring.

Per request, one way down and back: the body is read and validated into an
``ApiRequest`` (``serve_app.parse``, its fields by the typed models of
``serve_app.params``); a ``ReplicaStream`` (``serve_app.replica_stream``)
routes it, calls the replicas, resumes it on another replica when one fails
and counts its metrics; ``serve_app.responses`` renders the answer from that
stream's ``StreamItem``s. Nothing below calls back up into this module.

Every ingress replica is alike: nothing a request needs lives in one of
them only. The ids behind the model's replies are written through to the
cluster's ``ReplyStore``; a session's prefetch asks every live worker (the
one that knows the session starts it); decisions are made on each replica's
own table copy.

Predictive swap-in: a request whose ``X-Session-Id`` header names a session
starts that session's prefetch as soon as its headers are in, before its body
is read and tokenized (``prefetch_on_arrival``), so the session's WARM/COLD
prefix is on its way back to HOT while the rest of the request arrives. It is
fire and forget: bounded by ``prefetch_timeout_s``, its outcome counted in
``prefix_cache_session_prefetches_total`` and failures logged; the request
never waits for it and never fails because of it. One per request (a resumed
request does not start another). The body's ``session_id``, when given, names
the session the request runs under; the header's is the one prefetched.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from ray.serve.handle import DeploymentHandle

from actors.peer import PeerDirectory
from actors.reply_store import SharedReplies
from actors.routing_client import RoutingClient
from cluster.engine.checkpoint import ModelSpec, load_tokenizer, model_context, model_id
from cluster.engine.text import ChatPromptBuilder, ReplyMemory
from cluster.protocol import Tenant
from serve_app import admin, metrics
from serve_app.auth import Auth, read_json_body
from serve_app.logprobs import TokenNames
from serve_app.openapi import add_request_bodies
from serve_app.parse import ApiRequest, Limits, ParseContext, parse_generation
from serve_app.replica_stream import ReplicaCalls, ReplicaStream, session_key
from serve_app.responses import Presenter, merge_batch, respond
from serve_app.structured import assistant_texts
from serve_app.timing import RequestClock
from serve_app.token_api import detokenize, tokenize, tokenizer_info

log = logging.getLogger("ray.serve")

SESSION_HEADER = "x-session-id"
MAX_SESSION_ID_CHARS = 128
# The live workers' peer addresses an arrival prefetch fans out to may be this old: a
# directory call per request would put the directory on every session request's path.
PEER_ADDRESSES_MAX_AGE_S = 1.0


class IngressCore:
    """Everything but the Serve wiring, so it can be tested and reused."""

    def __init__(self, workers: Any, model: object = None, model_name: str | None = None,
                 namespace: str = "prefix-cache", api_keys: object = None,
                 admin_keys: str | list | None = None, limits: dict | None = None, retry_after_s: int = 1,
                 admin_without_keys: bool = False, max_resumes: int = 2, block_tokens: int = 16,
                 router: Any = None, peer_secret: str | None = None, shared_replies: bool = True,
                 ingress_id: str | None = None, prefetch_timeout_s: float = 2.0, replica_calls: str = "grpc"):
        """``workers``: the replicas' deployment handle. ``model`` is the replicas'
        model spec (``WorkerConfig.model``, anything ``ModelSpec.parse`` reads): the
        ingress loads only its tokenizer and chat template. ``api_keys``: what ``Auth``
        reads. ``model_name`` is the id clients send and ``/v1/models`` lists
        (default: the model's own id). ``router``: what decides (default: a
        ``RoutingClient`` on the directory of ``namespace``); ``peer_secret``:
        the app's peer-channel secret, for the admin calls aimed at one worker;
        ``ingress_id``: this ingress replica's id (responses name it);
        ``prefetch_timeout_s``: the bound on a prefetch started by a request's
        ``X-Session-Id`` header; ``replica_calls`` (``replica_calls_of``): how calls
        and their streams reach the replicas."""
        if replica_calls_of(replica_calls) == "grpc" and isinstance(workers, DeploymentHandle):
            workers = workers.options(_by_reference=False)
        self.workers = workers
        self.ingress_id = ingress_id
        spec = ModelSpec.parse(model)
        self.model_name = model_name or model_id(spec)
        self.namespace = namespace
        self.tokenizer = load_tokenizer(spec)
        self.token_names = TokenNames(self.tokenizer)   # logprobs' token texts
        self.context = model_context(spec)              # /tokenize's max_model_len
        local = ReplyMemory()
        self.replies = SharedReplies(namespace, local) if shared_replies else local
        if shared_replies:   # its process starts with the app, not in the middle of the first replies
            self.replies.start()
        self.prompts = ChatPromptBuilder(self.tokenizer, self.replies)
        self.limits = Limits(**(limits or {}))
        self.auth = Auth(api_keys, admin_keys, admin_without_keys)
        self.retry_after_s = retry_after_s
        self.max_resumes = max_resumes
        self.router = router if router is not None else RoutingClient(namespace, block_tokens=block_tokens)
        self.calls = ReplicaCalls(workers, self.router, max_resumes, retry_after_s)
        self.presenter = Presenter(self.tokenizer, self.token_names, self.model_name, ingress_id, self.prompts)
        self.peer_secret = peer_secret
        self._peers: PeerDirectory | None = None
        self._peer_addresses: tuple[float, dict[str, str]] | None = None   # (monotonic time, worker -> address)
        self.prefetch_timeout_s = prefetch_timeout_s
        self._prefetching: set[asyncio.Task] = set()   # arrival prefetches in flight (held: not collected)

    def install_openapi(self, app) -> None:
        """Describe the hand-parsed request bodies in ``app``'s OpenAPI document."""
        def openapi() -> dict:
            if app.openapi_schema is None:
                schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
                app.openapi_schema = add_request_bodies(schema, self.model_name, self.tokenizer.vocab_size)
            return app.openapi_schema

        app.openapi = openapi

    @property
    def peers(self) -> PeerDirectory:
        """Peer-channel clients of the live workers (admin calls aimed at one)."""
        if self._peers is None:
            directory = self.router.directory
            self._peers = PeerDirectory(directory.peer_address, secret=self.peer_secret, timeout_s=10.0)
        return self._peers

    async def peer_addresses(self, max_age_s: float = 0.0) -> dict[str, str]:
        """The live workers' peer channels (worker id -> host:port), from the directory,
        or as it answered at most ``max_age_s`` ago."""
        now = time.monotonic()
        if max_age_s > 0 and self._peer_addresses is not None and now - self._peer_addresses[0] <= max_age_s:
            return self._peer_addresses[1]
        addresses = await self.router.directory.peer_addresses()
        self._peer_addresses = (now, addresses)
        return addresses

    def prefetch_on_arrival(self, tenant: Tenant | None, session_id: str | None) -> asyncio.Task | None:
        """Predictive swap-in for a request whose headers name its session: start the
        session's prefetch in the background and return at once (None: no session)."""
        if not session_id:
            return None
        task = asyncio.get_running_loop().create_task(self._prefetch_session(tenant, session_id))
        self._prefetching.add(task)
        task.add_done_callback(self._prefetching.discard)
        return task

    async def _prefetch_session(self, tenant: Tenant | None, session_id: str) -> str:
        """One arrival prefetch, its outcome counted and its failures logged, never raised."""
        try:
            found = await asyncio.wait_for(
                admin.prefetch_session(self, tenant, session_id, timeout_s=self.prefetch_timeout_s,
                                       addresses_max_age_s=PEER_ADDRESSES_MAX_AGE_S), self.prefetch_timeout_s)
            outcome = found.outcome
            if found.failures:
                log.warning("arrival prefetch of session %r failed on %s", session_id,
                            {w: f"{type(e).__name__}: {e}" for w, e in found.failures.items()})
        except TimeoutError:
            outcome = "timeout"
            log.warning("arrival prefetch of session %r took longer than %g s", session_id, self.prefetch_timeout_s)
        except Exception as exc:   # e.g. no directory: the request goes on without it
            outcome = "failed"
            log.warning("arrival prefetch of session %r failed: %s: %s", session_id, type(exc).__name__, exc)
        metrics.session_prefetches.inc(tags={"outcome": outcome})
        return outcome

    def render_chat(self, tenant: str | None):
        """The chat renderer for one tenant: its reply memory is the tenant's own."""
        return lambda messages, tools=None: self.prompts.build(messages, tenant or "", tools).ids

    async def recall_replies(self, body: dict, tenant: str | None) -> None:
        """Before a chat is tokenized: the ids of its assistant replies that another
        ingress replica saw (a cache: without them the replies are tokenized as sent)."""
        if not isinstance(self.replies, SharedReplies):
            return
        texts = assistant_texts(body.get("messages"))
        if texts:
            await self.replies.prefetch(tenant or "", texts)

    async def tokenize(self, body: dict, tenant: str | None) -> dict:
        """``POST /tokenize``: the ids the completion or chat endpoint runs for a body."""
        await self.recall_replies(body, tenant)
        return tokenize(body, self.tokenizer, lambda t: self.token_names.name(t)[0], self.model_name,
                        self.context, self.limits, self.render_chat(tenant))

    def tokenizer_info(self) -> dict:
        """``GET /tokenizer_info`` (vLLM's): what a client needs to use the tokenizer remotely."""
        return tokenizer_info(self.tokenizer, self.context)

    def detokenize(self, body: dict) -> dict:
        return detokenize(body, self.tokenizer, self.model_name, self.context)

    def authenticate(self, request, admin: bool = False) -> str | None:
        return self.auth.authenticate(request, admin)

    async def body(self, request, empty_ok: bool = False, clock: RequestClock | None = None) -> dict:
        return await read_json_body(request, self.limits, empty_ok,
                                    on_bytes=clock.mark_body_read if clock is not None else None)

    @staticmethod
    def session_key(tenant: Tenant | None, session_id: str | None) -> str | None:
        return session_key(tenant, session_id)

    # -------------------------------------------------------------- generation
    def stream(self, gen: ApiRequest, tenant: Tenant | None, endpoint: str,
               clock: RequestClock | None = None) -> ReplicaStream:
        """The request on the replicas: its choices' items, routed, resumed, counted."""
        return ReplicaStream(self.calls, gen, tenant, endpoint, clock or RequestClock.start())

    async def complete(self, gen: ApiRequest, tenant: Tenant | None, endpoint: str, chat: bool,
                       clock: RequestClock | None = None):
        """The OpenAI response for one request: a JSON body, or a streaming response."""
        return await respond(self.stream(gen, tenant, endpoint, clock), self.presenter, chat)


REPLICA_CALLS = ("grpc", "object_ref")


def replica_calls_of(value: Any) -> str:
    """How the ingress's calls reach the cache replicas (the app arg ``replica_calls``):
    ``grpc`` (default), Serve's direct gRPC channel from handle to replica, each streamed
    item one message on it; ``object_ref``, Ray's object references and streaming
    generators (Serve's default), a task and an object per item. ``grpc`` costs the
    ingress and the replica less CPU per token beside the engine (measured in
    docs/deployment.md)."""
    if value not in REPLICA_CALLS:
        raise ValueError(f"replica_calls must be one of {list(REPLICA_CALLS)}, got {value!r}")
    return value


async def handle_generation(core: IngressCore, request, endpoint: str, chat: bool) -> Response:
    """One POST to /v1/completions or /v1/chat/completions, start to end."""
    clock = RequestClock.start()
    tenant = core.authenticate(request)
    header_session = session_header(request)
    core.prefetch_on_arrival(tenant, header_session)   # predictive swap-in: while the body is on its way
    body = await core.body(request, clock=clock)
    if chat:
        await core.recall_replies(body, tenant)
    context = ParseContext(core.limits, core.model_name, core.tokenizer,
                           core.render_chat(tenant) if chat else None, header_session)
    gens = parse_generation(body, chat, context)
    clock.mark_parsed()
    if len(gens) > 1:
        return await _batch(core, gens, tenant, clock)
    result = await core.complete(gens[0], tenant, endpoint, chat, clock)
    metrics.requests.inc(tags={"endpoint": endpoint, "status": "200"})
    return result if isinstance(result, Response) else JSONResponse(result)


BATCH_CONCURRENCY = 8     # prompts of one request in flight at once (the rest wait their turn)


async def _batch(core: IngressCore, gens: list[ApiRequest], tenant: Tenant | None, clock: RequestClock) -> Response:
    """A completions request with several prompts: each is its own request (routed on
    its own: prompts that share a context go where it is cached), run side by side;
    one answer with their choices in order (prompt i's choice j at index i * n + j)."""
    clocks = [clock] + [RequestClock.start() for _ in gens[1:]]
    gate = asyncio.Semaphore(BATCH_CONCURRENCY)

    async def one(gen: ApiRequest, c: RequestClock) -> dict:
        async with gate:
            return await core.complete(gen, tenant, "completions", False, c)

    bodies = await asyncio.gather(*(one(g, c) for g, c in zip(gens, clocks)))
    metrics.requests.inc(tags={"endpoint": "completions", "status": "200"})
    return JSONResponse(merge_batch(bodies))


def session_header(request) -> str | None:
    """The session a request's ``X-Session-Id`` header names (None: none, or empty)."""
    value = request.headers.get(SESSION_HEADER)
    return value[:MAX_SESSION_ID_CHARS] if value else None
