"""Chained block hashes of token sequences.

``h_i = H(h_{i-1} || tokens of block i)`` with the chain seeded by the
tenant's cache salt, so equal hashes mean equal prefixes within one tenant and
different tenants never share a hash. xxh3-64 is deterministic across
processes and machines (never Python's ``hash``, which is salted per process).
Hashes only route; a worker always compares tokens before reusing KV.
"""

from __future__ import annotations

from array import array
from typing import Sequence

import numpy as np
import xxhash

_SEED_DOMAIN = b"prefix-cache-cluster/v1"


def salt_seed(salt: str | int | None) -> int:
    """The chain's initial value for a tenant salt (None: the shared namespace)."""
    return xxhash.xxh3_64_intdigest(_SEED_DOMAIN + repr(salt).encode())


def block_hashes(tokens: Sequence[int], block_tokens: int, salt: str | int | None = None) -> list[int]:
    """Hashes of every *full* block of ``tokens`` (a partial last block is not hashed)."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    return chain_hashes(array("q", tokens).tobytes(), block_tokens, salt_seed(salt))


def tail_hash(prev: int, tokens: Sequence[int]) -> int:
    """The hash of a *partial* last block (fewer than ``block_tokens`` tokens) after
    the chain's hash ``prev``: the chain's step over fewer bytes, so it names those
    exact tokens after that prefix (L3 keys it apart from full blocks, and every
    read still compares the tokens)."""
    return xxhash.xxh3_64_intdigest(array("q", tokens).tobytes(), seed=prev)


def chain_hashes(int64_bytes: bytes, block_tokens: int, prev: int) -> list[int]:
    """Continue a chain from ``prev`` over the full blocks of ``int64_bytes``
    (tokens as native int64, the encoding ``block_hashes`` hashes)."""
    out = []
    step = block_tokens * 8
    digest = xxhash.xxh3_64_intdigest
    for start in range(0, (len(int64_bytes) // step) * step, step):
        prev = digest(int64_bytes[start:start + step], seed=prev)
        out.append(prev)
    return out


def chain_hashes_u32(u32_bytes: bytes, first_token: int, end_token: int, block_tokens: int, prev: int) -> list[int]:
    """``chain_hashes`` over tokens ``[first_token, end_token)`` of a packed
    uint32 sequence (the radix tree's key format), equal to ``block_hashes``
    of the same ids; ``first_token`` must start a block."""
    count = end_token - first_token
    if count < block_tokens:
        return []
    ids = np.frombuffer(u32_bytes, dtype=np.uint32, count=count, offset=first_token * 4)
    return chain_hashes(ids.astype(np.int64).tobytes(), block_tokens, prev)
