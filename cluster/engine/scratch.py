"""ScratchKV: the requests' working KV buffers, reused instead of allocated per request.

The engine reads a request's cached prefix into one working KV tensor
``[layers, 2, kv_heads, capacity, head_dim]`` (head-major: each head's keys
are contiguous rows, as attention reads them) that the forward writes the
new tokens' KV into and reads as the past, in place. A fresh CPU tensor of that size is mapped by the allocator and
faults its pages in on first write: for a 2,000-token prompt of a 135M
model that is 92 MB and about 35 ms of page faults per request, three
times the copy itself. Buffers are kept by capacity class (rounded up to
``granule`` tokens) and handed out again; at most ``max_idle_bytes`` wait
idle (a buffer given back past that is freed). On CUDA the caching
allocator already reuses memory; the pool costs nothing there.

Engine thread only, like the rest of the engine.
"""

from __future__ import annotations

import torch


class ScratchKV:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, *, max_idle_bytes: int, granule: int = 256):
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.granule = granule
        self.max_idle_bytes = max_idle_bytes
        self._idle: dict[int, list[torch.Tensor]] = {}
        self.idle_bytes = 0
        self.stats = {"taken": 0, "reused": 0, "freed": 0}

    def take(self, tokens: int) -> torch.Tensor:
        """A ``[layers, 2, kv_heads, tokens, head_dim]`` view of a buffer (contents undefined)."""
        capacity = -(-max(tokens, 1) // self.granule) * self.granule
        self.stats["taken"] += 1
        idle = self._idle.get(capacity)
        if idle:
            base = idle.pop()
            self.idle_bytes -= base.nbytes
            self.stats["reused"] += 1
        else:
            base = torch.empty((self.num_layers, 2, self.num_kv_heads, capacity, self.head_dim),
                               dtype=self.dtype, device=self.device)
        return base[:, :, :, :tokens]

    def give(self, view: torch.Tensor) -> None:
        """Hand back what ``take`` returned; nothing may use it afterwards."""
        base = view._base if view._base is not None else view
        if self.idle_bytes + base.nbytes > self.max_idle_bytes:
            self.stats["freed"] += 1
            return
        self._idle.setdefault(base.shape[3], []).append(base)
        self.idle_bytes += base.nbytes
