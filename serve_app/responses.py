"""The OpenAI-shaped answer of one request, built in one place from its ``StreamItem``s.

``respond`` turns the items of ``IngressCore.stream_items`` into a
completion or chat completion: one JSON body, or server-sent events. Text
comes from the token ids (``serve_app.output.TextStream``: detokenized
exactly, cut at stop strings); usage and the ``prefix_cache`` field come
from the last item and the request's own clock. A stream ends with its data
or with an error event, never silently.
"""

from __future__ import annotations

import json
import time
import uuid
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from fastapi.responses import StreamingResponse

from cluster.protocol import StreamItem, Tenant
from serve_app import metrics
from serve_app.output import TextStream
from serve_app.protocol import APIError, ApiRequest
from serve_app.timing import RequestClock

if TYPE_CHECKING:
    from serve_app.ingress import IngressCore


async def respond(core: "IngressCore", gen: ApiRequest, tenant: Tenant | None, endpoint: str, chat: bool,
                  clock: RequestClock):
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    if gen.stream:
        return await _streaming(core, gen, tenant, endpoint, chat, rid, created, clock)
    out, last, pieces = _text(core, gen), None, []
    # Without stop strings the replica's own stops (EOS, stop ids, max_tokens) end it:
    # take the whole answer from one call. Stop strings need the text as it comes.
    whole = not gen.stop
    async with aclosing(core.stream_items(gen, tenant, endpoint, clock, whole)) as items:
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
        core.remember_reply(tenant, text, out.reply_ids())
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "token_ids": out.ids, "logprobs": None, "finish_reason": finish}
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": core.model_name, "choices": [choice], "usage": usage(gen, out.ids, last),
            "prefix_cache": cache_info(last, clock, core.ingress_id)}


def _text(core: "IngressCore", gen: ApiRequest) -> TextStream:
    return TextStream(core.tokenizer, gen.stop, core.stop_token_ids(gen))


async def _streaming(core: "IngressCore", gen: ApiRequest, tenant: Tenant | None, endpoint: str, chat: bool,
                     rid: str, created: int, clock: RequestClock) -> StreamingResponse:
    items = core.stream_items(gen, tenant, endpoint, clock)
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
            delta: dict[str, Any] = {"content": text} if text else {}
            if not role_sent:
                delta["role"], role_sent = "assistant", True
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return {"id": rid, "object": kind, "created": created, "model": core.model_name, "choices": [choice]}

    async def sse():
        out, last, unsent = _text(core, gen), None, []
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
            error = exc if isinstance(exc, APIError) else core.api_error(exc)
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
            core.remember_reply(tenant, out.text, out.reply_ids())
        end = chunk("", [], out.finish_reason(last))
        if gen.include_usage:
            end["usage"] = usage(gen, out.ids, last)
            end["prefix_cache"] = cache_info(last, clock, core.ingress_id)
        yield _sse(end)
        yield "data: [DONE]\n\n"

    return StreamingResponse(sse(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def usage(gen: ApiRequest, tokens: list[int], last: StreamItem | None) -> dict:
    """Counted against the client's own prompt (a resumed request's items count
    the tokens it was resumed with as prompt)."""
    cached = min(last.cached_tokens, len(gen.prompt)) if last is not None else 0
    return {"prompt_tokens": len(gen.prompt), "completion_tokens": len(tokens),
            "total_tokens": len(gen.prompt) + len(tokens), "prompt_tokens_details": {"cached_tokens": cached}}


def cache_info(last: StreamItem | None, clock: RequestClock | None = None, ingress_id: str | None = None) -> dict:
    last = last or StreamItem(None, True)
    migration = last.migration.to_json() if last.migration is not None else None
    info = {"worker_id": last.worker_id, "ingress_id": ingress_id, "reason": last.reason,
            "cached_tokens_by_tier": last.cached_by_tier(), "migration": migration}
    if clock is not None:   # who routed it, and where its time went (serve_app.timing)
        info["routed_by"] = clock.routed_by
        info["timing_ms"] = clock.breakdown_ms()
    return info


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"
