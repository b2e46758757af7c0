"""Asynchronous copy engines: tier moves that never stall the forward pass.

Every engine implements ``CopyEngine``: ``submit`` returns an operation id at
once, ``poll`` returns the operations that finished (with their error, if
any), ``wait`` blocks on one operation. Completions are applied by the owner
of the cache when it polls: background threads never touch the tree.

- ``ThreadEngine``: a worker thread runs each job (tensor copies release the
  GIL, so the caller's compute loop keeps its core); used for host copies
  without CUDA and for disk IO everywhere.
- ``CudaStreamEngine``: copies are queued on a dedicated non-blocking CUDA
  stream, after the producer stream's pending work; each operation records an
  event, polled with ``event.query()``; a consumer that needs the data waits on
  that event only (``wait_on_stream``), never on the whole device.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch


class Pacer:
    """Keeps a background stream of copies at or under ``bytes_per_s``
    (``account`` sleeps when the stream runs ahead). None: no limit."""

    def __init__(self, bytes_per_s: float | None):
        self.bytes_per_s = bytes_per_s
        self._start = time.perf_counter()
        self._budget_t = self._start

    def account(self, nbytes: int) -> None:
        if not self.bytes_per_s:
            return
        now = time.perf_counter()
        # Idle time is not banked: a burst after a pause still goes at the rate.
        self._budget_t = max(self._budget_t, now) + nbytes / self.bytes_per_s
        ahead = self._budget_t - time.perf_counter()
        if ahead > 0:
            time.sleep(ahead)


@dataclass(slots=True)
class Completion:
    op_id: int
    error: BaseException | None
    seconds: float = 0.0   # the job's own run time (0.0 where the engine does not time it)


@runtime_checkable
class CopyEngine(Protocol):
    """What ``TieredCache`` needs from a copy engine (thread, CUDA stream, or immediate)."""

    def submit(self, job: Callable[[], None]) -> int:
        """Run ``job`` in the background; returns its operation id at once."""

    def submit_copies(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, paced: bool = True,
                      codec: Any = None) -> int:
        """Copy each ``(dst, src)`` pair in the background, as one operation; with a
        ``codec`` (``cluster.cache.codec``) each copy encodes or decodes on the way."""

    def poll(self) -> list[Completion]:
        """Operations finished since the last poll (never blocks)."""

    def wait(self, op_id: int) -> None:
        """Block until ``op_id`` finished (its completion still arrives through ``poll``)."""

    def in_flight(self) -> int: ...

    def close(self) -> None: ...


class ThreadEngine:
    """Runs jobs on one worker thread.

    ``drain_on_poll`` makes completion timing deterministic (every job
    submitted before a ``poll`` is complete when it returns), for property
    tests and simulations that must replay exactly; the copies still run on
    the worker thread.
    """

    def __init__(self, name: str, *, drain_on_poll: bool = False, max_bytes_per_s: float | None = None):
        """``max_bytes_per_s`` paces copies: on a CPU-only host the "device" and
        host pools share DRAM bandwidth with the forward pass, and an unpaced
        copy slows a memory-bound step by as much as it takes (measured: 2x at
        full speed, 6% at 1 GB/s on this 2-core VM). None: as fast as possible."""
        if max_bytes_per_s is not None and max_bytes_per_s <= 0:
            raise ValueError(f"max_bytes_per_s must be positive, got {max_bytes_per_s}")
        self.drain_on_poll = drain_on_poll
        self.max_bytes_per_s = max_bytes_per_s
        self.pacer = Pacer(max_bytes_per_s)   # used by jobs on this engine's single thread
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._ids = itertools.count(1)
        self._done: queue.SimpleQueue[Completion] = queue.SimpleQueue()
        self._futures: dict[int, Future] = {}
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], float | None]) -> int:
        op_id = next(self._ids)

        def run() -> None:
            err = None
            began = time.perf_counter()
            seconds = None
            try:
                seconds = job()
            except BaseException as exc:  # reported to the owner, never lost
                err = exc
            # A job may time itself (a float: the staged upload's copies on the device, which
            # the host's wall time would add queued compute to); else its wall time here.
            if not isinstance(seconds, float):
                seconds = time.perf_counter() - began
            self._done.put(Completion(op_id, err, seconds))

        self._futures[op_id] = self._pool.submit(run)
        return op_id

    def submit_copies(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, paced: bool = True,
                      codec: Any = None) -> int:
        """Copy ``dst.copy_(src)`` for each pair on the worker thread (with a ``codec``:
        encode or decode, here, off the caller's thread). ``paced`` applies
        ``max_bytes_per_s`` (background demotions); a promotion that a request waits
        for passes False. Pacing counts the bytes of the larger side."""
        pace = paced and self.max_bytes_per_s is not None

        def copy_all() -> None:
            for dst, src in pairs:
                # Runs of whole blocks are copied a block at a time when paced.
                chunks = zip(dst, src) if pace and dst.dim() == 6 and dst.shape[0] > 1 else [(dst, src)]
                for d, s in chunks:
                    if codec is not None:
                        codec.copy_kv(d, s)
                    else:
                        d.copy_(s)
                    if pace:
                        self.pacer.account(max(d.numel() * d.element_size(), s.numel() * s.element_size()))
        return self.submit(copy_all)

    def poll(self) -> list[Completion]:
        if self.drain_on_poll:
            for fut in list(self._futures.values()):
                fut.result()
        out = []
        while True:
            try:
                c = self._done.get_nowait()
            except queue.Empty:
                return out
            self._futures.pop(c.op_id, None)
            out.append(c)

    def wait(self, op_id: int) -> None:
        fut = self._futures.get(op_id)
        if fut is not None:
            fut.result()

    def in_flight(self) -> int:
        return len(self._futures)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class CudaStreamEngine:
    """Copies on a dedicated CUDA stream, completion tracked by events. Each op is timed by a
    pair of timing events on the copy stream, the first recorded after the stream has waited
    for the forward pass's queued work: a completion's ``seconds`` is the copy's own time
    on the device (what ``TieredCache.ready`` weighs against recomputing), not 0."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self._ids = itertools.count(1)
        self._events: dict[int, torch.cuda.Event] = {}
        self._starts: dict[int, torch.cuda.Event] = {}
        self._keepalive: dict[int, list] = {}

    def _timed(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        return event

    def submit_copies(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, paced: bool = True,
                      codec: Any = None) -> int:
        """With a ``codec`` the conversion is queued on the copy stream too, on the
        device side of each copy (only the stored bytes cross the bus)."""
        op_id = next(self._ids)
        producer = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            # Source KV may still be being written by the forward pass.
            self.stream.wait_stream(producer)
            start = self._timed()
            for dst, src in pairs:
                if codec is not None:
                    codec.copy_kv(dst, src, non_blocking=True)
                else:
                    dst.copy_(src, non_blocking=True)
            event = self._timed()
        for dst, src in pairs:  # the allocator must not reuse memory the copy reads or writes
            for t in (dst, src):
                if t.is_cuda:
                    t.record_stream(self.stream)
        self._events[op_id], self._starts[op_id] = event, start
        self._keepalive[op_id] = list(pairs)
        return op_id

    def submit(self, job: Callable[[], None]) -> int:
        op_id = next(self._ids)
        with torch.cuda.stream(self.stream):
            start = self._timed()
            job()
            event = self._timed()
        self._events[op_id], self._starts[op_id] = event, start
        return op_id

    def poll(self) -> list[Completion]:
        done = [op for op, ev in self._events.items() if ev.query()]
        out = []
        for op in done:
            end, start = self._events.pop(op), self._starts.pop(op, None)
            self._keepalive.pop(op, None)
            out.append(Completion(op, None, start.elapsed_time(end) / 1e3 if start is not None else 0.0))
        return out

    def wait(self, op_id: int) -> None:
        ev = self._events.get(op_id)
        if ev is not None:
            ev.synchronize()

    def wait_on_stream(self, op_id: int, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` (default: current) wait for ``op_id`` without blocking the host."""
        ev = self._events.get(op_id)
        if ev is not None:
            (stream or torch.cuda.current_stream(self.device)).wait_event(ev)

    def in_flight(self) -> int:
        return len(self._events)

    def close(self) -> None:
        self.stream.synchronize()


class ImmediateEngine:
    """For caches without KV payload (simulation): every move completes at once."""

    def __init__(self):
        self._ids = itertools.count(1)
        self._done: list[Completion] = []

    def submit(self, job: Callable[[], None]) -> int:
        op_id = next(self._ids)
        self._done.append(Completion(op_id, None))
        return op_id

    def submit_copies(self, pairs, *, paced: bool = True, codec: Any = None) -> int:
        return self.submit(lambda: None)

    def poll(self) -> list[Completion]:
        out, self._done = self._done, []
        return out

    def wait(self, op_id: int) -> None:
        pass

    def in_flight(self) -> int:
        return len(self._done)

    def close(self) -> None:
        pass


def make_copy_engine(device: torch.device, *, deterministic: bool = False,
                     max_bytes_per_s: float | None = None) -> CopyEngine:
    if device.type == "cuda":
        return CudaStreamEngine(device)  # DMA engines: no pacing needed
    return ThreadEngine("kv-copy", drain_on_poll=deterministic, max_bytes_per_s=max_bytes_per_s)
