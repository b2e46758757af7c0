"""EventReporter: a worker's KV events and load, sent to the directory.

Runs on the engine thread (``tick`` after every iteration): pending events go
out at most every 20 ms, the load alone every 100 ms while it changes and every
500 ms while it does not (a heartbeat), never blocking generation. Any status but "ok" (a gap, a resync, an unknown worker
after a directory restart) or a failed send makes the next tick push a full
snapshot.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from cluster.protocol import LoadReport
from cluster.routing.events import EVENT_INTERVAL_S, HEARTBEAT_S, IDLE_HEARTBEAT_S, KVEventPublisher

log = logging.getLogger(__name__)

__all__ = ["EVENT_INTERVAL_S", "HEARTBEAT_S", "IDLE_HEARTBEAT_S", "EventReporter"]


class EventReporter:
    def __init__(self, worker_id: str, publisher: KVEventPublisher, directory, load: Callable[[], LoadReport],
                 on_report: Callable[[], None] | None = None, wake: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic):
        """``directory``: a ``DirectoryLink`` (or anything with ``publish`` and
        ``push_snapshot``); ``on_report`` runs before each send (metrics)."""
        self.worker_id = worker_id
        self.publisher = publisher
        self.directory = directory
        self.load = load
        self.on_report = on_report
        self.wake = wake
        self.clock = clock
        self.snapshot_wanted = False   # set from any thread; read and cleared on the engine thread
        self._last_events = 0.0
        self._last_report = 0.0
        self._last_load: LoadReport | None = None

    def tick(self) -> None:
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
        try:
            status = self.directory.publish(self.worker_id, batch.encode() if batch is not None else None, load)
        except Exception as exc:  # the directory may be restarting: resync later
            log.warning("event publish from %s failed: %s", self.worker_id, exc)
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
        if status != "ok":
            self.snapshot_wanted = True
            self.wake()

    def send_snapshot(self) -> None:
        self.snapshot_wanted = False
        snapshot = self.publisher.snapshot()
        try:
            self.directory.push_snapshot(self.worker_id, snapshot)
        except Exception as exc:
            log.warning("snapshot push from %s failed: %s", self.worker_id, exc)
            self.snapshot_wanted = True
