"""StagedUpload: a promotion from COLD (and WARM) up to HOT, run on the disk thread.

COLD blocks are read, verified, straight into one of two staging buffers
(pinned host memory where HOT is a CUDA device), and copied up from there;
while one buffer's copy runs, the next blocks are read into the other. On
CUDA the copies are queued on the copy stream after an event the engine
recorded when it started the move (the freed HOT blocks may still be read by
work it queued before), each chunk records an event, and the disk thread
waits on those events only: never on the device, never on the engine's
stream, and never on the engine thread. WARM sources (pinned) are copied up
directly. Without CUDA the same path runs with plain memory and plain copies.

With a compressed tier codec the buffers hold stored bytes and each copy up
decodes on the way (on the copy stream under CUDA, on this thread otherwise).

The buffers are allocated on first use (``2 * chunk_blocks`` COLD blocks) and
reused; only the disk thread touches them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from cluster.cache.allocator import Extent
from cluster.cache.disk import DiskPool
from cluster.cache.kv_pool import KVPool, copy_pairs
from cluster.errors import ChecksumError

DEFAULT_CHUNK_BLOCKS = 16


@dataclass(slots=True)
class _StagingView:
    """What ``copy_pairs`` reads of a pool: staged blocks addressed by their slot."""

    tensor: torch.Tensor
    block_tokens: int


@dataclass(slots=True)
class _Chunk:
    """COLD blocks staged together: ``slots`` maps a disk block to its staging slot;
    ``entries`` are (job index, src extents remapped to slots, dst extents)."""

    slots: dict[int, int] = field(default_factory=dict)
    first_user: list[int] = field(default_factory=list)
    entries: list[tuple[int, list[Extent], list[Extent]]] = field(default_factory=list)


def slice_extents(extents: Sequence[Extent], start: int, stop: int) -> list[Extent]:
    """The sub-extents covering tokens ``[start, stop)`` of ``extents`` (pure: no allocator)."""
    out, pos = [], 0
    for b, off, length in extents:
        lo, hi = max(start, pos), min(stop, pos + length)
        if lo < hi:
            out.append(Extent(b, off + lo - pos, hi - lo))
        pos += length
        if pos >= stop:
            break
    return out


class StagedUpload:
    def __init__(self, hot: KVPool, disk: DiskPool, *, stream: Any = None,
                 chunk_blocks: int = DEFAULT_CHUNK_BLOCKS):
        """``stream``: the CUDA stream the copies go on (the copy engine's); None
        where HOT is not a CUDA device."""
        if chunk_blocks < 1:
            raise ValueError(f"chunk_blocks must be >= 1, got {chunk_blocks}")
        self.hot, self.disk, self.stream = hot, disk, stream
        self.codec = disk.codec   # a compressed tier codec's bytes are decoded on the way up
        self.chunk_blocks = chunk_blocks
        self.cuda = hot.device.type == "cuda"
        self._bufs: list[torch.Tensor] = []
        self._pending: list[Any] = [None, None]   # per buffer: the event its last copy recorded

    def _buffers(self) -> list[torch.Tensor]:
        if not self._bufs:
            shape = (self.chunk_blocks, *self.disk.block_shape)
            self._bufs = [torch.empty(shape, dtype=self.disk.dtype, pin_memory=self.cuda)
                          for _ in range(2)]
        return self._bufs

    def run(self, jobs: Sequence[tuple[Any, list[Extent], list[Extent]]], failed: list[int],
            pacer: Any = None, after: Any = None) -> float | None:
        """Copy each job ``(source pool, src extents, HOT extents)`` up, in order; on CUDA,
        the seconds it took on the device from when its stream was free of the engine's
        queued work (the copy rate the cache measures), else None (the thread times it).
        A COLD block that fails its checksum appends its first job's index to
        ``failed`` and raises ``ChecksumError``; every job before that one is
        copied whole first. ``after``: a CUDA event the copies wait for."""
        if not self.cuda:
            self._run(jobs, failed, pacer)
            return None
        with torch.cuda.device(self.hot.device):
            if after is not None:
                self.stream.wait_event(after)
            # Timed from when the stream has waited for the engine's queued work: the upload's
            # own time (disk reads overlap the copies), not the forward passes before it.
            start = torch.cuda.Event(enable_timing=True)
            start.record(self.stream)
            self._run(jobs, failed, pacer)
            end = torch.cuda.Event(enable_timing=True)
            end.record(self.stream)
            end.synchronize()
            return start.elapsed_time(end) / 1e3

    def _run(self, jobs, failed: list[int], pacer) -> None:
        which = 0
        chunk = _Chunk()
        try:
            for i, (pool, src, dst) in enumerate(jobs):
                if not isinstance(pool, DiskPool):
                    self._copy(list(copy_pairs(pool, src, self.hot, dst)), None)
                    if pacer is not None:
                        pacer.account(sum(e.length for e in src) * self.hot.layout.bytes_per_token())
                    continue
                pos = 0
                for b, off, length in src:
                    if b not in chunk.slots and len(chunk.slots) == self.chunk_blocks:
                        self._flush(chunk, which, failed, pacer)
                        which, chunk = 1 - which, _Chunk()
                    slot = chunk.slots.setdefault(b, len(chunk.slots))
                    if slot == len(chunk.first_user):
                        chunk.first_user.append(i)
                    entry = chunk.entries[-1] if chunk.entries and chunk.entries[-1][0] == i else None
                    if entry is None:
                        entry = (i, [], [])
                        chunk.entries.append(entry)
                    entry[1].append(Extent(slot, off, length))
                    entry[2].extend(slice_extents(dst, pos, pos + length))
                    pos += length
            if chunk.slots:
                self._flush(chunk, which, failed, pacer)
        finally:
            for ev in self._pending:   # nothing leaves this job with a copy still reading a buffer
                if ev is not None:
                    ev.synchronize()
            self._pending = [None, None]

    def _flush(self, chunk: _Chunk, which: int, failed: list[int], pacer) -> None:
        buf = self._buffers()[which]
        if self._pending[which] is not None:   # the copy that last read this buffer
            self._pending[which].synchronize()
            self._pending[which] = None
        for slot, block in enumerate(chunk.slots):
            try:
                self.disk.read_block_into(block, buf[slot])
            except ChecksumError:
                bad = chunk.first_user[slot]
                # Every block a job before ``bad`` uses sits in an earlier slot: copy those jobs whole.
                self._copy_entries([e for e in chunk.entries if e[0] < bad], buf, which)
                failed.append(bad)
                raise
        self._copy_entries(chunk.entries, buf, which)
        if pacer is not None:
            pacer.account(len(chunk.slots) * self.disk.block_bytes)

    def _copy_entries(self, entries, buf: torch.Tensor, which: int) -> None:
        view = _StagingView(buf, self.disk.block_tokens)
        pairs = [p for _, src, dst in entries for p in copy_pairs(view, src, self.hot, dst)]
        self._copy(pairs, which)

    def _copy(self, pairs: list, which: int | None) -> None:
        codec = self.codec
        if not self.cuda:
            for d, s in pairs:
                codec.copy_kv(d, s) if codec is not None else d.copy_(s)
            return
        with torch.cuda.stream(self.stream):
            for d, s in pairs:
                codec.copy_kv(d, s, non_blocking=True) if codec is not None else d.copy_(s, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        if which is None:   # a WARM source: pinned pool memory, nothing to reuse; wait at the end
            self._pending.append(event)
        else:
            self._pending[which] = event
