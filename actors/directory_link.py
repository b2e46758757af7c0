"""DirectoryLink: the one way every process reaches the directory actor.

Cache workers (``actors.worker.CacheWorker``, as a Serve replica or an actor) register,
publish KV event batches with their load, and push snapshots through it;
clients and the Serve router ask it for routing decisions. It never blocks
the caller on the directory: publishes return a future, routes are awaited
with a timeout (a fallback decision when the directory does not answer).

A directory that is gone for good (killed without restart) is recreated by
the first worker that notices (``create=True``); clients only look it up.
"""

from __future__ import annotations

import asyncio
import logging
import time

import ray
from ray.exceptions import RayActorError

from cluster.hashing import block_hashes
from cluster.names import DEFAULT_NAMESPACE, DIRECTORY_NAME
from cluster.protocol import (LoadReport, MalformedMessageError, MeasuredRates, PublisherEpoch, RouteDecision,
                              Snapshot, Tenant)
from cluster.routing.policies import NoLiveWorkerError

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 5.0   # the longest any awaited call to the directory may take (without its own bound)
NO_WORKER_RETRY_S = 0.1   # a route that found no live worker is asked again after this, within its bound


class DirectoryLink:
    def __init__(self, namespace: str = DEFAULT_NAMESPACE, *, name: str = DIRECTORY_NAME, create: bool = False,
                 policy: str = "cost", block_tokens: int = 16, route_timeout_s: float | None = None,
                 policy_kwargs: dict | None = None):
        self.namespace, self.name, self.create = namespace, name, create
        self.policy, self.block_tokens = policy, block_tokens
        self.policy_kwargs = dict(policy_kwargs or {})   # options of the policy, when this link creates the directory
        self.route_timeout_s = route_timeout_s
        self._handle = None

    # ------------------------------------------------------------ the handle
    def handle(self):
        """The directory actor (blocking GCS lookup: keep it off event loops, see ``ahandle``)."""
        if self._handle is None:
            if self.create:
                from actors.directory import get_or_create_directory
                self._handle = get_or_create_directory(self.namespace, policy=self.policy,
                                                       block_tokens=self.block_tokens, name=self.name,
                                                       policy_kwargs=self.policy_kwargs)
            else:
                self._handle = ray.get_actor(self.name, namespace=self.namespace)
        return self._handle

    async def ahandle(self):
        if self._handle is None:
            return await asyncio.to_thread(self.handle)
        return self._handle

    def forget(self) -> None:
        """The next call looks the directory up again (it died, or did not answer)."""
        self._handle = None

    def _watch(self, fut) -> None:
        # Runs on whichever thread completes the future: only drop the handle.
        if isinstance(fut.exception(), RayActorError):
            self.forget()

    # --------------------------------------------------------------- workers
    def register(self, worker_id: str, rates: MeasuredRates, peer_address: str | None = None,
                 fresh: bool = True) -> None:
        """``fresh``: a new process (the directory forgets what an earlier one of the same
        id held); False when a live worker registers again before its snapshot."""
        self.handle().register_worker.remote(worker_id, rates, peer_address, fresh)

    def ask_publisher_epoch(self, worker_id: str):
        """Ask for this new process's publisher epoch now and take the answer later
        (``publisher_epoch(worker_id, asked=...)``), so the directory's own start overlaps
        the worker's; None where asking failed (``publisher_epoch`` asks again)."""
        try:
            return self.publisher_epoch_future(worker_id), time.monotonic()
        except Exception as exc:
            log.info("publisher epoch not asked early for %s (%s)", worker_id, type(exc).__name__)
            return None

    def publisher_epoch(self, worker_id: str, timeout_s: float = 2.0, asked=None) -> int | None:
        """The epoch the directory hands this new process's KV event publisher, or None
        (no directory within ``timeout_s``, counted from ``asked``'s request where given, at
        least 0.2 s more: the publisher then takes its own clock's, and asks again if the
        directory refuses it). Blocking: called in constructors."""
        try:
            if asked is not None:
                fut, asked_at = asked
                issued = fut.result(timeout=max(0.2, asked_at + timeout_s - time.monotonic()))
            else:
                issued = ray.get(self.handle().publisher_epoch.remote(worker_id), timeout=timeout_s)
        except Exception as exc:
            log.warning("no publisher epoch from the directory for %s (%s); using this node's clock",
                        worker_id, type(exc).__name__)
            self.forget()
            return None
        if not isinstance(issued, PublisherEpoch) or issued.worker_id != worker_id:
            raise MalformedMessageError(f"the directory answered {issued!r:.80} for {worker_id}'s publisher epoch")
        return issued.epoch

    def publisher_epoch_future(self, worker_id: str):
        """``publisher_epoch`` without blocking: a future of the ``PublisherEpoch``
        (the caller bounds how long it waits for it)."""
        fut = self.handle().publisher_epoch.remote(worker_id).future()
        fut.add_done_callback(self._watch)
        return fut

    def measured_rates(self, bytes_per_token: int, block_tokens: int,
                       timeout_s: float = 2.0) -> MeasuredRates | None:
        """A live peer's measured rates for the same KV shape, or None (none yet,
        or no directory within ``timeout_s``). Blocking: called in constructors."""
        try:
            return ray.get(self.handle().measured_rates.remote(bytes_per_token, block_tokens), timeout=timeout_s)
        except Exception as exc:
            log.info("no measured rates from the directory (%s); measuring", type(exc).__name__)
            self.forget()
            return None

    def publish(self, worker_id: str, batch: bytes | None, load: LoadReport, want_l3_shares: bool = False):
        """Events and load; returns a future of the directory's status ("ok", or resend a snapshot),
        with ``want_l3_shares`` a ``PublishReply`` that carries the tenants' L3 counts too."""
        fut = self.handle().publish.remote(worker_id, batch, load, want_l3_shares).future()
        fut.add_done_callback(self._watch)
        return fut

    def push_snapshot(self, worker_id: str, snapshot: Snapshot) -> None:
        self.handle().load_snapshot.remote(worker_id, snapshot)

    # --------------------------------------------------------------- clients
    async def route(self, prompt: list[int], tenant: Tenant | None = None,
                    exclude: list[str] | None = None) -> RouteDecision:
        """The directory's decision for ``prompt``. No live worker yet (a directory
        that just restarted) is asked again until the bound (``route_timeout_s``,
        else ``CALL_TIMEOUT_S``). With ``route_timeout_s``, a directory that does not
        answer in time gives ``RouteDecision.fallback()``; without it, errors propagate."""
        hashes = block_hashes(prompt, self.block_tokens, tenant)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.route_timeout_s or CALL_TIMEOUT_S)
        try:
            while True:
                directory = await self.ahandle()
                ref = directory.route.remote(hashes, len(prompt), exclude)
                try:
                    return await asyncio.wait_for(ref, max(0.01, deadline - loop.time()))
                except NoLiveWorkerError:
                    # A directory that just restarted hears from its workers within a
                    # report interval: wait for them (within the bound) rather than fail.
                    if loop.time() + NO_WORKER_RETRY_S >= deadline:
                        raise
                    await asyncio.sleep(NO_WORKER_RETRY_S)
        except Exception as exc:
            self.forget()
            if self.route_timeout_s is None:
                raise
            log.warning("directory unavailable (%s); falling back to the least loaded replica", type(exc).__name__)
            return RouteDecision.fallback()

    async def report_failure(self, worker_id: str) -> None:
        try:
            await asyncio.wait_for((await self.ahandle()).report_failure.remote(worker_id), CALL_TIMEOUT_S)
        except Exception as exc:   # the directory will drop it on its own when heartbeats stop
            log.warning("could not report %s as failed: %s", worker_id, exc)

    def report_failure_nowait(self, worker_id: str) -> None:
        """``report_failure`` from any thread, without waiting (the watchdog's way)."""
        try:
            self.handle().report_failure.remote(worker_id)
        except Exception as exc:
            log.warning("could not report %s as failed: %s", worker_id, exc)

    async def _call(self, method: str, *args, timeout_s: float = CALL_TIMEOUT_S):
        """One directory call within ``timeout_s``, tried once more on a fresh lookup when
        the handle failed (the directory restarted: the first call on the old handle
        fails even though the actor is back)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        for attempt in (0, 1):
            try:
                handle = await self.ahandle()
                left = deadline - asyncio.get_running_loop().time()
                return await asyncio.wait_for(getattr(handle, method).remote(*args), max(0.01, left))
            except RayActorError:
                self.forget()
                if attempt or deadline - asyncio.get_running_loop().time() <= 0:
                    raise

    async def drain(self, worker_id: str, timeout_s: float = CALL_TIMEOUT_S) -> bool:
        """Stop routing to ``worker_id`` (it is leaving); False when the directory did not answer."""
        try:
            return bool(await self._call("drain_worker", worker_id, timeout_s=timeout_s))
        except Exception as exc:
            log.warning("could not mark %s as draining: %s", worker_id, exc)
            self.forget()
            return False

    async def leave(self, worker_id: str, timeout_s: float = CALL_TIMEOUT_S) -> bool:
        """Forget ``worker_id`` and its entries now (it handed off and is going)."""
        try:
            return bool(await self._call("drop_worker", worker_id, "left", timeout_s=timeout_s))
        except Exception as exc:   # its heartbeats stop: the directory drops it within its timeout
            log.warning("could not deregister %s: %s", worker_id, exc)
            self.forget()
            return False

    async def handoff_targets(self, worker_id: str, timeout_s: float = CALL_TIMEOUT_S) -> list[str]:
        """The live workers other than ``worker_id`` that take requests, least loaded first."""
        try:
            return list(await self._call("handoff_targets", worker_id, timeout_s=timeout_s))
        except Exception as exc:
            log.warning("no hand-off targets from the directory (%s)", type(exc).__name__)
            self.forget()
            return []

    async def note_lifecycle(self, worker_id: str, kind: str, report: dict,
                             timeout_s: float = CALL_TIMEOUT_S) -> None:
        """Record a hand-off or warm-up report with the directory (its stats show them)."""
        try:
            await self._call("note_lifecycle", worker_id, kind, report, timeout_s=timeout_s)
        except Exception as exc:
            log.warning("could not record %s of %s: %s", kind, worker_id, exc)

    async def live_workers(self, timeout_s: float = CALL_TIMEOUT_S) -> list[str]:
        return await asyncio.wait_for((await self.ahandle()).live_workers.remote(), timeout_s)

    async def peer_addresses(self, timeout_s: float = CALL_TIMEOUT_S) -> dict[str, str]:
        """Live workers' peer channels: worker id -> host:port."""
        return await asyncio.wait_for((await self.ahandle()).peer_addresses.remote(), timeout_s)

    async def peer_address(self, worker_id: str, timeout_s: float = 2.0) -> str | None:
        """One live worker's peer channel (None: not live, or no directory within ``timeout_s``)."""
        try:
            return (await self.peer_addresses(timeout_s)).get(worker_id)
        except Exception as exc:
            log.warning("no peer address for %s from the directory (%s)", worker_id, type(exc).__name__)
            self.forget()
            return None
