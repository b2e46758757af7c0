"""Tokenizers: the protocol the engine needs, and a dependency-free byte tokenizer.

The byte tokenizer is lossless (every string round-trips) and needs no vocabulary
file, so every process, test and benchmark tokenizes identically. Its chat
template is append-only: the prompt of turn n, followed by the assistant's reply,
is a prefix of the prompt of turn n+1, which is what makes multi-turn chats hit
the prefix cache.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

BYTE_VOCAB_SIZE = 259
BYTE_BOS_ID = 256
BYTE_EOS_ID = 257
BYTE_PAD_ID = 258

_ROLE_PATTERN = re.compile(r"[a-z][a-z_]*\Z")


@runtime_checkable
class Tokenizer(Protocol):
    """What the engine needs from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_id(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation: EOS first, then any other end-of-turn ids of the model."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens dropped."""
        ...

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Prompt ids for a chat, ending with the header of the assistant's turn."""
        ...


@runtime_checkable
class SegmentedChatTokenizer(Tokenizer, Protocol):
    """A tokenizer whose chat template can be tokenized piece by piece.

    `cluster.engine.text.ChatPromptBuilder` renders the template as text and
    tokenizes the template's own pieces and each message content separately, so
    a message's ids do not depend on its neighbours (multi-turn prefix reuse) and
    control tokens typed by a user stay text.
    """

    @property
    def special_token_ids(self) -> frozenset[int]: ...

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        """The template's text for validated `messages` (and `tools`, for a template that takes them)."""
        ...

    def encode_control_text(self, text: str) -> list[int]:
        """Template text: special-token strings become control tokens."""
        ...

    def encode_plain_text(self, text: str) -> list[int]:
        """Message content: never produces a special token."""
        ...

    def decode_exact(self, ids: Sequence[int]) -> str:
        """Inverse of the two encoders: special tokens kept, no clean-up."""
        ...


def validate_messages(messages: object) -> list[tuple[str, str]]:
    """(role, content) pairs of an OpenAI-style message list, or a TypeError/ValueError."""
    if not isinstance(messages, list):
        raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages must not be empty")
    pairs = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise TypeError(f"messages[{index}] must be a dict, got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not _ROLE_PATTERN.match(role):
            raise ValueError(
                f"messages[{index}]['role'] must be a lowercase name such as 'user', got {role!r}"
            )
        if not isinstance(content, str):
            raise TypeError(
                f"messages[{index}]['content'] must be a str, got {type(content).__name__}"
            )
        pairs.append((role, content))
    return pairs


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, plus BOS=256, EOS=257, PAD=258.

    Chat template: BOS, then `<|role|>\\ncontent\\n` per message, then
    `<|assistant|>\\n`. Role markers are plain bytes, so a message containing the
    text `<|user|>` is not distinguishable from a real header; that is accepted
    for a test tokenizer (real models use HFTokenizer).
    """

    vocab_size = BYTE_VOCAB_SIZE
    bos_id = BYTE_BOS_ID
    eos_id = BYTE_EOS_ID
    pad_id = BYTE_PAD_ID
    stop_token_ids = (BYTE_EOS_ID,)

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise TypeError(f"ids must be a sequence of ints, got {type(ids).__name__}")
        data = bytearray()
        for index, token in enumerate(ids):
            if isinstance(token, bool) or not isinstance(token, int):
                raise TypeError(f"ids[{index}] must be an int, got {type(token).__name__}")
            if not 0 <= token < BYTE_VOCAB_SIZE:
                raise ValueError(f"ids[{index}] = {token} is outside [0, {BYTE_VOCAB_SIZE})")
            if token < 256:
                data.append(token)
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        ids = [BYTE_BOS_ID]
        for role, content in validate_messages(messages):
            ids.extend(self.encode(f"<|{role}|>\n{content}\n"))
        ids.extend(self.encode("<|assistant|>\n"))
        return ids
