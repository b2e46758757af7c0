"""Attention of the packed decoder: the torch path (SDPA, matmuls for one decode) and the
batch of items the compiled kernels attend (``cluster.engine.kernels``: C++ on the CPU,
Triton on CUDA).

``DecoderModel.forward_into`` attends each layer's items one of two ways: items after a
cached prefix with at most ``EXTEND_MAX`` new tokens (decodes, a later turn's few tokens, a
burst of sessions behind one system prompt) all at once in the compiled kernel, the
rest one by one with ``attend_torch``. ``kernel_items`` picks the first group and maps
the caller's shared-prefix reads (``cluster.engine.shared_prefix``) onto it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

QUERY_CHUNK = 256  # queries per attention call when a cached prefix precedes them
# New tokens after a prefix that the compiled kernel attends (one call a layer for all such
# items); longer ones go to SDPA, whose flash kernel is faster from about 40 tokens on (Xeon
# 2-core VM: 15 items of 20 tokens after 420 plus a decode, a step 416 -> 384 ms; one item of
# 60 beside 4 decodes 98.7 -> 101.5 ms, of 120 164.9 -> 175.4 ms). With the kernel reading a
# shared prefix once (cluster.engine.shared_prefix), 15 items after a shared 420 plus a
# decode: 25 tokens each 461 -> 436 ms, 32 each 540 -> 529 ms, 40 each 630 -> 626 ms, 64
# each 906 -> 940 ms.
EXTEND_MAX = 32


def attend_torch(config, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start_pos: int) -> torch.Tensor:
    """q [T, heads, hd] at positions start_pos.., keys/values [kv_heads, start_pos + T, hd]
    (head-major: each head's keys contiguous rows, whichever buffer they live in)."""
    num_new = q.shape[0]
    c = config
    if num_new == 1 and start_pos:
        # Decode: one query sees every key. Plain matmuls, query heads grouped by their
        # KV head (a [kv_heads, group, hd] x [kv_heads, hd, S] batched product).
        group = c.num_heads // c.num_kv_heads
        grouped = q.view(c.num_kv_heads, group, c.head_dim)
        scores = torch.matmul(grouped, keys.transpose(1, 2)) * (c.head_dim ** -0.5)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
        return torch.matmul(probs, values).view(1, c.num_heads, c.head_dim)
    q = q.transpose(0, 1).unsqueeze(0)
    # SDPA's enable_gqa lets query head h read K/V head h // group without a per-head copy.
    keys = keys.unsqueeze(0)
    values = values.unsqueeze(0)
    gqa = c.num_heads != c.num_kv_heads
    if start_pos == 0:
        # No past: SDPA's top-left causal mask is exact, and its fused kernel skips the
        # masked half (twice as fast as an explicit mask for a long prefill).
        out = F.scaled_dot_product_attention(q, keys, values, is_causal=num_new > 1, enable_gqa=gqa)
    else:
        # New token i sits at absolute position start_pos + i and sees keys 0..start_pos + i.
        # With an explicit mask the kernel computes every score, so queries go in chunks that
        # each see only the keys up to their last position: the masked-out work stays small.
        out = torch.empty_like(q)
        for begin in range(0, num_new, QUERY_CHUNK):
            end = min(begin + QUERY_CHUNK, num_new)
            visible = start_pos + end
            query_pos = torch.arange(start_pos + begin, visible, device=q.device)
            mask = torch.arange(visible, device=q.device)[None, :] <= query_pos[:, None]
            out[:, :, begin:end] = F.scaled_dot_product_attention(
                q[:, :, begin:end], keys[:, :, :visible], values[:, :, :visible], attn_mask=mask,
                enable_gqa=gqa,
            )
    return out[0].transpose(0, 1)


@dataclass(frozen=True, slots=True)
class KernelItems:
    """The items of one forward attended by the batched kernel (after a prefix, at most
    ``EXTEND_MAX`` new tokens each)."""

    kernel: object
    items: set
    rows: torch.Tensor          # their tokens' rows in the packed tokens
    buffers: list               # their KV buffers, head-major
    positions: list             # each one's first new token's position
    counts: list                # each one's new tokens
    donors: list                # per kernel item: the kernel item whose buffer it reads its shared prefix from
    shared: list                # ... and that prefix's length (both empty: none shares)
    batch: object = None        # CUDA: the same on the device (``triton_attention.Batch``), built once a forward

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
        """One layer for all these items: their rows' q/k/v (in order; each row's heads
        contiguous), the new K/V written into their buffers; the attention output of those
        rows."""
        if self.batch is not None:
            return self.kernel.extend_attention(q.contiguous(), k.contiguous(), v.contiguous(), self.batch, layer,
                                                scale)
        return self.kernel(q, k, v, self.buffers, layer, self.positions, self.counts, scale, self.donors,
                           self.shared)


def _donors(index: list[int], shared, positions: list[int], readers: int) -> tuple[list[int], list[int]]:
    """``forward_into``'s ``shared`` entries of the kernel's first ``readers`` items as its
    (donor, length) lists over all its items; an entry whose donor is not one of them, or
    that would read past what either holds (``positions``), is dropped (that item reads its
    own buffer)."""
    if not shared:
        return [], []
    at = {item: k for k, item in enumerate(index)}
    donors, lengths = [-1] * len(index), [0] * len(index)
    for k, item in enumerate(index[:readers]):
        entry = shared[item]
        if entry is None or entry[0] not in at or entry[0] == item:
            continue
        d = at[entry[0]]
        n = min(entry[1], positions[k], positions[d])
        if n > 0:
            donors[k], lengths[k] = d, n
    return (donors, lengths) if any(n for n in lengths) else ([], [])


def kernel_items(kernel, checked: Sequence[tuple[torch.Tensor, int, torch.Tensor]],
                 shared: Sequence[tuple[int, int] | None] | None) -> KernelItems | None:
    """The items of ``checked`` (``(tokens, start_pos, kv buffer)`` each) the kernel attends:
    after a prefix, at most ``EXTEND_MAX`` new tokens; None when there are none or no kernel."""
    if kernel is None:
        return None
    index = [i for i, (t, p, _) in enumerate(checked) if t.numel() <= EXTEND_MAX and p > 0]
    if not index:
        return None
    rows, offset, chosen = [], 0, set(index)
    for i, (t, _, _) in enumerate(checked):
        if i in chosen:
            rows.extend(range(offset, offset + t.numel()))
        offset += t.numel()
    readers = len(index)
    if shared and not hasattr(kernel, "prepare"):
        # Items off the kernel that its items read from (a prompt being filled, read by the
        # requests behind it in the same step): donors of no new tokens, whose rows up to
        # the end of this step's tokens the torch path writes first in each layer.
        index += sorted({shared[i][0] for i in index if shared[i] is not None} - chosen)
    positions = [checked[i][1] + (0 if k < readers else checked[i][0].numel()) for k, i in enumerate(index)]
    donors, lengths = _donors(index, shared, positions, readers)
    buffers = [checked[i][2] for i in index]
    counts = [checked[i][0].numel() if k < readers else 0 for k, i in enumerate(index)]
    # CUDA (the Triton module): the table the launches read, on the device once for every layer.
    batch = kernel.prepare(buffers, positions, counts, donors, lengths) if hasattr(kernel, "prepare") else None
    return KernelItems(kernel, chosen, torch.tensor(rows, dtype=torch.long, device=buffers[0].device), buffers,
                       positions, counts, donors, lengths, batch)
