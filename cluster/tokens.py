"""Validation of token sequences at the library boundary.

Conversion goes through ``array.array('q')`` so type and range checks run in
C: this sits on the hot path of every match and insert.
"""

from __future__ import annotations

from array import array
from typing import Sequence

from cluster.errors import InvalidInputError


def as_token_list(tokens: Sequence[int], vocab_size: int | None = None, *, allow_empty: bool = False) -> list[int]:
    """Return ``tokens`` as a list of Python ints, or raise ``InvalidInputError``.

    Accepts lists, tuples, ``array`` objects, numpy arrays and 1-D integer
    tensors. Rejects non-integers (floats, strings, bools mixed in are accepted
    by Python as ints and therefore here too), negative ids, ids at or above
    ``vocab_size`` and, unless ``allow_empty``, empty sequences.
    """
    if isinstance(tokens, (str, bytes)):
        raise InvalidInputError(f"tokens must be a sequence of integer ids, got {type(tokens).__name__}")
    if type(tokens) is not list:
        if hasattr(tokens, "tolist"):  # numpy arrays, torch tensors
            if getattr(tokens, "ndim", 1) != 1:
                raise InvalidInputError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
            dtype = str(getattr(tokens, "dtype", ""))
            if "float" in dtype or "complex" in dtype:
                raise InvalidInputError(f"tokens must be integers, got dtype {dtype}")
            tokens = tokens.tolist()
        else:
            try:
                tokens = list(tokens)
            except TypeError:
                raise InvalidInputError(
                    f"tokens must be a sequence of integer ids, got {type(tokens).__name__}"
                ) from None
    if not tokens:
        if allow_empty:
            return tokens
        raise InvalidInputError("tokens must not be empty")
    try:
        array("q", tokens)
    except (TypeError, OverflowError) as exc:
        bad = next((t for t in tokens if not isinstance(t, int)), None)
        what = f"{bad!r} ({type(bad).__name__})" if bad is not None else "an id outside int64"
        raise InvalidInputError(f"tokens must be integer ids; found {what}") from exc
    lo = min(tokens)
    if lo < 0:
        raise InvalidInputError(f"token ids must be >= 0; found {lo} at index {tokens.index(lo)}")
    if vocab_size is not None:
        hi = max(tokens)
        if hi >= vocab_size:
            raise InvalidInputError(
                f"token ids must be < vocab_size={vocab_size}; found {hi} at index {tokens.index(hi)}"
            )
    return tokens


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists (slice compares run in C)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n   # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
