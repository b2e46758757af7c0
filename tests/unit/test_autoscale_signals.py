"""A worker's autoscaling signals without Ray: what its engine thread publishes after each
iteration (``EngineLoop.signals``) and what Serve's hook returns (``record_autoscaling_stats``)."""

import asyncio
import threading
import time
from types import SimpleNamespace

from actors.worker import CacheWorker
from cluster.cache.tier_types import Readiness
from cluster.routing.autoscale_signals import METRIC_NAMES
from tests.unit.helpers import TickClock, make_worker, run_worker


def published(core):
    """The signals the engine thread publishes at the end of the iteration whose start runs a
    command (so measured after everything before the call). Not those current when the
    command runs: before the loop's first iteration ends they are the defaults (zeros), which
    made the prefill rate read 0.0 on a loaded machine."""
    at_start = asyncio.run(core.loop.run(lambda: core.loop.signals))
    deadline = time.monotonic() + 60
    while core.signals() is at_start and time.monotonic() < deadline:   # each iteration publishes anew
        time.sleep(0.001)
    assert core.signals() is not at_start, "the engine thread published nothing for 60 s"
    return core.signals()


def hook(core):
    return asyncio.run(CacheWorker.record_autoscaling_stats(SimpleNamespace(core=core)))


def test_the_replica_ttft_enters_the_p90_and_the_hook_reports_every_signal():
    core = make_worker("w-s")
    try:
        idle = published(core)
        assert (idle.queued_prompt_tokens, idle.blocked_for_room, idle.ttft_p90_s, idle.engine_running) == (0, 0, 0, 0)
        # The engine's own measured prefill rate, or the worker's priced one until it has measured any.
        own = asyncio.run(core.loop.run(lambda: core.engine.prefill_tokens_per_s or core.cost.prefill_tokens_per_s))
        assert own > 0 and idle.prefill_tokens_per_s == own
        # Its own prefill at a rate of 20 tokens/s (set on the engine thread): 40 uncached
        # tokens are 2 s of each TTFT. The engine's clock ticks once a call: handed over (1) ...
        # first token sampled (6): a TTFT of 5 s, of which 3 s are wait.
        asyncio.run(core.loop.run(lambda: setattr(core.loop, "_prefill_tokens_per_s", lambda: 20.0)))
        core.engine.clock = TickClock()
        run_worker(core, list(range(40)), max_tokens=3)
        first = published(core)
        assert (first.ttft_p90_s, first.ttft_wait_p90_s, first.prefill_share) == (5.0, 3.0, 2.0 / 30.0)
        core.engine.clock = TickClock()
        run_worker(core, list(range(100, 140)), max_tokens=3)
        both = published(core)   # the window's prefill: 4 s of its 30
        assert (both.ttft_p90_s, both.ttft_wait_p90_s, both.prefill_share, both.prefill_tokens_per_s) == \
            (5.0, 3.0, 4.0 / 30.0, 20.0)
        metrics = hook(core)
        assert set(metrics) == set(METRIC_NAMES) and metrics["ttft_p90_s"] == 5.0
        assert all(isinstance(v, float) for v in metrics.values())   # what Serve accepts: numbers only
        assert asyncio.run(core.stats())["autoscaling"] == metrics
    finally:
        core.close()


def test_a_request_waiting_for_hot_room_is_queued_prefill_and_blocked_while_it_waits():
    core = make_worker("w-r")
    try:
        real_ready, looked, release = core.engine.cache.ready, threading.Event(), threading.Event()
        looks = []

        def ready(*args, **kwargs):   # no HOT room for its prefix's promotion until released
            if not release.is_set():
                looks.append(1)
                if len(looks) >= 2:
                    looked.set()
                return Readiness(False, [0, 16, 0, 0], blocked=True)
            return real_ready(*args, **kwargs)

        core.engine.cache.ready = ready

        async def scenario():
            from cluster.protocol import GenerateRequest, SamplingParams

            async def consume():
                return [i async for i in core.generate(GenerateRequest(list(range(40)), SamplingParams(max_tokens=2)))]
            task = asyncio.ensure_future(consume())
            await asyncio.to_thread(looked.wait)
            await core.loop.run(lambda: None)
            during = core.signals()
            release.set()
            core.loop.wake()
            await task
            await core.loop.run(lambda: None)
            return during, core.signals()
        during, after = asyncio.run(scenario())
        assert (during.queued_prompt_tokens, during.blocked_for_room, during.engine_running) == (40, 1.0, 0)
        assert (after.queued_prompt_tokens, after.blocked_for_room) == (0, 0.0)
        assert core.engine.stats["waits_for_promotion_room"] >= 2
    finally:
        core.close()


def test_the_hook_is_empty_before_the_worker_started():
    assert hook(None) == {}
