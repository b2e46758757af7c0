"""The CUDA twin of ``decode_attention.cpp``'s ``paged_attention``, in Triton.

One step's items that decode a token or add a few (at most ``EXTEND_MAX``) after a
cached prefix are attended with two launches per layer, whatever their number: the
first writes each new token's K/V at its slot in the engine's slotted KV pool
(``[blocks, layers, 2, block_tokens, kv_heads, head_dim]``), the second attends every
query head of every new token causally over its sequence's keys, read in place through
its slot table: no gather, no per-sequence launch. The pool's address and strides and
the items' slot tables travel in one device tensor (``PagedBatch``), so the launches read
nothing from the Python objects and a CUDA graph can capture them: a graph's static
table is refilled before each replay (``cluster.engine.cuda_graphs``).

A program handles one new token and one KV head: the query heads of that group (padded
to 16 rows for ``tl.dot``) against blocks of ``BLOCK_N`` keys with an online softmax,
accumulating in float32. Float32 products run in IEEE precision (no TF32): the results
equal the torch path's to about 1e-6.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

BLOCK_N = 64     # keys per block


# Per item, PAGED_META int64 fields: its pool's address, the pool's strides in elements
# (block, layer, K/V, token in block, head), block_tokens, and where its slot table starts
# in the batch's slots. The pool travels in the table (not as an argument) so a CUDA graph
# replays on whatever pool the refilled table names, and its padding rows on a dummy pool.
PAGED_META = 8


@dataclass(frozen=True, slots=True)
class PagedBatch:
    """A step's kernel items over pools: ``table`` [items, PAGED_META], per query row its item
    and absolute position, and the items' slot tables one after the other (``slots``)."""

    table: torch.Tensor
    row_item: torch.Tensor
    row_pos: torch.Tensor
    slots: torch.Tensor
    rows: int

    @classmethod
    def of(cls, flat: torch.Tensor, items: int, rows: int) -> "PagedBatch":
        """The batch over ``flat`` (``paged_host_rows``' list, then the slots, which may be
        followed by unused room: a CUDA graph's static input), as views."""
        head = items * PAGED_META
        return cls(flat[:head].view(items, PAGED_META), flat[head:head + rows], flat[head + rows:head + 2 * rows],
                   flat[head + 2 * rows:], rows)


def paged_host_rows(pools, starts, positions, counts) -> list[int]:
    """The table's fields, the rows' items and the rows' positions as one flat host list
    (the slots follow them on the device); item i on ``pools[i]`` (or one pool for all),
    its slot table from ``starts[i]`` in the batch's slots."""
    table, row_item, row_pos = [], [], []
    for i, (position, count) in enumerate(zip(positions, counts)):
        pool = pools[i] if isinstance(pools, (list, tuple)) else pools
        if pool.stride(-1) != 1:
            raise ValueError("the KV pool must have contiguous head_dim rows")
        table += [pool.data_ptr(), pool.stride(0), pool.stride(1), pool.stride(2), pool.stride(3), pool.stride(4),
                  pool.shape[3], starts[i]]
        row_item += [i] * count
        row_pos += range(position, position + count)
    return table + row_item + row_pos


def prepare_paged(pool: torch.Tensor, slots: torch.Tensor, starts, positions, counts) -> PagedBatch:
    """The ``PagedBatch`` of these items (``slots``: their tables one after the other, int64
    on the host), on the pool's device (one host-to-device copy)."""
    head = torch.tensor(paged_host_rows(pool, starts, positions, counts), dtype=torch.int64)
    flat = torch.cat([head, slots.to("cpu", torch.int64)]).to(pool.device)
    return PagedBatch.of(flat, len(positions), sum(counts))


@triton.jit
def _slot_address(entry, slots_ptr, n, layer, h, elem):
    """Per position ``n`` (a block of them) of the item at ``entry``: the address of its K row
    for ``layer`` and KV head ``h``, and the K-to-V step."""
    base = tl.load(entry).to(tl.pointer_type(elem))
    s_block, s_layer, s_kv = tl.load(entry + 1), tl.load(entry + 2), tl.load(entry + 3)
    s_token, s_head, block_tokens = tl.load(entry + 4), tl.load(entry + 5), tl.load(entry + 6)
    slot = tl.load(slots_ptr + tl.load(entry + 7) + n)
    return base + (slot // block_tokens) * s_block + layer * s_layer + (slot % block_tokens) * s_token \
        + h * s_head, s_kv


@triton.jit(do_not_specialize=["layer"])
def _write_kv_paged(k_ptr, v_ptr, table_ptr, row_item_ptr, row_pos_ptr, slots_ptr, layer,
                    KVH: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, META: tl.constexpr):
    row = tl.program_id(0)
    h = tl.program_id(1)
    item = tl.load(row_item_ptr + row)
    pos = tl.load(row_pos_ptr + row)
    dst, s_kv = _slot_address(table_ptr + item * META, slots_ptr, pos, layer, h, k_ptr.dtype.element_ty)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    tl.store(dst + d, tl.load(k_ptr + (row * KVH + h) * D + d, mask=dm), mask=dm)
    tl.store(dst + s_kv + d, tl.load(v_ptr + (row * KVH + h) * D + d, mask=dm), mask=dm)


@triton.jit(do_not_specialize=["layer"])
def _paged_attention(q_ptr, out_ptr, table_ptr, row_item_ptr, row_pos_ptr, slots_ptr, layer, scale,
                     H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr,
                     BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                     META: tl.constexpr):
    row = tl.program_id(0)
    h = tl.program_id(1)
    item = tl.load(row_item_ptr + row)
    pos = tl.load(row_pos_ptr + row)
    entry = table_ptr + item * META
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    qmask = (g < GROUP)[:, None] & dm[None, :]
    heads = (row * H + h * GROUP + g) * D
    q = tl.load(q_ptr + heads[:, None] + d[None, :], mask=qmask, other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(0, pos + 1, BLOCK_N):   # positions 0..pos: pos is this token's own, just written
        n = n0 + tl.arange(0, BLOCK_N)
        nm = n <= pos
        rows_at, s_kv = _slot_address(entry, slots_ptr, tl.where(nm, n, 0), layer, h, q_ptr.dtype.element_ty)
        mask = nm[:, None] & dm[None, :]
        k = tl.load(rows_at[:, None] + d[None, :], mask=mask, other=0.0)
        v = tl.load(rows_at[:, None] + s_kv + d[None, :], mask=mask, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(nm[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + heads[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=qmask)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: PagedBatch, layer: int,
                    scale: float) -> torch.Tensor:
    """One layer for a batch over slotted pools: q [rows, heads, head_dim], k/v [rows,
    kv_heads, head_dim] (contiguous, the batch's rows in order); writes k/v at the rows'
    slots, returns the attention output [rows, heads, head_dim]."""
    rows, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if batch.rows != rows or k.shape[0] != rows:
        raise ValueError(f"paged_attention: {rows} query rows for a batch of {batch.rows}")
    out = torch.empty_like(q)
    block_d = triton.next_power_of_2(head_dim)
    grid = (rows, kv_heads)
    _write_kv_paged[grid](k, v, batch.table, batch.row_item, batch.row_pos, batch.slots, layer, KVH=kv_heads,
                          D=head_dim, BLOCK_D=block_d, META=PAGED_META)
    _paged_attention[grid](q, out, batch.table, batch.row_item, batch.row_pos, batch.slots, layer, scale,
                           H=heads, KVH=kv_heads, D=head_dim, GROUP=heads // kv_heads,
                           BLOCK_G=max(16, triton.next_power_of_2(heads // kv_heads)), BLOCK_D=block_d,
                           BLOCK_N=BLOCK_N, IEEE=q.dtype == torch.float32, META=PAGED_META)
    return out
