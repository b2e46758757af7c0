"""WorkerCore: one model runner + tiered cache + NIXL endpoint, driven by one thread.

The cache has exactly one owner: the engine thread. Everything else (async
request handlers, migration, snapshots, stats) reaches the cache by submitting
a command that the engine thread runs between two batches, so no lock guards
the tree and the forward pass never waits on a caller.

This class has no Ray dependency of its own: ``actors.worker.CacheWorker`` (a
Ray actor) and the Serve replica deployment both wrap it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import queue
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, AsyncIterator, Callable, Protocol

import numpy as np
import torch
import xxhash

from cluster.cache.kv_pool import KVLayout
from cluster.cache.radix_tree import WARM
from cluster.cache.tiered import TierConfig, TieredCache
from cluster.engine.checkpoint import ModelSpec, load_model
from cluster.engine.runner import Engine, Request, SamplingParams
from cluster.errors import CacheError, InvalidInputError
from cluster.routing.events import KVEventPublisher
from cluster.transfer.nixl_transport import NixlEndpoint, TransferError, nixl_available, recommended_ucx_env

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs; plain values so it crosses Ray and YAML."""

    # A model spec (cluster.engine.checkpoint.ModelSpec): None for the embedded
    # default (SmolLM2-135M-Instruct), "builtin" or a dict of ModelConfig fields for
    # the seeded test model, a local checkpoint directory, a .gguf file or a hub id.
    model: str | dict | None = None
    hot_blocks: int = 2048
    warm_blocks: int = 4096
    cold_blocks: int = 0
    block_tokens: int = 16
    disk_dir: str | None = None
    max_batch_tokens: int = 4096
    max_running: int = 64
    max_queued_requests: int = 256
    use_nixl: bool = True
    torch_threads: int = 1
    device: str = "auto"

    def tier_config(self) -> TierConfig:
        return TierConfig(hot_blocks=self.hot_blocks, warm_blocks=self.warm_blocks, cold_blocks=self.cold_blocks,
                          block_tokens=self.block_tokens, disk_dir=self.disk_dir, device=self.device)

    @classmethod
    def from_dict(cls, data: dict | None) -> "WorkerConfig":
        data = dict(data or {})
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise InvalidInputError(f"unknown worker config keys: {sorted(unknown)}")
        config = cls(**data)
        config.model_spec()   # a bad spec fails here, naming the key, not in a replica
        return config

    def model_spec(self) -> ModelSpec:
        return ModelSpec.parse(self.model)

    def to_dict(self) -> dict:
        return asdict(self)


class PeerLink(Protocol):
    """How one worker reaches another (a Ray actor handle, a Serve handle with
    ``target_worker``, or in-process for tests). All calls are awaitable but
    ``release``, which is fire and forget."""

    async def export_prefix(self, tokens: list[int], tenant: Any) -> dict: ...

    async def info(self) -> dict: ...

    async def export_array(self, lease: int) -> tuple[np.ndarray, str]: ...

    def release(self, lease: int) -> None: ...


class QueueFullError(CacheError):
    """The worker's queue bound is reached; the caller should retry later (HTTP 429)."""


class WorkerCore:
    def __init__(self, worker_id: str, config: WorkerConfig,
                 publish: Callable[[bytes | None, dict], Any] | None = None,
                 push_snapshot: Callable[[int, dict], Any] | None = None):
        """``publish(batch, load)`` sends events and load to the directory and may
        return a future of its status; ``push_snapshot(seq, entries)`` sends the
        whole index when the directory asks for it."""
        self.worker_id = worker_id
        self.config = config
        torch.set_num_threads(config.torch_threads)
        # A model that cannot load raises here, so the actor or replica never reports ready.
        self.loaded = load_model(config.model_spec(), device=str(config.tier_config().resolved_device()))
        self.model = self.loaded.model
        mc = self.model.config
        self.layout = KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim, mc.dtype)
        self.cache = TieredCache(config.tier_config(), self.layout, vocab_size=mc.vocab_size)
        self.engine = Engine(self.model, self.cache, max_batch_tokens=config.max_batch_tokens,
                             max_running=config.max_running)
        self.publisher = KVEventPublisher(worker_id, self.cache.tree, config.block_tokens)
        self.cache.tree.listeners.append(self.publisher)
        self._publish = publish
        self._push_snapshot = push_snapshot
        self._snapshot_wanted = False
        self._last_report = 0.0
        self.nixl: NixlEndpoint | None = None
        if config.use_nixl and config.warm_blocks and nixl_available():
            try:
                self.nixl = NixlEndpoint(f"{worker_id}-{id(self):x}", self.cache.pools[WARM].tensor,
                                         ucx_env=recommended_ucx_env())
            except TransferError as exc:
                log.warning("NIXL disabled on %s: %s", worker_id, exc)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._leases: dict[int, tuple[list, float]] = {}
        self._lease_ids = iter(range(1, 1 << 62))
        self._nixl_peers: dict[str, str] = {}      # worker id -> NIXL agent name
        self.faults: set[str] = set()              # injected faults: "nixl", "object_store"
        self.stats = {"migrations_in": 0, "migrations_out": 0, "migrated_tokens": 0, "migration_bytes": 0,
                      "nixl_failures": 0, "object_store_fallbacks": 0, "recomputed_after_failed_migration": 0,
                      "rejected_queue_full": 0, "stale_migrations": 0, "engine_step_failures": 0}
        self.cost = self._measure_costs()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"engine-{worker_id}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        last_publish = 0.0
        while not self._stop.is_set():
            self._run_commands()
            if self.engine.has_work():
                try:
                    events = self.engine.step()
                except Exception as exc:   # never let the engine thread die: fail the step's requests
                    log.exception("engine step failed on %s", self.worker_id)
                    self.stats["engine_step_failures"] += 1
                    self.engine.fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
                    events = self.engine.drain_ended()
                for ev in events:
                    self._deliver(ev.request, ev.token, ev.finished)
            else:  # idle gap: housekeeping that must never delay a batch
                self.cache.enforce_watermarks()
                self.cache.compact_idle()
                self._wake.wait(0.01)
                self._wake.clear()
            now = time.monotonic()
            if now - last_publish > 0.02:
                self._flush_events()
                last_publish = now
            if self._snapshot_wanted:
                self._send_snapshot()

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

    def call(self, fn: Callable[[], Any]) -> cf.Future:
        """Run ``fn`` on the engine thread; returns a future for its result."""
        fut: cf.Future = cf.Future()
        self._commands.put((fn, fut))
        self._wake.set()
        return fut

    def _deliver(self, req: Request, token: int | None, finished: bool) -> None:
        entry = self._streams.get(req.request_id)
        if entry is None:
            return
        loop, q = entry
        item = {"token": token, "finished": finished, "finish_reason": req.finish_reason, "error": req.error,
                "cached_tokens": req.cached_tokens, "tier_hits": list(req.tier_hits),
                "prompt_tokens": len(req.prompt)}
        loop.call_soon_threadsafe(q.put_nowait, item)
        if finished:
            self._streams.pop(req.request_id, None)

    def _flush_events(self) -> None:
        """Send pending KV events with the current load; with no events, the load
        alone every 100 ms, so the directory's view of queues stays fresh."""
        if self._publish is None:
            return
        batch = self.publisher.drain()
        now = time.monotonic()
        if batch is None and now - self._last_report < 0.1:
            return
        self._last_report = now
        try:
            status = self._publish(batch.encode() if batch is not None else None, self.load())
        except Exception as exc:  # the directory may be restarting: resync later
            log.warning("event publish from %s failed: %s", self.worker_id, exc)
            self._snapshot_wanted = True
            return
        if hasattr(status, "add_done_callback"):
            status.add_done_callback(self._on_publish_status)

    def _on_publish_status(self, fut) -> None:
        # Runs on whatever thread completes the future: only set a flag.
        try:
            status = fut.result()
        except Exception:
            status = "failed"
        if status != "ok":
            self._snapshot_wanted = True
            self._wake.set()

    def _send_snapshot(self) -> None:
        self._snapshot_wanted = False
        if self._push_snapshot is None:
            return
        seq, entries = self.publisher.snapshot()
        try:
            self._push_snapshot(seq, entries)
        except Exception as exc:
            log.warning("snapshot push from %s failed: %s", self.worker_id, exc)
            self._snapshot_wanted = True

    # --------------------------------------------------------------- requests
    def load(self) -> dict:
        waiting = sum(len(r.prompt) - r.cached_tokens for r in self.engine.waiting)
        running = sum(r.params.max_tokens - len(r.output) for r in self.engine.running)
        return {"queued_tokens": waiting + running, "running": len(self.engine.running),
                "waiting": len(self.engine.waiting),
                "transfer_tokens_per_s": self.cost.get("transfer_tokens_per_s")}

    async def generate(self, prompt: list[int], params: dict | None = None, namespace: Any = None,
                       session_id: Any = None) -> AsyncIterator[dict]:
        """Stream ``{"token", "finished", ...}`` dicts; cancelling the iterator cancels the request."""
        if len(self.engine.waiting) >= self.config.max_queued_requests:
            self.stats["rejected_queue_full"] += 1
            raise QueueFullError(f"worker {self.worker_id} has {len(self.engine.waiting)} requests queued")
        sp = SamplingParams(**(params or {}))
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        req = Request(list(prompt), sp, namespace=namespace, session_id=session_id)

        def submit():
            self.engine.submit(req)
            self._streams[req.request_id] = (loop, q)
            return req.request_id

        await asyncio.wrap_future(self.call(submit))
        try:
            while True:
                item = await q.get()
                if item["error"]:
                    raise CacheError(item["error"])
                yield item
                if item["finished"]:
                    return
        finally:
            if not req.finished:  # the consumer went away: stop generating, release locks
                self.call(lambda: self.engine.cancel(req, "client_disconnected"))

    async def prefetch(self, session_id: Any = None, tokens: list[int] | None = None, namespace: Any = None) -> int:
        return await asyncio.wrap_future(self.call(lambda: self.cache.prefetch(session_id, tokens, namespace)))

    # -------------------------------------------------------------- migration
    def export_prefix(self, tokens: list[int], namespace: Any = None, max_tokens: int | None = None) -> dict:
        """(engine thread) Stage the cached prefix of ``tokens`` in whole host blocks.

        Returns block ids of the host pool (for a NIXL READ), their checksums,
        and a lease id; the blocks stay reserved until ``release`` or expiry.
        """
        m = self.cache.match(tokens, namespace, lock=True)
        try:
            n = m.length if max_tokens is None else min(m.length, max_tokens)
            if n == 0 or self.cache.num_tiers < 2:
                return {"tokens": 0}
            kv = self.cache.read(m.extents)[:, :, :n].to("cpu")
            warm = self.cache.pools[WARM]
            ext = warm.allocator.allocate(n, private_tail=True)
            warm.write(ext, kv)
        finally:
            self.cache.unlock(m.last_node)
        blocks = [e.block_id for e in ext]
        sums = [xxhash.xxh3_64_intdigest(warm.tensor[b].numpy().tobytes()) for b in blocks]
        lease = next(self._lease_ids)
        self._leases[lease] = (ext, time.monotonic() + 60.0)
        self.stats["migrations_out"] += 1
        return {"tokens": n, "blocks": blocks, "checksums": sums, "lease": lease,
                "block_tokens": self.config.block_tokens}

    def export_array(self, lease: int) -> tuple[np.ndarray, str]:
        """(engine thread) The staged KV of a lease for the object-store fallback.

        A numpy array (Ray moves it zero-copy through plasma; torch tensors take
        a slow pickling path) and the torch dtype name to view it back."""
        if "object_store" in self.faults:
            raise RuntimeError("injected fault: object store export")
        ext, _ = self._leases[lease]
        kv = self.cache.pools[WARM].read(ext).contiguous()
        dtype = str(kv.dtype).removeprefix("torch.")
        if kv.dtype == torch.bfloat16:
            kv = kv.view(torch.int16)
        return kv.numpy().copy(), dtype

    def release(self, lease: int) -> None:
        """(engine thread) Free a lease's staging blocks."""
        entry = self._leases.pop(lease, None)
        if entry is not None:
            self.cache.pools[WARM].allocator.free(entry[0])
        now = time.monotonic()
        for stale in [k for k, (_, exp) in self._leases.items() if exp < now]:
            self.cache.pools[WARM].allocator.free(self._leases.pop(stale)[0])

    def install_prefix(self, tokens: list[int], namespace: Any, kv: torch.Tensor) -> int:
        """(engine thread) Insert migrated KV for ``tokens[:n]`` into this worker's tree."""
        n = kv.shape[2]
        m = self.cache.match(tokens[:n], namespace, lock=True)
        try:
            if m.length >= n:
                return 0
            ext = self.cache.allocate(n - m.length)
            self.cache.write(ext, kv[:, :, m.length:n].to(self.cache.hot.tensor.device))
            self.cache.insert(tokens[:n], ext, namespace, start=m.length)
        finally:
            self.cache.unlock(m.last_node)
        self.stats["migrations_in"] += 1
        self.stats["migrated_tokens"] += n - m.length
        return n - m.length

    async def migrate_from(self, holder_id: str, link: PeerLink, tokens: list[int], tenant: Any) -> dict:
        """Pull ``holder_id``'s cached prefix of ``tokens`` into this worker:
        NIXL READ first, the object store if that fails, nothing (recompute) last.
        Never raises: a failed migration only costs the prefill it would have saved."""
        result = {"from": holder_id, "transport": None, "tokens": 0, "bytes": 0}
        try:
            staged = await link.export_prefix(tokens, tenant)
        except Exception as exc:  # holder gone
            log.warning("export from %s failed: %s", holder_id, exc)
            self.stats["recomputed_after_failed_migration"] += 1
            return result
        if not staged.get("tokens"):  # stale decision: the holder evicted it meanwhile
            self.stats["stale_migrations"] += 1
            log.info("migration from %s found nothing cached (stale decision); recomputing", holder_id)
            return result
        kv = None
        try:
            kv = await self.pull_nixl(holder_id, link, staged)
            result["transport"] = "nixl"
        except Exception as exc:
            self.stats["nixl_failures"] += 1
            log.warning("NIXL pull from %s failed (%s); using the object store", holder_id, exc)
            try:
                array, dtype = await link.export_array(staged["lease"])
                kv = torch.from_numpy(array)
                kv = kv.view(torch.bfloat16) if dtype == "bfloat16" else kv
                result["transport"] = "object_store"
                self.stats["object_store_fallbacks"] += 1
            except Exception as exc2:
                log.warning("object-store pull from %s failed too (%s); recomputing", holder_id, exc2)
                self.stats["recomputed_after_failed_migration"] += 1
        finally:
            link.release(staged["lease"])
        if kv is not None:
            result["tokens"] = await asyncio.wrap_future(self.call(lambda: self.install_prefix(tokens, tenant, kv)))
            result["bytes"] = kv.numel() * kv.element_size()
        return result

    async def pull_nixl(self, holder_id: str, link: PeerLink, staged: dict) -> torch.Tensor:
        """Connect to the holder's NIXL agent once, then READ and verify the staged blocks."""
        if "nixl" in self.faults:
            raise TransferError("injected fault: NIXL read")
        if self.nixl is None:
            raise TransferError("NIXL is not available on this worker")
        if holder_id not in self._nixl_peers:
            info = await link.info()
            if info["nixl"] is None:
                raise TransferError(f"worker {holder_id} has no NIXL endpoint")
            self._nixl_peers[holder_id] = self.nixl.connect(info["nixl"])
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        kv = await loop.run_in_executor(None, self.pull_blocks_nixl, self._nixl_peers[holder_id], staged)
        self.note_transfer(kv.numel() * kv.element_size(), time.perf_counter() - t0)
        return kv

    def pull_blocks_nixl(self, peer: str, staged: dict) -> torch.Tensor:
        """Read staged blocks from a peer over NIXL into local staging; verify; return KV."""
        if self.nixl is None:
            raise TransferError("NIXL is not available on this worker")
        warm = self.cache.pools[WARM]
        nblocks = len(staged["blocks"])
        local = self.call(lambda: warm.allocator.allocate(nblocks * self.config.block_tokens,
                                                          private_tail=True)).result()
        try:
            local_ids = [e.block_id for e in local]
            nbytes = self.nixl.read_blocks(peer, staged["blocks"], local_ids)
            for b, want in zip(local_ids, staged["checksums"]):
                got = xxhash.xxh3_64_intdigest(warm.tensor[b].numpy().tobytes())
                if got != want:
                    raise TransferError(f"block checksum mismatch after NIXL read (local block {b})")
            self.stats["migration_bytes"] += nbytes
            kv = torch.cat([warm.tensor[b] for b in local_ids], dim=2)[:, :, :staged["tokens"]].clone()
            return kv
        finally:
            self.call(lambda: warm.allocator.free(local))

    # ------------------------------------------------------------- inspection
    def info(self) -> dict:
        return {"worker_id": self.worker_id, "nixl": self.nixl.metadata() if self.nixl else None,
                "nixl_name": self.nixl.name if self.nixl else None, "block_tokens": self.config.block_tokens,
                "cost": self.cost, "vocab_size": self.model.config.vocab_size, "model_id": self.loaded.model_id}

    def collect_stats(self) -> dict:
        """(engine thread) Tier occupancy, hit counters, migrations, fragmentation."""
        c = self.cache
        return {"worker_id": self.worker_id, "tiers": c.tier_summary(), "cache": dict(c.stats),
                "tree": dict(c.tree.stats), "engine": dict(self.engine.stats), "worker": dict(self.stats),
                "load": self.load(), "fragmentation": c.hot.allocator.internal_fragmentation(),
                "protected_tokens": c.tree.protected_tokens, "evictable_tokens": c.tree.evictable_tokens}

    def drop_all(self) -> int:
        """(engine thread) Drop every unlocked cached prefix, coldest tier first."""
        freed = 0
        for tier in reversed(range(self.cache.num_tiers)):
            while True:
                n = self.cache.tree.evict(1 << 40, tier)
                freed += n
                if not n:
                    break
        return freed

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        self.cache.close()
        if self.nixl is not None:
            self.nixl.close()

    # ---------------------------------------------------------------- costs
    def _measure_costs(self) -> dict:
        """Measure, not guess: prefill tokens/s, host->device promotion and
        block transfer rates, in tokens/s, for the directory's cost model."""
        n = 256
        x = torch.randint(0, self.model.config.vocab_size, (n,))
        self.model.forward_one(x, 0, None)
        t0 = time.perf_counter()
        self.model.forward_one(x, 0, None)
        prefill = n / (time.perf_counter() - t0)
        src = torch.ones(4 << 20, dtype=torch.uint8)
        dst = torch.zeros_like(src, device=self.cache.hot.tensor.device)
        t0 = time.perf_counter()
        for _ in range(4):
            dst.copy_(src)
        gbps = 16 * (1 << 20) / (time.perf_counter() - t0) / 1e9
        bpt = self.layout.bytes_per_token()
        cost = {"prefill_tokens_per_s": prefill, "promote_tokens_per_s": gbps * 1e9 / bpt, "bytes_per_token": bpt}
        transfer = self._measure_nixl_bytes_per_s() if self.nixl is not None else None
        if transfer:
            cost["transfer_tokens_per_s"] = transfer / bpt
        if self.cache.num_tiers > 2:   # COLD: a checksummed read of a few written blocks
            disk = self.cache.pools[2]
            ext = disk.allocator.allocate(4 * disk.block_tokens)
            try:
                disk.write(ext, torch.zeros((*self.layout_shape(4 * disk.block_tokens),), dtype=self.layout.torch_dtype))
                t0 = time.perf_counter()
                disk.read(ext)
                cost["cold_promote_tokens_per_s"] = 4 * disk.block_tokens / (time.perf_counter() - t0)
            finally:
                disk.allocator.free(ext)
        return cost

    def layout_shape(self, ntokens: int) -> tuple[int, ...]:
        lay = self.layout
        return (lay.num_layers, 2, ntokens, lay.num_kv_heads, lay.head_dim)

    @staticmethod
    def _measure_nixl_bytes_per_s(nbytes: int = 8 << 20) -> float | None:
        """One NIXL READ between two scratch agents of this process: the local
        transport's rate (migrations then refine it, see ``note_transfer``)."""
        a = torch.ones(nbytes // (64 << 10), 64 << 10, dtype=torch.uint8)
        b = torch.zeros_like(a)
        try:
            with NixlEndpoint(f"probe-a-{id(a):x}", a, ucx_env=recommended_ucx_env()) as ea, \
                    NixlEndpoint(f"probe-b-{id(b):x}", b, ucx_env=recommended_ucx_env()) as eb:
                peer = eb.connect(ea.metadata())
                ids = list(range(a.shape[0]))
                eb.read_blocks(peer, ids, ids)            # connection set-up
                t0 = time.perf_counter()
                moved = eb.read_blocks(peer, ids, ids)
                return moved / (time.perf_counter() - t0)
        except Exception as exc:  # measuring must never stop a worker from starting
            log.warning("could not measure the NIXL transfer rate: %s", exc)
            return None

    def note_transfer(self, nbytes: int, seconds: float) -> None:
        """Fold an observed migration into the transfer rate reported with the load."""
        if seconds > 0 and nbytes > (1 << 20):
            rate = nbytes / seconds / self.layout.bytes_per_token()
            old = self.cost.get("transfer_tokens_per_s")
            self.cost["transfer_tokens_per_s"] = rate if old is None else 0.8 * old + 0.2 * rate
