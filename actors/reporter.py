"""EventReporter: a worker's KV events and load, sent to the directory.

Runs on the engine thread (``tick`` after every iteration): pending events go
out at most every 20 ms, the load alone every 100 ms while it changes and every
500 ms while it does not (a heartbeat), never blocking generation. Any status
but "ok" (a gap, a resync, an unknown worker after a directory restart) or a
failed send makes the next tick push a full snapshot, and every snapshot goes
after registering again, with the worker's measured rates and peer address: a
directory that restarted, or dropped this worker, would otherwise know it only
as a name its reports carry (and admin calls, session prefetch and pulls from
this worker would reach nothing).

A heartbeat thread (``start_heartbeat``) sends the latest load when the engine
thread has sent nothing for 500 ms: one step longer than the directory's 3 s
liveness bound (a long prefill on shared cores) must not get a live worker
dropped with its index entries.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from cluster.protocol import LoadReport
from cluster.routing.events import EVENT_INTERVAL_S, HEARTBEAT_S, IDLE_HEARTBEAT_S, KVEventPublisher

log = logging.getLogger(__name__)

__all__ = ["EVENT_INTERVAL_S", "HEARTBEAT_S", "IDLE_HEARTBEAT_S", "EventReporter"]


class EventReporter:
    def __init__(self, worker_id: str, publisher: KVEventPublisher, directory, load: Callable[[], LoadReport],
                 on_report: Callable[[], None] | None = None, wake: Callable[[], None] = lambda: None,
                 register: Callable[[], None] | None = None, clock: Callable[[], float] = time.monotonic):
        """``directory``: a ``DirectoryLink`` (or anything with ``publish`` and
        ``push_snapshot``); ``on_report`` runs before each send (metrics);
        ``register`` registers the worker again (rates, peer address); ``load``
        must be safe to call from the heartbeat thread (an immutable snapshot)."""
        self.worker_id = worker_id
        self.publisher = publisher
        self.directory = directory
        self.load = load
        self.on_report = on_report
        self.wake = wake
        self.clock = clock
        self.register = register
        self.snapshot_wanted = False   # set from any thread; read and cleared on the engine thread
        # The directory saw a newer start of this worker id: this process is an old life
        # (a zombie) and says nothing more (any thread sets it).
        self.superseded = False
        self.heartbeats = 0            # sent by the heartbeat thread
        self._last_events = 0.0
        self._last_report = 0.0        # any thread, under _lock
        self._last_load: LoadReport | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def tick(self) -> None:
        if self.superseded:
            return
        now = self.clock()
        if now - self._last_events > EVENT_INTERVAL_S:
            self._last_events = now
            self.flush(now)
        if self.snapshot_wanted:
            self.send_snapshot()

    def flush(self, now: float | None = None, force: bool = False):
        """Send pending events (and the load); returns the send's future, or None
        when nothing was sent. ``force``: send the load even within the heartbeat."""
        now = self.clock() if now is None else now
        batch = self.publisher.drain()
        with self._lock:
            since = now - self._last_report
            if batch is None and not force:
                if since < HEARTBEAT_S:
                    return None
                load = self.load()
                if load == self._last_load and since < IDLE_HEARTBEAT_S:
                    return None
            else:
                load = self.load()
            self._last_report, self._last_load = now, load
        if self.on_report is not None:
            self.on_report()
        return self._publish(batch.encode() if batch is not None else None, load, "event publish")

    def _publish(self, data: bytes | None, load: LoadReport, what: str):
        """One send (any thread); its status, or None when the send failed."""
        try:
            status = self.directory.publish(self.worker_id, data, load)
        except Exception as exc:  # the directory may be restarting: resync later
            log.warning("%s from %s failed: %s", what, self.worker_id, exc)
            self.snapshot_wanted = True
            return None
        if hasattr(status, "add_done_callback"):
            status.add_done_callback(self._on_status)
        return status

    def _on_status(self, fut) -> None:
        # Runs on whatever thread completes the future: only set a flag.
        try:
            status = fut.result()
        except Exception:
            status = "failed"
        if status == "stale_epoch":
            if not self.superseded:
                log.error("the directory knows a newer start of %s: this process stops reporting", self.worker_id)
            self.superseded = True
        elif status != "ok":
            self.snapshot_wanted = True
            self.wake()

    # ------------------------------------------------------------ heartbeat
    def start_heartbeat(self, alive: Callable[[], bool] = lambda: True) -> None:
        """Start the heartbeat thread; it beats only while ``alive()`` (a wedged
        worker must stay dropped)."""
        def run() -> None:
            while not self._stop.wait(IDLE_HEARTBEAT_S / 2):
                if alive():
                    self.beat()
        self._thread = threading.Thread(target=run, name=f"heartbeat-{self.worker_id}", daemon=True)
        self._thread.start()

    def beat(self) -> bool:
        """(heartbeat thread) Send the latest load if nothing went out for
        ``IDLE_HEARTBEAT_S``; True if it sent."""
        now = self.clock()
        with self._lock:
            if self.superseded or now - self._last_report < IDLE_HEARTBEAT_S:
                return False
            self._last_report = now
        if self._publish(None, self.load(), "heartbeat") is None:
            return False
        self.heartbeats += 1
        return True

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def send_snapshot(self) -> None:
        self.snapshot_wanted = False
        snapshot = self.publisher.snapshot()
        try:
            if self.register is not None:   # first: the snapshot must not register it as a bare name
                self.register()
            self.directory.push_snapshot(self.worker_id, snapshot)
        except Exception as exc:
            log.warning("snapshot push from %s failed: %s", self.worker_id, exc)
            self.snapshot_wanted = True
