"""Token sequences as packed ``uint32`` bytes: the radix tree's key format.

Why bytes: comparing a request against an edge is then one ``memcmp``
(``bytes.startswith`` at an offset, no slice, no per-token Python object),
and tree keys are ``array('I')`` (4 bytes a token, invisible to the garbage
collector) instead of lists of Python ints (8-byte pointers plus an int
object each, all walked by every collection).

A caller that matches and then inserts the same sequence encodes it once
(``encode_tokens``) and passes the bytes to both; the tree accepts lists too.
"""

from __future__ import annotations

from array import array
from typing import Sequence

from cluster.errors import InvalidInputError
from cluster.tokens import as_token_list

TOKEN_BYTES = 4
MAX_TOKEN_ID = (1 << 32) - 1


def encode_tokens(tokens: Sequence[int] | bytes, vocab_size: int | None = None, *,
                  validate: bool = True, allow_empty: bool = False) -> bytes:
    """``tokens`` as little-endian-native ``uint32`` bytes (bytes pass through as already encoded).

    Raises ``InvalidInputError`` naming the problem: not integers, negative,
    at or above ``vocab_size`` (when given) or above 2**32-1, empty (unless
    ``allow_empty``). ``validate=False`` skips the vocabulary check only; the
    conversion itself always rejects what cannot be a token id.
    """
    if type(tokens) is bytes:
        if len(tokens) % TOKEN_BYTES:
            raise InvalidInputError(f"encoded tokens must be a multiple of {TOKEN_BYTES} bytes, got {len(tokens)}")
        if not tokens and not allow_empty:
            raise InvalidInputError("tokens must not be empty")
        return tokens
    try:
        arr = array("I", tokens) if type(tokens) in (list, tuple) else None
    except (TypeError, OverflowError):
        arr = None
    if arr is None:
        # Slow path: precise messages (and numpy arrays, tensors, iterables).
        toks = as_token_list(tokens, vocab_size if validate else None, allow_empty=allow_empty)
        try:
            arr = array("I", toks)
        except OverflowError:
            raise InvalidInputError(f"token ids must be <= {MAX_TOKEN_ID}; found {max(toks)}") from None
    if not arr and not allow_empty:
        raise InvalidInputError("tokens must not be empty")
    if validate and vocab_size is not None and arr and max(arr) >= vocab_size:
        as_token_list(list(arr), vocab_size)  # raises with the offending id and index
    return arr.tobytes()


def decode_tokens(data: bytes) -> list[int]:
    arr = array("I")
    arr.frombytes(data)
    return arr.tolist()


def key_array(data: bytes | memoryview) -> array:
    """An ``array('I')`` holding the encoded tokens ``data`` (one copy)."""
    arr = array("I")
    arr.frombytes(data)
    return arr
