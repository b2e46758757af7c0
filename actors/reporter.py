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

A "stale epoch" answer means the directory knows a newer start of this worker
id: the process falls silent (an old life). Unless its epoch is its own clock's
(the directory did not answer at its start, ``renew_epoch``): then it asks the
directory for an epoch, at most one request in flight (``EPOCH_RENEW_S``), and
publishes under it, from a snapshot.

With ``on_l3_shares`` each send asks the directory for the tenants' L3 counts
across the cluster (a ``PublishReply``, ``cluster.routing.l3_shares``); the
latest that came back is handed over at the next ``tick``, on the engine thread,
which owns the cache that enforces the shares.

A heartbeat thread (``start_heartbeat``) sends the latest load when the engine
thread has sent nothing for 500 ms: one step longer than the directory's 3 s
liveness bound (a long prefill on shared cores) must not get a live worker
dropped with its index entries.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Callable

from cluster.protocol import L3ShareCounts, LoadReport, PublishReply
from cluster.routing.events import EVENT_INTERVAL_S, HEARTBEAT_S, IDLE_HEARTBEAT_S, KVEventPublisher

log = logging.getLogger(__name__)

__all__ = ["EVENT_INTERVAL_S", "HEARTBEAT_S", "IDLE_HEARTBEAT_S", "EPOCH_RENEW_S", "EventReporter"]

EPOCH_RENEW_S = 5.0   # an epoch request unanswered this long is asked again


class EventReporter:
    def __init__(self, worker_id: str, publisher: KVEventPublisher, directory, load: Callable[[], LoadReport],
                 on_report: Callable[[], None] | None = None, wake: Callable[[], None] = lambda: None,
                 register: Callable[[], None] | None = None, clock: Callable[[], float] = time.monotonic,
                 renew_epoch: Callable[[], Future] | None = None,
                 on_l3_shares: Callable[[L3ShareCounts], None] | None = None):
        """``directory``: a ``DirectoryLink`` (or anything with ``publish`` and
        ``push_snapshot``); ``on_report`` runs before each send (metrics);
        ``register`` registers the worker again (rates, peer address); ``load``
        must be safe to call from the heartbeat thread (an immutable snapshot).
        ``renew_epoch``: only while the publisher's epoch is its own clock's, a
        request for one from the directory (a future of a ``PublisherEpoch``).
        ``on_l3_shares``: takes the tenants' L3 counts (engine thread); None: not asked."""
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
        self.renew_epoch = renew_epoch
        self.on_l3_shares = on_l3_shares
        self._l3_shares: L3ShareCounts | None = None   # set by a reply's callback, taken on the engine thread
        self.epoch_wanted = False              # refused, with an epoch of our own: ask for one
        self._epoch_asked_at: float | None = None
        self._issued_epoch: int | None = None  # set by the request's callback, adopted on the engine thread
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
        if self.epoch_wanted:
            self._renew_epoch(now)
        shares, self._l3_shares = self._l3_shares, None
        if shares is not None and self.on_l3_shares is not None:
            self.on_l3_shares(shares)
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
            if self.on_l3_shares is not None:
                status = self.directory.publish(self.worker_id, data, load, want_l3_shares=True)
            else:
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
        if isinstance(status, PublishReply):
            if status.l3_shares is not None:
                self._l3_shares = status.l3_shares
            status = status.status
        if status == "stale_epoch" and self.renew_epoch is not None:
            self.epoch_wanted = True   # our clock's epoch lost to an earlier life's: not a zombie
            self.wake()
        elif status == "stale_epoch":
            if not self.superseded:
                log.error("the directory knows a newer start of %s: this process stops reporting", self.worker_id)
            self.superseded = True
        elif status != "ok":
            self.snapshot_wanted = True
            self.wake()

    def _renew_epoch(self, now: float) -> None:
        """(engine thread) Adopt the epoch the directory handed out, or ask for one."""
        issued = self._issued_epoch
        if issued is not None:
            self.publisher.adopt_epoch(issued)   # the next batch resyncs: a snapshot follows
            log.info("%s publishes under the directory's epoch %d from now on", self.worker_id, issued)
            self.renew_epoch, self.epoch_wanted, self._issued_epoch = None, False, None
            return
        if self._epoch_asked_at is not None and now - self._epoch_asked_at < EPOCH_RENEW_S:
            return
        self._epoch_asked_at = now
        try:
            self.renew_epoch().add_done_callback(self._on_epoch)
        except Exception as exc:   # no directory now: asked again after EPOCH_RENEW_S
            log.warning("no publisher epoch for %s: %s", self.worker_id, exc)

    def _on_epoch(self, fut) -> None:
        # Runs on whatever thread completes the future: only set fields.
        try:
            self._issued_epoch = fut.result().epoch
        except Exception as exc:   # asked again EPOCH_RENEW_S after the request
            log.warning("no publisher epoch for %s: %s", self.worker_id, exc)
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
