"""HTTP ingress: OpenAI-compatible API, auth, tenants, limits, streaming, admin.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with
``stream``), GET /v1/models, GET /healthz, POST /v1/sessions/{id}/prefetch,
GET /v1/cache/stats and POST /v1/cache/flush (admin).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from collections import OrderedDict
from contextlib import aclosing
from typing import Any, AsyncIterator

import ray
from ray.exceptions import RayActorError
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse

from actors.core import EngineWedgedError, QueueFullError
from cluster.errors import CacheError, InvalidInputError
from cluster.protocol import FinishReason, GenerateRequest, StreamItem
from actors.naming import DIRECTORY_NAME
from cluster.engine.checkpoint import ModelSpec, load_tokenizer, model_id
from cluster.engine.text import ChatPromptBuilder, ReplyMemory
from serve_app import metrics
from serve_app.auth import Auth, read_json_body
from serve_app.openapi import add_request_bodies
from serve_app.output import TextStream
from serve_app.protocol import APIError, GenerationRequest, Limits, parse_chat, parse_completion
from serve_app.timing import RequestClock

log = logging.getLogger("ray.serve")

TIER_NAMES = ("hot", "warm", "cold")


class IngressCore:
    """Everything but the Serve wiring, so it can be tested and reused."""

    def __init__(self, workers: Any, model: str | dict | None = None, model_name: str | None = None,
                 namespace: str = "prefix-cache", api_keys: str | dict | None = None,
                 admin_keys: str | list | None = None, limits: dict | None = None, retry_after_s: int = 1,
                 admin_without_keys: bool = False, max_resumes: int = 2):
        """``model`` is the replicas' model spec (``WorkerConfig.model``): the ingress
        loads only its tokenizer and chat template. ``model_name`` is the id clients
        send and ``/v1/models`` lists (default: the model's own id)."""
        self.workers = workers
        spec = ModelSpec.parse(model)
        self.model_name = model_name or model_id(spec)
        self.namespace = namespace
        self.tokenizer = load_tokenizer(spec)
        self.replies = ReplyMemory()
        self.prompts = ChatPromptBuilder(self.tokenizer, self.replies)
        self.limits = Limits(**(limits or {}))
        self.auth = Auth(api_keys, admin_keys, admin_without_keys)
        self.retry_after_s = retry_after_s
        self.max_resumes = max_resumes
        self._sessions: OrderedDict[tuple, str] = OrderedDict()   # (tenant, session) -> worker id

    def install_openapi(self, app: FastAPI) -> None:
        """Describe the hand-parsed request bodies in ``app``'s OpenAPI document."""
        def openapi() -> dict:
            if app.openapi_schema is None:
                schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
                app.openapi_schema = add_request_bodies(schema, self.model_name, self.tokenizer.vocab_size)
            return app.openapi_schema

        app.openapi = openapi

    def render_chat(self, tenant: str | None):
        """The chat renderer for one tenant: its reply memory is the tenant's own."""
        return lambda messages: self.prompts.build(messages, tenant or "").ids

    def stop_token_ids(self, gen: GenerationRequest) -> tuple[int, ...]:
        """The client's stop ids, plus EOS and the model's generation-config stop ids
        unless the client asked to ignore EOS."""
        own = () if gen.ignore_eos else tuple(self.tokenizer.stop_token_ids)
        return tuple(dict.fromkeys((*gen.stop_token_ids, *own)))

    def authenticate(self, request: Request, admin: bool = False) -> str | None:
        return self.auth.authenticate(request, admin)

    async def body(self, request: Request, empty_ok: bool = False, clock: RequestClock | None = None) -> dict:
        return await read_json_body(request, self.limits, empty_ok,
                                    on_bytes=clock.mark_body_read if clock is not None else None)

    # -------------------------------------------------------------- generation
    def _session_key(self, tenant, session_id):
        return None if session_id is None else f"{tenant}:{session_id}"

    async def stream_items(self, gen: GenerationRequest, tenant: str | None, endpoint: str,
                           clock: RequestClock | None = None, whole: bool = False) -> AsyncIterator[StreamItem]:
        """The worker's items for one request. Leaving early (a stop string, a client
        that went away) cancels the request on the worker, which caches what it
        computed and releases its locks.

        ``whole``: the caller reads every item before answering (a non-streamed
        request without stop strings), so the replica returns them all from one
        call (``generate_all``) instead of a stream: one message back instead of
        one per token, and no streaming machinery on the request path. A failed
        call then sent nothing, and resuming it starts over on another replica
        (with the same seed: the same answer).

        A replica that dies (or whose watchdog trips) mid-request does not end the
        request: it is resumed on another replica from the tokens already sent
        (prompt + sent tokens, ``max_tokens`` reduced, same seed: sampling is a
        function of (seed, position), so the continuation is what the first
        replica would have produced), up to ``max_resumes`` times, never on a
        replica it already failed on. When it cannot be resumed the caller gets
        an ``APIError`` (503 with Retry-After), never a bare exception."""
        params = {**gen.params(), "stop_token_ids": self.stop_token_ids(gen)}
        session = self._session_key(tenant, gen.session_id)
        metrics.prompt_tokens.inc(len(gen.prompt))
        start = time.perf_counter()
        last = None
        sent: list[int] = []
        failed_on: list[str] = []
        for attempt in range(self.max_resumes + 1):
            if attempt:
                metrics.resumed_requests.inc()
                log.warning("resuming a request after %d tokens (failed on %s)", len(sent), failed_on or "?")
            if len(sent) >= gen.max_tokens:   # everything was sent but the end: end it here
                yield StreamItem(None, True, FinishReason.LENGTH, prompt_tokens=len(gen.prompt))
                return
            message = GenerateRequest(gen.prompt + sent, {**params, "max_tokens": gen.max_tokens - len(sent)},
                                      tenant, session, exclude=tuple(failed_on))
            finished = False
            worker = None
            call_wall = time.time()
            if whole:
                stream = self.workers.generate_all.remote(message)
                items = _items_of(stream)
            else:
                stream = items = self.workers.options(stream=True).generate.remote(message)
            try:
                async for item in items:
                    now = time.perf_counter()
                    worker = item.worker_id
                    if last is None:
                        if clock is not None:   # the router wrote its decision and its time into the message
                            clock.mark_first(call_wall, message.route_s, item.timing, message.routing)
                        metrics.ttft.observe(now - start, tags={"endpoint": endpoint})
                        for tier, n in zip(TIER_NAMES, item.tier_hits):
                            if n:
                                metrics.cached_tokens.inc(n, tags={"tier": tier})
                        if gen.session_id is not None:
                            self._sessions[(tenant, gen.session_id)] = item.worker_id
                            self._sessions.move_to_end((tenant, gen.session_id))
                            while len(self._sessions) > 100_000:
                                self._sessions.popitem(last=False)
                    elif not whole:
                        metrics.inter_token.observe(now - last, tags={"endpoint": endpoint})
                    last = now
                    finished = item.finished
                    if item.token is not None:
                        sent.append(item.token)
                    if attempt:   # the client asked with its own prompt: count against that
                        item.prompt_tokens = len(gen.prompt)
                        item.cached_tokens = min(item.cached_tokens, len(gen.prompt))
                    yield item
                    if finished:
                        return
                failure: BaseException = ConnectionError("the replica's stream ended without its last item")
            except Exception as exc:
                failure = exc
            finally:
                if not finished:   # stop string, client gone, or an error: stop generating
                    stream.cancel()
            if not _resumable(failure):
                raise self._api_error(failure)
            if worker is None and message.routing is not None:   # it failed before its first item
                worker = message.routing.worker_id
            if worker is not None:
                failed_on.append(worker)
        raise APIError(503, f"the replicas serving this request failed ({len(failed_on)} tried) and it could "
                            f"not be resumed; retry later", type_="server_error", code="replica_failed",
                       headers={"Retry-After": str(self.retry_after_s)})

    def _api_error(self, exc: BaseException) -> APIError:
        """What the client sees for a failure that resuming cannot fix."""
        cause = _root_cause(exc)
        if isinstance(exc, APIError):
            return exc
        if isinstance(cause, QueueFullError) or type(exc).__name__ == "BackPressureError":
            return APIError(429, "the server is at capacity; retry later", type_="rate_limit_error",
                            code="queue_full", headers={"Retry-After": str(self.retry_after_s)})
        if isinstance(cause, InvalidInputError):   # a parameter the worker refused: the client's to fix
            return APIError(400, f"invalid request: {cause}", code="invalid_request")
        if isinstance(cause, CacheError):   # e.g. a prompt the KV cache can never hold
            return APIError(503, f"the request could not be served: {cause}", type_="server_error",
                            code="kv_cache_unavailable", headers={"Retry-After": str(self.retry_after_s)})
        log.error("request failed: %s: %s", type(exc).__name__, exc)
        return APIError(503, f"the request failed on the server ({type(cause).__name__}); retry later",
                        type_="server_error", code="server_error", headers={"Retry-After": str(self.retry_after_s)})

    def _text(self, gen: GenerationRequest) -> TextStream:
        return TextStream(self.tokenizer, gen.stop, self.stop_token_ids(gen))

    def _remember(self, tenant: str | None, text: str, out: TextStream) -> None:
        """Keep the ids behind a reply, so the client's next turn reuses their KV."""
        ids = out.reply_ids()
        if ids is not None:   # remember_reply keeps them only if they decode to exactly ``text``
            self.prompts.remember_reply(tenant or "", text, ids)

    async def complete(self, gen: GenerationRequest, tenant: str | None, endpoint: str, chat: bool,
                       clock: RequestClock | None = None):
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        clock = clock or RequestClock.start()
        if gen.stream:
            return await self._streaming(gen, tenant, endpoint, chat, rid, created, clock)
        out, last, pieces = self._text(gen), None, []
        # Without stop strings the replica's own stops (EOS, stop ids, max_tokens) end it:
        # take the whole answer from one call. Stop strings need the text as it comes.
        whole = not gen.stop
        async with aclosing(self.stream_items(gen, tenant, endpoint, clock, whole)) as items:
            async for item in items:
                last = item
                if item.token is not None:
                    pieces.append(out.push(item.token))
                    if out.stopped:
                        break
        pieces.append(out.finish())
        text = "".join(pieces)
        finish = out.finish_reason(last)
        if chat:
            self._remember(tenant, text, out)
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "token_ids": out.ids, "logprobs": None, "finish_reason": finish}
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": self.model_name, "choices": [choice], "usage": _usage(gen, out.ids, last),
                "prefix_cache": _cache_info(last, clock)}

    async def _streaming(self, gen, tenant, endpoint, chat, rid, created, clock: RequestClock):
        items = self.stream_items(gen, tenant, endpoint, clock)
        try:
            first = await items.__anext__()  # errors before the first token become HTTP errors
        except StopAsyncIteration:
            first = None
        except BaseException:
            await items.aclose()
            raise
        kind = "chat.completion.chunk" if chat else "text_completion"

        role_sent = False

        def chunk(text: str, ids: list[int], finish: str | None = None) -> dict:
            nonlocal role_sent
            if not chat:
                choice = {"index": 0, "text": text, "token_ids": ids, "finish_reason": finish}
            else:
                delta = {"content": text} if text else {}
                if not role_sent:
                    delta["role"], role_sent = "assistant", True
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            return {"id": rid, "object": kind, "created": created, "model": self.model_name, "choices": [choice]}

        async def sse():
            out, last, unsent = self._text(gen), None, []
            item = first
            opened = False
            try:
                while item is not None:
                    last = item
                    if item.token is not None:
                        unsent.append(item.token)
                        piece = out.push(item.token)
                        if piece:   # text held back (a partial character or stop string) waits
                            yield _sse(chunk(piece, unsent))
                            unsent = []
                        elif not opened:   # but the first token opens the stream at once: an empty
                            yield _sse(chunk("", []))   # chunk (for chat the role, as OpenAI sends)
                        opened = True
                        if out.stopped:
                            break
                    item = await items.__anext__()
            except StopAsyncIteration:
                pass
            except Exception as exc:   # the body has started: end it with an error event, never cut it
                error = exc if isinstance(exc, APIError) else self._api_error(exc)
                metrics.cut_streams.inc()
                if error.status >= 500:
                    metrics.responses_5xx.inc(tags={"endpoint": endpoint})
                yield _sse(error.body())
                yield "data: [DONE]\n\n"
                return
            finally:
                await items.aclose()
            rest = out.finish()
            if rest or unsent:
                yield _sse(chunk(rest, unsent))
            if chat:
                self._remember(tenant, out.text, out)
            end = chunk("", [], out.finish_reason(last))
            if gen.include_usage:
                end["usage"] = _usage(gen, out.ids, last)
                end["prefix_cache"] = _cache_info(last, clock)
            yield _sse(end)
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ------------------------------------------------------------------ admin
    async def directory(self):
        # Looked up per call (admin endpoints only): a handle kept across a directory that was
        # killed and recreated would point at the dead actor.
        return await asyncio.to_thread(ray.get_actor, DIRECTORY_NAME, namespace=self.namespace)

    async def cache_stats(self) -> dict:
        d = await self.directory()
        workers = await d.live_workers.remote()
        per_worker = await asyncio.gather(*[self.workers.stats.remote({"target_worker": w}) for w in workers],
                                          return_exceptions=True)
        return {"directory": await d.get_stats.remote(),
                "workers": {w: (s if not isinstance(s, Exception) else {"error": str(s)})
                            for w, s in zip(workers, per_worker)}}

    async def flush(self) -> dict:
        d = await self.directory()
        workers = await d.live_workers.remote()
        freed = await asyncio.gather(*[self.workers.flush.remote({"target_worker": w}) for w in workers])
        return {"flushed_tokens": int(sum(freed)), "workers": workers}

    async def set_policy(self, policy) -> dict:
        if not isinstance(policy, str):
            raise APIError(422, "'policy' must be a string", param="policy")
        d = await self.directory()
        try:
            await d.set_policy.remote(policy)
        except Exception as exc:
            raise APIError(422, str(_root_cause(exc)), param="policy") from None
        return {"policy": policy}

    async def prefetch(self, tenant, session_id: str) -> dict:
        wid = self._sessions.get((tenant, session_id))
        if wid is None:
            raise APIError(404, f"unknown session '{session_id}'", param="session_id", code="session_not_found")
        try:
            n = await self.workers.prefetch.remote({"target_worker": wid, "tenant": tenant,
                                                    "session_id": self._session_key(tenant, session_id)})
        except Exception as exc:
            if "unknown session" in str(exc):
                raise APIError(404, f"unknown session '{session_id}'", param="session_id",
                               code="session_not_found") from None
            raise
        return {"session_id": session_id, "worker_id": wid, "prefetching_tokens": n}


async def _items_of(call) -> AsyncIterator[StreamItem]:
    """The items of a ``generate_all`` call, as the stream would give them."""
    for item in await call:
        yield item


def _resumable(exc: BaseException) -> bool:
    """A failure of the replica, not of the request: another replica can go on."""
    cause = _root_cause(exc)
    return isinstance(cause, (RayActorError, EngineWedgedError, ConnectionError)) or isinstance(exc, RayActorError)


def _root_cause(exc: BaseException) -> BaseException:
    cause = getattr(exc, "cause", None) or exc.__cause__
    return _root_cause(cause) if cause is not None and cause is not exc else exc


def _usage(gen: GenerationRequest, tokens: list[int], last: StreamItem | None) -> dict:
    cached = last.cached_tokens if last is not None else 0
    return {"prompt_tokens": len(gen.prompt), "completion_tokens": len(tokens),
            "total_tokens": len(gen.prompt) + len(tokens), "prompt_tokens_details": {"cached_tokens": cached}}


def _cache_info(last: StreamItem | None, clock: RequestClock | None = None) -> dict:
    last = last or StreamItem(None, True)
    migration = last.migration.to_json() if last.migration is not None else None
    info = {"worker_id": last.worker_id, "reason": last.reason,
            "cached_tokens_by_tier": dict(zip(TIER_NAMES, last.tier_hits)), "migration": migration}
    if clock is not None:   # who routed it, and where its time went (serve_app.timing)
        info["routed_by"] = clock.routed_by
        info["timing_ms"] = clock.breakdown_ms()
    return info


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def handle_generation(core: IngressCore, request: Request, endpoint: str, chat: bool) -> Response:
    clock = RequestClock.start()
    tenant = core.authenticate(request)
    body = await core.body(request, clock=clock)
    if chat:
        gen = parse_chat(body, core.limits, core.model_name, core.tokenizer, core.render_chat(tenant))
    else:
        gen = parse_completion(body, core.limits, core.model_name, core.tokenizer)
    clock.mark_parsed()
    if gen.seed is None:
        # Every request gets a seed: sampling is a function of (seed, position), so a request
        # resumed on another replica continues exactly where the first one stopped.
        gen.seed = secrets.randbits(63)
    header_session = request.headers.get("x-session-id")
    if gen.session_id is None and header_session:
        gen.session_id = header_session[:128]
    result = await core.complete(gen, tenant, endpoint, chat, clock)
    metrics.requests.inc(tags={"endpoint": endpoint, "status": "200"})
    return result if isinstance(result, Response) else JSONResponse(result)
