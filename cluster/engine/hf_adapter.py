"""Run a local `transformers` causal LM (Llama family) behind the engine's model contract.

Optional extra (`pip install transformers`); transformers is imported only when an
adapter is built, so this module imports without it.

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
- `apply_chat_template` returns a BatchEncoding by default in 5.x; the
  tokenizer adapter asks for a plain list (`return_dict=False`).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cluster.engine.model import DTYPES, BatchItem, kv_shape, validate_item, validate_items
from cluster.engine.tokenizer import validate_messages
from cluster.errors import InvalidInputError

_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError as error:  # pragma: no cover - transformers is a dependency; a broken install
        raise ImportError(
            "the Hugging Face adapter needs transformers: pip install 'transformers>=4.44'"
        ) from error
    return transformers


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
        transformers = _import_transformers()
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
        transformers = _import_transformers()
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


class HFTokenizer:
    """A transformers tokenizer behind the Tokenizer and SegmentedChatTokenizer protocols.

    Besides the protocol, it exposes what `cluster.engine.text.ChatPromptBuilder`
    needs to tokenize a chat piece by piece: the rendered template text, an
    encoder that turns special-token strings into control tokens (for the
    template's own text) and one that never does (for message contents, so a
    user typing `<|im_end|>` cannot end their turn), and an exact decoder.
    """

    def __init__(self, tokenizer: Any, generation_eos_ids: Sequence[int] = ()) -> None:
        transformers = _import_transformers()
        if not isinstance(tokenizer, transformers.PreTrainedTokenizerBase):
            raise TypeError(f"tokenizer must be a transformers tokenizer, got {type(tokenizer).__name__}")
        if tokenizer.eos_token_id is None:
            raise ValueError("tokenizer has no eos token: the engine could not stop generation")
        self.tokenizer = tokenizer
        stops = [int(tokenizer.eos_token_id)]
        for token in generation_eos_ids:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < len(tokenizer):
                raise ValueError(f"generation eos id {token!r} is not a token id of this tokenizer")
            if token not in stops:
                stops.append(token)
        self._stop_token_ids = tuple(stops)
        self._special_ids = frozenset(int(i) for i in tokenizer.all_special_ids) | frozenset(
            int(i) for i, added in tokenizer.added_tokens_decoder.items() if added.special)
        self._plain_backend = _plain_text_backend(tokenizer)
        self._sanitize_kwarg = "sanitize_control_tokens" in inspect.signature(
            tokenizer.apply_chat_template).parameters

    @classmethod
    def from_pretrained(cls, path: str | Path) -> HFTokenizer:
        """Loads a local tokenizer directory; never downloads.

        The stop tokens are the tokenizer's EOS plus the `eos_token_id` (an int or
        a list) of `generation_config.json` when the directory has one: chat
        models often end a turn with a token other than the tokenizer's EOS.
        """
        transformers = _import_transformers()
        if not Path(path).is_dir():
            raise FileNotFoundError(f"tokenizer directory {str(path)!r} does not exist")
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        return cls(tokenizer, generation_eos_ids=_generation_eos_ids(Path(path) / "generation_config.json"))

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def bos_id(self) -> int | None:
        """None for tokenizers without a BOS token (the chat template then starts bare)."""
        return self.tokenizer.bos_token_id

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """EOS first, then the generation config's other end-of-turn ids."""
        return self._stop_token_ids

    @property
    def special_token_ids(self) -> frozenset[int]:
        return self._special_ids

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        _check_ids(ids)
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def decode_exact(self, ids: Sequence[int]) -> str:
        """Text of `ids` with special tokens kept and no clean-up: encode's inverse."""
        _check_ids(ids)
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def encode_control_text(self, text: str) -> list[int]:
        """Template text: special-token strings in it become their control tokens."""
        return self.encode(text)

    def encode_plain_text(self, text: str) -> list[int]:
        """Message content: special-token strings are tokenized as ordinary text.

        Uses a private copy of the Rust tokenizer with `encode_special_tokens`
        set, because transformers' `split_special_tokens=True` flips that flag on
        the shared backend for the duration of a call (not thread-safe).
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        if self._plain_backend is not None:
            ids = self._plain_backend.encode(text, add_special_tokens=False).ids
        else:
            ids = self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
        if not self._special_ids.isdisjoint(ids):
            raise InvalidInputError(
                f"text {text[:40]!r} tokenizes to a control token even as plain text; rephrase it")
        return list(ids)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        """The chat template's text for `messages` (already validated), untokenized;
        `tools` for a template that renders them."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("tokenizer has no chat_template")
        extra = {"tools": tools} if tools else {}
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra)
        if not isinstance(text, str):
            raise TypeError(f"chat template rendered a {type(text).__name__}, expected a str")
        return text

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Whole-text tokenization of the rendered chat.

        Where transformers supports it (5.x), control tokens typed inside
        messages are encoded as text (`sanitize_control_tokens`).
        """
        pairs = validate_messages(messages)
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("tokenizer has no chat_template")
        extra = {"sanitize_control_tokens": True} if self._sanitize_kwarg else {}
        if tools:
            extra["tools"] = tools
        ids = self.tokenizer.apply_chat_template(
            [{"role": role, "content": content} for role, content in pairs],
            tokenize=True, add_generation_prompt=True, return_dict=False, **extra,
        )
        if hasattr(ids, "keys"):  # a BatchEncoding, should a version ignore return_dict
            ids = ids["input_ids"]
        return [int(i) for i in ids]


def _check_ids(ids: Sequence[int]) -> None:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise TypeError(f"ids must be a sequence of ints, got {type(ids).__name__}")


def _plain_text_backend(tokenizer: Any) -> Any:
    """A private Rust tokenizer that encodes special-token strings as text, or None (slow tokenizers)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    from tokenizers import Tokenizer as RustTokenizer

    plain = RustTokenizer.from_str(backend.to_str())
    plain.encode_special_tokens = True
    plain.no_truncation()
    plain.no_padding()
    return plain


def _generation_eos_ids(path: Path) -> tuple[int, ...]:
    """`eos_token_id` of a generation_config.json (int, list or absent) as a tuple."""
    if not path.is_file():
        return ()
    value = json.loads(path.read_text()).get("eos_token_id")
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{path}: eos_token_id must be an int or a list of ints, got {value!r}")
    return tuple(values)
