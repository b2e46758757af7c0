"""The compiled parts a ``DecoderModel`` runs on, as one public object (``model.kernels``).

``DecoderModel.use_decode_kernel``, ``use_cuda_graphs`` and ``tune_linears`` fill it;
``cluster.engine.packed_weights`` (the tuned layouts and packed weight copies),
``layer_loop`` (the compiled layer loop over those copies) and ``cuda_graphs`` read and set
its fields, and the exactness bench wraps them to count their calls. A field left None is a
part not in use: the model's torch path serves instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Layouts = tuple[int, ...]   # linear_layouts.Layouts: a layout per row count


@dataclass
class ModelKernels:
    attention: Any = None      # the batched attention over the KV pool's slots (C++ on the CPU, Triton on CUDA)
    small_ops: Any = None      # the compiled rms_norm and rope (CPU, float32)
    prefill: Any = None        # a prompt chunk's causal attention in one flash pass (CPU, float32, head_dim 64)
    layer_loop: Any = None     # layer_loop.CompiledLayers: a step's whole layer loop in one call (CPU)
    graphs: Any = None         # cuda_graphs.DecodeGraphs: decode steps replayed from captured graphs (CUDA)
    layer_layouts: Layouts | None = None   # the fastest linear layout per row count: the layers' linears
    head_layouts: Layouts | None = None    # the same for the output head
    # The weights' packed copies, by (layout, id(weight)): MKL's packed copy or the blocked Panels.
    packed: dict = field(default_factory=dict)
