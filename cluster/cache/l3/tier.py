"""L3Tier: the tiered cache's side of L3 (write behind, fetch ahead, one I/O thread).

L3 sits beside the tree, not in it: the tree holds what this replica has
(HOT, WARM, COLD), L3 holds whole blocks for the whole cluster by their
tenant-salted chained hash (``cluster.cache.l3``). Two flows cross:

- **write behind**: when a request commits its sequence, the engine thread
  copies the KV of its full blocks that L3 does not have yet (as far as this
  replica knows: ``written``), and of its partial last block, out of the
  pools, and the I/O thread stores them. A commit's write goes to the front
  of the write queue, behind only the queued writes of the same chain (the
  session's next turn may land on another replica at once). The request never
  waits; a write queue over ``max_pending_bytes`` drops the newest writes
  (counted), so a slow store costs L3 coverage, never memory or latency.
- **fetch ahead**: when the scheduler looks at a waiting request whose full
  blocks run past what the tree holds, the cache starts a fetch of those
  blocks (``start_fetch``) and the request waits while others run, as it does
  for a promotion. The I/O thread reads the leading run of blocks L3 has
  (verified with their tokens: ``cluster.cache.l3.wire``), then the longest
  partial block stored right after that run (where a sequence committed
  elsewhere ended), and the engine thread installs them into the tree
  (``take_fetched``) before the request is admitted. A fetch is started only
  where it beats recompute (``fetch_cost.FetchCost``: a round trip plus tokens).

Every method but the I/O loop runs on the cache's owner thread. Results come
back through a queue the owner drains (``take_fetched``, ``take_written``),
as the copy engines' completions do. Listeners hear which blocks this replica
stored (and which ones a fetch found missing), so the directory's index knows
what L3 holds.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections import deque
from typing import Any, Callable, Hashable, Sequence

import torch

from cluster.cache.codec import TierCodec
from cluster.cache.kv_pool import KVLayout
from cluster.cache.l3.fetch_cost import FetchCost
from cluster.cache.l3.store import GetStatus, L3Block, L3Lookup, L3Store, kv_layout_version, l3_key
from cluster.cache.l3.tier_types import (  # noqa: F401  (l3_model_id: imported from here)
    BoundedHashes, FetchJob, FetchResult, InventoryJob, L3TierConfig, L3TierStats, WriteDone, WriteJob, l3_model_id)
from cluster.errors import InvalidInputError
from cluster.hashing import tail_hash

log = logging.getLogger(__name__)


class L3Tier:
    def __init__(self, store: L3Store, layout: KVLayout, block_tokens: int, config: L3TierConfig, *,
                 clock: Callable[[], float] = time.monotonic, start_thread: bool = True,
                 codec: TierCodec | None = None):
        """``start_thread=False``: no I/O threads; ``run_pending`` does the I/O on
        the caller's thread (exact tests). Otherwise two: ``l3-fetch`` and ``l3-write``
        (at ``config.write_nice``), each taking its own queue's jobs in order.
        ``codec``: the cache's tier codec (None: ``none``); values hold its stored
        bytes, converted on the I/O threads, and the key names it."""
        self.store = store
        self.layout = layout
        self.block_tokens = block_tokens
        self.config = config
        self.clock = clock
        self.codec = codec if codec is not None and codec.compressed else None
        self.version = kv_layout_version(layout, block_tokens, self.codec_name)
        self.written = BoundedHashes(config.max_remembered)
        self.written_tails = BoundedHashes(config.max_remembered)   # partial blocks' hashes (``tail_hash``)
        self._missing = BoundedHashes(config.max_remembered)   # hash -> when a fetch found it missing
        self._fetching: dict[int, FetchJob] = {}             # first block's hash -> fetch in flight
        self.fetch_tokens_per_s: float | None = None       # measured (calibration), then observed
        self.prefill_tokens_per_s: float | None = None
        self.cost = FetchCost(started_at=clock())   # the ``auto`` guard: fetch where it beats prefill
        self.listeners: list[Any] = []   # on_l3_stored(hashes, namespace), on_l3_removed(hashes), on_l3_inventory
        self.stats = L3TierStats()
        self._cv = threading.Condition()
        self._fetch_jobs: deque[FetchJob] = deque()
        self._write_jobs: deque[WriteJob] = deque()
        self._done_fetches: deque[FetchResult] = deque()
        self._done_writes: deque[WriteDone] = deque()
        self._done_inventories: deque[list[int] | None] = deque()
        self._inventory_queued = False
        self._pending_bytes = 0
        self._busy = {"fetch": False, "write": False}   # a job of that queue is running
        self._closed = False
        self._threads: list[threading.Thread] = []
        if start_thread:
            for kind in ("fetch", "write"):
                thread = threading.Thread(target=self._loop, args=(kind,), name=f"l3-{kind}", daemon=True)
                thread.start()
                self._threads.append(thread)

    # ------------------------------------------------------------ policy
    def set_rates(self, fetch_tokens_per_s: float | None, prefill_tokens_per_s: float | None) -> None:
        self.fetch_tokens_per_s = self.cost.rate = fetch_tokens_per_s
        self.prefill_tokens_per_s = prefill_tokens_per_s

    @property
    def codec_name(self) -> str:
        return self.codec.name if self.codec is not None else "none"

    @property
    def writes(self) -> bool:
        return self.config.write != "off" and self.store.stats().state != "closed"

    def key(self, block_hash: int, tail_tokens: int = 0):
        """The key of a full block, or of a partial one of ``tail_tokens`` (its ``tail_hash``)."""
        return l3_key(self.config.model_id, self.version, block_hash, tail_tokens)

    @property
    def key_prefix(self) -> str:
        """The names of this model's blocks in this KV format start with it."""
        return f"pc/{self.config.model_id}/{self.version}/"

    def remove_all(self) -> int:
        """Remove every block of this model and KV format from L3 (an admin flush;
        any thread); how many went (-1: unknown). ``forget`` afterwards."""
        return self.store.remove_prefix(self.key_prefix)

    def forget(self) -> None:
        """Forget which blocks were written or missing (owner thread; after ``remove_all``)."""
        self.written = BoundedHashes(self.config.max_remembered)
        self.written_tails = BoundedHashes(self.config.max_remembered)
        self._missing = BoundedHashes(self.config.max_remembered)

    # ------------------------------------------------------------- writes
    def unwritten(self, hashes: Sequence[int]) -> list[int]:
        """Indices of ``hashes`` not known to be in L3."""
        written = self.written
        return [i for i, h in enumerate(hashes) if h not in written]

    def write(self, tokens: Sequence[int], hashes: Sequence[int], index: Sequence[int],
              kv: torch.Tensor | list[torch.Tensor], remove: Sequence[int] = (), *,
              tail: int | None = None, front: bool = False, namespace: Hashable = None) -> int:
        """Queue blocks ``index`` (indices into ``hashes``, the full blocks of ``tokens``)
        for writing, and with ``tail`` (its ``tail_hash``) the partial block after them,
        ``tokens[len(hashes) * block_tokens:]``; ``kv`` holds exactly those blocks' KV,
        in order, token-major (a private copy: the caller's pools may change once this
        returns); under a compressed codec it may be parts, each model-dtype or stored,
        encoded on the I/O thread. Returns the blocks queued (0 when over
        ``max_pending_bytes``: dropped, counted). ``remove``: hashes of blocks to remove
        from L3 before these are stored (a tenant's quota; the listeners hear of them as
        removed once queued). ``front``: a commit's write, queued ahead of every other
        write but those holding blocks of ``hashes``. ``namespace``: the tenant they are
        written for (the listeners hear it with the stored blocks)."""
        bt = self.block_tokens
        full = len(hashes) * bt
        if tail is not None and not 0 < len(tokens) - full < bt:
            raise InvalidInputError(f"a partial block has 1 to {bt - 1} tokens, got {len(tokens) - full}")
        count = len(index) + (tail is not None)
        if not count:
            return 0
        parts = kv if isinstance(kv, list) else [kv]
        nbytes = sum(p.numel() * p.element_size() for p in parts)
        with self._cv:
            if self._pending_bytes + nbytes > self.config.max_pending_bytes:
                self.stats.writes_dropped += count
                return 0
            keys = [(self.key(hashes[i]), tuple(tokens[i * bt:(i + 1) * bt])) for i in index]
            if tail is not None:
                keys.append((self.key(tail, len(tokens) - full), tuple(tokens[full:])))
            job = WriteJob([], [hashes[i] for i in index], nbytes, tail=tail, remove=[self.key(h) for h in remove],
                           namespace=namespace)
            if self.codec is None and len(parts) == 1:   # slices of one tensor (the tail's is the shorter last)
                job.blocks = [L3Block(k, toks, parts[0][:, :, j * bt:(j + 1) * bt]) for j, (k, toks) in enumerate(keys)]
            else:
                job.keys, job.parts = keys, parts
            self._settle_queued(hashes, index, remove)
            self._queue_write(job, set(hashes) if front else None)
            self._pending_bytes += nbytes
            self.stats.writes_queued += count
            self._cv.notify_all()   # two I/O threads wait on it: wake the one whose queue it is
        for i in index:   # optimistic: a failed write is forgotten again in take_written
            self.written.add(hashes[i])
        if tail is not None:
            self.written_tails.add(tail)
        for h in remove:
            self.written.discard(h)
        if remove:
            for listener in self.listeners:
                listener.on_l3_removed(list(remove))
        return count

    def _settle_queued(self, hashes: Sequence[int], index: Sequence[int], remove: Sequence[int]) -> None:
        """(under ``_cv``) A write may run before the queued ones (``front``): a block it
        removes that a queued write still holds is not written at all, and a block it
        writes that a queued write would remove is no longer removed, so the store ends
        holding what the quotas admitted, whatever order the writes run in."""
        gone = set(remove)
        adding = {self.key(hashes[i]) for i in index}
        for queued in self._write_jobs:
            if not isinstance(queued, WriteJob):
                continue
            if gone:
                queued.cancelled.update(gone.intersection(queued.hashes))
            if adding and queued.remove:
                queued.remove = [k for k in queued.remove if k not in adding]

    def _queue_write(self, job: WriteJob, chain: set[int] | None) -> None:
        """(under ``_cv``) Queue ``job`` last, or with its ``chain`` first: the queued
        writes holding blocks of that chain (earlier turns of the session, a shared
        prefix), in their order, then ``job``, then every other write."""
        jobs = self._write_jobs
        if chain is None:
            jobs.append(job)
            return
        mine = [j for j in jobs if not chain.isdisjoint(j.hashes)]
        others = [j for j in jobs if chain.isdisjoint(j.hashes)] if mine else list(jobs)
        jobs.clear()
        jobs.extend(mine)
        jobs.append(job)
        jobs.extend(others)

    def take_written(self) -> int:
        """Apply finished writes (owner thread): tell the listeners which blocks L3
        now holds. Returns the blocks reported stored."""
        with self._cv:
            done, self._done_writes = self._done_writes, deque()
        stored_total = 0
        for w in done:
            ok = [h for h, s in zip(w.hashes, w.stored) if s]
            for h, s in zip(w.hashes, w.stored):
                if not s:
                    self.written.discard(h)
            if w.tail is not None:   # partial blocks stay out of the directory's index: no event
                if w.tail_stored:
                    self.stats.tails_written += 1
                else:
                    self.written_tails.discard(w.tail)
                    self.stats.write_failures += 1
            self.stats.blocks_written += len(ok)
            self.stats.write_failures += len(w.hashes) - len(ok) - w.cancelled
            self.stats.writes_cancelled += w.cancelled
            self.stats.bytes_written += w.nbytes
            stored_total += len(ok)
            if ok:
                for listener in self.listeners:
                    listener.on_l3_stored(ok, w.namespace)
        self._take_inventories()
        return stored_total

    # ---------------------------------------------------------- inventory
    def request_inventory(self) -> None:
        """List what L3 holds of this model and layout, on the fetch thread, and tell
        the listeners (``on_l3_inventory``) at the next ``take_written``: how a
        directory that restarted, or a worker that started, learns L3's content.
        Where the store cannot list, what this replica knows it holds goes instead."""
        with self._cv:
            if self._inventory_queued:
                return
            self._inventory_queued = True
            self._fetch_jobs.append(InventoryJob())
            self._cv.notify_all()

    def _take_inventories(self) -> None:
        with self._cv:
            done, self._done_inventories = list(self._done_inventories), deque()
        for listed in done:
            if listed is not None:
                for h in listed:   # in L3: not to be written again
                    self.written.add(h)
            hashes = self.written.keys() if listed is None else listed
            self.stats.inventories += 1
            self.stats.inventory_blocks = len(hashes)
            self.stats.inventory_listed = listed is not None
            for listener in self.listeners:
                listener.on_l3_inventory(hashes)

    def _list_hashes(self) -> list[int] | None:
        prefix = self.key_prefix
        names = self.store.list_names(prefix)
        if names is None:
            return None
        out = []
        for name in names:
            try:
                out.append(int(name[len(prefix):], 16))
            except ValueError:   # not one of ours after all
                continue
        return out

    # ------------------------------------------------------------- fetches
    def wants_fetch(self, hashes: Sequence[int], first_block: int) -> bool:
        """Whether blocks ``[first_block, len(hashes))`` are worth asking L3 for."""
        cfg = self.config
        if cfg.fetch == "off" or len(hashes) - first_block < cfg.min_fetch_blocks:
            return False
        h = hashes[first_block]
        missed = self._missing.get(h)
        if missed is not None and self.clock() - missed < cfg.miss_ttl_s:
            return False
        run = min(len(hashes) - first_block, cfg.max_fetch_blocks) * self.block_tokens
        if cfg.fetch == "auto" and not self.cost.beats_recompute(run, self.prefill_tokens_per_s):
            if not self.cost.probe_due(self.clock()):   # one fetch a while still measures L3
                self.stats.fetch_skipped_slower += 1
                return False
            self.stats.fetch_probes += 1
        return True

    def note_missing(self, block_hash: int) -> None:
        """Do not fetch from this block for ``miss_ttl_s`` (missing, or not installable)."""
        self._missing.add(block_hash, self.clock())

    def fetching(self, hashes: Sequence[int], first_block: int) -> int:
        """Blocks a fetch in flight from ``hashes[first_block]`` asked for (0: none)."""
        job = self._fetching.get(hashes[first_block]) if first_block < len(hashes) else None
        return 0 if job is None else len(job.hashes) - job.first_block

    def start_fetch(self, namespace: Hashable, tokens: Sequence[int], hashes: Sequence[int],
                    first_block: int) -> None:
        """Ask L3 for blocks ``[first_block, len(hashes))`` of ``tokens`` (at most
        ``max_fetch_blocks``), and for a partial block where that run ends (the job
        keeps up to ``block_tokens - 1`` tokens past it); the answer comes back
        through ``take_fetched``."""
        last = min(len(hashes), first_block + self.config.max_fetch_blocks)
        bt = self.block_tokens
        job = FetchJob(namespace, list(tokens[:last * bt + bt - 1]), list(hashes[:last]), first_block)
        self._fetching[hashes[first_block]] = job
        self.stats.fetches += 1
        self.stats.fetch_blocks_asked += last - first_block
        with self._cv:
            self._fetch_jobs.append(job)
            self._cv.notify_all()   # two I/O threads wait on it: wake the one whose queue it is

    def take_fetched(self) -> list[FetchResult]:
        """Finished fetches (owner thread), for the cache to install."""
        with self._cv:
            done, self._done_fetches = list(self._done_fetches), deque()
        now = self.clock()
        for r in done:
            self._fetching.pop(r.first_hash, None)
            for h in r.found:        # in L3: installing them must not write them back
                self.written.add(h)
            if r.tail_tokens:
                self.written_tails.add(r.tail_hash)
                self.stats.tails_fetched += 1
            brought = r.blocks * self.block_tokens + r.tail_tokens
            if brought:
                self.stats.fetch_blocks_hit += r.blocks
                self.stats.bytes_fetched += r.bytes
                times, sizes = self.stats.fetch_s, self.stats.fetch_tokens
                times.append(r.seconds)
                sizes.append(brought)
                self.stats.fetches_timed += 1
                self.cost.add(brought, r.seconds)
                if len(times) > 4096:
                    del times[:2048]
                    del sizes[:2048]
                # Observed rate, smoothed, from runs the guard decides on (a lone tail times a round trip).
                if r.seconds > 0 and r.blocks >= self.config.min_fetch_blocks:
                    rate = brought / r.seconds
                    f = self.fetch_tokens_per_s
                    self.fetch_tokens_per_s = rate if f is None else 0.8 * f + 0.2 * rate
            elif not r.unanswered:
                self.stats.fetch_misses += 1
            if r.unanswered:   # no answer is not an answer: nothing is marked missing or removed
                self.stats.fetch_unanswered += 1
            for h in r.backoff:   # ... but the request computes, and nobody asks again at once
                self._missing.add(h, now)
            for h in r.missing:
                self._missing.add(h, now)
                if h in self.written:     # it was there once: evicted from L3 since
                    self.written.discard(h)
            if r.missing:
                for listener in self.listeners:
                    listener.on_l3_removed(r.missing)
        return done

    # ------------------------------------------------------------ the I/O
    def _loop(self, kind: str) -> None:
        if kind == "write" and self.config.write_nice:
            _lower_priority(self.config.write_nice)
        while True:
            with self._cv:
                while not (self._jobs(kind) or self._closed):
                    self._cv.wait()
                if self._closed and not self._jobs(kind):
                    return
                job = self._jobs(kind).popleft()
                self._busy[kind] = True
            try:
                self._run(job)
            except Exception:   # the store never raises for store trouble; anything else is a bug
                log.exception("L3 I/O job failed")
                self._fail(job)
            finally:
                with self._cv:
                    self._busy[kind] = False
                    self._cv.notify_all()

    def run_pending(self) -> int:
        """Without an I/O thread: run every queued job here (tests). Returns jobs run."""
        n = 0
        while True:
            with self._cv:
                if not (self._fetch_jobs or self._write_jobs):
                    return n
                job = self._fetch_jobs.popleft() if self._fetch_jobs else self._write_jobs.popleft()
            self._run(job)
            n += 1

    def _run(self, job: FetchJob | WriteJob | InventoryJob) -> None:
        if isinstance(job, InventoryJob):
            listed = self._list_hashes()
            with self._cv:
                self._inventory_queued = False
                self._done_inventories.append(listed)
            return
        if isinstance(job, WriteJob):
            if job.remove:
                removed = self.store.remove_keys(job.remove)
                with self._cv:
                    self.stats.quota_removed += max(0, removed)
            if job.parts:
                job.blocks = self._stored_blocks(job)
            n = len(job.hashes)
            with self._cv:
                keep = [i for i, h in enumerate(job.hashes) if h not in job.cancelled]
            put = [r.stored for r in self.store.put_blocks([job.blocks[i] for i in keep] + job.blocks[n:])]
            stored = [False] * n
            for j, i in enumerate(keep):
                stored[i] = put[j]
            with self._cv:
                self._pending_bytes -= job.nbytes
                self._done_writes.append(WriteDone(job.hashes, stored, job.nbytes, job.tail,
                                                   job.tail is not None and put[len(keep)], job.namespace,
                                                   n - len(keep)))
            return
        self._fetch(job)

    def _fetch(self, job: FetchJob) -> None:
        """The leading run of verified blocks L3 holds from ``job.first_block``, then
        the partial block stored where that run ends, if any (``_read_tail``)."""
        started = time.perf_counter()
        bt = self.block_tokens
        first, hashes, tokens = job.first_block, job.hashes, job.tokens
        lookups = [L3Lookup(self.key(hashes[i]), tuple(tokens[i * bt:(i + 1) * bt]))
                   for i in range(first, len(hashes))]
        results = list(self.store.get_blocks(lookups))
        found = 0
        for r in results:
            if not r.hit:
                break
            found += 1
        if self.codec is not None:   # another format under this key is refused, as a failed check
            for i in range(found):
                if not self.codec.is_stored(results[i].kv):
                    log.warning("L3 block %s is not %s's stored format: refused", results[i].key.name,
                                self.codec_name)
                    results[i] = dataclasses.replace(results[i], status=GetStatus.VERIFY_FAILED, kv=None)
                    found = i
                    break
        stop = results[found].status if found < len(results) else None
        # A partial block only continues a run that ended in an answer (a miss, or the last block asked).
        tail = self._read_tail(job, first + found) if stop in (None, GetStatus.MISS) else None
        n_tail, tail_h = (tail[0], tail[1]) if tail is not None else (0, 0)
        parts = [r.kv for r in results[:found]] + ([tail[2]] if tail is not None else [])
        kv = torch.cat(parts, dim=2) if parts else None
        nbytes = 0 if kv is None else kv.numel() * kv.element_size()
        if kv is not None and self.codec is not None:
            kv = self.codec.decode(kv)   # restored to the model's dtype here, on the fetch thread
        if stop is GetStatus.VERIFY_FAILED:   # every read of it would fail: it goes (and is missing)
            self._remove_failed(results[found].key)
        # Only an answer makes a block missing: a timeout or an off store says nothing of it.
        missing = [hashes[first + found]] if stop in (GetStatus.MISS, GetStatus.VERIFY_FAILED) else []
        out = FetchResult(job.namespace, tokens[:(first + found) * bt + n_tail], first, found, kv, missing,
                          time.perf_counter() - started, hashes[first],
                          nbytes, hashes[first:first + found],
                          unanswered=stop in (GetStatus.TIMEOUT, GetStatus.OFF),
                          backoff=[hashes[first + found]] if stop in (GetStatus.TIMEOUT, GetStatus.OFF) else [],
                          tail_tokens=n_tail, tail_hash=tail_h)
        with self._cv:
            self._done_fetches.append(out)

    def _read_tail(self, job: FetchJob, block: int) -> tuple[int, int, torch.Tensor] | None:
        """(tokens, tail hash, KV) of the longest partial block L3 holds right after block
        ``block - 1`` of ``job.tokens`` (a sequence committed elsewhere ended inside block
        ``block``): its keys name their tokens, so one existence check covers every
        length, and the read verifies the tokens as any other."""
        bt, tokens = self.block_tokens, job.tokens
        start = block * bt
        longest = min(bt - 1, len(tokens) - start)
        if block < 1 or longest < 1:
            return None
        prev = job.hashes[block - 1]
        candidates = [(n, tail_hash(prev, tokens[start:start + n])) for n in range(longest, 0, -1)]
        keys = [self.key(h, n) for n, h in candidates]
        for (n, h), key, there in zip(candidates, keys, self.store.contains(keys)):
            if not there:
                continue
            got = self.store.get_blocks([L3Lookup(key, tuple(tokens[start:start + n]))])[0]
            if got.hit and (self.codec is None or self.codec.is_stored(got.kv)):
                return n, h, got.kv
            if got.status is GetStatus.VERIFY_FAILED:
                self._remove_failed(key)
        return None

    def _remove_failed(self, key) -> None:
        """A value that failed verification goes: every read of it would fail."""
        removed = self.store.remove_keys([key])
        with self._cv:
            self.stats.verify_failed_removed += max(0, removed)

    def _stored_blocks(self, job: WriteJob) -> list[L3Block]:
        """The blocks of a write whose KV came as parts: each part in the stored format
        (encoded here, on the write thread), then cut into blocks."""
        codec, bt = self.codec, self.block_tokens
        if codec is not None:
            stored = [p if codec.is_stored(p) else codec.encode(p) for p in job.parts]
        else:
            stored = job.parts
        kv = torch.cat(stored, dim=2) if len(stored) > 1 else stored[0]
        return [L3Block(k, toks, kv[:, :, j * bt:(j + 1) * bt]) for j, (k, toks) in enumerate(job.keys)]

    def _fail(self, job: FetchJob | WriteJob | InventoryJob) -> None:
        with self._cv:
            if isinstance(job, InventoryJob):
                self._inventory_queued = False
                self._done_inventories.append(None)
            elif isinstance(job, WriteJob):
                self._pending_bytes -= job.nbytes
                self._done_writes.append(WriteDone(job.hashes, [False] * len(job.hashes), job.nbytes, job.tail,
                                                   namespace=job.namespace))
            else:
                self._done_fetches.append(FetchResult(job.namespace, [], job.first_block, 0, None, [], 0.0,
                                                      job.hashes[job.first_block], unanswered=True,
                                                      backoff=[job.hashes[job.first_block]]))

    # ------------------------------------------------------------ lifecycle
    def pending(self) -> int:
        """Jobs queued or running."""
        with self._cv:
            return len(self._fetch_jobs) + len(self._write_jobs) + sum(self._busy.values())

    def wait_fetches(self, timeout_s: float) -> bool:
        """Wait (any thread) until no fetch is queued or running, at most ``timeout_s``."""
        return self._wait_idle("fetch", timeout_s)

    def drop_queued_writes(self) -> int:
        """Drop the writes that have not started (owner thread; an admin flush, whose
        removal they would otherwise outlive). Returns the blocks dropped."""
        with self._cv:
            jobs, self._write_jobs = self._write_jobs, deque()
            for job in jobs:
                self._pending_bytes -= job.nbytes
            self._cv.notify_all()
        dropped = sum(len(job.hashes) + (job.tail is not None) for job in jobs)
        for job in jobs:
            for h in job.hashes:
                self.written.discard(h)
            if job.tail is not None:
                self.written_tails.discard(job.tail)
        self.stats.writes_dropped += dropped
        return dropped

    def flush(self, timeout_s: float) -> bool:
        """Wait (any thread) until every queued write is done, at most ``timeout_s``."""
        return self._wait_idle("write", timeout_s)

    def _jobs(self, kind: str) -> deque:
        """The queue of ``kind`` ("fetch" or "write"), looked up each time: ``drop_queued_writes``
        swaps the write queue for a new one."""
        return self._fetch_jobs if kind == "fetch" else self._write_jobs

    def _wait_idle(self, kind: str, timeout_s: float) -> bool:
        """Until ``kind``'s queue is empty and none of its jobs runs; without I/O threads, run them here."""
        if not self._threads:
            self.run_pending()
            return True
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._jobs(kind) or self._busy[kind]:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))


def _lower_priority(nice: int) -> None:
    """This thread's nice value to ``nice`` (Linux: per thread); where that cannot be done it
    keeps the process's, and says so once."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError) as exc:   # another platform, or not permitted
        log.info("L3 writes keep the process's priority (%s)", exc)
