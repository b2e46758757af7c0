"""Text around the token stream: streaming detokenization, stop strings, chat prompts.

- `IncrementalDetokenizer` turns generated ids into text one id at a time
  without splitting a multi-byte character, at O(window) cost per id.
- `StopMatcher` cuts the text at the first stop string (OpenAI semantics),
  holding back only text that could still become one.
- `ChatPromptBuilder` tokenizes a chat so that turn n's prompt plus the ids
  the model generated is a token prefix of turn n+1's prompt, which is what
  lets the prefix cache reuse the reply's KV; `ReplyMemory` remembers those ids.

Pure library: no Ray, no torch.
"""

from __future__ import annotations

import bisect
import hashlib
import secrets
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from cluster.engine.tokenizer import SegmentedChatTokenizer, Tokenizer, validate_messages
from cluster.errors import InvalidInputError

REPLACEMENT_CHAR = "\ufffd"
CHAT_ROLES = ("system", "user", "assistant", "tool")   # tool: a function's result (the agent loop)
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
# Prompt tokens decoded in front of the first generated id, as vLLM does: tokenizers
# whose decoder strips a leading space at the start of a sequence keep it mid-text.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Generated ids -> text, emitting only whole characters.

    vLLM's scheme: decode the window `ids[prefix_offset:]` and compare it with
    the text of `ids[prefix_offset:read_offset]` (already emitted). The
    difference is new text unless it ends in U+FFFD, which means the last id
    holds only part of a UTF-8 sequence; then nothing is emitted until a later
    id completes it. The window is a few ids long, so each push costs O(1)
    decodes of O(1) ids instead of decoding the whole output.

    Without `prompt_ids`, the pieces (pushes then flush) concatenate to exactly
    `tokenizer.decode(output ids)`. With them, the last prompt ids are decoded
    as context, which is the same text for byte-level tokenizers and keeps the
    first token's leading space for SentencePiece ones.
    """

    __slots__ = ("_tokenizer", "_ids", "_start", "_prefix_offset", "_read_offset", "_prefix_text",
                 "_pieces", "_length", "_boundaries", "_flushed")

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None) -> None:
        self._tokenizer = tokenizer
        context = [int(i) for i in prompt_ids[-PROMPT_CONTEXT_TOKENS:]] if prompt_ids else []
        context_text = tokenizer.decode(context) if context else ""
        if REPLACEMENT_CHAR in context_text:  # a prompt cut inside a character is no context
            context, context_text = [], ""
        self._ids: list[int] = context
        self._start = len(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = context_text
        self._pieces: list[str] = []
        self._length = 0
        self._boundaries: list[tuple[int, int]] = [(0, 0)]  # (text length, output ids) at each emission
        self._flushed = False

    def push(self, token_id: int) -> str:
        """Adds one generated id; returns the text it completes (often "", never part of a character)."""
        if self._flushed:
            raise RuntimeError("push after flush: the detokenizer has finished")
        self._ids.append(int(token_id))
        window = self._tokenizer.decode(self._ids[self._prefix_offset:])
        emitted_len = len(self._prefix_text)
        if len(window) <= emitted_len or window.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._tokenizer.decode(self._ids[self._prefix_offset:self._read_offset])
        return self._emit(window[emitted_len:])

    def flush(self) -> str:
        """Text still held at the end: an unfinished trailing sequence, as `decode` renders it."""
        if self._flushed:
            return ""
        self._flushed = True
        emitted = self.text
        full = self._tokenizer.decode(self._ids[self._start:])
        if self._start == 0 and full.startswith(emitted):
            rest = full[len(emitted):]
        else:
            window = self._tokenizer.decode(self._ids[self._prefix_offset:])
            rest = window[len(self._prefix_text):] if len(window) > len(self._prefix_text) else ""
        self._read_offset = len(self._ids)
        return self._emit(rest) if rest else ""

    def _emit(self, piece: str) -> str:
        self._pieces.append(piece)
        self._length += len(piece)
        self._boundaries.append((self._length, self._read_offset - self._start))
        return piece

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def token_ids(self) -> list[int]:
        """The generated ids pushed so far (no prompt context)."""
        return self._ids[self._start:]

    def ids_for_text_length(self, length: int) -> list[int] | None:
        """The generated ids whose text is exactly `text[:length]`, or None when `length` cuts inside a token.

        For `ReplyMemory` after a stop string truncated the reply: the ids are
        only worth remembering when they produce the returned text exactly.
        """
        index = bisect.bisect_left(self._boundaries, (length, -1))
        if index == len(self._boundaries) or self._boundaries[index][0] != length:
            return None
        return self._ids[self._start:self._start + self._boundaries[index][1]]


class StopMatcher:
    """Cuts streamed text at the first stop string, OpenAI style.

    The stop string and everything after it are dropped. Text that could be the
    start of a stop string (the longest suffix of the pending text that is a
    proper prefix of some stop) is held back until the next piece shows whether
    it is one, so a stop split across tokens is still caught and nothing of it
    reaches the client.
    """

    __slots__ = ("stops", "_pending", "_stopped")

    def __init__(self, stops: str | Sequence[str] | None = None) -> None:
        self.stops: tuple[str, ...] = validate_stops(stops)
        self._pending = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to send now, whether a stop string was reached); after a stop, ("", True)."""
        if self._stopped:
            return "", True
        if not self.stops:
            return text, False
        buffer = self._pending + text
        cut = min((i for i in (buffer.find(stop) for stop in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self._pending, self._stopped = "", True
            return buffer[:cut], True
        hold = self._held_suffix(buffer)
        self._pending = buffer[len(buffer) - hold:] if hold else ""
        return buffer[:len(buffer) - hold], False

    def flush(self) -> str:
        """The held text at the end of generation: it never became a stop string."""
        pending, self._pending = self._pending, ""
        return "" if self._stopped else pending

    def _held_suffix(self, buffer: str) -> int:
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:size]):
                    longest = size
                    break
        return longest


def validate_stops(stops: str | Sequence[str] | None) -> tuple[str, ...]:
    """The stop strings of a request (None, one string or a list), deduplicated, or InvalidInputError."""
    if stops is None:
        return ()
    if isinstance(stops, str):
        stops = [stops]
    if not isinstance(stops, Sequence):
        raise InvalidInputError(f"'stop' must be a string or a list of strings, got {type(stops).__name__}")
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidInputError(f"'stop' may hold at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
    for index, stop in enumerate(stops):
        if not isinstance(stop, str):
            raise InvalidInputError(f"'stop'[{index}] must be a string, got {type(stop).__name__}")
        if not stop:
            raise InvalidInputError(f"'stop'[{index}] is empty; a stop string needs at least one character")
        if len(stop) > MAX_STOP_CHARS:
            raise InvalidInputError(
                f"'stop'[{index}] is {len(stop)} characters long; the limit is {MAX_STOP_CHARS}")
    return tuple(dict.fromkeys(stops))


class ReplyMemory:
    """The ids the model generated for a reply text, per namespace, LRU-bounded.

    A chat client sends the assistant's reply back as text next turn, and
    tokenizing that text rarely gives back the ids the model sampled (BPE is
    canonical only for its own output). Looking the text up here returns the
    sampled ids, so the next prompt starts with exactly the tokens whose KV the
    cache holds. Keys are (namespace, sha256 of the text): one tenant's entries
    never serve another. Ids are stored as 4-byte arrays; both the entry count
    and the total ids are bounded.
    """

    def __init__(self, max_entries: int = 10_000, max_tokens: int = 4_000_000) -> None:
        if max_entries < 1 or max_tokens < 1:
            raise InvalidInputError(
                f"max_entries and max_tokens must be >= 1, got {max_entries} and {max_tokens}")
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self._entries: OrderedDict[tuple[str, bytes], array] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()  # the ingress may tokenize on worker threads

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def total_tokens(self) -> int:
        return self._tokens

    def remember(self, namespace: str, text: str, ids: Sequence[int]) -> None:
        """Stores `ids` as the tokens of `text`; the caller vouches that they decode to exactly `text`."""
        stored = array("I", ids)
        if not text or not stored or len(stored) > self.max_tokens:
            return
        key = _reply_key(namespace, text)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._tokens -= len(old)
            self._entries[key] = stored
            self._tokens += len(stored)
            while len(self._entries) > self.max_entries or self._tokens > self.max_tokens:
                self._tokens -= len(self._entries.popitem(last=False)[1])

    def recall(self, namespace: str, text: str) -> list[int] | None:
        """The remembered ids of `text` in `namespace` (now most recently used), or None."""
        key = _reply_key(namespace, text)
        with self._lock:
            stored = self._entries.get(key)
            if stored is None:
                return None
            self._entries.move_to_end(key)
            return stored.tolist()


def _reply_key(namespace: str, text: str) -> tuple[str, bytes]:
    return namespace, hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """Prompt ids of a chat; `bridged_messages` replies came from ReplyMemory, `fallback` if whole-text."""

    ids: list[int]
    bridged_messages: int
    fallback: bool


def validate_chat_messages(messages: object) -> list[tuple[str, str]]:
    """(role, content) pairs of a chat with roles system/user/assistant/tool, or InvalidInputError."""
    try:
        pairs = validate_messages(messages)
    except (TypeError, ValueError) as error:
        raise InvalidInputError(str(error)) from error
    for index, (role, _) in enumerate(pairs):
        if role not in CHAT_ROLES:
            raise InvalidInputError(
                f"messages[{index}]['role'] is {role!r}; supported roles are {', '.join(CHAT_ROLES)}")
    return pairs


class ChatPromptBuilder:
    """Chat prompt ids whose reply segments stay what the model generated.

    Tokenizing the whole rendered chat lets BPE merges cross message boundaries
    and re-tokenizes the assistant's replies canonically, so turn n+1's prompt
    often diverges from turn n's prompt + generated ids and the reply's KV is
    recomputed. Instead the template is rendered once with a unique sentinel in
    place of each content, split at the sentinels, and each piece is tokenized
    alone: template pieces with control tokens recognized, contents as plain
    text (a user typing `<|im_end|>` gets text, not a control token), and an
    assistant content that `ReplyMemory` knows gets its generated ids. Then
    turn n's prompt + reply ids (+ the template's end-of-turn token, when the
    model ended with it) is a token prefix of turn n+1's prompt.

    A template that edits contents (trims, rewrites) breaks the split; the
    builder checks that the pieces rebuild the real rendering exactly and that
    the ids decode back to it, and otherwise falls back to whole-text
    tokenization (counted in `fallbacks`). Tokenizers without the segmented
    interface (ByteTokenizer, whose template is append-only already) go through
    their own `apply_chat_template`.
    """

    _TEMPLATE_CACHE_ENTRIES = 4096
    # Contents' plain-text ids, most recently used last: a chat sends its system prompt and every
    # earlier message again each turn, and sessions share system prompts, so most of a turn's
    # text was tokenized before; the Ingress's event loop, which every request and streamed token
    # shares, builds a long chat's prompt several times faster (docs/engine.md, "Text").
    _CONTENT_CACHE_ENTRIES = 16_384
    _CONTENT_CACHE_TOKENS = 2_000_000   # int32 ids: 8 MB

    def __init__(self, tokenizer: Tokenizer, reply_memory: ReplyMemory | None = None) -> None:
        self.tokenizer = tokenizer
        self.reply_memory = reply_memory
        self.segmented = isinstance(tokenizer, SegmentedChatTokenizer)
        self.builds = 0
        self.fallbacks = 0
        self.bridged_messages = 0
        self._template_ids: dict[str, tuple[int, ...]] = {}
        self._content_ids: OrderedDict[str, array] = OrderedDict()
        self._content_tokens = 0
        self.content_hits = 0

    def build(self, messages: object, namespace: str = "", tools: list[dict] | None = None) -> ChatPrompt:
        """Prompt ids for `messages`, ending with the assistant's generation header;
        `tools` go to a template that renders them itself (OpenAI's tool list)."""
        pairs = validate_chat_messages(messages)
        chat = [{"role": role, "content": content} for role, content in pairs]
        self.builds += 1
        if not self.segmented:
            return ChatPrompt([int(i) for i in self.tokenizer.apply_chat_template(chat)], 0, False)
        tokenizer: SegmentedChatTokenizer = self.tokenizer  # type: ignore[assignment]
        rendered = tokenizer.render_chat(chat, tools=tools)
        templates = self._template_pieces(pairs, rendered, tools)
        if templates is None:
            return self._fallback(chat, tools)
        ids: list[int] = list(self._encode_template(templates[0]))
        bridged = 0
        for (role, content), template in zip(pairs, templates[1:]):
            remembered = None
            if role == "assistant" and self.reply_memory is not None:
                remembered = self.reply_memory.recall(namespace, content)
            if remembered is not None:
                ids.extend(remembered)
                bridged += 1
            else:
                ids.extend(self._encode_content(content))
            ids.extend(self._encode_template(template))
        if tokenizer.decode_exact(ids) != rendered:  # e.g. a decoder that strips a leading space per piece
            return self._fallback(chat, tools)
        self.bridged_messages += bridged
        return ChatPrompt(ids, bridged, False)

    def remember_reply(self, namespace: str, text: str, ids: Sequence[int]) -> bool:
        """Remembers the generated `ids` of the reply `text` returned to the client; True if stored.

        A trailing stop id is dropped. Ids are stored only when they decode to
        exactly `text` and hold no special token, so a reply cut by a stop
        string inside a token, or any mismatch, is simply not remembered.
        """
        if self.reply_memory is None or not self.segmented or not text:
            return False
        tokenizer: SegmentedChatTokenizer = self.tokenizer  # type: ignore[assignment]
        ids = [int(i) for i in ids]
        if ids and ids[-1] in tokenizer.stop_token_ids:
            ids.pop()
        if not ids or not tokenizer.special_token_ids.isdisjoint(ids) or tokenizer.decode_exact(ids) != text:
            return False
        self.reply_memory.remember(namespace, text, ids)
        return True

    def _template_pieces(self, pairs: list[tuple[str, str]], rendered: str,
                         tools: list[dict] | None = None) -> list[str] | None:
        """The template's text around each content (len(pairs) + 1 pieces), or None if it edits contents."""
        nonce = f"{secrets.randbelow(10**15):015d}"
        sentinels = [f"\ue000{nonce}.{index}\ue001" for index in range(len(pairs))]
        if any(sentinel in content for sentinel in sentinels for _, content in pairs):
            return None
        marked_chat = [{"role": role, "content": sentinel} for (role, _), sentinel in zip(pairs, sentinels)]
        marked = self.tokenizer.render_chat(marked_chat, tools=tools)  # type: ignore[attr-defined]
        pieces, position = [], 0
        for sentinel in sentinels:
            found = marked.find(sentinel, position)
            if found < 0 or marked.find(sentinel, found + 1) >= 0:
                return None  # a content dropped, reordered or repeated by the template
            pieces.append(marked[position:found])
            position = found + len(sentinel)
        pieces.append(marked[position:])
        rebuilt = pieces[0] + "".join(content + piece for (_, content), piece in zip(pairs, pieces[1:]))
        return pieces if rebuilt == rendered else None

    def _encode_template(self, piece: str) -> tuple[int, ...]:
        ids = self._template_ids.get(piece)
        if ids is None:
            if len(self._template_ids) >= self._TEMPLATE_CACHE_ENTRIES:
                self._template_ids.clear()
            ids = tuple(self.tokenizer.encode_control_text(piece))  # type: ignore[attr-defined]
            self._template_ids[piece] = ids
        return ids

    def _encode_content(self, text: str) -> array:
        """A content's plain-text ids (``encode_plain_text``), from the cache when it was seen."""
        ids = self._content_ids.get(text)
        if ids is not None:
            self._content_ids.move_to_end(text)
            self.content_hits += 1
            return ids
        ids = array("i", self.tokenizer.encode_plain_text(text))  # type: ignore[attr-defined]
        if len(ids) <= self._CONTENT_CACHE_TOKENS // 16:   # one huge document does not flush the rest
            self._content_ids[text] = ids
            self._content_tokens += len(ids)
            while len(self._content_ids) > self._CONTENT_CACHE_ENTRIES or \
                    self._content_tokens > self._CONTENT_CACHE_TOKENS:
                self._content_tokens -= len(self._content_ids.popitem(last=False)[1])
        return ids

    def _fallback(self, chat: list[dict], tools: list[dict] | None = None) -> ChatPrompt:
        self.fallbacks += 1
        if tools:
            return ChatPrompt([int(i) for i in self.tokenizer.apply_chat_template(chat, tools=tools)], 0, True)
        return ChatPrompt([int(i) for i in self.tokenizer.apply_chat_template(chat)], 0, True)
