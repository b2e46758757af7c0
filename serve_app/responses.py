"""The OpenAI-shaped answer of one request, built in one place from its ``StreamItem``s.

``respond`` runs the request's choices (``n``, or ``best_of`` candidates) through
``IngressCore.stream_items`` and turns their items into a completion or chat
completion: one JSON body, or server-sent events. The choices are forks of one
prefill: they go to one replica together (the first is routed, the others are
pinned to it), where the first computes the prompt and checkpoints it into the
tree and the others find it cached; each samples with its own seed (choice 0
with the request's, so ``n: 1`` answers as before). Text comes from the token
ids (``serve_app.output.TextStream``: detokenized exactly, cut at stop strings);
logprobs in OpenAI's shapes (``serve_app.logprobs``); usage counts the prompt
once and every generated token; the ``prefix_cache`` field comes from the first
choice. A stream ends with its data or with an error event, never silently.
"""

from __future__ import annotations

import asyncio
import json
import struct
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator

import xxhash
from fastapi.responses import StreamingResponse

from cluster.protocol import RouteDecision, StreamItem, Tenant
from serve_app import metrics
from serve_app.errors import APIError
from serve_app.logprobs import chat_logprobs, completion_logprobs
from serve_app.output import TextStream
from serve_app.protocol import ApiRequest
from serve_app.structured import assistant_text
from serve_app.timing import RequestClock

if TYPE_CHECKING:
    from serve_app.ingress import IngressCore


def choice_seed(seed: int, index: int) -> int:
    """Choice ``index``'s seed: the request's own for the first, a hash of (seed, index) after."""
    if index == 0:
        return seed
    return xxhash.xxh3_64_intdigest(struct.pack("<QQ", seed % (1 << 64), index)) >> 1


@dataclass
class Choice:
    index: int
    out: TextStream
    entries: list = field(default_factory=list)    # per generated token: (logprob, top) when asked
    prompt_entries: tuple | None = None            # echo with logprobs: per prompt token
    last: StreamItem | None = None
    text: list[str] = field(default_factory=list)

    @property
    def cumulative_logprob(self) -> float:
        return sum(lp for lp, _ in self.entries)


class ChoiceRunner:
    """The choices of one request and how each one's items are asked for."""

    def __init__(self, core: "IngressCore", gen: ApiRequest, tenant: Tenant | None, endpoint: str,
                 clock: RequestClock):
        self.core, self.gen, self.tenant, self.endpoint, self.clock = core, gen, tenant, endpoint, clock
        g = gen.generation
        self.count = g.choices_to_run if g is not None else 1
        self.want_logprobs = g.logprobs if g is not None else None
        self.echo = bool(g is not None and g.echo)
        # best_of ranks by cumulative logprob: ask for the sampled tokens' own at least.
        logprobs = self.want_logprobs
        if g is not None and g.best_of and logprobs is None:
            logprobs = 0
        self.logprobs = logprobs
        self.prompt_logprobs = self.want_logprobs if self.echo and self.want_logprobs is not None else None
        self.prompt_entries: tuple | None = None   # the prompt's logprobs (choice 0 asks for them)
        self.route: RouteDecision | None = None

    def new_choice(self, index: int) -> Choice:
        return Choice(index, TextStream(self.core.tokenizer, self.gen.stop, self.core.stop_token_ids(self.gen)))

    async def decide(self) -> None:
        """With several choices, one routing decision for all (they share the prefill)."""
        if self.count > 1:
            self.route = await self.core.router.route(self.gen.prompt, self.tenant)

    def items(self, index: int, whole: bool) -> AsyncIterator[StreamItem]:
        route = self.route
        if route is not None and index > 0 and route.worker_id is not None:
            route = RouteDecision.pinned(route.worker_id)
        return self.core.stream_items(self.gen, self.tenant, self.endpoint, self.clock if index == 0 else None,
                                      whole, seed=choice_seed(self.gen.seed, index), first_route=route,
                                      logprobs=self.logprobs,
                                      prompt_logprobs=self.prompt_logprobs if index == 0 else None,
                                      sibling=self.count > 1 or self.gen.batched)

    def take(self, choice: Choice, item: StreamItem) -> str:
        """Account one item to its choice; the text it makes safe to send."""
        choice.last = item
        if item.prompt_logprobs is not None:
            choice.prompt_entries = self.prompt_entries = item.prompt_logprobs
        if item.token is None:
            return ""
        if self.logprobs is not None:
            choice.entries.append((item.logprob, item.top_logprobs))
        return choice.out.push(item.token)


async def respond(core: "IngressCore", gen: ApiRequest, tenant: Tenant | None, endpoint: str, chat: bool,
                  clock: RequestClock):
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    runner = ChoiceRunner(core, gen, tenant, endpoint, clock)
    await runner.decide()
    if gen.stream:
        return await _streaming(runner, chat, rid, created)
    # Without stop strings the replica's own stops (EOS, stop ids, max_tokens) end it:
    # take the whole answer from one call. Stop strings need the text as it comes.
    whole = not gen.stop

    async def collect(index: int) -> Choice:
        choice = runner.new_choice(index)
        async with aclosing(runner.items(index, whole)) as items:
            async for item in items:
                choice.text.append(runner.take(choice, item))
                if choice.out.stopped:
                    break
        choice.text.append(choice.out.finish())
        return choice

    choices = await _all(collect(i) for i in range(runner.count))
    g = gen.generation
    kept = choices
    if g is not None and g.best_of:   # the n most likely of the candidates, in their order of likelihood
        kept = sorted(choices, key=lambda c: (-c.cumulative_logprob, c.index))[:g.n]
    body_choices = []
    for i, choice in enumerate(kept):
        text = "".join(choice.text)
        finish = choice.out.finish_reason(choice.last)
        if chat:
            message, finish = _chat_message(runner, choice, text, finish)
            entry: dict[str, Any] = {"index": i, "message": message, "logprobs": None, "finish_reason": finish}
            if runner.want_logprobs is not None:
                entry["logprobs"] = chat_logprobs(core.token_names, choice.out.ids, choice.entries)
        else:
            entry = {"index": i, "text": _echoed(runner, text), "token_ids": choice.out.ids, "logprobs": None,
                     "finish_reason": finish}
            if runner.want_logprobs is not None:
                entry["logprobs"] = _completion_logprobs(runner, choice)
        body_choices.append(entry)
    first = choices[0]
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": core.model_name, "choices": body_choices,
            "usage": usage(gen, [c.out.ids for c in choices], first.last),
            "prefix_cache": cache_info(first.last, clock, core.ingress_id)}


def _chat_message(runner: ChoiceRunner, choice: Choice, text: str, finish: str) -> tuple[dict, str]:
    """The assistant message of a chat choice (its tool calls parsed out when the
    request has tools) and its finish reason; its ids are remembered under the text
    the next turn will render for it, so that turn reuses their KV."""
    tools = runner.gen.tools
    calls: list[dict] = []
    content: str | None = text
    if tools is not None:
        content, calls = tools.parse(text)
    if not calls:
        runner.core.remember_reply(runner.tenant, text, choice.out.reply_ids())
        return {"role": "assistant", "content": text}, finish
    runner.core.remember_reply(runner.tenant, assistant_text(content, calls), choice.out.reply_ids())
    return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"


async def _all(coros) -> list:
    """Every coroutine's result; when one fails, the others are cancelled (their
    replica work with them) and the failure is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _prompt_text(runner: ChoiceRunner) -> str:
    gen = runner.gen
    return gen.prompt_text if gen.prompt_text is not None else runner.core.tokenizer.decode(gen.prompt)


def _echoed(runner: ChoiceRunner, text: str) -> str:
    return _prompt_text(runner) + text if runner.echo else text


def _completion_logprobs(runner: ChoiceRunner, choice: Choice, ids: list[int] | None = None,
                         entries: list | None = None, offset: int = 0, with_prompt: bool = True) -> dict:
    """The completions ``logprobs`` object of a choice (or of some of its tokens), the
    prompt's tokens first when it echoes them."""
    names = runner.core.token_names
    ids = choice.out.ids if ids is None else ids
    entries = choice.entries if entries is None else entries
    out = completion_logprobs(names, ids, entries, offset)
    if runner.echo and with_prompt:
        prompt = runner.gen.prompt
        known = choice.prompt_entries if choice.prompt_entries is not None else runner.prompt_entries
        head_entries = list(known) if known is not None else [None] * len(prompt)
        head = completion_logprobs(names, prompt, head_entries, 0)
        shift = len("".join(head["tokens"]))
        out = {key: head[key] + (out[key] if key != "text_offset" else [o + shift for o in out[key]])
               for key in out}
    return out


async def _streaming(runner: ChoiceRunner, chat: bool, rid: str, created: int) -> StreamingResponse:
    core, gen = runner.core, runner.gen
    count = runner.count
    iters = [runner.items(i, False) for i in range(count)]
    firsts: list[StreamItem | None] = []
    try:   # errors before the first token of any choice become HTTP errors
        for it in iters:
            try:
                firsts.append(await it.__anext__())
            except StopAsyncIteration:
                firsts.append(None)
    except BaseException:
        for it in iters:
            await it.aclose()
        raise
    kind = "chat.completion.chunk" if chat else "text_completion"
    choices = [runner.new_choice(i) for i in range(count)]
    opened = [False] * count

    def chunk(choice: Choice, text: str, ids: list[int], entries: list, finish: str | None = None,
              echo_head: bool = False) -> dict:
        i = choice.index
        if not chat:
            entry: dict[str, Any] = {"index": i, "text": text, "token_ids": ids, "finish_reason": finish}
            if runner.want_logprobs is not None:
                entry["logprobs"] = _completion_logprobs(runner, choice, ids, entries, with_prompt=echo_head)
        else:
            delta: dict[str, Any] = {"content": text} if text else {}
            if not opened[i]:
                delta["role"] = "assistant"
            entry = {"index": i, "delta": delta, "finish_reason": finish}
            if runner.want_logprobs is not None and ids:
                entry["logprobs"] = chat_logprobs(core.token_names, ids, entries)
        opened[i] = True
        return {"id": rid, "object": kind, "created": created, "model": core.model_name, "choices": [entry]}

    merger = _Merger(iters, firsts)

    hold = chat and gen.tools is not None

    async def sse():
        unsent: list[list[int]] = [[] for _ in range(count)]
        unsent_lp: list[list] = [[] for _ in range(count)]
        ended = [False] * count
        try:
            if runner.echo:   # the prompt first, as the first chunk of each choice
                if firsts[0] is not None and firsts[0].prompt_logprobs is not None:
                    runner.prompt_entries = firsts[0].prompt_logprobs
                for choice in choices:
                    yield _sse(chunk(choice, _prompt_text(runner), [], [], echo_head=True))
            async for i, item in merger:
                choice = choices[i]
                if isinstance(item, BaseException):
                    raise item
                if item is None or ended[i]:
                    continue
                piece = runner.take(choice, item)
                if item.token is not None:
                    unsent[i].append(item.token)
                    if runner.logprobs is not None:
                        unsent_lp[i].append(choice.entries[-1])
                    if hold:   # with tools the answer is a call or content: known at its end
                        if not opened[i]:
                            yield _sse(chunk(choice, "", [], []))
                        continue
                    if piece:   # text held back (a partial character or stop string) waits
                        yield _sse(chunk(choice, piece, unsent[i], unsent_lp[i]))
                        unsent[i], unsent_lp[i] = [], []
                    elif not opened[i]:   # but the first token opens the stream at once: an empty
                        yield _sse(chunk(choice, "", [], []))   # chunk (for chat the role one, as OpenAI sends)
                    if choice.out.stopped:   # a stop string: this choice generates no more
                        ended[i] = True
                        await merger.stop(i)
        except Exception as exc:   # the body has started: end it with an error event, never cut it
            error = exc if isinstance(exc, APIError) else core.api_error(exc)
            metrics.cut_streams.inc()
            if error.status >= 500:
                metrics.responses_5xx.inc(tags={"endpoint": runner.endpoint})
            yield _sse(error.body())
            yield "data: [DONE]\n\n"
            return
        finally:
            await merger.close()
        finishes = {}
        for choice in choices:
            rest = choice.out.finish()
            finish = choice.out.finish_reason(choice.last)
            if hold:
                message, finish = _chat_message(runner, choice, choice.out.text, finish)
                end = chunk(choice, message["content"] or "", unsent[choice.index], unsent_lp[choice.index])
                if message.get("tool_calls"):
                    end["choices"][0]["delta"]["tool_calls"] = [{"index": k, **call}
                                                                for k, call in enumerate(message["tool_calls"])]
                yield _sse(end)
            else:
                if rest or unsent[choice.index]:
                    yield _sse(chunk(choice, rest, unsent[choice.index], unsent_lp[choice.index]))
                if chat:
                    core.remember_reply(runner.tenant, choice.out.text, choice.out.reply_ids())
            finishes[choice.index] = finish
        usage_fields = {}
        if gen.include_usage:
            usage_fields = {"usage": usage(gen, [c.out.ids for c in choices], choices[0].last),
                            "prefix_cache": cache_info(choices[0].last, runner.clock, core.ingress_id)}
        for choice in choices:
            end = chunk(choice, "", [], [], finishes[choice.index])
            if count == 1:
                end.update(usage_fields)
            yield _sse(end)
        if count > 1 and usage_fields:   # OpenAI's shape: usage in a last chunk without choices
            yield _sse({"id": rid, "object": kind, "created": created, "model": core.model_name, "choices": [],
                        **usage_fields})
        yield "data: [DONE]\n\n"

    return StreamingResponse(sse(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class _Merger:
    """The items of several choices as they come: ``(index, item)``, ``(index, None)``
    when a choice ended, ``(index, exception)`` when it failed. One task per choice
    reads its iterator; ``stop(i)`` ends one choice (its replica work with it)."""

    def __init__(self, iters: list[AsyncIterator[StreamItem]], firsts: list[StreamItem | None]):
        self.iters, self.firsts = iters, firsts
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks: list[asyncio.Task] | None = None
        self.done = 0

    async def _pump(self, i: int) -> None:
        try:
            if self.firsts[i] is not None:
                await self.queue.put((i, self.firsts[i]))
                async for item in self.iters[i]:
                    await self.queue.put((i, item))
            await self.queue.put((i, None))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:   # reported to the consumer, who ends the stream with it
            await self.queue.put((i, exc))

    def __aiter__(self) -> "_Merger":
        if self.tasks is None:
            self.tasks = [asyncio.ensure_future(self._pump(i)) for i in range(len(self.iters))]
        return self

    async def __anext__(self) -> tuple[int, Any]:
        if self.done >= len(self.iters):
            raise StopAsyncIteration
        i, item = await self.queue.get()
        if item is None or isinstance(item, BaseException):
            self.done += 1
        return i, item

    async def stop(self, i: int) -> None:
        task = self.tasks[i]
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            self.done += 1
        await self.iters[i].aclose()

    async def close(self) -> None:
        for task in self.tasks or []:
            task.cancel()
        await asyncio.gather(*(self.tasks or []), return_exceptions=True)
        for it in self.iters:
            await it.aclose()


def merge_batch(bodies: list[dict]) -> dict:
    """One completions answer from the answers of a request's prompts, in order: the
    choices re-indexed across them, usage summed; ``prefix_cache`` is the first
    prompt's, ``prefix_cache_by_prompt`` every prompt's."""
    out = dict(bodies[0])
    choices, totals, cached = [], {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}, 0
    for body in bodies:
        for choice in body["choices"]:
            choices.append({**choice, "index": len(choices)})
        for key in totals:
            totals[key] += body["usage"][key]
        cached += body["usage"]["prompt_tokens_details"]["cached_tokens"]
    out["choices"] = choices
    out["usage"] = {**totals, "prompt_tokens_details": {"cached_tokens": cached}}
    out["prefix_cache_by_prompt"] = [body["prefix_cache"] for body in bodies]
    return out


def usage(gen: ApiRequest, outputs: list[list[int]], last: StreamItem | None) -> dict:
    """Counted against the client's own prompt (a resumed request's items count
    the tokens it was resumed with as prompt); the prompt once, every choice's output."""
    cached = min(last.cached_tokens, len(gen.prompt)) if last is not None else 0
    completion = sum(len(ids) for ids in outputs)
    return {"prompt_tokens": len(gen.prompt), "completion_tokens": completion,
            "total_tokens": len(gen.prompt) + completion, "prompt_tokens_details": {"cached_tokens": cached}}


def cache_info(last: StreamItem | None, clock: RequestClock | None = None, ingress_id: str | None = None) -> dict:
    last = last or StreamItem(None, True)
    migration = last.migration.to_json() if last.migration is not None else None
    info = {"worker_id": last.worker_id, "ingress_id": ingress_id, "reason": last.reason,
            "cached_tokens_by_tier": last.cached_by_tier(), "found_tokens_by_tier": last.found_by_tier(),
            "migration": migration}
    if clock is not None:   # who routed it, and where its time went (serve_app.timing)
        info["routed_by"] = clock.routed_by
        info["timing_ms"] = clock.breakdown_ms()
    return info


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"
