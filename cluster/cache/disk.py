"""COLD tier: a preallocated file of block slots, a checksum per block.

The file holds ``num_blocks`` slots of ``block_bytes`` each, written and read
in whole blocks. A block's xxh3-64 checksum is kept beside it in a sidecar
file and verified on every read: a torn write, a truncated file or flipped
bits raise ``ChecksumError`` and never return corrupt KV. Extents come from the
same slotted allocator as the memory tiers; a slot write is a read, verify,
modify, write of its block (all IO on the cache's single disk thread).

With a compressed tier codec (``cluster.cache.codec``) a slot holds the codec's
stored bytes (what WARM holds, moved as they are) and the checksum covers them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import xxhash

from typing import Any

from cluster.cache.allocator import AllocatorConfig, BlockAllocator, Extent
from cluster.cache.kv_pool import KVLayout
from cluster.errors import ChecksumError, DiskTierError

_EMPTY = 0  # checksum of a never-written block; reads of such blocks are refused


class DiskPool:
    def __init__(self, alloc_config: AllocatorConfig, layout: KVLayout, directory: str | os.PathLike,
                 *, name: str = "cold", codec: Any = None):
        self.name = name
        self.layout = layout
        self.codec = codec if codec is not None and codec.compressed else None
        self.dtype = self.codec.stored_dtype if self.codec else layout.torch_dtype
        self.allocator = BlockAllocator(alloc_config)
        self.block_tokens = alloc_config.block_tokens
        row = self.codec.stored_row if self.codec else layout.head_dim
        self.block_shape = (layout.num_layers, 2, self.block_tokens, layout.num_kv_heads, row)
        self.block_bytes = int(np.prod(self.block_shape)) * self.dtype.itemsize
        self.checksum_failures = 0
        directory = Path(directory)
        if not directory.is_dir():
            raise DiskTierError(f"disk tier directory does not exist: {directory}")
        if not os.access(directory, os.W_OK):
            raise DiskTierError(f"disk tier directory is not writable: {directory}")
        self.path = directory / f"{name}-{os.getpid()}.kvblocks"
        size = alloc_config.num_blocks * self.block_bytes
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            os.posix_fallocate(self._fd, 0, size) if hasattr(os, "posix_fallocate") else os.ftruncate(self._fd, size)
        except OSError as exc:
            raise DiskTierError(f"cannot preallocate {size} bytes for the disk tier at {self.path}: {exc}") from exc
        self._sums = np.zeros(alloc_config.num_blocks, dtype=np.uint64)

    # Whole-block IO ---------------------------------------------------------
    def _read_block(self, b: int) -> torch.Tensor:
        buf = bytearray(self.block_bytes)
        self._read_verified(b, buf)
        return torch.frombuffer(buf, dtype=self.dtype).view(self.block_shape)

    def _read_verified(self, b: int, buf) -> None:
        """Read block ``b`` into the writable buffer ``buf`` (``block_bytes`` long) and verify it."""
        n = os.preadv(self._fd, [buf], b * self.block_bytes)
        expected = int(self._sums[b])
        if n != self.block_bytes or expected == _EMPTY or xxhash.xxh3_64_intdigest(buf) != expected:
            self.checksum_failures += 1
            raise ChecksumError(f"disk block {b} of {self.path} failed its checksum "
                                f"({'short read' if n != self.block_bytes else 'content mismatch'})")

    def read_block_into(self, b: int, out: torch.Tensor) -> None:
        """Read and verify block ``b`` straight into ``out`` (a contiguous CPU tensor
        of ``block_shape``; pinned for an upload): no intermediate buffer."""
        if out.device.type != "cpu" or not out.is_contiguous() or tuple(out.shape) != self.block_shape \
                or out.dtype != self.dtype:
            raise ValueError(f"out {tuple(out.shape)} {out.dtype} on {out.device} is not one block of "
                             f"{self.block_shape} {self.dtype} in contiguous host memory")
        self._read_verified(b, out.view(torch.uint8).view(-1).numpy())   # any dtype: numpy has no bfloat16

    def _write_block(self, b: int, block: torch.Tensor) -> None:
        data = block.contiguous().view(torch.uint8).numpy().tobytes()   # any dtype: numpy has no bfloat16
        checksum = xxhash.xxh3_64_intdigest(data) or 1
        if os.pwrite(self._fd, data, b * self.block_bytes) != self.block_bytes:
            raise DiskTierError(f"short write to disk block {b} of {self.path}")
        self._sums[b] = checksum

    # Extent IO (runs on the disk thread) -------------------------------------
    def write(self, extents: Sequence[Extent], kv: torch.Tensor) -> None:
        """Write ``kv`` ``[L, 2, T, H, D]`` (CPU; stored bytes under a codec) into ``extents``,
        block by block."""
        if self.codec is not None:
            self.codec.check_stored(kv, "KV written to the disk tier")
        elif kv.dtype != self.dtype or kv.shape[-1] != self.block_shape[-1]:
            raise ValueError(f"KV of {kv.dtype} with last dimension {kv.shape[-1]} written to a disk tier "
                             f"of {self.dtype} rows of {self.block_shape[-1]}")
        pos = 0
        by_block: dict[int, list[tuple[int, int, int]]] = {}
        for b, off, length in extents:
            by_block.setdefault(b, []).append((off, length, pos))
            pos += length
        for b, parts in by_block.items():
            full = len(parts) == 1 and parts[0][1] == self.block_tokens
            block = torch.zeros(self.block_shape, dtype=self.dtype) if full or not self._sums[b] \
                else self._read_block(b).clone()
            for off, length, src in parts:
                block[:, :, off:off + length] = kv[:, :, src:src + length]
            self._write_block(b, block)

    def read(self, extents: Sequence[Extent]) -> torch.Tensor:
        """Read and verify; returns ``[L, 2, T, H, D]`` on the CPU."""
        cache: dict[int, torch.Tensor] = {}
        parts = []
        for b, off, length in extents:
            if b not in cache:
                cache[b] = self._read_block(b)
            parts.append(cache[b][:, :, off:off + length])
        return torch.cat(parts, dim=2)

    def drop_page_cache(self) -> None:
        """Ask the OS to forget this file's cached pages, so the next reads
        measure the device (calibration); best effort where fadvise is missing."""
        if hasattr(os, "posix_fadvise"):
            os.fsync(self._fd)
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def corrupt_block_for_test(self, block_id: int) -> None:
        """Flip bytes of one block on disk (fault injection for tests and drills)."""
        os.pwrite(self._fd, b"\xff" * 16, block_id * self.block_bytes)

    def close(self) -> None:
        try:
            os.close(self._fd)
            self.path.unlink(missing_ok=True)
        except OSError:
            pass
