"""The text of one generation as the client sees it: detokenized, cut at stops.

A ``TextStream`` turns the worker's token ids into text pieces that never end
inside a character (``IncrementalDetokenizer``) and ends the text before the
first OpenAI ``stop`` string (``StopMatcher``, which holds back a piece that
may be the start of one). The same object serves the streamed and the
non-streamed response, so both carry the same text.
"""

from __future__ import annotations

from cluster.engine.text import IncrementalDetokenizer, StopMatcher
from cluster.engine.tokenizer import Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stops: list[str], stop_token_ids: tuple[int, ...]):
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stops = StopMatcher(stops) if stops else None
        self.stop_token_ids = frozenset(stop_token_ids)
        self.ids: list[int] = []        # every generated id, a final stop token included
        self.text = ""                  # the text returned so far
        self.stopped = False            # ended by a stop string

    def push(self, token: int) -> str:
        """The text this token makes safe to send ("" while it is held back)."""
        self.ids.append(token)
        return self._emit(self.detok.push(token))

    def finish(self) -> str:
        """What is left once generation ended: held-back text that proved harmless."""
        if self.stopped:
            return ""
        piece = self._emit(self.detok.flush())
        if not self.stopped and self.stops is not None:
            rest = self.stops.flush()
            self.text += rest
            piece += rest
        return piece

    def _emit(self, piece: str) -> str:
        if self.stops is not None and piece:
            piece, self.stopped = self.stops.feed(piece)
        self.text += piece
        return piece

    def finish_reason(self, last_item) -> str:
        """OpenAI's finish_reason: "stop" for a stop string or a stop token, "length"
        at max_tokens; any other worker reason (an error, a cancel) as it is."""
        if self.stopped:
            return "stop"
        reason = getattr(last_item, "finish_reason", None)   # a cluster.protocol.StreamItem
        return str(reason) if reason else "length"

    def reply_ids(self) -> list[int] | None:
        """The generated ids that produce exactly ``text``, for the reply memory;
        None when a stop string cut the text inside a token."""
        if not self.stopped:
            return list(self.ids)
        return self.detok.ids_for_text_length(len(self.text))
