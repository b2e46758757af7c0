"""Attention of the packed decoder on the torch path (SDPA, matmuls for one decode), and
the reach of the compiled kernels (``EXTEND_MAX``).

``DecoderModel.forward_paged`` (``cluster.engine.paged``) attends each layer's items one of
two ways: items after a cached prefix with at most ``EXTEND_MAX`` new tokens (decodes, a
later turn's few tokens, a burst of sessions behind one system prompt) all at once in the
compiled kernel (``cluster.engine.kernels``: C++ on the CPU, Triton on CUDA), the rest one
by one with ``attend_torch`` (as the tests' reference forward attends every item).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

QUERY_CHUNK = 256  # CUDA: queries per masked attention call when a cached prefix precedes them
# New tokens after a prefix that the compiled kernel attends (one call a layer for all such
# items); longer ones go to SDPA, whose flash kernel is faster from a few dozen tokens on
# (the measurements behind 32: docs/engine.md, "Speed on the CPU").
EXTEND_MAX = 32
# Where the compiled prefill kernel attends prompt chunks (``prefill_attention``: float32, head_dim
# 64, AVX-512), it is faster than the extend kernel from about a dozen new tokens on: a step of
# one 24-token chunk after 1,024 cached tokens 35-42 ms against 45, of 4 such items 122-129
# against 150, of 8 items of 20 after one shared 1,024 211-215 against 229 (SmolLM2-135M, AMD
# EPYC, 2 threads). So with it the extend kernel takes at most this many.
EXTEND_MAX_BESIDE_PREFILL = 8


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
    elif q.device.type == "cpu":
        # New token i sits at absolute position start_pos + i and sees every cached key and
        # the new keys 0..i: two flash calls without a mask, the queries over the cached keys
        # (all visible) and over their own keys (causal; top-left is right when the lengths
        # match), merged through their log-sum-exps. No mask is built and no score is
        # computed for a hidden key.
        out = _merge(_flash(q, keys[:, :, :start_pos], values[:, :, :start_pos], False),
                     _flash(q, keys[:, :, start_pos:], values[:, :, start_pos:], num_new > 1))
    else:
        # CUDA: an explicit mask, queries in chunks that each see only the keys up to their last
        # position, so the masked-out work stays small.
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


def _flash(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA's CPU flash kernel (what ``scaled_dot_product_attention`` runs there; query head h
    reads K/V head h // group) with its log-sum-exp: output [1, heads, T, hd], lse [1, heads, T]."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, keys, values, 0.0, causal)


def _merge(first: tuple[torch.Tensor, torch.Tensor], second: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Softmax attention over two key sets, from each set's output and log-sum-exp: the first
    set's share of the total weight is ``exp(lse1) / (exp(lse1) + exp(lse2))``, the sigmoid of
    ``lse1 - lse2``, and the output moves from the second's toward the first's by it (three
    ops: at a later turn's few rows each op's dispatch costs more than its arithmetic)."""
    (out1, lse1), (out2, lse2) = first, second
    share = torch.sigmoid(lse1 - lse2).unsqueeze(-1).to(out1.dtype)
    return torch.lerp(out2, out1, share)
