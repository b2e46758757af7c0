"""The ingress resumes a request whose replica died, without Serve: a fake
deployment handle whose replicas fail on cue, and a fake router deciding for
the ingress."""

import asyncio
import dataclasses
import json

import pytest
from ray.exceptions import ActorDiedError

from actors.engine_loop import EngineWedgedError
from actors.pytest_plugin import TEST_MODEL
from cluster.engine.checkpoint import ModelSpec, load_tokenizer
from cluster.errors import CacheError
from cluster.protocol import FinishReason, GenerateRequest, RouteDecision, StreamItem
from serve_app.errors import APIError
from serve_app.ingress import IngressCore
from serve_app.parse import Limits, parse_completion


class FakeRouter:
    """The ingress's decision: the worker of the next script, as a real router would choose it."""

    def __init__(self, replicas):
        self.replicas, self.asked = replicas, []

    async def route(self, prompt, tenant, exclude):
        self.asked.append((list(prompt), exclude))
        return RouteDecision(self.replicas.scripts[0][0], "test")


class FakeStream:
    def __init__(self, items, error):
        self.items, self.error, self.cancelled = items, error, False

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for item in self.items:
            yield item
        if self.error is not None:
            raise self.error

    def cancel(self):
        self.cancelled = True


class FakeReplicas:
    """Each call takes the next script: (worker id, tokens, error or None to finish)."""

    def __init__(self, scripts):
        self.scripts, self.payloads, self.streams = list(scripts), [], []

    def options(self, **_):
        return self

    @property
    def generate(self):
        return self

    def remote(self, payload):
        self.payloads.append(payload)
        worker, tokens, error = self.scripts.pop(0)
        items = [StreamItem(t, False, worker_id=worker) for t in tokens]
        if error is None:
            items[-1] = dataclasses.replace(items[-1], finished=True, finish_reason=FinishReason.LENGTH)
        stream = FakeStream(items, error)
        self.streams.append(stream)
        return stream

    @property
    def generate_all(self):
        return FakeWholeCalls(self)


class FakeWholeCalls:
    """``generate_all``: the call answers every item, or fails with none."""

    def __init__(self, replicas):
        self.replicas = replicas

    def remote(self, payload):
        stream = self.replicas.remote(payload)

        async def answer():
            if stream.error is not None:
                raise stream.error
            return stream.items
        call = FakeCall(answer(), stream)
        return call


class FakeCall:
    def __init__(self, coro, stream):
        self.coro, self.stream = coro, stream

    def __await__(self):
        return self.coro.__await__()

    def cancel(self):
        self.stream.cancelled = True


def gen(max_tokens=6, stream=False):
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": max_tokens, "temperature": 0.7, "seed": 42,
            "ignore_eos": True, "stream": stream, "stream_options": {"include_usage": False}}
    return parse_completion(body, Limits(), "m", load_tokenizer(ModelSpec.parse(TEST_MODEL)))


def collect(core, g):
    async def go():
        return [i async for i in core.stream(g, "t", "completions").items()]
    return asyncio.run(go())


def core_with(scripts, **kw):
    replicas = FakeReplicas(scripts)
    core = IngressCore(replicas, model=TEST_MODEL, router=FakeRouter(replicas), shared_replies=False, **kw)
    return core, replicas


def test_a_request_resumes_on_another_replica_from_the_tokens_sent():
    died = ActorDiedError()
    core, replicas = core_with([("r1", [10, 11], died), ("r2", [12], EngineWedgedError("wedged")),
                                ("r3", [13, 14, 15], None)])
    items = collect(core, gen())
    assert [i.token for i in items] == [10, 11, 12, 13, 14, 15] and items[-1].finished
    assert all(isinstance(p, GenerateRequest) for p in replicas.payloads)   # typed, not a dict
    second, third = replicas.payloads[1], replicas.payloads[2]
    assert second.prompt == [1, 2, 3, 10, 11] and second.params.max_tokens == 4
    assert third.prompt == [1, 2, 3, 10, 11, 12] and third.params.max_tokens == 3
    assert {p.params.seed for p in replicas.payloads} == {42}
    assert third.exclude == ("r1", "r2")
    # Each attempt was decided by the ingress, on the prompt it resumed with, away from the failed replicas.
    assert [p.route.worker_id for p in replicas.payloads] == ["r1", "r2", "r3"]
    assert core.router.asked[2] == ([1, 2, 3, 10, 11, 12], ["r1", "r2"])
    assert [s.cancelled for s in replicas.streams] == [True, True, False]


def test_no_replica_left_is_a_503_with_retry_after():
    core, replicas = core_with([("r1", [10], ActorDiedError())] * 3)
    with pytest.raises(APIError) as err:
        collect(core, gen())
    assert err.value.status == 503 and err.value.headers == {"Retry-After": "1"}
    assert err.value.body()["error"]["code"] == "replica_failed" and len(replicas.payloads) == 3


def test_a_request_failure_is_not_resumed():
    core, replicas = core_with([("r1", [10], CacheError("prompt too long for the KV cache"))])
    with pytest.raises(APIError) as err:
        collect(core, gen())
    assert err.value.status == 503 and err.value.body()["error"]["code"] == "kv_cache_unavailable"
    assert len(replicas.payloads) == 1


def test_an_unknown_failure_is_a_503_not_a_bare_500():
    core, _ = core_with([("r1", [10], KeyError("boom"))])
    with pytest.raises(APIError) as err:
        collect(core, gen())
    assert err.value.status == 503 and err.value.headers == {"Retry-After": "1"}


def test_a_stream_that_cannot_resume_ends_with_an_error_event_and_done():
    core, _ = core_with([("r1", [10, 11], ActorDiedError())] * 3, max_resumes=2)

    async def go():
        response = await core.complete(gen(stream=True), "t", "completions", chat=False)
        return [chunk async for chunk in response.body_iterator]
    chunks = asyncio.run(go())
    assert chunks[-1] == "data: [DONE]\n\n"
    error = json.loads(chunks[-2][len("data: "):])
    assert error["error"]["code"] == "replica_failed" and error["error"]["type"] == "server_error"
    tokens = [t for c in chunks[:-2] for t in json.loads(c[len("data: "):])["choices"][0]["token_ids"]]
    assert tokens == [10, 11, 10, 11, 10, 11]   # what each replica sent before it failed, all delivered


def test_a_non_streamed_answer_comes_whole_from_one_call_and_a_failed_one_starts_over_elsewhere():
    core, replicas = core_with([("r1", [10, 11], ActorDiedError()), ("r2", [20, 21, 22], None)])

    async def go():
        return await core.complete(gen(max_tokens=3), "t", "completions", chat=False)
    body = asyncio.run(go())
    assert body["choices"][0]["token_ids"] == [20, 21, 22]   # r1 sent nothing: nothing of it shows
    first, second = replicas.payloads
    assert second.prompt == [1, 2, 3] and second.params.max_tokens == 3   # from scratch, same seed
    assert second.params.seed == 42 and second.exclude == ("r1",)       # never the replica that failed
    assert [s.cancelled for s in replicas.streams] == [True, False]
