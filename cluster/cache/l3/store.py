"""L3: a cluster-wide block store on Mooncake Store (client side).

Below COLD, blocks live in Mooncake Store so any replica can read what another
computed and the cache outlives the replica that computed it (DESIGN.md,
"Lifetime"). This module is the client: keys, the value format, verification,
timeouts and the "off" state; docs/l3.md has the details. Pure library: no
Ray, and ``mooncake`` is imported lazily.

Who owns the pool. A Mooncake object lives in the memory segment of one client
process; when that process dies its objects are gone (at once for reads, for
the master after ``client_ttl``). If replicas contributed segments, a replica
removed by the autoscaler or killed with ``kill -9`` would take its share of
L3 with it (measured: a killed writer with its own segment lost 3 of its 8
blocks; a consumer lost none), which is what L3 is there to survive. So a
replica is a *consumer* (``segment_bytes=0``): it stores into other clients'
segments through a small staging buffer. The pool is held by one standalone
``mooncake_client`` per node (``cluster.cache.l3.master`` starts one), a
process that runs no model and is not scaled with traffic. A replica's death
loses nothing in L3; a holder's death loses that node's share
(``replica_num=2`` across nodes survives it, at twice the memory).

Keys ``pc/<model_id>/<layout_version>/<block hash>``: the tenant-salted chained
hash of ``cluster.hashing``, and ``kv_layout_version`` naming the KV format.
Values: a header (magic, format, dtype, shape, token count, a digest of the
key, the KV bytes' xxh3-64, the header's own xxh3-64), the block's tokens
(uint32) and the KV bytes. Every read verifies all of it and compares the
tokens with the caller's; a mismatch is a miss and counted, never data.

Timeouts. Mooncake calls hang 30-90 s on an unreachable master unless its RPC
timeouts are set (``MOONCAKE_ENV_DEFAULTS``, where the user set none). Every
operation also runs on a worker thread with a deadline (put, get and is_exist
release the GIL; measured). ``setup`` holds the GIL, so it is bounded by those
settings and by a TCP probe of the master first.

Off. Without mooncake, with the master unreachable at setup, or after
``trip_after_failures`` failed calls in a row, the store is off: one warning
says why; calls return misses, ``OFF`` or ``False`` at once (``off_calls``),
never raise. Only calls that failed themselves count (they raised, returned
an RPC error, or ran past their deadline); a call whose deadline passed while
it was queued behind another never ran and does not (``queued_timeouts``), so
a busy but healthy master is never switched off. A store tripped at run time
probes the master every ``retry_after_s`` and comes back on (one info line);
one that never set up stays off. Put keeps Mooncake's rule that an existing key keeps its old value:
such a key is ``ALREADY_PRESENT`` and not sent. Calls are synchronous and
bounded; writing behind is the caller's business.
"""

from __future__ import annotations

import abc
import importlib
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import urllib.request

import torch

from cluster.cache.l3.wire import (  # noqa: F401  (the format, re-exported)
    FORMAT_VERSION, MAGIC, GetStatus, L3Block, L3GetResult, L3Key, L3Lookup, L3PutResult, PutStatus,
    decode_block, encode_block, kv_layout_version, l3_key)
from cluster.errors import InvalidInputError

log = logging.getLogger("cluster.cache.l3")   # the name operators filter on (the module was cluster/cache/l3.py)

__all__ = ["GetStatus", "INSTALL_HINT", "L3Block", "L3Config", "L3GetResult", "L3Key", "L3Lookup", "L3PutResult", "L3Stats",
           "L3Store", "MooncakeL3Store", "PutStatus", "decode_block", "encode_block", "kv_layout_version",
           "l3_key", "mooncake_available"]


_RPC_ERRORS = (-900, -901)  # Mooncake: RPC failed, RPC timed out
INSTALL_HINT = ("pip install mooncake-transfer-engine-non-cuda==0.3.13.post1 (CPU machines; "
                "mooncake-transfer-engine on CUDA machines) and the system library libibverbs1 (Debian/Ubuntu)")
# Mooncake reads these when a client is set up; without them an unreachable master
# blocks setup and every call for tens of seconds (docs/l3.md). Set only where the user has not.
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the master is near: never via a proxy
MOONCAKE_ENV_DEFAULTS = {"MC_RPC_TIMEOUT_MS": "2000", "MC_RPC_CONNECT_TIMEOUT_MS": "1000",
                         "MC_STORE_CLIENT_SETUP_RETRIES": "1"}


# ------------------------------------------------------------------ interface
@dataclass(frozen=True, slots=True)
class L3Stats:
    """Counters since the store was built. ``hits + misses`` is the number of
    lookups; ``misses`` includes verify failures, token mismatches, timeouts
    and lookups while off. ``puts`` counts blocks sent and stored."""

    state: str = "off"                 # "on" | "off" | "closed"
    off_reason: str | None = None
    hits: int = 0
    misses: int = 0
    verify_failures: int = 0
    token_mismatches: int = 0
    puts: int = 0
    put_existing: int = 0
    put_failures: int = 0
    put_bytes: int = 0
    get_bytes: int = 0
    timeouts: int = 0
    queued_timeouts: int = 0           # of ``timeouts``: deadline passed before the call ran (not failures)
    rpc_failures: int = 0
    off_calls: int = 0


class L3Store(abc.ABC):
    """A cluster-wide block store. Calls never raise for store trouble and never
    block past their timeout: trouble is a miss, a failed put or ``False``."""

    @abc.abstractmethod
    def put_blocks(self, blocks: Sequence[L3Block]) -> tuple[L3PutResult, ...]: ...

    @abc.abstractmethod
    def get_blocks(self, lookups: Sequence[L3Lookup]) -> tuple[L3GetResult, ...]: ...

    @abc.abstractmethod
    def contains(self, keys: Sequence[L3Key]) -> tuple[bool, ...]:
        """Whether each key is stored (a hint: a later read still verifies)."""

    @abc.abstractmethod
    def remove_prefix(self, prefix: str) -> int:
        """Remove every value whose key name starts with ``prefix`` (an admin flush),
        values being read included; how many were removed, -1 when the store could
        not say."""

    @abc.abstractmethod
    def remove_keys(self, keys: Sequence[L3Key]) -> int:
        """Remove these values (blocks that failed verification: every read of them
        would be a miss); how many went, -1 when the store could not say."""

    @abc.abstractmethod
    def list_names(self, prefix: str) -> list[str] | None:
        """The names of every value whose name starts with ``prefix`` (what the
        directory's L3 inventory is rebuilt from); None when the store cannot list."""

    @abc.abstractmethod
    def close(self) -> None: ...

    @abc.abstractmethod
    def stats(self) -> L3Stats: ...


# ------------------------------------------------------------------ Mooncake
def _env_defaults() -> None:
    """``MOONCAKE_ENV_DEFAULTS`` where the user set none: before the first import of
    mooncake and before every setup."""
    for name, value in MOONCAKE_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)


def mooncake_available() -> bool:
    _env_defaults()
    try:
        importlib.import_module("mooncake.store")
    except Exception:  # ImportError, or a missing system library (libibverbs)
        return False
    return True


@dataclass(frozen=True)
class L3Config:
    master_address: str = "127.0.0.1:50051"
    local_hostname: str = "127.0.0.1"
    protocol: str = "tcp"
    segment_bytes: int = 0              # 0: a consumer, the pool lives in the node's holder (module docstring)
    local_buffer_bytes: int = 64 << 20  # staging buffer; bounds one batch and one value
    replica_num: int = 1
    setup_timeout_s: float = 10.0
    op_timeout_s: float = 5.0           # per public call, whatever the number of batches
    probe_timeout_s: float = 1.0        # TCP probe of the master before setup and before coming back on
    trip_after_failures: int = 3
    retry_after_s: float = 30.0
    # The master's HTTP server (its metrics port): GET /get_all_keys lists the keys
    # (``list_names``). None: the master's host and 9003, mooncake_master's default.
    http_address: str | None = None

    def __post_init__(self) -> None:
        host, _, port = self.master_address.rpartition(":")
        if not host or not port.isdigit():
            raise InvalidInputError(f"master_address must be host:port, got {self.master_address!r}")
        for name in ("setup_timeout_s", "op_timeout_s", "probe_timeout_s", "retry_after_s"):
            if not getattr(self, name) > 0:
                raise InvalidInputError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.segment_bytes < 0 or self.local_buffer_bytes <= 0 or self.replica_num < 1 \
                or self.trip_after_failures < 1:
            raise InvalidInputError("segment_bytes must be >= 0, local_buffer_bytes > 0, replica_num and "
                                    "trip_after_failures >= 1")

    @property
    def master_host_port(self) -> tuple[str, int]:
        host, _, port = self.master_address.rpartition(":")
        return host, int(port)

    @property
    def http_url(self) -> str:
        return f"http://{self.http_address or self.master_host_port[0] + ':9003'}"


class _DeadlineWorker:
    """One daemon thread that runs native calls in order; each caller waits with
    its own deadline.

    Calls queue behind each other (a fetch issued during a write waits for it,
    within the fetch's own deadline: measured, a write batch takes tens of ms).
    A queued call whose deadline passes is cancelled and never runs
    (``NeverStarted``: the lane was busy, which says nothing of the store).
    ``stuck`` means the running call is past *its* deadline, still inside
    Mooncake: until it returns, new calls fail at once instead of queueing
    behind it. A daemon thread, so a call stuck in Mooncake never keeps the
    interpreter from exiting.
    """

    def __init__(self, name: str):
        self._cond = threading.Condition()
        self._queue: list[tuple[Callable[[], Any], Future, float]] = []
        self._running_deadline: float | None = None   # monotonic deadline of the call running now
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                fn, fut, deadline = self._queue.pop(0)
                if not fut.set_running_or_notify_cancel():
                    continue
                self._running_deadline = deadline
            try:
                fut.set_result(fn())
            except BaseException as exc:  # surfaced to the caller by fut.result()
                fut.set_exception(exc)
            finally:
                with self._cond:
                    self._running_deadline = None

    @property
    def stuck(self) -> bool:
        running = self._running_deadline
        return running is not None and time.monotonic() > running

    def call(self, fn: Callable[[], Any], timeout_s: float) -> Any:
        """``fn()``'s result. Past ``timeout_s``: ``NeverStarted`` when it was still
        queued (cancelled: it never runs), ``FutureTimeout`` when it was running."""
        fut: Future = Future()
        timeout_s = max(timeout_s, 0.0)
        with self._cond:
            self._queue.append((fn, fut, time.monotonic() + timeout_s))
            self._cond.notify()
        try:
            return fut.result(timeout=timeout_s)
        except FutureTimeout:
            if fut.cancel():   # still queued: cancelled before it ran
                raise NeverStarted() from None
            if fut.done():     # it finished just now
                return fut.result()
            raise


class NeverStarted(FutureTimeout):
    """A call whose deadline passed while it waited behind another call: it never
    ran, so it is not a failure of the store (``trip_after_failures`` ignores it)."""


def _probe(host: str, port: int, timeout_s: float) -> str | None:
    """None when something accepts TCP at host:port, else why not."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"


class _Off(Exception):
    """Internal: the store is (or just went) off; the call returns misses."""


class MooncakeL3Store(L3Store):
    """``L3Store`` on Mooncake Store's Python client (a consumer by default).

    Builds and sets up the client at once; never raises for store trouble (an
    invalid config raises ``InvalidInputError``). Thread-safe: native calls run
    one at a time on the store's worker thread, in the order they were made,
    each within its own deadline (``_DeadlineWorker``).
    """

    def __init__(self, config: L3Config | None = None, *, clock: Callable[[], float] = time.monotonic):
        self.config = config or L3Config()
        self._clock = clock
        self._lock = threading.Lock()
        self._counts = {f: 0 for f in L3Stats.__dataclass_fields__ if f not in ("state", "off_reason")}
        self._client: Any = None
        self._state = "off"
        self._off_reason: str | None = None
        self._off_since = 0.0
        self._recoverable = False
        self._consecutive_failures = 0
        self._worker = _DeadlineWorker("l3-mooncake")
        # Mooncake's staging allocator does not fit a batch of the buffer's full size
        # (docs/benchmarks.md, "Why the defaults are what they are"): batches use half of it.
        self._batch_bytes = self.config.local_buffer_bytes // 2
        self._setup()

    # ------------------------------------------------------------- lifecycle
    def _setup(self) -> None:
        cfg = self.config
        _env_defaults()
        try:
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        except Exception as exc:
            self._go_off(f"mooncake is not importable ({exc}); install {INSTALL_HINT}", recoverable=False)
            return
        why = _probe(*cfg.master_host_port, cfg.probe_timeout_s)
        if why is not None:
            self._go_off(f"master {cfg.master_address} unreachable at setup ({why})", recoverable=False)
            return
        _env_defaults()
        client = MooncakeDistributedStore()
        try:
            rc = self._worker.call(lambda: client.setup(cfg.local_hostname, "P2PHANDSHAKE", cfg.segment_bytes,
                                                        cfg.local_buffer_bytes, cfg.protocol, "",
                                                        cfg.master_address), cfg.setup_timeout_s)
        except FutureTimeout:
            self._go_off(f"setup against master {cfg.master_address} did not finish in {cfg.setup_timeout_s} s",
                         recoverable=False)
            return
        except Exception as exc:
            self._go_off(f"setup against master {cfg.master_address} raised {exc!r}", recoverable=False)
            return
        if rc != 0:
            self._go_off(f"setup against master {cfg.master_address} returned {rc}", recoverable=False)
            return
        self._replicate = ReplicateConfig()
        self._replicate.replica_num = cfg.replica_num
        self._client = client
        self._state = "on"
        log.info("L3 on: Mooncake master %s, %s consumer (segment %d bytes, staging %d bytes)",
                 cfg.master_address, cfg.protocol, cfg.segment_bytes, cfg.local_buffer_bytes)

    def _go_off(self, reason: str, *, recoverable: bool) -> None:
        with self._lock:
            if self._state == "closed" or self._off_reason is not None:
                return
            self._state, self._off_reason = "off", reason
            self._off_since, self._recoverable = self._clock(), recoverable
        log.warning("L3 off: %s; L3 reads are misses and writes are dropped%s", reason,
                    f", retrying every {self.config.retry_after_s:g} s" if recoverable else "")

    def _ensure_on(self) -> None:
        """Raise ``_Off`` (counted) unless the store can take a call now."""
        if self._state == "off" and self._recoverable and self._clock() - self._off_since >= self.config.retry_after_s:
            if _probe(*self.config.master_host_port, self.config.probe_timeout_s) is None:
                with self._lock:
                    self._state, self._off_reason, self._consecutive_failures = "on", None, 0
                log.info("L3 back on: master %s answers again", self.config.master_address)
            else:
                self._off_since = self._clock()
        if self._state != "on":
            self._count(off_calls=1)
            raise _Off()

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
            self._state, self._off_reason = "closed", "closed"
        if client is not None and not self._worker.stuck:
            try:
                self._worker.call(client.close, self.config.op_timeout_s)
            except Exception as exc:  # the process is leaving L3 anyway; say so and go on
                log.warning("L3 close did not finish cleanly: %r", exc)

    def stats(self) -> L3Stats:
        with self._lock:
            return L3Stats(state=self._state, off_reason=self._off_reason, **self._counts)

    # ------------------------------------------------------------- plumbing
    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def _native(self, fn: Callable[[], Any], deadline: float) -> Any:
        """Run one native call before ``deadline`` (clock time); ``_Off`` when it cannot
        (also at once while an earlier call is stuck in Mooncake past its own deadline)."""
        if self._worker.stuck:
            self._count(timeouts=1)
            raise _Off()
        try:
            return self._worker.call(fn, deadline - self._clock())
        except NeverStarted:   # queued behind a call within its own deadline: the store is busy, not failing
            self._count(timeouts=1, queued_timeouts=1)
            raise _Off() from None
        except FutureTimeout:
            self._count(timeouts=1)
            self._failed("a call ran past its deadline")
            raise _Off() from None
        except Exception as exc:
            self._failed(f"a call raised {exc!r}")
            raise _Off() from None

    def _failed(self, what: str) -> None:
        with self._lock:
            self._consecutive_failures += 1
            trip = self._consecutive_failures >= self.config.trip_after_failures
        if trip:
            self._go_off(f"master {self.config.master_address} unreachable "
                         f"({self.config.trip_after_failures} failed calls in a row, last: {what})", recoverable=True)

    def _rpc_result(self, code: int) -> None:
        if code in _RPC_ERRORS:
            self._count(rpc_failures=1)
            self._failed(f"Mooncake error {code}")
        else:
            with self._lock:
                self._consecutive_failures = 0

    def _exists(self, names: list[str], deadline: float) -> list[int]:
        """Mooncake's answer per key: 1 stored, 0 not, negative: the master did not answer."""
        codes = [int(c) for c in self._native(lambda: self._client.batch_is_exist(names), deadline)]
        self._rpc_result(_RPC_ERRORS[0] if any(c < 0 for c in codes) else 0)
        return codes

    def _batches(self, sizes: Sequence[int]) -> list[list[int]]:
        """Indices grouped so one put batch fits the staging buffer (a larger batch fails whole)."""
        out: list[list[int]] = []
        room = 0
        for i, size in enumerate(sizes):
            if not out or size > room:
                out.append([])
                room = self._batch_bytes
            out[-1].append(i)
            room -= size
        return out

    # ------------------------------------------------------------- operations
    def put_blocks(self, blocks: Sequence[L3Block]) -> tuple[L3PutResult, ...]:
        status = [PutStatus.OFF] * len(blocks)
        sent = [0] * len(blocks)
        if not blocks:
            return ()
        deadline = self._clock() + self.config.op_timeout_s
        names = [b.key.name for b in blocks]
        try:
            self._ensure_on()
            exists = self._exists(names, deadline)
            status = [PutStatus.ALREADY_PRESENT if c == 1 else PutStatus.TIMEOUT for c in exists]
            values = {i: encode_block(blocks[i]) for i, c in enumerate(exists) if c != 1}
            for i, value in values.items():
                if len(value) > self._batch_bytes:
                    status[i] = PutStatus.FAILED
            todo = [i for i in values if status[i] is PutStatus.TIMEOUT]
            for batch in self._batches([len(values[i]) for i in todo]):
                idx = [todo[j] for j in batch]
                keys, vals = [names[i] for i in idx], [values[i] for i in idx]
                rc = int(self._native(lambda: self._client.put_batch(keys, vals, self._replicate), deadline))
                self._rpc_result(rc)
                for i in idx:
                    status[i] = PutStatus.STORED if rc == 0 else PutStatus.FAILED
                    sent[i] = len(values[i]) if rc == 0 else 0
        except _Off:
            pass
        stored = [s is PutStatus.STORED for s in status]
        self._count(puts=sum(stored), put_bytes=sum(sent),
                    put_existing=status.count(PutStatus.ALREADY_PRESENT),
                    put_failures=len(status) - sum(stored) - status.count(PutStatus.ALREADY_PRESENT))
        return tuple(L3PutResult(b.key, s, n) for b, s, n in zip(blocks, status, sent))

    def get_blocks(self, lookups: Sequence[L3Lookup]) -> tuple[L3GetResult, ...]:
        status = [GetStatus.OFF] * len(lookups)
        kvs: list[torch.Tensor | None] = [None] * len(lookups)
        got_bytes = 0
        if not lookups:
            return ()
        deadline = self._clock() + self.config.op_timeout_s
        names = [q.key.name for q in lookups]
        try:
            self._ensure_on()
            # is_exist first: get() answers b"" both for a miss and for a failure,
            # is_exist tells them apart (and absent blocks cost no transfer).
            exists = self._exists(names, deadline)
            status = [GetStatus.TIMEOUT if c == 1 else GetStatus.MISS for c in exists]
            todo = [i for i, c in enumerate(exists) if c == 1]
            # get_batch fills what fits the staging buffer and answers b"" for the
            # rest: ask again for those until a round brings nothing back.
            while todo:
                keys = [names[i] for i in todo]
                values = self._native(lambda: self._client.get_batch(keys), deadline)
                left = []
                for i, value in zip(todo, values):
                    if value:
                        got_bytes += len(value)
                        status[i], kvs[i] = decode_block(value, lookups[i])
                    else:
                        left.append(i)
                if len(left) == len(todo):
                    for i in left:
                        status[i] = GetStatus.MISS  # gone since is_exist, or larger than the buffer
                    break
                todo = left
        except _Off:
            pass
        hits = status.count(GetStatus.HIT)
        self._count(hits=hits, misses=len(status) - hits, get_bytes=got_bytes,
                    verify_failures=status.count(GetStatus.VERIFY_FAILED),
                    token_mismatches=status.count(GetStatus.TOKEN_MISMATCH))
        return tuple(L3GetResult(q.key, s, kv) for q, s, kv in zip(lookups, status, kvs))

    def remove_prefix(self, prefix: str) -> int:
        # force: Mooncake otherwise skips every object read in the last lease period
        # (the master's default_kv_lease_ttl), so a flush right after traffic left the
        # blocks just read in place. A reader that loses one mid-read gets a verify
        # failure, i.e. a miss. Releases without the flag remove what has no lease.
        pattern = "^" + re.escape(prefix)

        def remove() -> int:
            try:
                return self._client.remove_by_regex(pattern, force=True)
            except TypeError:
                return self._client.remove_by_regex(pattern)
        try:
            self._ensure_on()
            return int(self._native(remove, self._clock() + self.config.op_timeout_s))
        except _Off:
            return -1

    def contains(self, keys: Sequence[L3Key]) -> tuple[bool, ...]:
        if not keys:
            return ()
        try:
            self._ensure_on()
            codes = self._exists([k.name for k in keys], self._clock() + self.config.op_timeout_s)
        except _Off:
            return (False,) * len(keys)
        return tuple(c == 1 for c in codes)

    def remove_keys(self, keys: Sequence[L3Key]) -> int:
        if not keys:
            return 0
        names = [k.name for k in keys]

        def remove() -> list[int]:
            return list(self._client.batch_remove(names, True))   # force: a leased (just read) value too
        try:
            self._ensure_on()
            codes = self._native(remove, self._clock() + self.config.op_timeout_s)
        except _Off:
            return -1
        return sum(1 for c in codes if int(c) == 0)

    def list_names(self, prefix: str) -> list[str] | None:
        """From the master's HTTP server (``/get_all_keys``, one name per line), within
        ``op_timeout_s``; None (logged) when it does not answer."""
        url = f"{self.config.http_url}/get_all_keys"
        try:
            with _NO_PROXY.open(url, timeout=self.config.op_timeout_s) as resp:
                body = resp.read().decode("utf-8", "replace")
        except Exception as exc:   # not reachable, or not a mooncake_master: the caller re-announces instead
            log.warning("cannot list L3 keys at %s (%s); set l3_master_http to the master's metrics port", url, exc)
            return None
        return [line for line in body.splitlines() if line.startswith(prefix)]
