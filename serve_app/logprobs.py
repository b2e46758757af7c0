"""Logprobs in OpenAI's shapes, from the ids and logprobs a replica returns.

A token's text is its own decoded text; a token that is not whole UTF-8 on its
own (a byte of a multi-byte character) is written ``bytes:\\xNN...`` as vLLM
does, so two different tokens never share a name in a ``top_logprobs`` map.
``bytes`` (chat) are the token's raw bytes.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Sequence

from cluster.engine.tokenizer import Tokenizer


def _gpt2_byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode (byte-level BPE vocabularies)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_DECODER = _gpt2_byte_decoder()


class TokenNames:
    """Each token id's text and bytes, for one tokenizer (cached)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.name = lru_cache(maxsize=1 << 16)(self._name)

    def raw_bytes(self, token: int) -> bytes:
        tok = self.tokenizer
        hf = getattr(tok, "tokenizer", None)
        if hf is not None and hasattr(hf, "convert_ids_to_tokens"):
            piece = hf.convert_ids_to_tokens(int(token))
            if isinstance(piece, str) and piece and all(c in _BYTE_DECODER for c in piece):
                return bytes(_BYTE_DECODER[c] for c in piece)
        if token < 256 and getattr(tok, "vocab_size", 0) <= 260:   # the built-in byte tokenizer
            return bytes([token])
        decode = getattr(tok, "decode_exact", tok.decode)
        return decode([token]).encode("utf-8")

    def _name(self, token: int) -> tuple[str, tuple[int, ...]]:
        raw = self.raw_bytes(token)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return text, tuple(raw)


def completion_logprobs(names: TokenNames, ids: Sequence[int], entries: Sequence[Any], start_offset: int = 0) -> dict:
    """OpenAI completions' ``logprobs``: tokens, token_logprobs, top_logprobs, text_offset
    (``entries[i]``: (logprob, ((id, lp), ...)) or None, as for an echoed first token)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = start_offset
    for token, entry in zip(ids, entries):
        text = names.name(token)[0]
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            token_lps.append(None)
            tops.append(None)
            continue
        lp, top = entry
        token_lps.append(lp)
        tops.append({names.name(t)[0]: v for t, v in top} if top else {})
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(names: TokenNames, ids: Sequence[int], entries: Sequence[Any]) -> dict:
    """OpenAI chat's ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    content = []
    for token, (lp, top) in zip(ids, entries):
        text, raw = names.name(token)
        content.append({"token": text, "logprob": lp, "bytes": list(raw),
                        "top_logprobs": [{"token": names.name(t)[0], "logprob": v, "bytes": list(names.name(t)[1])}
                                         for t, v in top]})
    return {"content": content}
