"""EngineLoop: the one thread that owns a worker's engine, cache and scheduler.

Everything else (async request handlers, migrations, snapshots, stats) hands
it a command (``call``/``run``) that it runs between two batches, so no lock
guards the tree and the forward pass never waits on a caller. Tokens go back
to each request's event loop through ``call_soon_threadsafe``.

Owned by the engine thread: ``engine`` (its queues and stats), the cache, the
streams table, ``stats``. Published for other threads: ``load_report`` (a
frozen ``LoadReport`` replaced whole after each iteration). With ownership
checks on (``cluster.ownership``), the engine and the cache raise
``OwnershipError`` when another thread touches them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import queue
import threading
from typing import Any, AsyncIterator, Callable

from cluster.engine.runner import Engine, Request
from cluster.errors import CacheError
from cluster.ownership import ThreadOwner, checks_enabled
from cluster.protocol import FinishReason, LoadReport, StreamItem

log = logging.getLogger(__name__)


class QueueFullError(CacheError):
    """The worker's queue bound is reached; the caller should retry later (HTTP 429)."""


class EngineLoop:
    def __init__(self, name: str, engine: Engine, *, max_queued_requests: int,
                 on_idle: Callable[[], None] | None = None, on_tick: Callable[[], None] | None = None,
                 transfer_rate: Callable[[], float | None] = lambda: None):
        """``on_idle`` runs in idle gaps (housekeeping), ``on_tick`` after every
        iteration (event reports); both on the engine thread."""
        self.name = name
        self.engine = engine
        self.cache = engine.cache
        self.max_queued_requests = max_queued_requests
        self._on_idle, self._on_tick, self._transfer_rate = on_idle, on_tick, transfer_rate
        self.owner = ThreadOwner(f"engine-{name}")
        if checks_enabled():
            engine.owner = self.cache.owner = self.owner
        self.stats = {"rejected_queue_full": 0, "engine_step_failures": 0}
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.load_report = LoadReport(0, 0, 0)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"engine-{name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        self.owner.bind()
        while not self._stop.is_set():
            self._run_commands()
            if self.engine.has_work():
                try:
                    events = self.engine.step()
                except Exception as exc:   # never let the engine thread die: fail the step's requests
                    log.exception("engine step failed on %s", self.name)
                    self.stats["engine_step_failures"] += 1
                    self.engine.fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
                    events = self.engine.drain_ended()
                for ev in events:
                    self._deliver(ev.request, ev.token, ev.finished)
            else:  # idle gap: housekeeping that must never delay a batch
                if self._on_idle is not None:
                    self._on_idle()
                self._wake.wait(0.01)
                self._wake.clear()
            self.load_report = self.measure_load()
            if self._on_tick is not None:
                self._on_tick()

    def _run_commands(self) -> None:
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as exc:
                    fut.set_exception(exc)

    def _deliver(self, req: Request, token: int | None, finished: bool) -> None:
        entry = self._streams.get(req.request_id)
        if entry is None:
            return
        loop, q = entry
        item = StreamItem(token, finished, req.finish_reason, req.error, req.cached_tokens,
                          tuple(req.tier_hits), len(req.prompt))
        loop.call_soon_threadsafe(q.put_nowait, item)
        if finished:
            self._streams.pop(req.request_id, None)

    def measure_load(self) -> LoadReport:
        """(engine thread) Queued work in prefill-token equivalents."""
        self.owner.check("EngineLoop.measure_load")
        waiting = sum(len(r.prompt) - r.cached_tokens for r in self.engine.waiting)
        running = sum(r.params.max_tokens - len(r.output) for r in self.engine.running)
        return LoadReport(waiting + running, len(self.engine.running), len(self.engine.waiting),
                          self._transfer_rate())

    def wake(self) -> None:
        self._wake.set()

    # -------------------------------------------------------------- any thread
    def call(self, fn: Callable[[], Any]) -> cf.Future:
        """Run ``fn`` on the engine thread; returns a future for its result."""
        fut: cf.Future = cf.Future()
        self._commands.put((fn, fut))
        self._wake.set()
        return fut

    async def run(self, fn: Callable[[], Any]) -> Any:
        """Await ``fn`` run on the engine thread."""
        return await asyncio.wrap_future(self.call(fn))

    async def stream(self, req: Request) -> AsyncIterator[StreamItem]:
        """Submit ``req`` and yield its items; leaving early cancels it (its
        locks are released and what it computed is cached)."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def submit():   # the queue bound is read where the queue lives
            if len(self.engine.waiting) >= self.max_queued_requests:
                self.stats["rejected_queue_full"] += 1
                raise QueueFullError(f"worker {self.name} has {len(self.engine.waiting)} requests queued")
            self.engine.submit(req)
            self._streams[req.request_id] = (loop, q)

        await self.run(submit)
        try:
            while True:
                item = await q.get()
                if item.error:
                    raise CacheError(item.error)
                yield item
                if item.finished:
                    return
        finally:
            if not req.finished:  # the consumer went away: stop generating, release locks
                self.call(lambda: self.engine.cancel(req, FinishReason.CLIENT_DISCONNECTED))

    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        self.owner.release()   # shutdown (cache.close) runs on the caller's thread
