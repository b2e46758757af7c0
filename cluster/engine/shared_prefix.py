"""Shared-prefix reads: running requests whose working buffers begin with the same KV
bytes read that prefix from one buffer in the attention kernel.

Each running request keeps its whole sequence's KV in a working buffer of its own
(``cluster.engine.scratch``), the cached prefix copied in at admission. Sessions
behind one system prompt therefore hold the same prefix once each, and a decode
step read it once each: 8 sequences of 550 tokens, 420 of them a shared system
prompt, read 200 MB of KV a step on the 135M model, which on two cores is
memory-bound (11.4 ms of a 47 ms step, measured). Read from one buffer while it is
in the core's cache, the same step's attention takes 6.7 ms (16 sequences of 700
tokens: 27 -> 17 ms), and every result is the same bit for bit: the kernel does the
same arithmetic in the same order, only from another address
(``extend_attention``'s ``donors``/``shared``).

Whether two buffers hold the same bytes is checked, not assumed: when a request is
admitted, the running request with which it has the longest common token prefix
(at least ``MIN_TOKENS``) is compared with it over that prefix, byte for byte
(``torch.equal``: about 2 ms for 420 tokens of the 135M model, once per
admission). KV for the same tokens computed in different batches can differ in its
last bits, so equal tokens alone would not do. Matching requests form a group; a
request's buffer never changes below its computed length while it runs (a
preempted request is checked afresh when it is admitted again), so what was
checked stays true for as long as both run. In each step the group's member with the
longest checked prefix lends its buffer to the others of the step.

State lives on the requests (``_kv_group``, ``_kv_shared``) and is touched only on the
engine thread, as the rest of the engine's state.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

# Shorter common prefixes are not worth the check: the read they save is as small as it.
MIN_TOKENS = 64


class Group:
    """Requests whose buffers hold the same bytes as the group's first member in their
    first ``_kv_shared`` positions (each its own length)."""

    __slots__ = ()


def forget(req) -> None:
    """``req`` got a new working buffer (admitted, again after a preemption): nothing is
    known about its bytes until it is checked."""
    req._kv_group, req._kv_shared = None, 0


def join(req, running: Iterable, common_prefix) -> int:
    """Check ``req``'s freshly loaded prefix against the running request it shares the
    longest token prefix with, and join that request's group when the bytes are the
    same. Returns the positions ``req`` may read from the group (0: none)."""
    forget(req)
    if req._len < MIN_TOKENS:
        return 0
    seq = req.tokens[:req._len]
    best, best_n = None, 0
    for other in running:
        if other is req or other._kv is None or other.namespace != req.namespace:
            continue
        n = common_prefix(seq, other.tokens[:other._len])
        # A member of a group already (and so lending to others) wins ties: one buffer is read.
        if n > best_n or (n == best_n and best is not None and best._kv_group is None
                          and other._kv_group is not None):
            best, best_n = other, n
    if best is None or best_n < MIN_TOKENS:
        return 0
    if best._kv_group is not None:
        best_n = min(best_n, best._kv_shared)
        if best_n < MIN_TOKENS:
            return 0
    if not torch.equal(req._kv[:, :, :, :best_n], best._kv[:, :, :, :best_n]):
        return 0   # the same tokens, computed in another batch: not the same bytes
    if best._kv_group is None:
        best._kv_group, best._kv_shared = Group(), best_n
    req._kv_group, req._kv_shared = best._kv_group, best_n
    return best_n


def reads(plan: Sequence) -> list[tuple[int, int] | None] | None:
    """For a step's plan ``[(request, tokens), ...]``: per item, ``(lender's index, positions)``
    for the model's ``forward_into(shared=...)``, or None when nobody in the step shares."""
    lender: dict[int, int] = {}   # id(group) -> plan index of its member with the longest checked prefix
    for i, (req, _) in enumerate(plan):
        group = req._kv_group
        if group is not None:
            j = lender.get(id(group))
            if j is None or req._kv_shared > plan[j][0]._kv_shared:
                lender[id(group)] = i
    out: list[tuple[int, int] | None] = [None] * len(plan)
    found = False
    for i, (req, _) in enumerate(plan):
        group = req._kv_group
        if group is None:
            continue
        j = lender[id(group)]
        if j != i:
            out[i] = (j, min(req._kv_shared, plan[j][0]._kv_shared))
            found = True
    return out if found else None
