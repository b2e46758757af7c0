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

Whether two buffers hold the same bytes is known, not assumed. KV for the same
tokens computed in different batches can differ in its last bits, so equal tokens
alone do not do. When a request is admitted (its cached prefix just copied from
HOT into its buffer):

- if a running request's buffer was filled from the same HOT slots for its first
  positions (``KVLease.prefix_extents``, recorded at each admission), those
  positions hold the same bytes: both copies were read from slots the first
  request's lease has kept locked since, and a locked slot's bytes never change
  (no eviction, demotion, compaction or merge touches a locked node; a split or a
  copy-on-write append leaves its bytes where they are). Nothing is compared;
- otherwise (the running request computed that prefix itself, say) the one it
  shares the longest token prefix with is compared with it over that prefix, byte
  for byte (``torch.equal``: about 2 ms for 420 tokens of the 135M model).

Matching requests (at least ``MIN_TOKENS`` positions) form a group; a request's
buffer never changes below its computed length while it runs (a preempted request
is looked at afresh when it is admitted again), so what was established stays true
for as long as both run. In each step the group's member known to match furthest
lends its buffer to the others of the step. In a burst of sessions behind one
system prompt only the first follower is compared (with the request that computed
the prompt); the others match its HOT slots (15 checks, 33 ms of the step that
admits them, before).

State lives on the requests (``_kv_group``, ``_kv_shared``, ``_kv_source``) and is touched only on the
engine thread, as the rest of the engine's state.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from cluster.tokens import common_prefix

# Shorter common prefixes are not worth the check: the read they save is as small as it.
MIN_TOKENS = 64


class Group:
    """Requests whose buffers hold the same bytes as the group's first member in their
    first ``_kv_shared`` positions (each its own length)."""

    __slots__ = ()


def forget(req) -> None:
    """``req`` got a new working buffer (admitted, again after a preemption), or gave its
    buffer back: nothing is known about its bytes."""
    req._kv_group, req._kv_shared, req._kv_source = None, 0, ()


def same_slots(a: Sequence, b: Sequence) -> int:
    """How many positions from the start two lists of extents (``block_id``, ``offset``,
    ``length``) name the same slots of the same blocks, however they are cut."""
    i = j = ai = bj = n = 0
    while i < len(a) and j < len(b):
        ea, eb = a[i], b[j]
        if ea.block_id != eb.block_id or ea.offset + ai != eb.offset + bj:
            break
        step = min(ea.length - ai, eb.length - bj)
        n, ai, bj = n + step, ai + step, bj + step
        if ai == ea.length:
            i, ai = i + 1, 0
        if bj == eb.length:
            j, bj = j + 1, 0
    return n


def join(req, running: Iterable, source: Sequence = ()) -> int:
    """Join ``req`` (its prefix just read from HOT slots ``source``) to the group of a
    running request whose buffer begins with the same bytes: one read from the same
    slots, or else the one it shares the longest token prefix with, compared byte for
    byte. Returns the positions ``req`` may read from the group (0: none)."""
    forget(req)
    req._kv_source = tuple(source)
    if req._len < MIN_TOKENS:
        return 0
    running = [o for o in running if o is not req and o._kv is not None and o.namespace == req.namespace]
    twin, twin_n = None, 0
    for other in running:
        n = same_slots(req._kv_source, other._kv_source)
        if other._kv_group is not None:
            n = min(n, other._kv_shared)
        if n > twin_n or (n == twin_n and twin is not None and twin._kv_group is None
                          and other._kv_group is not None):
            twin, twin_n = other, n
    if twin_n >= MIN_TOKENS:
        if twin._kv_group is None:
            twin._kv_group, twin._kv_shared = Group(), twin_n
        req._kv_group, req._kv_shared = twin._kv_group, twin_n
        return twin_n
    seq = req.tokens[:req._len]
    best, best_n = None, 0
    for other in running:
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
