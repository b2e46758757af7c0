"""The packed decoder's reference forward, a test adapter around its one forward.

``DecoderModel`` has one forward for the engine, ``forward_paged`` (K/V read and written
in place in the HOT pool through slot tables). Tests compare it, the compiled kernels and
the cache against this reference: each item's past KV given as one contiguous tensor
``[layers, 2, start_pos, kv_heads, head_dim]``, its new KV returned as another, every item
attended on the torch path (``attention.attend_torch``) over its past and new K/V
concatenated, through the model's own layer loop (``DecoderModel.forward_packed``), and
against transformers' forward (``hf_reference.py``).

``forward_one(model, ...)`` and ``forward_batch(model, ...)`` call a model's own method
where it has one (the transformers adapters) and this reference otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from cluster.engine import attention
from cluster.engine.model_inputs import BatchItem, kv_shape, validate_items


class ReferenceForward:
    """``forward_one`` / ``forward_batch`` of a ``DecoderModel`` (the engine's ``CausalLM``
    contract, which the transformers adapters implement too)."""

    def __init__(self, model: Any):
        self.model = model

    @property
    def config(self) -> Any:
        return self.model.config

    def forward_one(self, tokens: torch.Tensor, start_pos: int = 0, past_kv: torch.Tensor | None = None,
                    last_logits_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [T, vocab] (float32; [1, vocab] with ``last_logits_only``) and the new
        tokens' KV [layers, 2, T, kv_heads, head_dim]; ``past_kv`` is the KV of the
        ``start_pos`` tokens before ``tokens`` (None when 0)."""
        return self.forward_batch([(tokens, start_pos, past_kv)], last_logits_only=last_logits_only)[0]

    @torch.no_grad()
    def forward_batch(self, items: Sequence[BatchItem], last_logits_only: bool = False
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``forward_one`` for each item, the token-wise work on all tokens packed."""
        model, c = self.model, self.model.config
        device = model.device
        checked = [(tokens.to(device), start_pos, None if past_kv is None else past_kv.to(device))
                   for tokens, start_pos, past_kv in validate_items(c, items)]
        if not checked:
            return []
        new_kvs = [torch.empty(kv_shape(c, t.numel()), dtype=c.torch_dtype, device=device) for t, _, _ in checked]

        def attend(layer_index, q, k, v, item_index):
            _, start_pos, past_kv = checked[item_index]
            new_kv = new_kvs[item_index]
            new_kv[layer_index, 0] = k
            new_kv[layer_index, 1] = v
            keys, values = new_kv[layer_index, 0], new_kv[layer_index, 1]
            if start_pos:
                keys = torch.cat((past_kv[layer_index, 0], keys))
                values = torch.cat((past_kv[layer_index, 1], values))
            return attention.attend_torch(c, q, keys.transpose(0, 1), values.transpose(0, 1), start_pos)

        logits = model.forward_packed([(t, p) for t, p, _ in checked], attend, last_logits_only)
        return list(zip(logits, new_kvs))


def reference(model: Any) -> Any:
    """The model itself where it has the ``CausalLM`` methods, else its ``ReferenceForward``."""
    return model if hasattr(model, "forward_batch") else ReferenceForward(model)


def forward_one(model: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return reference(model).forward_one(*args, **kwargs)


def forward_batch(model: Any, *args: Any, **kwargs: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return reference(model).forward_batch(*args, **kwargs)
