"""CUDA graphs of the packed decoder's decode steps, one per batch-size bucket.

A step in which every item decodes one token after its cached prefix launches the
same kernels in the same shapes every time (per layer: a norm, three linears, rope,
the Triton attention's two launches, ...): about 15 launches a layer, 450 for a
30-layer model, whose launch cost on a GPU exceeds the work of a small batch. A graph
captured once per bucket replays them all with one launch. A capture that fails
(a kernel that cannot be captured on this setup) turns graphs off for the model: the
steps run eagerly, no request fails for it. What changes between
steps lives in one static device tensor the graph reads: the tokens, the Triton
attention's table of the pool's address and strides and the rows' positions, and the
items' slot tables (``cluster.engine.kernels.triton_attention.PagedBatch``), refilled by
one host-to-device copy before each replay. A step of ``n`` decodes runs the smallest
bucket >= n; the rows beyond ``n`` decode a dummy token into a dummy pool of two slots
and are dropped.

Steps with anything else (a prefill chunk, a later turn's few tokens) run eagerly, as
do batches above the largest bucket. All graphs share one memory pool. Engine thread
only, like the model.

Nothing compiles on the serving path: ``warm_up_steps(model)`` is the start-up work that
compiles Triton's kernels for the eager steps and captures the graph of every bucket,
in pieces the replica runs on its engine thread before it reports ready
(``serve_app.replica``); a bucket not captured then (a capture that failed, a model
warmed without it) is still captured on its first use.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from itertools import accumulate

import torch

from cluster.engine import paged

log = logging.getLogger(__name__)

DEFAULT_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)


class _Captured:
    __slots__ = ("graph", "inputs", "logits")

    def __init__(self, graph, inputs, logits):
        self.graph, self.inputs, self.logits = graph, inputs, logits


class DecodeGraphs:
    """The graphs of ``forward_paged``'s steps of decodes alone over a slotted pool: the
    static input holds the items' slot tables, room for every item's ``max_position`` slots."""

    def __init__(self, model, kernel, sizes: Sequence[int] = DEFAULT_SIZES):
        if model.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        if not sizes or min(sizes) < 1:
            raise ValueError(f"graph batch sizes must be positive, got {list(sizes)}")
        self.model, self.kernel = model, kernel
        self.sizes = sorted(set(int(s) for s in sizes))
        c = model.config
        # Padding rows write their K/V at slot 1 of this one-block pool and attend slots 0..1.
        self._dummy_pool = torch.zeros(1, c.num_layers, 2, 2, c.num_kv_heads, c.head_dim, dtype=c.torch_dtype,
                                       device=model.device)
        self._graphs: dict[int, _Captured] = {}
        self._pool = None
        self.stats = {"captured": 0, "replays": 0, "eager": 0, "capture_failures": 0}

    def run(self, checked: Sequence[tuple[torch.Tensor, int, torch.Tensor]],
            pool: torch.Tensor) -> list[torch.Tensor] | None:
        """Each item's logits [1, vocab], from a graph replay, when every item of ``checked``
        (``forward_paged``'s ``(tokens, start_pos, slots)`` on ``pool``, checked; slots int64
        on the host) decodes one token after a prefix and a bucket holds them all; None
        otherwise (the caller runs the step eagerly)."""
        n = len(checked)
        size = next((size for size in self.sizes if size >= n), None)   # the smallest bucket that holds them
        if size is None or any(t.numel() != 1 or p <= 0 for t, p, _ in checked):
            self.stats["eager"] += 1
            return None
        if not self.capture(size):
            return None
        captured = self._graphs[size]
        pad = size - n
        tables = [slots for _, _, slots in checked] + [torch.tensor([0, 1])] * pad
        starts = [0, *accumulate(table.numel() for table in tables)]
        head = self.kernel.paged_host_rows([pool] * n + [self._dummy_pool] * pad, starts,
                                           [p for _, p, _ in checked] + [1] * pad, [1] * size)
        tokens = [int(t.item()) for t, _, _ in checked] + [0] * pad
        host = torch.cat([torch.tensor(tokens + head, dtype=torch.int64)] + tables)
        captured.inputs[:host.numel()].copy_(host)
        captured.graph.replay()
        self.stats["replays"] += 1
        logits = captured.logits[:n].clone()   # the graph's output is overwritten by the next replay
        return [logits[i:i + 1] for i in range(n)]

    def capture(self, size: int) -> bool:
        """The graph of bucket ``size``, captured now unless it was before; False when the
        capture failed (graphs are then off for the model: every decode step runs eagerly)."""
        if size in self._graphs:
            return True
        if size not in self.sizes:
            return False
        try:
            self._capture(size)
        except Exception as exc:   # a capture that fails costs speed, never a request
            log.warning("CUDA graph capture of %d decodes failed (%s: %s); decode steps run eagerly",
                        size, type(exc).__name__, exc)
            self.sizes, self._graphs = [], {}
            self.stats["capture_failures"] += 1
            torch.cuda.synchronize(self.model.device)
            return False
        return True

    def _capture(self, size: int) -> _Captured:
        model = self.model
        inputs, decodes = self._inputs(size)
        tokens, batch = inputs[:size], decodes.batch
        bounds = [(i, i + 1) for i in range(size)]

        def forward() -> torch.Tensor:   # one row per item: every row's logits are its last
            return model.run_layers(tokens, batch.row_pos, bounds, None, False, decodes)[0]

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

    def _inputs(self, size: int) -> tuple[torch.Tensor, paged.PagedItems]:
        """The static input (the tokens, then the attention's batch: one row an item, then the
        slot tables, with room for ``size`` tables of ``max_position`` slots) and the kernel
        items over it; valid contents for the warm-up and capture launches: every row on the
        dummy pool."""
        kernel, device = self.kernel, self.model.device
        head = kernel.paged_host_rows(self._dummy_pool, list(range(0, 2 * size, 2)), [1] * size, [1] * size)
        room = size * max(2, self.model.config.max_position)
        inputs = torch.zeros(size + len(head) + room, dtype=torch.int64)
        inputs[:size + len(head)] = torch.tensor([0] * size + head, dtype=torch.int64)
        inputs[size + len(head):size + len(head) + 2 * size] = torch.tensor([0, 1] * size)
        inputs = inputs.to(device)
        batch = kernel.PagedBatch.of(inputs[size:], size, size)
        return inputs, paged.PagedItems(kernel, set(range(size)), torch.arange(size, device=device),
                                        self._dummy_pool, None, [], [], [], batch)


# Tokens an eager warm-up step adds after its prefix: one odd and one even count. Triton
# specializes a launch on the 16-byte alignment of its pointers, and where the rows'
# positions start in the batch's table (``triton_attention.PagedBatch``) follows the parity of
# the row count, so the two counts compile every variant an eager step launches.
WARM_EXTEND_TOKENS = (3, 2)
WARM_PREFIX = 16


def warm_up_steps(model) -> list[tuple[str, Callable[[], dict]]]:
    """What compiles or captures on ``model``'s first CUDA steps, as ``(name, step)``
    pieces that each return what they did, to run one at a time on the thread that owns
    the model before it serves (each piece is short: a replica's watchdog sees progress
    between them). First Triton's kernels for eager steps (a few tokens after a prefix,
    ``forward_paged`` on a scratch pool), then the CUDA graph of every batch-size bucket
    (the first capture's warm-up launches compile the graph's own variants). Empty where nothing
    compiles: on the CPU (its kernels are built when the engine is made), or without the
    Triton attention."""
    kernel = getattr(getattr(model, "kernels", None), "attention", None)
    if getattr(model, "device", torch.device("cpu")).type != "cuda" or not hasattr(kernel, "prepare_paged"):
        return []
    steps: list[tuple[str, Callable[[], dict]]] = [
        (f"triton-{count}", lambda count=count: _warm_eager(model, count)) for count in WARM_EXTEND_TOKENS]
    graphs = getattr(getattr(model, "kernels", None), "graphs", None)
    if graphs is not None:
        steps += [(f"graph-{size}", lambda size=size: _warm_graph(graphs, size)) for size in graphs.sizes]
    return steps


def _warm_eager(model, count: int) -> dict:
    """An eager ``forward_paged`` step of ``count`` tokens after a ``WARM_PREFIX``-token prefix
    of zeros, on a scratch pool of one block, slots in order: Triton compiles what it
    launches (its cache on disk makes a restart's quick)."""
    c = model.config
    began = time.perf_counter()
    graphs, model.kernels.graphs = model.kernels.graphs, None   # not a step of decodes a graph could take
    try:
        tokens = torch.zeros(count, dtype=torch.long)
        pool = torch.zeros(1, c.num_layers, 2, WARM_PREFIX + count, c.num_kv_heads, c.head_dim,
                           dtype=c.torch_dtype, device=model.device)
        model.forward_paged([(tokens, WARM_PREFIX, torch.arange(WARM_PREFIX + count))], pool)
        torch.cuda.synchronize(model.device)
    finally:
        model.kernels.graphs = graphs
    return {"eager_tokens": count, "seconds": round(time.perf_counter() - began, 3)}


def _warm_graph(graphs: DecodeGraphs, size: int) -> dict:
    began = time.perf_counter()
    ok = graphs.capture(size)
    if ok:
        torch.cuda.synchronize(graphs.model.device)
    return {"bucket": size, "captured": ok, "seconds": round(time.perf_counter() - began, 3)}


def warm_up(model, run: Callable[[Callable[[], dict]], dict] = lambda step: step()) -> dict:
    """Every ``warm_up_steps`` piece, each through ``run`` (the replica hands them to its
    engine thread one at a time); a summary: the buckets captured, the graphs' state, the
    seconds. ``{"steps": 0}`` where nothing compiles (the CPU)."""
    steps = warm_up_steps(model)
    if not steps:
        return {"steps": 0}
    began = time.perf_counter()
    done = [run(step) for _, step in steps]
    graphs = getattr(getattr(model, "kernels", None), "graphs", None)
    return {"steps": len(steps), "triton_eager_steps": sum("eager_tokens" in d for d in done),
            "graphs_captured": sorted(graphs._graphs) if graphs is not None else [],
            "graph_capture_failures": graphs.stats["capture_failures"] if graphs is not None else 0,
            "seconds": round(time.perf_counter() - began, 3)}
