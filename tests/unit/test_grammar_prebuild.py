"""A replica builds the grammars' tokenizer in the background only once its engine has idled
``GRAMMARS_AFTER_IDLE_S`` (``WorkerCore.prepare_grammars``): the build holds the GIL about 2 s,
and the engine's steps beside it ran 1.5-2.6x as long."""

import threading
from types import SimpleNamespace

from actors.core import GRAMMARS_AFTER_IDLE_S, WorkerCore
from tests.unit.helpers import make_worker


class ScriptedLoop:
    """An engine loop whose ``idle_s`` answers from a script (then its last value)."""

    def __init__(self, script):
        self.script, self.calls = list(script), 0

    def idle_s(self):
        self.calls += 1
        return self.script.pop(0) if len(self.script) > 1 else self.script[0]


class RecordingGrammars:
    def __init__(self, loop, ready=False):
        self.loop, self.ready, self.prepared_after = loop, ready, []
        self.build_s = 0.0

    def prepare(self):
        self.prepared_after.append(self.loop.calls)   # how many idle readings came before the build
        self.ready = True


def _prepare(script, ready=False, closing=False):
    loop = ScriptedLoop(script)
    grammars = RecordingGrammars(loop, ready)
    core = SimpleNamespace(grammars=grammars, loop=loop, worker_id="w", _closing=threading.Event())
    if closing:
        core._closing.set()
    before = set(threading.enumerate())
    WorkerCore.prepare_grammars(core)
    for thread in set(threading.enumerate()) - before:
        thread.join(timeout=30)
        assert not thread.is_alive()
    return grammars, loop


def test_the_build_waits_for_the_engine_to_idle_long_enough():
    busy = [0.0, 2.5, GRAMMARS_AFTER_IDLE_S - 0.1, GRAMMARS_AFTER_IDLE_S]
    grammars, _ = _prepare(busy)
    assert grammars.prepared_after == [4]   # built once, right after the fourth reading, not before


def test_no_build_when_a_request_built_them_first_or_the_worker_closes():
    grammars, _ = _prepare([0.0], ready=True)
    assert grammars.prepared_after == []   # already built (or by a constrained request): nothing started
    grammars, _ = _prepare([0.0], closing=True)
    assert grammars.prepared_after == [] and not grammars.ready


def test_a_real_engine_loop_never_reads_idle_while_it_has_work_and_idles_after():
    import asyncio
    import time

    from cluster.protocol import GenerateRequest, SamplingParams

    core = make_worker("idle-reader")
    readings = []

    async def generate_and_read():
        async for _ in core.generate(GenerateRequest(list(range(40)), SamplingParams(max_tokens=48))):
            readings.append(core.loop.idle_s())   # the engine has this request's work
    try:
        asyncio.run(generate_and_read())
        assert len(readings) >= 48 and max(readings) < 1.0   # between steps at most, never a second
        deadline = time.monotonic() + 30
        while core.loop.idle_s() < 0.3:   # then it idles, and says so
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        core.close()
