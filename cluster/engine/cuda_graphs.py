"""CUDA graphs of the packed decoder's decode steps, one per batch-size bucket.

A step in which every item decodes one token after its cached prefix launches the
same kernels in the same shapes every time (per layer: a norm, three linears, rope,
the Triton attention's two launches, ...): about 15 launches a layer, 450 for a
30-layer model, whose launch cost on a GPU exceeds the work of a small batch. A graph
captured once per bucket replays them all with one launch. A capture that fails
(a kernel that cannot be captured on this setup) turns graphs off for the model: the
steps run eagerly, no request fails for it. What changes between
steps lives in one static device tensor the graph reads: the tokens, and the Triton
attention's table of KV-buffer addresses, strides and positions
(``cluster.engine.kernels.triton_attention``), refilled by one host-to-device copy
before each replay. A step of ``n`` decodes runs the smallest bucket >= n; the rows
beyond ``n`` decode a dummy token into a dummy two-position buffer and are dropped.

Steps with anything else (a prefill chunk, a later turn's few tokens) run eagerly, as
do batches above the largest bucket. Graphs are captured on first use of a bucket
(warm-up launches compile Triton's kernels first), all in one memory pool. Engine
thread only, like the model.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from cluster.engine import attention

log = logging.getLogger(__name__)

DEFAULT_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)


class _Captured:
    __slots__ = ("graph", "inputs", "logits")

    def __init__(self, graph, inputs, logits):
        self.graph, self.inputs, self.logits = graph, inputs, logits


class DecodeGraphs:
    def __init__(self, model, kernel, sizes: Sequence[int] = DEFAULT_SIZES):
        if model.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        if not sizes or min(sizes) < 1:
            raise ValueError(f"graph batch sizes must be positive, got {list(sizes)}")
        self.model, self.kernel = model, kernel
        self.sizes = sorted(set(int(s) for s in sizes))
        c = model.config
        # Padding rows write their K/V at position 1 of this buffer and attend positions 0..1.
        self._dummy = torch.zeros(c.num_layers, 2, c.num_kv_heads, 2, c.head_dim, dtype=c.torch_dtype,
                                  device=model.device)
        self._graphs: dict[int, _Captured] = {}
        self._pool = None
        self.stats = {"captured": 0, "replays": 0, "eager": 0, "capture_failures": 0}

    def bucket(self, n: int) -> int | None:
        return next((size for size in self.sizes if size >= n), None)

    def run(self, checked: Sequence[tuple[torch.Tensor, int, torch.Tensor]],
            shared: Sequence[tuple[int, int] | None] | None = None) -> list[torch.Tensor] | None:
        """Each item's logits [1, vocab], from a graph replay, when every item of
        ``checked`` (``(tokens, start_pos, kv buffer)``) decodes one token after a prefix
        and a bucket holds them all; None otherwise (the caller runs the step eagerly)."""
        n = len(checked)
        size = self.bucket(n)
        if size is None or any(t.numel() != 1 or p <= 0 for t, p, _ in checked):
            self.stats["eager"] += 1
            return None
        captured = self._graphs.get(size)
        if captured is None:
            try:
                captured = self._capture(size)
            except Exception as exc:   # a capture that fails costs speed, never a request
                log.warning("CUDA graph capture of %d decodes failed (%s: %s); decode steps run eagerly",
                            size, type(exc).__name__, exc)
                self.sizes, self._graphs = [], {}
                self.stats["capture_failures"] += 1
                torch.cuda.synchronize(self.model.device)
                return None
        pad = size - n
        donors, lengths = attention._donors(list(range(n)), shared, [p for _, p, _ in checked])
        table, row_item, row_pos = self.kernel.host_rows(
            [kv for _, _, kv in checked] + [self._dummy] * pad, [p for _, p, _ in checked] + [1] * pad,
            [1] * size, donors + [-1] * pad if donors else (), lengths + [0] * pad if lengths else ())
        tokens = [int(t.item()) for t, _, _ in checked] + [0] * pad
        captured.inputs.copy_(torch.tensor(tokens + table + row_item + row_pos, dtype=torch.int64))
        captured.graph.replay()
        self.stats["replays"] += 1
        logits = captured.logits[:n].clone()   # the graph's output is overwritten by the next replay
        return [logits[i:i + 1] for i in range(n)]

    def _capture(self, size: int) -> _Captured:
        model, kernel = self.model, self.kernel
        # The tokens, then the attention's batch (one row an item); valid contents for the
        # warm-up and capture launches: every row on the dummy buffer.
        table, row_item, row_pos = kernel.host_rows([self._dummy] * size, [1] * size, [1] * size)
        inputs = torch.tensor([0] * size + table + row_item + row_pos, dtype=torch.int64).to(model.device)
        tokens = inputs[:size]
        batch = kernel.Batch.of(inputs[size:], size, size)
        decodes = attention.KernelItems(kernel, set(range(size)), torch.arange(size, device=model.device), [],
                                        [], [], [], [], batch)
        bounds = [(i, i + 1) for i in range(size)]

        def forward() -> torch.Tensor:   # one row per item: every row's logits are its last
            return model._layers(tokens, batch.row_pos, bounds, None, False, decodes)[0]

        stream = torch.cuda.Stream(device=model.device)
        stream.wait_stream(torch.cuda.current_stream(model.device))
        with torch.cuda.stream(stream):   # warm-up off the capture: compiles Triton, sizes cuBLAS workspaces
            for _ in range(2):
                forward()
        torch.cuda.current_stream(model.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # thread_local: the tier copy engine's thread may use CUDA while this one captures.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits = forward()
        captured = _Captured(graph, inputs, logits)
        self._graphs[size] = captured
        self.stats["captured"] += 1
        return captured
