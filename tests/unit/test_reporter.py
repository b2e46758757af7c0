"""EventReporter against a recording directory: when the load goes out, the
heartbeat that covers a long engine step, and registering again after the
directory forgot the worker (no Ray: the directory is a fake with futures)."""

from __future__ import annotations

import concurrent.futures as cf

from actors.reporter import HEARTBEAT_S, IDLE_HEARTBEAT_S, EventReporter
from cluster.protocol import LoadReport


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class Publisher:
    def drain(self):
        return None

    def snapshot(self):
        return "snapshot"


class Directory:
    def __init__(self):
        self.calls: list[tuple] = []
        self.status = "ok"

    def publish(self, worker_id, batch, load):
        self.calls.append(("publish", worker_id, load))
        fut = cf.Future()
        fut.set_result(self.status)
        return fut

    def push_snapshot(self, worker_id, snapshot):
        self.calls.append(("snapshot", worker_id, snapshot))


def make(load):
    clock, directory, registered = Clock(), Directory(), []
    reporter = EventReporter("w0", Publisher(), directory, lambda: load[0], clock=clock,
                             register=lambda: registered.append(clock.now))
    return reporter, directory, clock, registered


def test_an_unchanged_load_goes_out_every_idle_heartbeat_and_a_changed_one_sooner():
    load = [LoadReport(0, 0)]
    reporter, directory, clock, _ = make(load)
    reporter.tick()
    assert len(directory.calls) == 1
    clock.now += HEARTBEAT_S + 0.01
    reporter.tick()
    assert len(directory.calls) == 1                 # unchanged, within the idle heartbeat
    clock.now += IDLE_HEARTBEAT_S
    reporter.tick()
    assert len(directory.calls) == 2                 # the idle heartbeat
    load[0] = LoadReport(40, 1)
    clock.now += HEARTBEAT_S + 0.01
    reporter.tick()
    assert directory.calls[-1] == ("publish", "w0", LoadReport(40, 1)) and len(directory.calls) == 3


def test_the_heartbeat_thread_covers_a_long_engine_step_and_only_then():
    load = [LoadReport(7, 1)]
    reporter, directory, clock, _ = make(load)
    reporter.tick()                                  # the engine thread reported
    clock.now += IDLE_HEARTBEAT_S / 2
    assert not reporter.beat() and len(directory.calls) == 1
    for _ in range(8):                               # a 4 s step: no tick from the engine thread
        clock.now += IDLE_HEARTBEAT_S
        assert reporter.beat()
    assert len(directory.calls) == 9 and reporter.heartbeats == 8
    assert all(c == ("publish", "w0", LoadReport(7, 1)) for c in directory.calls)
    clock.now += HEARTBEAT_S + 0.01
    reporter.tick()                                  # the step ended: nothing new to say yet
    assert len(directory.calls) == 9


def test_a_worker_the_directory_forgot_registers_again_then_sends_its_snapshot():
    load = [LoadReport(0, 0)]
    reporter, directory, clock, registered = make(load)
    directory.status = "unknown_worker"
    assert reporter.beat()                           # the heartbeat thread hears "unknown_worker"
    assert reporter.snapshot_wanted and registered == []
    directory.status = "ok"
    clock.now += 0.05
    reporter.tick()                                  # engine thread: register, then the snapshot
    assert registered == [clock.now] and directory.calls[-1] == ("snapshot", "w0", "snapshot")
    assert not reporter.snapshot_wanted
    clock.now += 0.05
    reporter.tick()
    assert len(registered) == 1                      # once


def test_a_failed_send_resyncs_by_registering_and_pushing_a_snapshot():
    """The directory was killed: the send fails, and the new directory must get the
    worker's rates and address before its snapshot (a snapshot alone registers it
    as a bare name: admin calls and pulls would not reach it)."""
    load = [LoadReport(0, 0)]
    reporter, directory, clock, registered = make(load)

    def gone(*args):
        raise RuntimeError("the actor is dead")
    directory.publish = gone
    reporter.tick()                                  # the send fails; the same tick resyncs
    assert registered == [clock.now] and directory.calls == [("snapshot", "w0", "snapshot")]
    assert not reporter.snapshot_wanted


def test_the_heartbeat_thread_stops_with_the_reporter_and_skips_a_dead_engine():
    load = [LoadReport(0, 0)]
    reporter, directory, clock, _ = make(load)
    reporter.start_heartbeat(alive=lambda: False)
    reporter.close()
    assert reporter._thread is not None and not reporter._thread.is_alive()
    assert directory.calls == []


def test_a_process_the_directory_knows_a_newer_start_of_falls_silent():
    load = [LoadReport(0, 0)]
    reporter, directory, clock, registered = make(load)
    directory.status = "stale_epoch"
    reporter.tick()
    assert reporter.superseded and not reporter.snapshot_wanted and len(directory.calls) == 1
    for _ in range(5):                               # no snapshot loop, no heartbeat: silent
        clock.now += IDLE_HEARTBEAT_S + 0.01
        reporter.tick()
        assert reporter.beat() is False
    assert len(directory.calls) == 1 and registered == []


def test_a_process_refused_with_its_own_clocks_epoch_asks_for_one_and_goes_on():
    """The directory did not answer at the start (the epoch is this node's clock's)
    and then knows a newer epoch of an earlier life: not a zombie, it asks for an
    issued epoch (one request at a time) and reports under it, from a snapshot."""
    from cluster.protocol import PublisherEpoch

    class EpochPublisher(Publisher):
        adopted: list[int] = []

        def adopt_epoch(self, epoch):
            self.adopted.append(epoch)

    load, asks, pending = [LoadReport(0, 0)], [], []

    def renew():
        asks.append(clock.now)
        fut = cf.Future()
        pending.append(fut)
        return fut

    clock, directory, registered = Clock(), Directory(), []
    publisher = EpochPublisher()
    reporter = EventReporter("w0", publisher, directory, lambda: load[0], clock=clock,
                             register=lambda: registered.append(clock.now), renew_epoch=renew)
    directory.status = "stale_epoch"
    reporter.tick()
    assert reporter.epoch_wanted and not reporter.superseded and asks == []
    clock.now += IDLE_HEARTBEAT_S + 0.01
    reporter.tick()                                  # asks; the answer is not back yet
    clock.now += IDLE_HEARTBEAT_S + 0.01
    reporter.tick()                                  # one request in flight: not asked again
    assert len(asks) == 1 and publisher.adopted == []
    pending[0].set_result(PublisherEpoch("w0", 42))
    directory.status = "ok"
    reporter.tick()
    assert publisher.adopted == [42] and not reporter.epoch_wanted and reporter.renew_epoch is None
    # Issued now: a later stale epoch is a real newer life, and this one falls silent.
    directory.status = "stale_epoch"
    clock.now += IDLE_HEARTBEAT_S + 0.01
    reporter.tick()
    assert reporter.superseded and len(asks) == 1


def test_an_unanswered_epoch_request_is_asked_again_after_its_bound():
    from actors.reporter import EPOCH_RENEW_S

    asks = []

    def renew():
        asks.append(clock.now)
        fut = cf.Future()
        fut.set_exception(TimeoutError("no directory"))
        return fut

    load = [LoadReport(0, 0)]
    clock, directory = Clock(), Directory()
    directory.status = "stale_epoch"
    reporter = EventReporter("w0", Publisher(), directory, lambda: load[0], clock=clock, renew_epoch=renew)
    reporter.tick()
    reporter.tick()                                  # asks: the request fails
    clock.now += EPOCH_RENEW_S - 0.01
    reporter.tick()
    assert asks == [100.0] and reporter.epoch_wanted
    clock.now += 0.02
    reporter.tick()
    assert len(asks) == 2 and asks[1] == clock.now
