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

import xxhash

_SEED_DOMAIN = b"prefix-cache-cluster/v1"


def salt_seed(salt: str | int | None) -> int:
    """The chain's initial value for a tenant salt (None: the shared namespace)."""
    return xxhash.xxh3_64_intdigest(_SEED_DOMAIN + repr(salt).encode())


def block_hashes(tokens: Sequence[int], block_tokens: int, salt: str | int | None = None) -> list[int]:
    """Hashes of every *full* block of ``tokens`` (a partial last block is not hashed)."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    prev = salt_seed(salt)
    out = []
    buf = array("q", tokens).tobytes()
    step = block_tokens * 8
    for start in range(0, (len(tokens) // block_tokens) * step, step):
        prev = xxhash.xxh3_64_intdigest(buf[start:start + step], seed=prev)
        out.append(prev)
    return out
