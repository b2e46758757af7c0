"""The peer channel: calls from one worker (or the ingress) straight to another worker.

Migrations (export a prefix, fetch its staged blocks when NIXL fails,
release the lease) and the admin calls aimed at one worker (stats, flush,
prefetch, fault drills) go from caller to worker over this channel, not
through Ray Serve: Serve carries only the requests themselves, and a
migration is one call from the target replica to the holder.

One method per operation on both sides: ``PeerClient.export_prefix``,
``.fetch_blocks``, ``.release``, ``.info``, ``.stats``, ``.flush``,
``.prefetch``, ``.inject_fault``, ``.pull``, ``.offers``, each with typed
arguments and results (``cluster.protocol``), answered by the same-named
method of the worker's ``PeerService`` (``WorkerCore``).

Wire: TCP, each message a 4-byte big-endian length and a msgpack map.
A request is ``{"v": WIRE_VERSION, "op": ..., "args": {...}, "secret": ...}``
(``op``: one of ``OPS``); the answer ``{"ok": result}`` or ``{"error":
message, "kind": ...}``. Typed values travel as their ``to_fields()`` maps
and are rebuilt (and checked: a bad argument is an ``invalid`` error naming
it) on arrival.
One request at a time per connection; a client keeps a few idle
connections per peer and opens another when all are busy.

Every call has a timeout (``PeerTimeoutError``); a peer that is gone fails
at connect (``PeerUnavailableError``); an error the peer raised comes back
as the same kind of error here (``PeerCallError`` and its subclasses), so a
caller handles each failure on its own.

The server runs on a thread of its own with its own event loop, so it
answers while the worker's other loop is busy, and the service reaches the
engine thread the usual way (``EngineLoop.run``). A shared ``secret`` (the
app's, generated at deploy) must match on every request: the channel
serves KV, and only the app's own processes may ask for it.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import logging
import struct
import threading
from typing import Any, Awaitable, Callable, Protocol

import msgpack
import numpy as np

from cluster.errors import CacheError, InvalidInputError
from cluster.protocol import (WIRE_VERSION, MalformedMessageError, PrefixOffer, StagedPrefix, Tenant, Transport,
                              WorkerInfo)

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 1 << 30    # a staged prefix of 20k tokens of a 1B model is about 0.5 GB
_HEADER = struct.Struct(">I")


class PeerCallError(CacheError):
    """The peer answered with an error (``kind`` says which)."""

    def __init__(self, message: str, kind: str = "internal"):
        super().__init__(message)
        self.kind = kind


class PeerRefusedError(PeerCallError):
    """The peer refused: a lease it did not issue, other tokens, a bad secret."""


class UnknownPeerSessionError(PeerCallError):
    """The peer has never seen (or has forgotten) the session named."""


class PeerTimeoutError(CacheError, TimeoutError):
    """The peer did not answer within the call's timeout."""


class PeerUnavailableError(CacheError, ConnectionError):
    """Nothing answers at the peer's address (gone, or not yet started)."""


_KINDS = {"refused": PeerRefusedError, "unknown_session": UnknownPeerSessionError}


def error_kind(exc: BaseException) -> str:
    """How a handler's exception travels: the kinds a caller acts on."""
    name = type(exc).__name__
    if name in ("MigrationRefused", "PeerRefusedError"):
        return "refused"
    if name in ("UnknownSessionError", "UnknownPeerSessionError"):
        return "unknown_session"
    if name == "EngineWedgedError":
        return "wedged"
    if isinstance(exc, InvalidInputError):
        return "invalid"
    return "internal"


async def _read_frame(reader: asyncio.StreamReader) -> Any:
    header = await reader.readexactly(_HEADER.size)
    (size,) = _HEADER.unpack(header)
    if size > MAX_FRAME_BYTES:
        raise InvalidInputError(f"peer frame of {size} bytes exceeds {MAX_FRAME_BYTES}")
    return msgpack.unpackb(await reader.readexactly(size), raw=False, strict_map_key=False)


def _frame(obj: Any) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return _HEADER.pack(len(body)) + body


# ---------------------------------------------------------------- server
class PeerService(Protocol):
    """What a worker answers on its peer channel, one method per operation
    (``actors.core.WorkerCore``). ``info`` and ``inject_fault`` are plain
    methods: the server runs ``inject_fault`` on a thread ('wedge' waits until
    the engine thread is in it)."""

    async def export_prefix(self, tokens: list[int], tenant: Tenant | None = None,
                            max_tokens: int | None = None) -> StagedPrefix: ...

    async def fetch_blocks(self, lease: str) -> tuple[np.ndarray, str]: ...

    async def release(self, lease: str) -> None: ...

    def info(self) -> WorkerInfo: ...

    async def stats(self) -> dict: ...

    async def flush(self) -> int: ...

    async def prefetch(self, session_id: str | None = None, tokens: list[int] | None = None,
                       namespace: Tenant | None = None) -> int: ...

    def inject_fault(self, kind: str, on: bool = True) -> None: ...

    async def pull(self, offer: PrefixOffer) -> int: ...

    async def offers(self, limit: int) -> list[PrefixOffer]: ...


class _Answers:
    """The server side of each operation, under its wire name: read the
    arguments (a bad one is an ``invalid`` error naming it), call the
    service, send its typed result as fields."""

    def __init__(self, service: PeerService):
        self.service = service

    async def export(self, tokens, tenant=None, max_tokens=None) -> dict:
        staged = await self.service.export_prefix(_tokens(tokens, "tokens"), _tenant(tenant),
                                                  _count(max_tokens, "max_tokens", optional=True))
        return staged.to_fields()

    async def fetch(self, lease) -> dict:
        array, dtype = await self.service.fetch_blocks(_text(lease, "lease"))
        return {"data": array.tobytes(), "numpy_dtype": array.dtype.str, "shape": list(array.shape),
                "dtype": dtype}

    async def release(self, lease) -> None:
        await self.service.release(_text(lease, "lease"))

    async def info(self) -> dict:
        return self.service.info().to_fields()

    async def stats(self) -> dict:
        return await self.service.stats()

    async def flush(self) -> int:
        return int(await self.service.flush())

    async def prefetch(self, session_id=None, tokens=None, tenant=None) -> int:
        return int(await self.service.prefetch(None if session_id is None else _text(session_id, "session_id"),
                                               None if tokens is None else _tokens(tokens, "tokens"),
                                               _tenant(tenant)))

    async def inject_fault(self, kind, on=True) -> None:
        if not isinstance(on, bool):
            raise InvalidInputError(f"on must be true or false, got {on!r:.40}")
        await asyncio.to_thread(self.service.inject_fault, _text(kind, "kind"), on)

    async def pull(self, offer) -> int:
        return int(await self.service.pull(PrefixOffer.from_fields(offer)))

    async def offers(self, limit=32) -> list[dict]:
        return [o.to_fields() for o in await self.service.offers(_count(limit, "limit"))]


OPS = ("export", "fetch", "release", "info", "stats", "flush", "prefetch", "inject_fault", "pull", "offers")


def _tokens(value: Any, name: str) -> list[int]:
    if not isinstance(value, (list, tuple)) or any(isinstance(t, bool) or not isinstance(t, int) or t < 0
                                                   for t in value):
        raise InvalidInputError(f"{name} must be a list of non-negative integer token ids")
    return list(value)


def _tenant(value: Any) -> Tenant | None:
    if value is not None and not isinstance(value, str):
        raise InvalidInputError(f"tenant must be a string or null, got {value!r:.40}")
    return value


def _text(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise InvalidInputError(f"{name} must be a string, got {value!r:.40}")
    return value


def _count(value: Any, name: str, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidInputError(f"{name} must be a non-negative integer{' or null' if optional else ''}, "
                                f"got {value!r:.40}")
    return value


class PeerServer:
    """Answers peer calls to ``service`` on its own thread and event loop."""

    def __init__(self, name: str, service: PeerService, *, host: str = "127.0.0.1", port: int = 0,
                 secret: str | None = None):
        self.name = name
        self._answers = _Answers(service)
        self.secret = secret
        self.stats = {"calls": 0, "errors": 0, "refused_secret": 0}   # server thread only
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[asyncio.Task] = set()   # server thread only
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            try:
                self._server = self._loop.run_until_complete(asyncio.start_server(self._serve, host, port))
            except BaseException as exc:   # the address cannot be bound: the worker must not start
                failure.append(exc)
                started.set()
                return
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name=f"peer-{name}", daemon=True)
        self._thread.start()
        started.wait(10)
        if failure or self._server is None:
            raise PeerUnavailableError(f"peer channel of {name} could not listen on {host}:{port}: "
                                       f"{failure[0] if failure else 'timed out'}")
        bound = self._server.sockets[0].getsockname()
        self.address = f"{bound[0]}:{bound[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        try:
            while True:
                try:
                    request = await _read_frame(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return   # the caller closed the connection
                writer.write(_frame(await self._answer(request)))
                await writer.drain()
        except Exception as exc:   # a broken connection ends that connection only
            log.info("peer connection to %s ended: %s", self.name, exc)
        except asyncio.CancelledError:
            # close() cancels open connections. Ending normally, not cancelled: Python
            # 3.11's stream callback calls task.exception() and would log a traceback.
            pass
        finally:
            self._connections.discard(task)
            writer.close()

    async def _answer(self, request: Any) -> dict:
        self.stats["calls"] += 1
        if not isinstance(request, dict) or request.get("v") != WIRE_VERSION:
            self.stats["errors"] += 1
            return {"error": f"peer channel version {request.get('v') if isinstance(request, dict) else None!r}; "
                             f"this worker speaks {WIRE_VERSION}", "kind": "invalid"}
        if self.secret is not None and not hmac.compare_digest(str(request.get("secret") or ""), self.secret):
            self.stats["refused_secret"] += 1
            return {"error": "peer call refused: wrong or missing secret", "kind": "refused"}
        op, args = request.get("op"), request.get("args") or {}
        if op not in OPS or not isinstance(args, dict):
            self.stats["errors"] += 1
            return {"error": f"unknown peer call {op!r}", "kind": "invalid"}
        answer = getattr(self._answers, op)
        try:
            inspect.signature(answer).bind(**args)
        except TypeError as exc:
            self.stats["errors"] += 1
            return {"error": f"peer call {op!r}: {exc}", "kind": "invalid"}
        try:
            return {"ok": await answer(**args)}
        except Exception as exc:
            self.stats["errors"] += 1
            return {"error": f"{type(exc).__name__}: {exc}", "kind": error_kind(exc)}

    def close(self) -> None:
        if self._server is None or not self._thread.is_alive():
            return

        async def stop() -> None:
            self._server.close()
            for task in list(self._connections):   # open connections end now, not at garbage collection
                task.cancel()
            await asyncio.gather(*self._connections, return_exceptions=True)
            await self._server.wait_closed()

        try:
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=5)
        except Exception as exc:   # shutting down anyway: say what was left behind
            log.warning("peer channel of %s did not close cleanly: %s", self.name, exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()


# ---------------------------------------------------------------- client
class PeerClient:
    """Calls to the worker at ``address``. Its idle connections belong to one
    event loop: used from another, it opens new ones."""

    transport = Transport.PEER   # how the fallback pull of a migration arrives

    def __init__(self, worker_id: str, address: str, *, secret: str | None = None, timeout_s: float = 2.0,
                 max_idle: int = 4):
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise InvalidInputError(f"peer address must be host:port, got {address!r}")
        self.worker_id, self.address = worker_id, address
        self._host, self._port = host, int(port)
        self.secret, self.timeout_s, self.max_idle = secret, timeout_s, max_idle
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._loop: asyncio.AbstractEventLoop | None = None   # the loop the idle connections belong to

    async def _request(self, op: str, timeout_s: float | None, **args) -> Any:
        """Send one call and await its answer within ``timeout_s`` (None: the client's
        bound; connect included)."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            return await asyncio.wait_for(self._call(op, args), limit)
        except asyncio.TimeoutError:
            raise PeerTimeoutError(f"peer {self.worker_id} ({self.address}) did not answer {op!r} "
                                   f"within {limit:g} s") from None

    async def _call(self, op: str, args: dict) -> Any:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:   # connections of another (perhaps closed) loop cannot be used here
            self._idle, self._loop = [], loop
        conn = self._idle.pop() if self._idle else None
        if conn is None:
            try:
                conn = await asyncio.open_connection(self._host, self._port)
            except OSError as exc:
                raise PeerUnavailableError(f"peer {self.worker_id} at {self.address} is not reachable: {exc}") from None
        reader, writer = conn
        try:
            writer.write(_frame({"v": WIRE_VERSION, "op": op, "args": args, "secret": self.secret}))
            await writer.drain()
            answer = await _read_frame(reader)
        except BaseException as exc:   # a half-used connection is never reused
            writer.close()
            if isinstance(exc, (asyncio.IncompleteReadError, ConnectionError)):
                raise PeerUnavailableError(f"peer {self.worker_id} at {self.address} closed the connection") from None
            raise
        if len(self._idle) < self.max_idle:
            self._idle.append(conn)
        else:
            writer.close()
        if "error" in answer:
            kind = answer.get("kind", "internal")
            raise _KINDS.get(kind, PeerCallError)(f"peer {self.worker_id}: {answer['error']}", kind)
        return answer.get("ok")

    def close(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()

    # ------------------------------------------ one method per operation
    # Each bounded by ``timeout_s`` (None: the client's ``timeout_s``). The first
    # four are the ``PeerLink`` a migration pulls through.
    async def export_prefix(self, tokens: list[int], tenant: Tenant | None = None, max_tokens: int | None = None,
                            *, timeout_s: float | None = None) -> StagedPrefix:
        """Stage the holder's cached prefix of ``tokens`` under a lease."""
        return StagedPrefix.from_fields(await self._request("export", timeout_s, tokens=list(tokens), tenant=tenant,
                                                            max_tokens=max_tokens))

    async def info(self, *, timeout_s: float | None = None) -> WorkerInfo:
        return WorkerInfo.from_fields(await self._request("info", timeout_s))

    async def fetch_blocks(self, lease: str, *, timeout_s: float | None = None) -> tuple[np.ndarray, str]:
        """The staged blocks of ``lease``, whole, and the torch dtype name to view them as."""
        out = await self._request("fetch", timeout_s, lease=lease)
        try:
            array = np.frombuffer(out["data"], dtype=np.dtype(out["numpy_dtype"])).reshape(out["shape"])
            return array, str(out["dtype"])
        except (KeyError, TypeError, ValueError) as exc:
            raise MalformedMessageError(f"staged blocks from {self.worker_id} are malformed: {exc!r}") from None

    def release(self, lease: str | None) -> None:
        """Fire and forget (the holder's lease expires anyway)."""
        if lease is None:
            return

        async def send() -> None:
            try:
                await self._request("release", None, lease=lease)
            except Exception as exc:   # it expires on its own; say why it was not released now
                log.info("release of %s on %s failed: %s", lease, self.worker_id, exc)

        asyncio.get_running_loop().create_task(send())

    async def stats(self, *, timeout_s: float | None = None) -> dict:
        """The worker's stats document (``WorkerCore.stats``)."""
        return await self._request("stats", timeout_s)

    async def flush(self, *, timeout_s: float | None = None) -> int:
        """Drop the worker's cached prefixes (and this model's L3 blocks); the tokens freed."""
        return int(await self._request("flush", timeout_s))

    async def prefetch(self, session_id: str | None = None, tokens: list[int] | None = None,
                       tenant: Tenant | None = None, *, timeout_s: float | None = None) -> int:
        """Start bringing a session's (or ``tokens``') prefix up to HOT; the tokens it started
        moving. A session the worker does not know: ``UnknownPeerSessionError``."""
        return int(await self._request("prefetch", timeout_s, session_id=session_id,
                                       tokens=None if tokens is None else list(tokens), tenant=tenant))

    async def inject_fault(self, kind: str, on: bool = True, *, timeout_s: float | None = None) -> None:
        """Drills: 'wedge' blocks the engine thread, 'slow' lengthens every engine iteration,
        'nixl' and 'fallback' break a transport."""
        await self._request("inject_fault", timeout_s, kind=kind, on=on)

    async def pull(self, offer: PrefixOffer, *, timeout_s: float | None = None) -> int:
        """Ask the worker to pull ``offer`` from its holder; the tokens it installed."""
        return int(await self._request("pull", timeout_s, offer=offer.to_fields()))

    async def offers(self, limit: int = 32, *, timeout_s: float | None = None) -> list[PrefixOffer]:
        """The worker's most valuable shared prefixes."""
        got = await self._request("offers", timeout_s, limit=limit)
        if not isinstance(got, list):
            raise MalformedMessageError(f"offers from {self.worker_id} must be a list, got {type(got).__name__}")
        return [PrefixOffer.from_fields(o) for o in got]


class PeerDirectory:
    """Peer clients by worker id, for one event loop: where the worker's
    address comes from is the caller's (``lookup``: the directory)."""

    def __init__(self, lookup: Callable[[str], Awaitable[str | None]], *, secret: str | None = None,
                 timeout_s: float = 2.0):
        self._lookup, self.secret, self.timeout_s = lookup, secret, timeout_s
        self._clients: dict[tuple[int, str], PeerClient] = {}

    async def client(self, worker_id: str) -> PeerClient | None:
        """The client of ``worker_id`` on the running loop, or None when it is unknown (gone)."""
        key = (id(asyncio.get_running_loop()), worker_id)
        client = self._clients.get(key)
        if client is None:
            address = await self._lookup(worker_id)
            if address is None:
                return None
            client = self._clients[key] = PeerClient(worker_id, address, secret=self.secret,
                                                     timeout_s=self.timeout_s)
        return client

    def forget(self, worker_id: str) -> None:
        for key in [k for k in self._clients if k[1] == worker_id]:
            self._clients.pop(key).close()
