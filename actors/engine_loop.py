"""EngineLoop: the one thread that owns a worker's engine, cache and scheduler.

Everything else (async request handlers, migrations, snapshots, stats) hands
it a command (``call``/``run``) that it runs between two batches, so no lock
guards the tree and the forward pass never waits on a caller. A step's tokens go
back to their requests' event loop through one ``call_soon_threadsafe`` per loop.

Owned by the engine thread: ``engine`` (its queues and stats), the cache, the
streams table, ``stats``, ``ttft`` (the window of times to first token).
Published for other threads, each frozen and replaced whole after every
iteration: ``load_report`` (a ``LoadReport``, for the directory) and
``signals`` (a ``ReplicaSignals``, for the autoscaler:
``cluster.routing.autoscale_signals``). With ownership
checks on (``cluster.ownership``), the engine and the cache raise
``OwnershipError`` when another thread touches them.

The watchdog: a second thread that owns nothing of the engine's. The engine
thread stamps ``_progress_at`` after every iteration (idle ones included,
every 10 ms); when that stamp is older than ``watchdog_s`` while requests
are in flight or commands wait, the engine is wedged (a step that never
returns). The watchdog then trips once for good: every open stream ends
with ``EngineWedgedError``, new requests and commands are refused, ``alive()``
turns False (so the Serve health check fails and the actor's ``health``
raises) and ``on_trip`` runs (the shell reports the worker to the directory,
which drops it). A wedged thread cannot be stopped from outside, so the
replica is not reused: it is replaced.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import queue
import threading
import time
from typing import Any, AsyncIterator, Callable

from dataclasses import dataclass

from cluster.engine.engine import Engine, EngineRequest
from cluster.errors import CacheError
from cluster.ownership import ThreadOwner, checks_enabled
from cluster.protocol import STEP_COUNTS, FinishReason, LoadReport, MigrationResult, ReplicaTiming, StreamItem
from cluster.routing.autoscale_signals import ReplicaSignals, TtftWindow

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StreamContext:
    """What the worker knows about a request beyond the engine: why it was
    routed here, the migration run for it first, and when it arrived. Every
    ``StreamItem`` of the request is built from the engine's state and this."""

    reason: str = "direct"
    migration: MigrationResult | None = None
    migrate_s: float = 0.0
    received_at: float = 0.0   # wall clock (time.time()): the worker's generate() began


class QueueFullError(CacheError):
    """The worker's queue bound is reached; the caller should retry later (HTTP 429)."""


# The engine thread's wait between idle iterations (housekeeping, L3 results, the
# reporter's tick): it doubles from MIN to MAX while nothing arrives.
IDLE_WAIT_MIN_S = 0.01
IDLE_WAIT_MAX_S = 0.08
# Work is queued but no step could run (a prefix still on its way up to HOT, an L3 lookup
# not yet answered): the loop waits this long, or until new work or a command, before it
# looks again, instead of spinning through empty steps (dozens ahead of each fresh prompt's
# step, each taking the GIL from the replica's event loop: docs/benchmarks.md).
PENDING_WAIT_S = 0.002


class EngineWedgedError(CacheError):
    """The worker's engine made no progress for ``watchdog_s`` with work queued;
    its requests are failed and the worker is unhealthy for good. The request
    itself is fine: it can be resumed on another worker."""


def _step_fields(trace) -> dict:
    """A request's ``StepTrace`` as ``ReplicaTiming``'s step fields."""
    return {name: getattr(trace, name) for name in STEP_COUNTS}


def _put_all(items: list) -> None:
    """(on a caller's event loop) Each (queue, item) of a step, in order."""
    for q, item in items:
        q.put_nowait(item)


class EngineLoop:
    def __init__(self, name: str, engine: Engine, *, max_queued_requests: int,
                 on_idle: Callable[[], None] | None = None, on_tick: Callable[[], None] | None = None,
                 transfer_rate: Callable[[], float | None] = lambda: None,
                 prefill_rate: Callable[[], float | None] = lambda: None,
                 watchdog_s: float | None = 10.0, on_trip: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, gather_s: tuple[float, float] = (0.0, 0.0)):
        """``on_idle`` runs in idle gaps (housekeeping), ``on_tick`` after every
        iteration (event reports); both on the engine thread. ``watchdog_s``:
        the longest the engine may go without finishing an iteration while it
        has work (None: no watchdog); ``on_trip(reason)`` runs on the watchdog
        thread when it trips. ``gather_s``: (quiet, most) seconds the first step after an
        idle gap waits for more work (``_gather``). ``prefill_rate``: the prefill tokens/s
        the signals report until the engine measured its own (the calibrated rate)."""
        self.name = name
        self.gather_quiet_s, self.gather_max_s = gather_s
        self.engine = engine
        self.cache = engine.cache
        self.max_queued_requests = max_queued_requests
        self._on_idle, self._on_tick, self._transfer_rate = on_idle, on_tick, transfer_rate
        self._prefill_rate = prefill_rate
        self.owner = ThreadOwner(f"engine-{name}")
        if checks_enabled():
            engine.owner = self.cache.owner = self.owner
        self.stats = {"rejected_queue_full": 0, "engine_step_failures": 0, "tick_failures": 0, "idle_failures": 0,
                      "gathers": 0}
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # Open streams: written by the engine thread and by callers, read by the watchdog.
        # request id -> (caller's loop, its queue, engine-clock entry time, context)
        self._streams: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue, float, StreamContext]] = {}
        self._streams_lock = threading.Lock()
        self.load_report = LoadReport(0, 0, 0)
        self.signals = ReplicaSignals()
        self.clock = clock
        self.ttft = TtftWindow()
        self.watchdog_s = watchdog_s
        self._on_trip = on_trip
        self._progress_at = clock()     # replaced whole by the engine thread after each iteration
        self._working, self._worked_at = False, clock()   # written by the engine thread only (idle_s)
        self.wedged: str | None = None  # set once, by the watchdog: why the engine was declared wedged
        self.watchdog_trips = 0
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"engine-{name}", daemon=True)
        self._thread.start()
        self._watchdog = None
        if watchdog_s is not None:
            self._watchdog = threading.Thread(target=self._watch, name=f"watchdog-{name}", daemon=True)
            self._watchdog.start()

    def idle_s(self) -> float:
        """(any thread) How long the engine has been without work: 0 during an iteration
        that has some, else the time since the last one ended."""
        return 0.0 if self._working else max(0.0, self.clock() - self._worked_at)

    # ------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        self.owner.bind()
        idle_wait = IDLE_WAIT_MIN_S
        while not self._stop.is_set():
            self._run_commands()
            if self.engine.has_work():
                idle_wait = IDLE_WAIT_MIN_S
                self._working = True
                steps = self.engine.stats["steps"]
                try:
                    events = self.engine.step(defer_finish=True)
                except Exception as exc:   # never let the engine thread die: fail the step's requests
                    log.exception("engine step failed on %s", self.name)
                    self.stats["engine_step_failures"] += 1
                    self.engine.fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
                    events = self.engine.drain_ended()
                self._deliver_all(events)
                # The last tokens are on their way: now cache their sequences and unlock
                # (the client does not wait for the final token's KV or the insert).
                self.engine.complete_finished()
                self._worked_at, self._working = self.clock(), False
                if not events and self.engine.stats["steps"] == steps and self._wake.wait(PENDING_WAIT_S):
                    self._wake.clear()
            else:  # idle gap: housekeeping that must never delay a batch
                if self._on_idle is not None:
                    try:
                        self._on_idle()
                    except Exception:   # never let the engine thread die: the next idle gap tries again
                        log.exception("idle housekeeping failed on %s", self.name)
                        self.stats["idle_failures"] += 1
                # New work and commands set the event, so the wait costs them nothing;
                # it only spaces the idle housekeeping, more widely the longer it idles.
                if self._wake.wait(idle_wait):
                    idle_wait = IDLE_WAIT_MIN_S
                    self._gather()
                else:
                    idle_wait = min(IDLE_WAIT_MAX_S, idle_wait * 2)
                self._wake.clear()
            self.load_report, self.signals = self._measure()
            self._progress_at = self.clock()
            if self._on_tick is not None and self.wedged is None:   # a tripped worker stays dropped
                try:
                    self._on_tick()
                except Exception:   # never let the engine thread die: the reports go on next tick
                    log.exception("engine tick failed on %s", self.name)
                    self.stats["tick_failures"] += 1

    def _gather(self) -> None:
        """Work came to an idle engine: wait for what follows it closely, until ``gather_quiet_s``
        pass without a new arrival (``gather_max_s`` at most), so one step takes a burst whole:
        sessions behind one system prompt then ride on its fill (``Engine._ride``) instead of
        waiting a step for it. A lone request pays ``gather_quiet_s``; a loaded engine never
        waits (it is not idle). Only for a new fill (``Engine.new_fill_waiting``): a request whose
        prompt is mostly cached, a session's next turn, starts at once (the window cost every
        later turn its quiet time and shared nothing)."""
        if self.gather_max_s <= 0 or self.gather_quiet_s <= 0:
            return
        self._run_commands()   # the submits that woke the engine
        if not self.engine.new_fill_waiting():
            return
        self.stats["gathers"] += 1
        end = self.clock() + self.gather_max_s
        self._wake.clear()
        while (left := end - self.clock()) > 0 and self._wake.wait(min(self.gather_quiet_s, left)):
            self._wake.clear()

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

    def _deliver_all(self, events) -> None:
        """Hand a step's items to their streams: one wake-up of each caller's event loop for
        the whole step, not one a token (each wake-up takes a core from the next step's
        forward for a moment, and with two threads on two cores the other one waits)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for ev in events:
            posted = self._item(ev.request, ev.token, ev.finished)
            if posted is not None:
                by_loop.setdefault(posted[0], []).append(posted[1:])
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:   # that caller's event loop is closed: nobody is waiting
                pass

    def _item(self, req: EngineRequest, token: int | None, finished: bool):
        """(caller's loop, its queue, the StreamItem) for one event, or None (no stream)."""
        entry = self._streams.get(req.request_id)
        if entry is None:
            return None
        loop, q, entered, ctx = entry
        timing = None
        if token is not None and len(req.output) == 1 and None not in (req.scheduled_at, req.admitted_at,
                                                                        req.forward_at, req.first_token_at):
            timing = ReplicaTiming(queue_s=max(0.0, req.scheduled_at - entered),
                                   prefix_load_s=max(0.0, req.forward_at - req.scheduled_at),
                                   forward_s=max(0.0, req.first_token_at - req.forward_at),
                                   migrate_s=ctx.migrate_s, received_at=ctx.received_at,
                                   **_step_fields(req.trace))
        logprob, top, prompt_lps = None, (), None
        if token is not None and req.params.logprobs is not None and req.token_logprobs:
            logprob, top = req.token_logprobs[-1]
        if token is not None and len(req.output) == 1 and req.prompt_logprobs is not None:
            k = req.params.prompt_logprobs
            prompt_lps = tuple(None if e is None else (e[0], tuple(e[1][:k])) for e in req.prompt_logprobs)
        if token is not None and len(req.output) == 1 and req.first_token_at is not None:
            # The replica's TTFT: its migration, then from the hand-over to the engine on; and
            # its own prefill (its uncached tokens at the prefill rate), the part of it that
            # is not wait.
            rate = self._prefill_tokens_per_s()
            own = (len(req.prompt) - req.cached_tokens) / rate if rate > 0 else None
            self.ttft.add(self.clock(), ctx.migrate_s + max(0.0, req.first_token_at - entered), own)
        item = StreamItem(token, finished, req.finish_reason, req.error, req.cached_tokens, tuple(req.tier_hits),
                          len(req.prompt), self.name, ctx.reason, ctx.migration, timing, logprob, top, prompt_lps,
                          tiers_found=tuple(req.tiers_found))
        if finished:
            with self._streams_lock:
                self._streams.pop(req.request_id, None)
        return loop, q, item

    # --------------------------------------------------------- watchdog thread
    def _watch(self) -> None:
        period = min(0.25, self.watchdog_s / 4)
        while not self._stop.wait(period):
            if self.check_wedged():
                return

    def check_wedged(self) -> bool:
        """(watchdog thread, or a test) Trip if the engine has work and made no
        progress for ``watchdog_s``; True once tripped."""
        if self.wedged is not None:
            return True
        stalled = self.clock() - self._progress_at
        if stalled <= self.watchdog_s or not (self._streams or not self._commands.empty()):
            return False
        self.trip(f"engine of worker {self.name} made no progress for {stalled:.1f} s "
                  f"(watchdog bound {self.watchdog_s:g} s) with work queued")
        return True

    def trip(self, reason: str) -> None:
        """Declare the engine wedged: fail every open stream, refuse new work, report."""
        if self.wedged is not None:
            return
        self.wedged = reason
        self.watchdog_trips += 1
        log.error("watchdog: %s; failing its requests and marking the worker unhealthy", reason)
        with self._streams_lock:
            streams, self._streams = list(self._streams.values()), {}
        error = EngineWedgedError(reason)
        for loop, q, _, _ in streams:
            try:
                loop.call_soon_threadsafe(q.put_nowait, error)
            except RuntimeError:   # that caller's event loop is closed: nobody is waiting
                pass
        while True:   # commands that will never run: fail them instead of leaving callers waiting
            try:
                _, fut = self._commands.get_nowait()
            except queue.Empty:
                break
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EngineWedgedError(reason))
        if self._on_trip is not None:
            try:
                self._on_trip(reason)
            except Exception:   # reporting is best effort: the health check says it too
                log.exception("watchdog on_trip failed on %s", self.name)

    def measure_load(self) -> LoadReport:
        """(engine thread) Queued work in prefill-token equivalents."""
        return self._measure()[0]

    def _measure(self) -> tuple[LoadReport, ReplicaSignals]:
        """(engine thread) The load for the directory and the signals for the autoscaler."""
        self.owner.check("EngineLoop.measure_load")
        engine = self.engine
        waiting = sum(len(r.prompt) - r.cached_tokens for r in engine.scheduler.waiting)
        running = sum(r.params.max_tokens - len(r.output) for r in engine.scheduler.running)
        load = LoadReport(waiting + running, len(engine.scheduler.running), len(engine.scheduler.waiting), self._transfer_rate())
        now = self.clock()
        signals = ReplicaSignals(waiting, 1.0 if engine.blocked_for_room else 0.0, self.ttft.p90(now),
                                 len(engine.scheduler.running), self._prefill_tokens_per_s(),
                                 ttft_wait_p90_s=self.ttft.wait_p90(now), prefill_share=self.ttft.prefill_share(now))
        return load, signals

    def _prefill_tokens_per_s(self) -> float:
        """(engine thread) The engine's measured prefill rate, or the priced one until it has
        measured any (0: unknown)."""
        return self.engine.prefill_tokens_per_s or self._prefill_rate() or 0.0

    def wake(self) -> None:
        self._wake.set()

    # -------------------------------------------------------------- any thread
    def call(self, fn: Callable[[], Any]) -> cf.Future:
        """Run ``fn`` on the engine thread; returns a future for its result."""
        fut: cf.Future = cf.Future()
        if self.wedged is not None:
            fut.set_exception(EngineWedgedError(self.wedged))
            return fut
        self._commands.put((fn, fut))
        self._wake.set()
        return fut

    async def run(self, fn: Callable[[], Any]) -> Any:
        """Await ``fn`` run on the engine thread."""
        return await asyncio.wrap_future(self.call(fn))

    async def stream(self, req: EngineRequest, context: StreamContext = StreamContext()
                     ) -> AsyncIterator[StreamItem]:
        """Submit ``req`` and yield its items (built with ``context``); leaving
        early cancels it (its locks are released and what it computed is cached)."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        entered = self.engine.clock()   # the replica's queue time counts from here

        def submit():   # the queue bound is read where the queue lives
            if len(self.engine.scheduler.waiting) >= self.max_queued_requests:
                self.stats["rejected_queue_full"] += 1
                raise QueueFullError(f"worker {self.name} has {len(self.engine.scheduler.waiting)} requests queued")
            self.engine.submit(req)
            with self._streams_lock:
                self._streams[req.request_id] = (loop, q, entered, context)

        def refused(fut: cf.Future) -> None:   # the queue bound, a bad input, a wedged engine
            if fut.exception() is not None:
                try:
                    loop.call_soon_threadsafe(q.put_nowait, fut.exception())
                except RuntimeError:   # that caller's event loop is closed: nobody is waiting
                    pass

        # Not awaited: the first token (or the refusal) comes through the queue, one
        # cross-thread wake-up instead of two.
        self.call(submit).add_done_callback(refused)
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                if item.error:
                    raise CacheError(item.error)
                yield item
                if item.finished:
                    return
        finally:
            if not req.finished and self.wedged is None:   # the consumer went away: stop, release locks
                self.call(lambda: self.engine.cancel(req, FinishReason.CLIENT_DISCONNECTED))

    def alive(self) -> bool:
        """The engine thread runs and the watchdog has not declared it wedged."""
        return self._thread.is_alive() and self.wedged is None

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        if self._watchdog is not None:
            self._watchdog.join(timeout=5)
        self.owner.release()   # shutdown (cache.close) runs on the caller's thread
