"""A reference: a local `transformers` causal LM (Llama family) behind the engine's model contract.

Test-only. It runs the engine on a model without ``forward_paged`` (``ModelRunner``'s
gathered path) and checks the packed decoder's KV against transformers' own cache.

The KV contract is the one of `cluster.engine.model`: `[layers, 2, T, kv_heads,
head_dim]`, K after RoPE. transformers' Llama attention applies the rotary
embedding before `cache.update`, so its cache holds K after RoPE too and the
conversion is a pure re-layout (`[1, kv_heads, S, head_dim]` per layer).

Version notes (checked against transformers 5.24 and the 4.4x API):
- 5.x renamed the forward kwarg `past_key_values` to `cache` (and the output
  field likewise); the adapter reads the model's signature to pick the name.
- 4.4x turns `past_key_values=None` into a legacy tuple cache on output; the
  adapter always passes a `DynamicCache` object, so a Cache comes back.
- 5.x stores tensors in `cache.layers[i].keys/values`, 4.4x in
  `cache.key_cache[i]/value_cache[i]`; both are read.
- `from_pretrained` takes `dtype` from 4.56 on and `torch_dtype` before.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from cluster.engine.model import DTYPES, BatchItem, kv_shape, validate_item, validate_items

_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def _version_at_least(version: str, major: int, minor: int) -> bool:
    parts = [int(p) if p.isdigit() else 0 for p in version.split(".")[:2]]
    return tuple(parts) >= (major, minor)


@dataclass(frozen=True)
class HFModelConfig:
    """The CausalLMConfig view of a transformers config."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position: int
    dtype: str


class HFCausalLM:
    """forward_one / forward_batch over an in-memory transformers causal LM."""

    def __init__(self, model: Any) -> None:
        if not isinstance(model, transformers.PreTrainedModel):
            raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
        hf = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        if getattr(hf, "sliding_window", None) is not None and getattr(hf, "use_sliding_window", True):
            # A sliding-window cache drops old keys, which breaks "KV of every prefix token".
            raise ValueError(
                "sliding-window attention models are not supported: the cache must hold every token"
            )
        if model.dtype not in _DTYPE_NAMES:
            raise ValueError(f"model dtype {model.dtype} is not one of {sorted(DTYPES)}")
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        self.model = model.eval().requires_grad_(False)
        self.config = HFModelConfig(
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim,
            vocab_size=model.get_output_embeddings().out_features,
            max_position=hf.max_position_embeddings,
            dtype=_DTYPE_NAMES[model.dtype],
        )
        self._cache_class = transformers.DynamicCache
        self._cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters \
            else "past_key_values"

    @classmethod
    def from_pretrained(
        cls, path: str | Path, dtype: torch.dtype = torch.float32, attn_implementation: str | None = None
    ) -> HFCausalLM:
        """Loads a local checkpoint directory; never downloads."""
        if not Path(path).is_dir():
            raise FileNotFoundError(f"checkpoint directory {str(path)!r} does not exist")
        dtype_kwarg = "dtype" if _version_at_least(transformers.__version__, 4, 56) else "torch_dtype"
        kwargs: dict[str, Any] = {dtype_kwarg: dtype, "local_files_only": True}
        if attn_implementation is not None:
            kwargs["attn_implementation"] = attn_implementation
        return cls(transformers.AutoModelForCausalLM.from_pretrained(str(path), **kwargs))

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def forward_one(
        self, tokens: torch.Tensor, start_pos: int = 0, past_kv: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [T, vocab] (float32) and new KV [layers, 2, T, kv_heads, head_dim]."""
        tokens = validate_item(self.config, tokens, start_pos, past_kv)
        return self._forward(tokens, start_pos, past_kv)

    def forward_batch(self, items: Sequence[BatchItem]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """forward_one per item, all items validated first.

        Sequences run one by one: packing them into one padded transformers batch
        would need padded caches and a padding mask, and changes the numerics
        against forward_one; this adapter exists for correctness on real
        checkpoints, and DecoderModel is the packed path.
        """
        return [self._forward(*item) for item in validate_items(self.config, items)]

    @torch.no_grad()
    def _forward(
        self, tokens: torch.Tensor, start_pos: int, past_kv: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.device
        cache = self._cache_class()
        if past_kv is not None and start_pos:
            past_kv = past_kv.to(device)
            for layer in range(self.config.num_layers):
                # ours [P, kv_heads, hd] -> transformers [1, kv_heads, P, hd]
                cache.update(past_kv[layer, 0].transpose(0, 1).unsqueeze(0),
                             past_kv[layer, 1].transpose(0, 1).unsqueeze(0), layer)
        num_new = tokens.numel()
        positions = torch.arange(start_pos, start_pos + num_new, device=device).unsqueeze(0)
        output = self.model(input_ids=tokens.to(device).unsqueeze(0), position_ids=positions,
                            use_cache=True, **{self._cache_kwarg: cache})
        returned = getattr(output, self._cache_kwarg, None)
        layers = _cache_layers(returned if returned is not None else cache)
        if len(layers) != self.config.num_layers:
            raise RuntimeError(
                f"transformers returned {len(layers)} cache layers, expected {self.config.num_layers}"
            )
        new_kv = torch.empty(kv_shape(self.config, num_new), dtype=DTYPES[self.config.dtype], device=device)
        for layer, (keys, values) in enumerate(layers):
            if keys.shape[-2] != start_pos + num_new:
                raise RuntimeError(
                    f"layer {layer} cache holds {keys.shape[-2]} tokens, expected {start_pos + num_new}"
                )
            new_kv[layer, 0] = keys[0, :, start_pos:].transpose(0, 1)
            new_kv[layer, 1] = values[0, :, start_pos:].transpose(0, 1)
        return output.logits[0].float(), new_kv


def _cache_layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per layer from a transformers cache of any supported version."""
    if hasattr(cache, "layers"):  # transformers >= 4.54
        return [(layer.keys, layer.values) for layer in cache.layers]
    if hasattr(cache, "key_cache"):  # transformers 4.4x DynamicCache
        return list(zip(cache.key_cache, cache.value_cache))
    return [(entry[0], entry[1]) for entry in cache]  # legacy tuple of (k, v)
