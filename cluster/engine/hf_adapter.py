"""A local `transformers` tokenizer behind the engine's tokenizer protocols.

transformers is imported only when a tokenizer is built, so this module imports
without it. `apply_chat_template` returns a BatchEncoding by default in 5.x; the
adapter asks for a plain list (`return_dict=False`).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cluster.engine.tokenizer import validate_messages
from cluster.errors import InvalidInputError


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError as error:  # pragma: no cover - transformers is a dependency; a broken install
        raise ImportError(
            "the Hugging Face adapter needs transformers: pip install 'transformers>=4.44'"
        ) from error
    return transformers


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
        self.stop_token_ids = tuple(stops)   # EOS first, then the generation config's other end-of-turn ids
        self.special_token_ids = frozenset(int(i) for i in tokenizer.all_special_ids) | frozenset(
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
        return cls(tokenizer, generation_eos_ids=generation_eos_ids(Path(path) / "generation_config.json"))

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
        if not self.special_token_ids.isdisjoint(ids):
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


def generation_eos_ids(path: Path) -> tuple[int, ...]:
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
