"""The OpenAI-shaped answer of one request, rendered from its choices' ``StreamItem``s.

``respond`` reads the items of a request's choices (``n``, or ``best_of``
candidates) from its ``ReplicaStream`` and turns them into a completion or
chat completion: one JSON body, or server-sent events. It never calls back
into the ingress: what it renders with (tokenizer, token names, the served
model's name, the chat reply memory) comes in a ``Presenter``. Text comes
from the token ids (``serve_app.output.TextStream``: detokenized exactly, cut
at stop strings); logprobs in OpenAI's shapes (``serve_app.logprobs``); usage
counts the prompt once and every generated token; the ``prefix_cache`` field
comes from the first choice. A stream ends with its data or with an error
event, never silently.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi.responses import StreamingResponse

from cluster.engine.text import ChatPromptBuilder
from cluster.engine.tokenizer import Tokenizer
from cluster.protocol import StreamItem
from serve_app import metrics
from serve_app.logprobs import TokenNames, chat_logprobs, completion_logprobs
from serve_app.output import TextStream
from serve_app.parse import ApiRequest
from serve_app.replica_stream import ReplicaStream
from serve_app.structured import assistant_text
from serve_app.timing import RequestClock


@dataclass(frozen=True)
class Presenter:
    """What answers are rendered with: the model's tokenizer and token names, the
    served model's name, this ingress replica's id, and the chat reply memory (the
    ids behind each reply, so the client's next turn reuses their KV)."""

    tokenizer: Tokenizer
    token_names: TokenNames
    model_name: str
    ingress_id: str | None
    prompts: ChatPromptBuilder

    def remember_reply(self, tenant: str | None, text: str, ids: list[int] | None) -> None:
        if ids is not None:   # remember_reply keeps them only if they decode to exactly ``text``
            self.prompts.remember_reply(tenant or "", text, ids)


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


class Answer:
    """One request's answer as it is built: its choices' text, logprobs and ends."""

    def __init__(self, stream: ReplicaStream, view: Presenter, chat: bool):
        self.stream, self.view, self.chat = stream, view, chat
        self.gen: ApiRequest = stream.gen
        self.rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.prompt_entries: tuple | None = None   # the prompt's logprobs (choice 0 asks for them)

    def new_choice(self, index: int) -> Choice:
        return Choice(index, TextStream(self.view.tokenizer, self.gen.stop, self.gen.params.stop_token_ids))

    def take(self, choice: Choice, item: StreamItem) -> str:
        """Account one item to its choice; the text it makes safe to send."""
        choice.last = item
        if item.prompt_logprobs is not None:
            choice.prompt_entries = self.prompt_entries = item.prompt_logprobs
        if item.token is None:
            return ""
        if self.stream.logprobs is not None:
            choice.entries.append((item.logprob, item.top_logprobs))
        return choice.out.push(item.token)

    def prompt_text(self) -> str:
        gen = self.gen
        return gen.prompt_text if gen.prompt_text is not None else self.view.tokenizer.decode(gen.prompt)

    def usage_fields(self, choices: list[Choice]) -> dict:
        return {"usage": usage(self.gen, [c.out.ids for c in choices], choices[0].last),
                "prefix_cache": cache_info(choices[0].last, self.stream.clock, self.view.ingress_id)}

    def chat_message(self, choice: Choice, text: str, finish: str) -> tuple[dict, str]:
        """The assistant message of a chat choice (its tool calls parsed out when the
        request has tools) and its finish reason; its ids are remembered under the text
        the next turn will render for it, so that turn reuses their KV."""
        tools = self.gen.tools
        calls: list[dict] = []
        content: str | None = text
        if tools is not None:
            content, calls = tools.parse(text)
        tenant = self.stream.tenant
        if not calls:
            self.view.remember_reply(tenant, text, choice.out.reply_ids())
            return {"role": "assistant", "content": text}, finish
        self.view.remember_reply(tenant, assistant_text(content, calls), choice.out.reply_ids())
        return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"

    def completion_logprobs(self, choice: Choice, ids: list[int] | None = None, entries: list | None = None,
                            with_prompt: bool = True) -> dict:
        """The completions ``logprobs`` object of a choice (or of some of its tokens), the
        prompt's tokens first when it echoes them."""
        names = self.view.token_names
        ids = choice.out.ids if ids is None else ids
        entries = choice.entries if entries is None else entries
        out = completion_logprobs(names, ids, entries, 0)
        if self.stream.echo and with_prompt:
            prompt = self.gen.prompt
            known = choice.prompt_entries if choice.prompt_entries is not None else self.prompt_entries
            head_entries = list(known) if known is not None else [None] * len(prompt)
            head = completion_logprobs(names, prompt, head_entries, 0)
            shift = len("".join(head["tokens"]))
            out = {key: head[key] + (out[key] if key != "text_offset" else [o + shift for o in out[key]])
                   for key in out}
        return out


async def respond(stream: ReplicaStream, view: Presenter, chat: bool):
    """The OpenAI response for one request: a JSON body, or a streaming response."""
    answer = Answer(stream, view, chat)
    await stream.decide()
    if stream.gen.stream:
        return await _streaming(answer)
    return await _whole(answer)


async def _whole(answer: Answer) -> dict:
    stream = answer.stream
    # Without stop strings the replica's own stops (EOS, stop ids, max_tokens) end it:
    # take the whole answer from one call. Stop strings need the text as it comes.
    whole = not answer.gen.stop

    async def collect(index: int) -> Choice:
        choice = answer.new_choice(index)
        async with aclosing(stream.items(index, whole)) as items:
            async for item in items:
                choice.text.append(answer.take(choice, item))
                if choice.out.stopped:
                    break
        choice.text.append(choice.out.finish())
        return choice

    choices = await _all(collect(i) for i in range(stream.count))
    kept = choices
    if stream.best_of:   # the n most likely of the candidates, in their order of likelihood
        kept = sorted(choices, key=lambda c: (-c.cumulative_logprob, c.index))[:stream.n]
    return {"id": answer.rid, "object": "chat.completion" if answer.chat else "text_completion",
            "created": answer.created, "model": answer.view.model_name,
            "choices": [_whole_choice(answer, i, choice) for i, choice in enumerate(kept)],
            **answer.usage_fields(choices)}


def _whole_choice(answer: Answer, index: int, choice: Choice) -> dict:
    text = "".join(choice.text)
    finish = choice.out.finish_reason(choice.last)
    want = answer.stream.want_logprobs is not None
    if answer.chat:
        message, finish = answer.chat_message(choice, text, finish)
        entry: dict[str, Any] = {"index": index, "message": message, "logprobs": None, "finish_reason": finish}
        if want:
            entry["logprobs"] = chat_logprobs(answer.view.token_names, choice.out.ids, choice.entries)
        return entry
    entry = {"index": index, "text": answer.prompt_text() + text if answer.stream.echo else text,
             "token_ids": choice.out.ids, "logprobs": None, "finish_reason": finish}
    if want:
        entry["logprobs"] = answer.completion_logprobs(choice)
    return entry


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


async def _streaming(answer: Answer) -> StreamingResponse:
    iters = [answer.stream.items(i) for i in range(answer.stream.count)]
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
    events = _Events(answer, firsts)
    return StreamingResponse(events.sse(_Merger(iters, firsts)), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class _Events:
    """The server-sent events of a streamed answer, choice by choice as items come."""

    def __init__(self, answer: Answer, firsts: list[StreamItem | None]):
        self.answer, self.firsts = answer, firsts
        count = answer.stream.count
        self.kind = "chat.completion.chunk" if answer.chat else "text_completion"
        self.choices = [answer.new_choice(i) for i in range(count)]
        self.opened = [False] * count
        self.ended = [False] * count
        self.unsent: list[list[int]] = [[] for _ in range(count)]
        self.unsent_lp: list[list] = [[] for _ in range(count)]
        self.hold = answer.chat and answer.gen.tools is not None   # tools: a call or content, known at the end

    def chunk(self, choice: Choice, text: str, ids: list[int], entries: list, finish: str | None = None,
              echo_head: bool = False) -> dict:
        answer, i = self.answer, choice.index
        want = answer.stream.want_logprobs is not None
        if not answer.chat:
            entry: dict[str, Any] = {"index": i, "text": text, "token_ids": ids, "finish_reason": finish}
            if want:
                entry["logprobs"] = answer.completion_logprobs(choice, ids, entries, with_prompt=echo_head)
        else:
            delta: dict[str, Any] = {"content": text} if text else {}
            if not self.opened[i]:
                delta["role"] = "assistant"
            entry = {"index": i, "delta": delta, "finish_reason": finish}
            if want and ids:
                entry["logprobs"] = chat_logprobs(answer.view.token_names, ids, entries)
        self.opened[i] = True
        return self.frame([entry])

    def frame(self, choices: list[dict], **extra) -> dict:
        answer = self.answer
        return {"id": answer.rid, "object": self.kind, "created": answer.created, "model": answer.view.model_name,
                "choices": choices, **extra}

    def unsent_chunk(self, choice: Choice, text: str, finish: str | None = None) -> dict:
        i = choice.index
        out = self.chunk(choice, text, self.unsent[i], self.unsent_lp[i], finish)
        self.unsent[i], self.unsent_lp[i] = [], []
        return out

    async def sse(self, merger: "_Merger") -> AsyncIterator[str]:
        answer = self.answer
        try:
            if answer.stream.echo:   # the prompt first, as the first chunk of each choice
                if self.firsts[0] is not None and self.firsts[0].prompt_logprobs is not None:
                    answer.prompt_entries = self.firsts[0].prompt_logprobs
                for choice in self.choices:
                    yield _sse(self.chunk(choice, answer.prompt_text(), [], [], echo_head=True))
            async for i, item in merger:
                if isinstance(item, BaseException):
                    raise item
                if item is not None and not self.ended[i]:
                    for event in self.on_item(self.choices[i], item):
                        yield _sse(event)
                    if self.ended[i]:   # a stop string: this choice generates no more
                        await merger.stop(i)
        except Exception as exc:   # the body has started: end it with an error event, never cut it
            error = answer.stream.calls.error_of(exc)
            metrics.cut_streams.inc()
            if error.status >= 500:
                metrics.responses_5xx.inc(tags={"endpoint": answer.stream.endpoint})
            yield _sse(error.body())
            yield "data: [DONE]\n\n"
            return
        finally:
            await merger.close()
        for event in self.ending():
            yield _sse(event)
        yield "data: [DONE]\n\n"

    def on_item(self, choice: Choice, item: StreamItem) -> list[dict]:
        """The chunks one item makes (none while text is held back)."""
        i = choice.index
        piece = self.answer.take(choice, item)
        if item.token is None:
            return []
        self.unsent[i].append(item.token)
        if self.answer.stream.logprobs is not None:
            self.unsent_lp[i].append(choice.entries[-1])
        out = []
        if piece and not self.hold:   # text held back (a partial character or stop string) waits
            out.append(self.unsent_chunk(choice, piece))
        elif not self.opened[i]:   # but the first token opens the stream at once: an empty
            out.append(self.chunk(choice, "", [], []))   # chunk (for chat the role one, as OpenAI sends)
        if choice.out.stopped and not self.hold:
            self.ended[i] = True
        return out

    def ending(self) -> list[dict]:
        """Each choice's rest and its finish reason, then usage."""
        out, finishes = [], {}
        for choice in self.choices:
            rest = choice.out.finish()
            finish = choice.out.finish_reason(choice.last)
            if self.hold:
                message, finish = self.answer.chat_message(choice, choice.out.text, finish)
                end = self.unsent_chunk(choice, message["content"] or "")
                if message.get("tool_calls"):
                    end["choices"][0]["delta"]["tool_calls"] = [{"index": k, **call}
                                                                for k, call in enumerate(message["tool_calls"])]
                out.append(end)
            else:
                if rest or self.unsent[choice.index]:
                    out.append(self.unsent_chunk(choice, rest))
                if self.answer.chat:
                    self.answer.view.remember_reply(self.answer.stream.tenant, choice.out.text,
                                                    choice.out.reply_ids())
            finishes[choice.index] = finish
        usage_fields = self.answer.usage_fields(self.choices) if self.answer.gen.include_usage else {}
        for choice in self.choices:
            end = self.chunk(choice, "", [], [], finishes[choice.index])
            if len(self.choices) == 1:
                end.update(usage_fields)
            out.append(end)
        if len(self.choices) > 1 and usage_fields:   # OpenAI's shape: usage in a last chunk without choices
            out.append(self.frame([], **usage_fields))
        return out


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
        info["timing_steps"] = clock.step_counts()
    return info


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"
