"""Attention that reads K/V in place from the HOT pool, through per-sequence slot tables.

The pool (``cluster.cache.kv_pool.KVPool.tensor``) is
``[num_blocks, num_layers, 2, block_tokens, num_kv_heads, head_dim]``; a sequence's KV is
a list of extents ``(block, offset, length)`` at any offsets. A token's *slot* is
``block * block_tokens + offset``, and a sequence's *slot table* lists the slot of each of
its positions: the cached prefix's, then the room reserved for the tokens a forward adds.
``DecoderModel.forward_paged`` writes each new token's K/V at its slot, layer by layer,
and attends over the table: no per-request copy of the past, and sequences on one cached
prefix read the same pool memory.

Two paths per layer: the items after a prefix with at most
``EXTEND_MAX`` new tokens all at once in the compiled kernel (``paged_attention``: C++ on
the CPU, Triton on CUDA), the rest one by one over a transient gather of the layer's K/V
(a prefill chunk's attention outweighs the gather): with the compiled ``prefill_attention``
where the model has it (the CPU, float32, head_dim 64, AVX-512: ``prefill_fits``), else
``attention.attend_torch``.
The torch items run first in each layer, so a kernel item may read slots a torch item of
the same step writes (a prompt being filled and a request behind it on its prefix).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from cluster.engine.attention import EXTEND_MAX, attend_torch
from cluster.engine.model_inputs import validate_tokens

PagedItem = tuple[torch.Tensor, int, torch.Tensor]   # (tokens, start_pos, slots)


def validate_pool(config, pool: object, device: torch.device) -> torch.Tensor:
    """The pool tensor, checked against the model's KV layout."""
    c = config
    if not isinstance(pool, torch.Tensor) or pool.dim() != 6:
        raise ValueError("pool must be a tensor [num_blocks, num_layers, 2, block_tokens, num_kv_heads, head_dim]")
    _, layers, two, _, kv_heads, head_dim = pool.shape
    if (layers, two, kv_heads, head_dim) != (c.num_layers, 2, c.num_kv_heads, c.head_dim):
        raise ValueError(f"pool of shape {tuple(pool.shape)} does not hold this model's KV "
                         f"({c.num_layers} layers, 2, *, {c.num_kv_heads} kv heads, head_dim {c.head_dim})")
    if pool.dtype != c.torch_dtype or pool.device != device:
        raise ValueError(f"pool is {pool.dtype} on {pool.device}, the model {c.torch_dtype} on {device}")
    if not pool.is_contiguous():
        raise ValueError("pool must be contiguous")
    return pool


def validate_items(config, items: Sequence[PagedItem], pool: torch.Tensor) -> list[PagedItem]:
    """Every ``(tokens, start_pos, slots)`` checked before any runs; tokens and slots as
    int64 on the host."""
    capacity = pool.shape[0] * pool.shape[3]
    checked = []
    for index, item in enumerate(items):
        if not isinstance(item, tuple) or len(item) != 3:
            raise TypeError(f"items[{index}] must be a (tokens, start_pos, slots) tuple")
        tokens, start_pos, slots = item
        where = f"items[{index}]: " if len(items) > 1 else ""
        tokens = validate_tokens(config, tokens, start_pos, where)
        total = start_pos + tokens.numel()
        if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.dtype.is_floating_point \
                or slots.dtype.is_complex or slots.dtype == torch.bool:
            raise ValueError(f"{where}slots must be a 1-D integer tensor, got {slots!r:.80}")
        if slots.numel() != total:
            raise ValueError(f"{where}slots has {slots.numel()} entries; the sequence has start_pos + len(tokens) "
                             f"= {start_pos} + {tokens.numel()} = {total} positions")
        low, high = int(slots.min()), int(slots.max())
        if low < 0 or high >= capacity:
            bad = low if low < 0 else high
            raise ValueError(f"{where}slot {bad} is out of range: the pool has slots [0, {capacity})")
        # On the host: the kernels' tables are built there (CUDA: one copy a step for all items).
        checked.append((tokens, start_pos, slots.to(device="cpu", dtype=torch.long).contiguous()))
    return checked


def check_writes(checked: Sequence[PagedItem], on_kernel: set) -> None:
    """Every slot a step writes is written once, and read only where the write comes first:
    by a later item, or by a kernel item when the writer is on the torch path (which runs
    first in each layer). Anything else would read a slot while or before it is written."""
    if not checked:
        return
    writes = torch.cat([slots[p:] for _, p, slots in checked])
    unique = torch.unique(writes)
    if unique.numel() != writes.numel():
        counts = torch.bincount(torch.searchsorted(unique, writes))
        raise ValueError(f"slot {int(unique[int(torch.argmax(counts))])} is written by more than one new token")
    prefixes = [slots[:p] for _, p, slots in checked]
    if not bool(torch.isin(torch.cat(prefixes), writes).any()):   # the common case, in one call
        return
    for reader, prefix in enumerate(prefixes):
        for slot in prefix[torch.isin(prefix, writes)].tolist():
            writer = next(i for i, (_, p, s) in enumerate(checked) if bool((s[p:] == slot).any()))
            if writer == reader or writer in on_kernel or (reader not in on_kernel and writer > reader):
                raise ValueError(f"items[{reader}] reads slot {slot} in its prefix, which items[{writer}] writes "
                                 "in this forward after (or while) it is read")


PREFILL_HEAD_DIM, PREFILL_MAX_GROUP = 64, 8   # what the compiled prefill_attention serves


def prefill_fits(config) -> bool:
    """Whether the compiled ``prefill_attention`` serves this model's shapes (head_dim 64, at
    most 8 query heads per KV head, float32)."""
    return config.head_dim == PREFILL_HEAD_DIM and config.num_heads % config.num_kv_heads == 0 \
        and config.num_heads // config.num_kv_heads <= PREFILL_MAX_GROUP and config.dtype == "float32"


class SlotRows:
    """The torch path's view of the pool: ``pool.view(-1, head_dim)``, and per item the row
    of each position's slot at layer 0, K, head 0 (a layer, V and a head are fixed steps
    from there). ``prefill``: the compiled ``prefill_attention`` (None: ``attend_torch``)."""

    def __init__(self, pool: torch.Tensor, checked: Sequence[PagedItem], prefill=None):
        _, layers, _, block_tokens, kv_heads, head_dim = pool.shape
        self.flat = pool.view(-1, head_dim)
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.layer_rows = 2 * block_tokens * kv_heads
        self.v_rows = block_tokens * kv_heads
        self.heads = torch.arange(kv_heads, device=pool.device)
        self.device = pool.device
        self.block_tokens, self.block_rows = block_tokens, layers * self.layer_rows
        self.checked = checked
        self.prefill = prefill if pool.device.type == "cpu" else None
        self.token_rows: dict[int, torch.Tensor] = {}   # per item, once a forward (kernel items need none)

    def attend(self, config, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               item: int) -> torch.Tensor:
        """One item's layer: its new K/V into their slots, then attention over a transient
        head-major gather of its K/V [kv_heads, positions, head_dim]."""
        _, start_pos, slots = self.checked[item]
        if item not in self.token_rows:
            slots = slots.to(self.device)
            self.token_rows[item] = (slots // self.block_tokens) * self.block_rows + \
                (slots % self.block_tokens) * self.kv_heads
        keys_at = self.token_rows[item] + layer * self.layer_rows   # [positions]
        new = (keys_at[start_pos:, None] + self.heads[None, :]).reshape(-1)   # token-major, as k and v
        self.flat.index_copy_(0, new, k.reshape(-1, self.head_dim))
        self.flat.index_copy_(0, new + self.v_rows, v.reshape(-1, self.head_dim))
        rows = (self.heads[:, None] + keys_at[None, :]).reshape(-1)   # head-major
        keys = self.flat.index_select(0, rows).view(self.kv_heads, -1, self.head_dim)
        values = self.flat.index_select(0, rows + self.v_rows).view(self.kv_heads, -1, self.head_dim)
        if self.prefill is not None and q.shape[0] > 1:
            return self.prefill(q.contiguous(), keys, values, start_pos, config.head_dim ** -0.5)
        return attend_torch(config, q, keys, values, start_pos)


@dataclass(frozen=True, slots=True)
class PagedItems:
    """The items of one ``forward_paged`` the batched kernel attends (after a prefix, at most
    ``EXTEND_MAX`` new tokens each), with their slot tables concatenated."""

    kernel: object
    items: set
    rows: torch.Tensor       # their tokens' rows in the packed tokens
    pool: torch.Tensor
    slots: torch.Tensor      # their slot tables one after the other (int64)
    starts: list             # where each one's table begins in ``slots`` (one more: the end)
    positions: list          # each one's first new token's position
    counts: list             # each one's new tokens
    batch: object = None     # CUDA: the same on the device (``triton_attention.PagedBatch``)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
        """One layer for all these items: their rows' q/k/v in order, the new K/V written at
        their slots; the attention output of those rows."""
        if self.batch is not None:
            return self.kernel.paged_attention(q.contiguous(), k.contiguous(), v.contiguous(), self.batch, layer,
                                               scale)
        return self.kernel(q, k, v, self.pool, layer, self.slots, self.starts, self.positions, self.counts, scale)


def kernel_items(kernel, pool: torch.Tensor, checked: Sequence[PagedItem],
                 reach: int = EXTEND_MAX) -> PagedItems | None:
    """The items of ``checked`` the kernel attends: after a prefix, at most ``reach`` new
    tokens (``EXTEND_MAX``; ``EXTEND_MAX_BESIDE_PREFILL`` where the prefill kernel takes
    the longer ones); None when there are none or no kernel."""
    if kernel is None:
        return None
    index = [i for i, (t, p, _) in enumerate(checked) if t.numel() <= reach and p > 0]
    if not index:
        return None
    positions = [checked[i][1] for i in index]
    counts = [checked[i][0].numel() for i in index]
    ends = list(accumulate(t.numel() for t, _, _ in checked))   # each item's rows end there
    rows = [row for i, count in zip(index, counts) for row in range(ends[i] - count, ends[i])]
    slots = torch.cat([checked[i][2] for i in index]) if len(index) > 1 else checked[index[0]][2]
    starts = [0, *accumulate(checked[i][2].numel() for i in index)]
    batch = kernel.prepare_paged(pool, slots, starts, positions, counts) if hasattr(kernel, "prepare_paged") \
        else None
    return PagedItems(kernel, set(index), torch.tensor(rows, dtype=torch.long, device=pool.device), pool, slots,
                      starts, positions, counts, batch)
