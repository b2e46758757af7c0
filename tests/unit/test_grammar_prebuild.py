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


class RecordingPool:
    """A pool whose ``prefault`` maps one chunk per call of its loop (``host_memory.populate``'s
    shape): it records the idle reading each chunk was mapped after."""

    def __init__(self, loop, chunks):
        self.loop, self.chunks, self.mapped_after = loop, chunks, []

    def prefault(self, stop, pause):
        while len(self.mapped_after) < self.chunks and not stop():
            if pause():
                continue
            self.mapped_after.append(self.loop.calls)
        return {"bytes": len(self.mapped_after), "seconds": 0.0, "supported": True}


def test_the_pools_pages_are_mapped_only_while_the_engine_idles():
    """Mapped beside a burst's first turns right after ready (the kernel zeroing pages on the two
    cores the forward passes use), 16 first turns took 2.9-4.6 s at the p50 against 1.3 s: each
    chunk now waits for the engine to have idled ``POOLS_AFTER_IDLE_S``."""
    from actors.core import POOLS_AFTER_IDLE_S

    loop = ScriptedLoop([POOLS_AFTER_IDLE_S, 0.0, 0.0, POOLS_AFTER_IDLE_S + 1, 0.2, POOLS_AFTER_IDLE_S])
    pool = RecordingPool(loop, chunks=3)
    core = SimpleNamespace(cache=SimpleNamespace(pools=[pool]), loop=loop, worker_id="w", _closing=threading.Event())
    before = set(threading.enumerate())
    WorkerCore.prepare_pools(core)
    for thread in set(threading.enumerate()) - before:
        thread.join(timeout=30)
        assert not thread.is_alive()
    assert pool.mapped_after == [1, 4, 6]   # after each idle reading only, never while the engine worked


def test_populate_waits_while_paused_and_stops_when_told():
    import mmap

    from cluster.cache import host_memory

    mapping = mmap.mmap(-1, 3 * host_memory.POPULATE_CHUNK_BYTES)
    try:
        answers = iter([True, True, False, True, False, False])
        done = host_memory.populate(mapping, pause=lambda: next(answers))
        if done["supported"]:
            assert done["bytes"] == len(mapping)
        stopped = host_memory.populate(mapping, stop=lambda: True, pause=lambda: True)
        assert stopped["bytes"] == 0
        reads = iter([False, True, True])
        halted = host_memory.populate(mapping, stop=lambda: next(reads), pause=lambda: True)
        assert halted["bytes"] == 0   # paused from the start, then stopped: nothing mapped
    finally:
        mapping.close()
