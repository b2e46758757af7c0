"""A preallocated KV pool: one torch tensor plus a slotted block allocator.

Layout ``[num_blocks, num_layers, 2, block_tokens, num_kv_heads, head_dim]``:
block first, so one block is contiguous (one memcpy to offload it, one
descriptor to send it). The KV of a token sequence, as the model produces and
consumes it, is ``[num_layers, 2, T, num_kv_heads, head_dim]``.

A pool can be built without a tensor (``layout=None``) for simulation and
benchmarks of the tree alone; data operations then only do bookkeeping.

A pool below HOT may store its KV compressed (``codec``: ``cluster.cache.codec``):
the same layout with the codec's stored dtype and row (``head_dim + 1`` bytes).
Its views are then stored bytes; ``write`` encodes model-dtype KV on the way in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from cluster.cache.allocator import AllocatorConfig, BlockAllocator, Extent
from cluster.cache.host_memory import populate, zeroed_host_tensor
from cluster.errors import InvalidInputError, PoolExhaustedError

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise InvalidInputError(f"{name} must be a positive integer, got {value!r}")
        if self.dtype not in _DTYPES:
            raise InvalidInputError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.torch_dtype.itemsize


def cuda_available() -> bool:
    return torch.cuda.is_available()


class KVPool:
    def __init__(self, alloc_config: AllocatorConfig, layout: KVLayout | None, *,
                 device: str | torch.device = "cpu", pin_memory: bool = False, name: str = "pool",
                 codec: Any = None, prefault: bool = True):
        self.name = name
        self.codec = codec if codec is not None and codec.compressed else None
        self.allocator = BlockAllocator(alloc_config)
        self.layout = layout
        self.block_tokens = alloc_config.block_tokens
        self.device = torch.device(device)
        self.cow_copies = 0
        self.moved_tokens = 0
        self.tensor: torch.Tensor | None = None
        self._mapping = None   # a CPU pool's anonymous mapping (``host_memory``)
        if layout is not None:
            row = self.codec.stored_row if self.codec else layout.head_dim
            shape = (alloc_config.num_blocks, layout.num_layers, 2, alloc_config.block_tokens,
                     layout.num_kv_heads, row)
            dtype = self.codec.stored_dtype if self.codec else layout.torch_dtype
            pin = pin_memory and self.device.type == "cpu" and cuda_available()
            # A CPU pool lies on an anonymous mapping: zero from the OS, its pages mapped by
            # ``prefault`` (now, or after a worker is ready) or by their first write.
            if self.device.type == "cpu" and not pin:
                self.tensor, self._mapping = zeroed_host_tensor(shape, dtype)
            else:
                self.tensor = torch.zeros(shape, dtype=dtype, device=self.device, pin_memory=pin)
            if prefault:
                self.prefault()

    def prefault(self, stop=lambda: False, pause=lambda: False) -> dict | None:
        """Map a CPU pool's pages ahead of its first copies (``host_memory.populate``, waiting
        while ``pause()``), so serving pays no page faults for them; what the pool holds is
        unchanged, so this may run while the pool is in use. None for a pool that needs
        nothing (on a device, pinned, or empty)."""
        return populate(self._mapping, stop, pause) if self._mapping is not None else None

    @property
    def block_bytes(self) -> int:
        return 0 if self.tensor is None else self.tensor[0].numel() * self.tensor.element_size()

    # ------------------------------------------------------------- data access
    def _index(self, extents: Sequence[Extent]) -> tuple[torch.Tensor, torch.Tensor]:
        blocks, offsets = [], []
        for b, off, length in extents:
            blocks.extend([b] * length)
            offsets.extend(range(off, off + length))
        dev = self.device
        return torch.tensor(blocks, dtype=torch.long, device=dev), torch.tensor(offsets, dtype=torch.long, device=dev)

    def read(self, extents: Sequence[Extent]) -> torch.Tensor:
        """Gather the KV of ``extents`` as ``[num_layers, 2, T, kv_heads, head_dim]``."""
        if self.tensor is None:
            raise InvalidInputError(f"pool {self.name!r} has no tensor (built without a layout)")
        if not extents:
            lay = self.layout
            return self.tensor.new_zeros((lay.num_layers, 2, 0, lay.num_kv_heads, self.tensor.shape[-1]))
        if len(extents) == 1:
            b, off, length = extents[0]
            return self.tensor[b, :, :, off:off + length]
        bidx, oidx = self._index(extents)
        # Advanced indexing on dims 0 and 3 puts the token dim first: [T, L, 2, H, D].
        return self.tensor[bidx, :, :, oidx].permute(1, 2, 0, 3, 4)

    def read_into(self, extents: Sequence[Extent], out: torch.Tensor) -> None:
        """Copy the KV of ``extents`` into ``out`` (``[num_layers, 2, T, kv_heads, head_dim]``),
        one copy per extent: no gather index and no intermediate tensor."""
        if self.tensor is None:
            raise InvalidInputError(f"pool {self.name!r} has no tensor (built without a layout)")
        total = sum(e.length for e in extents)
        if out.dim() != 5 or out.shape[2] != total:
            raise InvalidInputError(f"out of shape {tuple(out.shape)} does not fit extents covering {total} tokens")
        pos = 0
        for b, off, length in extents:
            out[:, :, pos:pos + length].copy_(self.tensor[b, :, :, off:off + length])
            pos += length

    def write(self, extents: Sequence[Extent], kv: torch.Tensor) -> None:
        """Scatter ``kv`` (``[num_layers, 2, T, kv_heads, head_dim]``) into ``extents``; a
        compressed pool takes model-dtype KV (encoded here) or its own stored bytes."""
        if self.tensor is None:
            return
        total = sum(e.length for e in extents)
        if kv.dim() != 5 or kv.shape[2] != total:
            raise InvalidInputError(f"kv of shape {tuple(kv.shape)} does not fit extents covering {total} tokens")
        pos = 0
        for b, off, length in extents:
            dst, src = self.tensor[b, :, :, off:off + length], kv[:, :, pos:pos + length]
            if self.codec is not None:
                self.codec.copy_kv(dst, src, non_blocking=True)
            else:
                dst.copy_(src, non_blocking=True)
            pos += length

    def copy_extent(self, src: Extent, dst: Extent) -> None:
        if self.tensor is not None:
            sb, so, ln = src
            db, do, _ = dst
            self.tensor[db, :, :, do:do + ln].copy_(self.tensor[sb, :, :, so:so + ln])

    # -------------------------------------------------------------- appending
    def append(self, extents: list[Extent], num_tokens: int, owner: Any = None) -> tuple[list[Extent], list[Extent]]:
        """Extend a sequence that this caller owns by ``num_tokens`` slots.

        Returns ``(all_extents, new_extents)``; write the new tokens' KV into
        ``new_extents``. Copy-on-write: if the sequence's last extent sits in a
        block shared with other extents (a slot), it is first copied to a block
        of its own, where the sequence can then grow in place. All or nothing:
        on ``PoolExhaustedError`` nothing changed.
        """
        alloc = self.allocator
        bt = self.block_tokens
        out = list(extents)
        last = out[-1] if out else None
        cow = last is not None and last.length < bt and alloc.is_shared(last)
        room = 0
        if last is not None:
            tail_len = last.length
            if cow:
                room = bt - tail_len
            elif alloc.refcount[last.block_id] == 1:
                room = alloc.room_after(last)
        rest = max(0, num_tokens - room)
        needed = (1 if cow else 0) + -(-rest // bt)
        if needed > alloc.free_blocks:
            raise PoolExhaustedError(
                f"pool {self.name!r} exhausted: append of {num_tokens} tokens needs {needed} blocks, "
                f"{alloc.free_blocks} free", needed_blocks=needed, free_blocks=alloc.free_blocks)
        new: list[Extent] = []
        if cow:
            (own,) = alloc.allocate(last.length, owner, private_tail=True)
            self.copy_extent(last, own)
            alloc.free([last])
            out[-1] = last = own
            self.cow_copies += 1
        if room and num_tokens:
            grown = alloc.try_grow(last, num_tokens)
            if grown is not None:
                new.append(Extent(last.block_id, last.offset + last.length, grown.length - last.length))
                out[-1] = grown
                num_tokens -= grown.length - last.length
        if num_tokens:
            fresh = alloc.allocate(num_tokens, owner, private_tail=True)
            out.extend(fresh)
            new.extend(fresh)
        return out, new

    # -------------------------------------------------------------- compaction
    def compact(self, max_blocks_moved: int, can_move=lambda owner: owner is not None) -> int:
        """Evacuate up to ``max_blocks_moved`` sparse blocks into fewer blocks.

        Each live extent of a chosen block is copied (a real tensor copy) into a
        slot elsewhere and its owner is told via ``owner.replace_extent``; the
        emptied block returns to the free list. Blocks holding an extent whose
        owner cannot move (``can_move`` false: locked, or a request's private
        tail) are skipped. Returns the number of blocks freed.
        """
        alloc = self.allocator
        free_before = alloc.free_blocks
        for b in alloc.compaction_candidates(limit=4 * max_blocks_moved):
            if alloc.free_blocks - free_before >= max_blocks_moved:
                break
            live = sorted(alloc.extents_at(b).items())
            if not live or not all(can_move(owner) for _, (_, owner) in live):
                continue
            was_open = alloc.is_open(b)
            alloc.set_open(b, False)  # no slot may land in the block being emptied
            # Moving a fuller block only pays when its extents fit into rooms of
            # other blocks; a sparse one may start a fresh block that later
            # candidates share.
            if alloc.used[b] > alloc.block_tokens // 2 and not alloc.fits_in_open_blocks(
                    [ln for _, (ln, _) in live]):
                alloc.set_open(b, was_open)
                continue
            try:
                for off, (length, owner) in live:
                    src = Extent(b, off, length)
                    (dst,) = alloc.allocate(length, owner)
                    self.copy_extent(src, dst)
                    alloc.free([src])
                    owner.replace_extent(src, dst)
                    self.moved_tokens += length
            except PoolExhaustedError:
                if alloc.refcount[b]:
                    alloc.set_open(b, was_open)
                break
        return alloc.free_blocks - free_before


def copy_pairs(src_pool: KVPool, src_ext: Sequence[Extent], dst_pool: KVPool, dst_ext: Sequence[Extent]):
    """(dst view, src view) pairs covering the same tokens, cut at both sides'
    boundaries; runs of whole blocks consecutive on both sides become one copy."""
    runs: list[list[int]] = []   # [dst block, dst off, src block, src off, tokens, whole blocks]
    si = di = s_off = d_off = 0
    bt = dst_pool.block_tokens
    while si < len(src_ext) and di < len(dst_ext):
        sb, so, sl = src_ext[si]
        db, do, dl = dst_ext[di]
        k = min(sl - s_off, dl - d_off)
        whole = k == bt and so + s_off == 0 and do + d_off == 0
        last = runs[-1] if runs else None
        if whole and last and last[5] and last[0] + last[5] == db and last[2] + last[5] == sb:
            last[5] += 1
        else:
            runs.append([db, do + d_off, sb, so + s_off, k, 1 if whole else 0])
        s_off += k
        d_off += k
        if s_off == sl:
            si, s_off = si + 1, 0
        if d_off == dl:
            di, d_off = di + 1, 0
    st, dt = src_pool.tensor, dst_pool.tensor
    for db, do, sb, so, k, nblocks in runs:
        if nblocks:
            yield dt[db:db + nblocks], st[sb:sb + nblocks]
        else:
            yield dt[db, :, :, do:do + k], st[sb, :, :, so:so + k]
