"""ScratchKV: the requests' working KV buffers, carved from memory faulted in at start-up.

The engine reads a request's cached prefix into one working KV tensor
``[layers, 2, kv_heads, capacity, head_dim]`` (head-major: each head's keys
are contiguous rows, as attention reads them) that the forward writes the
new tokens' KV into and reads as the past, in place.

A fresh CPU tensor of that size is mapped by the allocator and faults its
pages in on first write: for a 2,000-token prompt of a 135M model that is
92 MB and about 35 ms of page faults per request, three times the copy
itself. On a virtual machine whose memory the host backs lazily (Firecracker
here), a page no process of the machine has touched yet costs far more:
measured 15-18 us a page against 0.8 for a recycled one, so the first burst
of sessions after a replica started spent 30% of its engine thread, 1.85 s
for 15 requests of 400 cached tokens, faulting in their working buffers.

So on the CPU the buffers come from an arena: one tensor of
``arena_tokens`` tokens, zero-filled (every page faulted in) when the engine
starts, carved first fit into contiguous buffers and coalesced when they are
given back. A buffer the arena cannot hold (more concurrent capacity than it
has) is allocated as before, and kept by capacity class (rounded up to
``granule`` tokens) to be handed out again, at most ``max_idle_bytes`` of
them idle. On CUDA the caching allocator already reuses memory: no arena.

Engine thread only, like the rest of the engine.
"""

from __future__ import annotations

import bisect

import torch

ARENA_GRANULE = 64   # arena buffers are rounded up to this many tokens (no classes to share)


class ScratchKV:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, *, max_idle_bytes: int, granule: int = 256,
                 arena_tokens: int = 0):
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.granule = granule
        self.max_idle_bytes = max_idle_bytes
        self._idle: dict[int, list[torch.Tensor]] = {}
        self.idle_bytes = 0
        self.stats = {"taken": 0, "arena": 0, "reused": 0, "allocated": 0, "freed": 0}
        self._token_elems = num_layers * 2 * num_kv_heads * head_dim
        arena_tokens = _round_up(arena_tokens, ARENA_GRANULE) if arena_tokens > 0 else 0
        # zeros, not empty: the fill faults every page in now, at start-up, not in a request.
        self._arena = (torch.zeros(arena_tokens * self._token_elems, dtype=dtype, device=self.device)
                       if arena_tokens else None)
        self.arena_tokens = arena_tokens
        self._free: list[tuple[int, int]] = [(0, arena_tokens)] if arena_tokens else []   # (start, tokens), by start
        self._lent: dict[int, tuple[int, int]] = {}   # data_ptr -> the arena range it covers

    @property
    def arena_free_tokens(self) -> int:
        return sum(n for _, n in self._free)

    def take(self, tokens: int) -> torch.Tensor:
        """A ``[layers, 2, kv_heads, tokens, head_dim]`` view of a buffer (contents undefined)."""
        self.stats["taken"] += 1
        base = self._carve(_round_up(tokens, ARENA_GRANULE))
        if base is not None:
            self.stats["arena"] += 1
            return base[:, :, :, :tokens]
        capacity = _round_up(tokens, self.granule)
        if self._idle.get(capacity):
            base = self._idle[capacity].pop()
            self.idle_bytes -= base.nbytes
            self.stats["reused"] += 1
        else:
            base = torch.empty(self._shape(capacity), dtype=self.dtype, device=self.device)
            self.stats["allocated"] += 1
        return base[:, :, :, :tokens]

    def give(self, view: torch.Tensor) -> None:
        """Hand back what ``take`` returned; nothing may use it afterwards."""
        lent = self._lent.pop(view.data_ptr(), None)
        if lent is not None:
            self._release(*lent)
            return
        base = view._base if view._base is not None else view
        if self.idle_bytes + base.nbytes > self.max_idle_bytes:
            self.stats["freed"] += 1
            return
        self._idle.setdefault(base.shape[3], []).append(base)
        self.idle_bytes += base.nbytes

    # ------------------------------------------------------------------ arena
    def _shape(self, capacity: int) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_kv_heads, capacity, self.head_dim)

    def _carve(self, capacity: int) -> torch.Tensor | None:
        """A buffer of ``capacity`` tokens from the first free range that holds it (None: none does)."""
        for i, (start, length) in enumerate(self._free):
            if length >= capacity:
                if length == capacity:
                    del self._free[i]
                else:
                    self._free[i] = (start + capacity, length - capacity)
                flat = self._arena[start * self._token_elems:(start + capacity) * self._token_elems]
                base = flat.view(self._shape(capacity))
                self._lent[base.data_ptr()] = (start, capacity)
                return base
        return None

    def _release(self, start: int, length: int) -> None:
        """Give an arena range back, merged with the free ranges it touches."""
        i = bisect.bisect_left(self._free, (start, length))
        if i < len(self._free) and start + length == self._free[i][0]:   # joins the next one
            length += self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == start:   # and the previous one
            start, length = self._free[i - 1][0], self._free[i - 1][1] + length
            self._free[i - 1] = (start, length)
            return
        self._free.insert(i, (start, length))


def _round_up(tokens: int, unit: int) -> int:
    return -(-max(tokens, 1) // unit) * unit
