"""The peer channel: calls from one worker (or the ingress) straight to another worker.

Migrations (export a prefix, fetch its staged blocks when NIXL fails,
release the lease) and the admin calls aimed at one worker (stats, flush,
prefetch, fault drills) go from caller to worker over this channel, not
through Ray Serve: Serve carries only the requests themselves, and a
migration is one call from the target replica to the holder.

Wire: TCP, each message a 4-byte big-endian length and a msgpack map.
A request is ``{"v": WIRE_VERSION, "op": ..., "args": {...}, "secret": ...}``;
the answer ``{"ok": result}`` or ``{"error": message, "kind": ...}``. Typed
results travel as their ``to_fields()`` maps and are rebuilt on arrival.
One request at a time per connection; a client keeps a few idle
connections per peer and opens another when all are busy.

Every call has a timeout (``PeerTimeoutError``); a peer that is gone fails
at connect (``PeerUnavailableError``); an error the peer raised comes back
as the same kind of error here (``PeerCallError`` and its subclasses), so a
caller handles each failure on its own.

The server runs on a thread of its own with its own event loop, so it
answers while the worker's other loop is busy, and handlers reach the
engine thread the usual way (``EngineLoop.run``). A shared ``secret`` (the
app's, generated at deploy) must match on every request: the channel
serves KV, and only the app's own processes may ask for it.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import struct
import threading
from typing import Any, Awaitable, Callable

import msgpack
import numpy as np

from cluster.errors import CacheError, InvalidInputError
from cluster.protocol import WIRE_VERSION, StagedPrefix, Transport, WorkerInfo

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
Handler = Callable[..., Awaitable[Any]]


class PeerServer:
    """Answers peer calls with ``handlers[op](**args)`` on its own thread and event loop."""

    def __init__(self, name: str, handlers: dict[str, Handler], *, host: str = "127.0.0.1", port: int = 0,
                 secret: str | None = None):
        self.name = name
        self.handlers = dict(handlers)
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
        handler = self.handlers.get(request.get("op"))
        args = request.get("args") or {}
        if handler is None or not isinstance(args, dict):
            self.stats["errors"] += 1
            return {"error": f"unknown peer call {request.get('op')!r}", "kind": "invalid"}
        try:
            return {"ok": await handler(**args)}
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

    async def call(self, op: str, timeout_s: float | None = None, **args) -> Any:
        """Send one call and await its answer within ``timeout_s`` (connect included)."""
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

    # -------------------------------------------------- the PeerLink methods
    async def export_prefix(self, tokens: list[int], tenant: str | None,
                            max_tokens: int | None = None) -> StagedPrefix:
        return StagedPrefix.from_fields(await self.call("export", tokens=list(tokens), tenant=tenant,
                                                        max_tokens=max_tokens))

    async def info(self) -> WorkerInfo:
        return WorkerInfo.from_fields(await self.call("info"))

    async def fetch_blocks(self, lease: str) -> tuple[np.ndarray, str]:
        """The staged blocks of ``lease``, whole, and the torch dtype name to view them as."""
        out = await self.call("fetch", lease=lease)
        array = np.frombuffer(out["data"], dtype=np.dtype(out["numpy_dtype"])).reshape(out["shape"])
        return array, out["dtype"]

    def release(self, lease: str | None) -> None:
        """Fire and forget (the holder's lease expires anyway)."""
        if lease is None:
            return

        async def send() -> None:
            try:
                await self.call("release", lease=lease)
            except Exception as exc:   # it expires on its own; say why it was not released now
                log.info("release of %s on %s failed: %s", lease, self.worker_id, exc)

        asyncio.get_running_loop().create_task(send())


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
