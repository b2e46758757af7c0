"""What a causal LM takes in, checked before any of it runs: the engine's KV contract
(``kv_shape``), the configs and models it talks to (``CausalLMConfig``, ``CausalLM``), and the
validation of a request's tokens, start position and past KV (``validate_items``). Below the
model and the paged path, which both check their inputs here (``cluster.engine.model``
re-exports these names)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from cluster.names import DTYPES

BatchItem = tuple[torch.Tensor, int, "torch.Tensor | None"]


def kv_shape(config: CausalLMConfig, num_tokens: int) -> tuple[int, int, int, int, int]:
    """Shape of the KV of `num_tokens` tokens for all layers."""
    return (config.num_layers, 2, num_tokens, config.num_kv_heads, config.head_dim)


@runtime_checkable
class CausalLMConfig(Protocol):
    """The config fields the engine and the KV pools read."""

    @property
    def num_layers(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def max_position(self) -> int: ...


@runtime_checkable
class CausalLM(Protocol):
    """What the engine needs from a model without ``forward_paged`` (the transformers adapters; the
    packed decoder's one forward is ``forward_paged``, and the tests' reference adapter fits this too)."""

    @property
    def config(self) -> CausalLMConfig: ...

    def forward_one(
        self, tokens: torch.Tensor, start_pos: int, past_kv: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward_batch(
        self, items: Sequence[BatchItem]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]: ...


def validate_items(config: "CausalLMConfig", items: Sequence["BatchItem"]) -> list["BatchItem"]:
    """Validate every (tokens, start_pos, past_kv) of a batch before any runs;
    returns them with tokens as checked tensors."""
    checked = []
    for index, item in enumerate(items):
        if not isinstance(item, tuple) or len(item) != 3:
            raise TypeError(f"items[{index}] must be a (tokens, start_pos, past_kv) tuple")
        tokens, start_pos, past_kv = item
        where = f"items[{index}]: " if len(items) > 1 else ""
        checked.append((validate_item(config, tokens, start_pos, past_kv, where), start_pos, past_kv))
    return checked


def validate_item(
    config: CausalLMConfig, tokens: object, start_pos: object, past_kv: object, where: str = ""
) -> torch.Tensor:
    """Checks one (tokens, start_pos, past_kv) request; returns tokens as int64."""
    tokens = validate_tokens(config, tokens, start_pos, where)
    if past_kv is None:
        if start_pos:
            raise ValueError(
                f"{where}past_kv is None but start_pos is {start_pos}: pass the KV of the prefix"
            )
    else:
        expected = kv_shape(config, start_pos)
        if not isinstance(past_kv, torch.Tensor) or tuple(past_kv.shape) != expected:
            shape = tuple(past_kv.shape) if isinstance(past_kv, torch.Tensor) else type(past_kv).__name__
            raise ValueError(f"{where}past_kv must have shape {expected} (P == start_pos), got {shape}")
        if past_kv.dtype != DTYPES[config.dtype]:
            raise ValueError(
                f"{where}past_kv dtype {past_kv.dtype} differs from the model dtype {config.dtype}"
            )
    return tokens


def validate_tokens(config: CausalLMConfig, tokens: object, start_pos: object, where: str = "") -> torch.Tensor:
    """Checks a request's new tokens and where they start; returns them as int64."""
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 \
            or tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise TypeError(f"{where}tokens must be a 1-D integer tensor, got {tokens!r:.80}")
    if tokens.numel() == 0:
        raise ValueError(f"{where}tokens must not be empty")
    if isinstance(start_pos, bool) or not isinstance(start_pos, int) or start_pos < 0:
        raise ValueError(f"{where}start_pos must be a non-negative int, got {start_pos!r}")
    if start_pos + tokens.numel() > config.max_position:
        raise ValueError(
            f"{where}start_pos + len(tokens) = {start_pos + tokens.numel()} exceeds "
            f"max_position {config.max_position}"
        )
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= config.vocab_size:
        raise ValueError(f"{where}tokens must lie in [0, {config.vocab_size}), got [{low}, {high}]")
    return tokens.long()
