"""The packed decoder's layer loop as one compiled call (``kernels/layers.cpp``).

``DecoderModel._layers`` runs each layer as about eleven Python-level calls (norms,
linears, the rotary embedding, the batched attention, silu and mul): some 330 a step
for a 30-layer model, each dispatched from Python with the GIL held: about a tenth of a
decode step of 8 or 16 sequences alone (docs/engine.md, "The layer loop in one call"), and
in a replica the event loop's thread wants the GIL between every two of them.
For the steps the CPU serves most (every sequence on the batched attention kernel, the
linears on the blocked kernel) the same loop runs in C++ with the GIL released: the same
kernels and ATen ops in the same order, so the same bits (``tests/unit/test_layer_loop.py``),
the attention reading and writing K/V in the pool through the step's slot tables.
"""

from __future__ import annotations

from typing import Any

import torch

from cluster.engine import linear_layouts
from cluster.engine.paged import PagedItems


class CompiledLayers:
    """The model's per-layer weights as the compiled loop takes them, gathered once."""

    def __init__(self, fn: Any, model: Any, panels: dict[str, list]):
        c = model.config
        layers = model.layers
        self._fn = fn
        first = panels["qkv"][0]

        def optional(name: str) -> list[torch.Tensor]:
            values = [getattr(layer, name) for layer in layers]
            return [] if values[0] is None else values

        self._weights = ([layer.attn_norm for layer in layers], [p.panels for p in panels["qkv"]],
                         optional("qkv_bias"), optional("qk_norm"), [p.panels for p in panels["o"]],
                         optional("o_bias"), [layer.mlp_norm for layer in layers],
                         [p.panels for p in panels["gate_up"]], optional("gate_up_bias"),
                         [p.panels for p in panels["down"]], optional("down_bias"),
                         [panels[kind][0].n for kind in ("qkv", "o", "gate_up", "down")], first.parts, first.kc,
                         c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps, c.head_dim ** -0.5)

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 decodes: PagedItems) -> torch.Tensor:
        """The layers over ``hidden`` with the attention over the pool's slots (``decodes``:
        every item of the step)."""
        return self._fn(hidden, cos, sin, *self._weights, decodes.pool, decodes.slots, decodes.starts,
                        decodes.positions, decodes.counts)


def compiled_layers(model: Any) -> CompiledLayers | None:
    """The compiled loop for ``model`` where its steps can take it (CPU, float32, the batched
    kernel and the small ops on, every layer linear with blocked panels), else None."""
    if model.kernels.small_ops is None or model.kernels.attention is None or model.device.type != "cpu" or \
            model.config.dtype != "float32" or linear_layouts.BLOCKED not in (model.kernels.layer_layouts or ()):
        return None
    from cluster.engine import kernels

    fn = kernels.decoder_layers_paged()
    if fn is None:
        return None
    names = {"qkv": "qkv_proj", "o": "o_proj", "gate_up": "gate_up_proj", "down": "down_proj"}
    panels = {kind: [model.kernels.packed.get((linear_layouts.BLOCKED, id(getattr(layer, name)))) for layer in model.layers]
              for kind, name in names.items()}
    if any(p is None for group in panels.values() for p in group) or \
            len({(p.parts, p.kc) for group in panels.values() for p in group}) != 1:
        return None
    return CompiledLayers(fn, model, panels)
