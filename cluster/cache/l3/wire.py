"""The L3 key and value format: names of blocks in the cluster-wide store, and the
self-checking value (header, tokens, KV bytes) every read verifies (``cluster.cache.l3``
stores and fetches them; see its docstring)."""

from __future__ import annotations

import enum
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from cluster.cache.codec import CODECS, format_id
from cluster.cache.kv_pool import KVLayout
from cluster.errors import InvalidInputError

FORMAT_VERSION = 1
MAGIC = b"PCL3"
_HEAD = struct.Struct("<4sHBBIQQQQ")  # magic, format, dtype, ndim, n_tokens, key digest, kv bytes, kv sum, head sum
_DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.uint8: 4, torch.int8: 5}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}


# ------------------------------------------------------------------ keys
def kv_layout_version(layout: KVLayout, block_tokens: int, codec: str = "none") -> str:
    """The name of one block's KV format, e.g. ``f1-L30-H3-D64-bfloat16-B16``, and with a
    compressed tier codec (``cluster.cache.codec``) its stored format's name and version
    after it (``f1-L30-H3-D64-float32-B16-int8v2``): blocks of different formats, a codec's
    older versions included, never share a key."""
    if not isinstance(block_tokens, int) or block_tokens <= 0:
        raise InvalidInputError(f"block_tokens must be a positive integer, got {block_tokens!r}")
    if codec not in CODECS:
        raise InvalidInputError(f"tier codec must be one of {', '.join(CODECS)}; got {codec!r}")
    return (f"f{FORMAT_VERSION}-L{layout.num_layers}-H{layout.num_kv_heads}-D{layout.head_dim}"
            f"-{layout.dtype}-B{block_tokens}" + ("" if codec == "none" else f"-{format_id(codec)}"))


def _check_key_part(name: str, value: Any) -> None:
    if not isinstance(value, str) or not value or len(value) > 200 or not value.isprintable() \
            or any(c.isspace() for c in value):
        raise InvalidInputError(f"L3 key {name} must be a non-empty printable string without spaces "
                                f"(at most 200 characters), got {value!r:.80}")


@dataclass(frozen=True, slots=True)
class L3Key:
    """Where one block lives in L3: model, KV format and the salted chained hash.
    A partial last block (``tail_tokens`` of them, fewer than a block: the end of a
    committed sequence) is keyed by ``cluster.hashing.tail_hash`` and its name ends
    in ``-t<tail_tokens>``, so it never shares a name with a full block."""

    model_id: str
    layout_version: str
    block_hash: int
    tail_tokens: int = 0

    def __post_init__(self) -> None:
        _check_key_part("model_id", self.model_id)
        _check_key_part("layout_version", self.layout_version)
        if not isinstance(self.block_hash, int) or not 0 <= self.block_hash < 1 << 64:
            raise InvalidInputError(f"L3 key block_hash must be an unsigned 64-bit integer, got {self.block_hash!r}")
        if type(self.tail_tokens) is not int or self.tail_tokens < 0:
            raise InvalidInputError(f"L3 key tail_tokens must be a non-negative integer, got {self.tail_tokens!r}")

    @property
    def name(self) -> str:
        tail = f"-t{self.tail_tokens}" if self.tail_tokens else ""
        return f"pc/{self.model_id}/{self.layout_version}/{self.block_hash:016x}{tail}"


def l3_key(model_id: str, layout_version: str, block_hash: int, tail_tokens: int = 0) -> L3Key:
    return L3Key(model_id, layout_version, block_hash, tail_tokens)


# ------------------------------------------------------------------ values
def _token_bytes(tokens: Sequence[int]) -> bytes:
    try:
        return array("I", tokens).tobytes()
    except (OverflowError, TypeError) as exc:
        raise InvalidInputError(f"block tokens must be integers in [0, 2**32): {exc}") from None


@dataclass(frozen=True, slots=True)
class L3Block:
    """One block to store: its key, its tokens and its KV (any shape, on the CPU
    or not; stored as one contiguous tensor)."""

    key: L3Key
    tokens: tuple[int, ...]
    kv: torch.Tensor

    def __post_init__(self) -> None:
        if not isinstance(self.kv, torch.Tensor) or self.kv.dtype not in _DTYPE_CODES:
            raise InvalidInputError(f"L3 block kv must be a tensor of {sorted(str(d) for d in _DTYPE_CODES)}, "
                                    f"got {getattr(self.kv, 'dtype', type(self.kv).__name__)}")
        if not self.tokens:
            raise InvalidInputError("an L3 block needs its tokens (verified on every read)")


@dataclass(frozen=True, slots=True)
class L3Lookup:
    """A block to read: its key and the tokens the caller expects it to hold."""

    key: L3Key
    tokens: tuple[int, ...]


class GetStatus(enum.Enum):
    HIT = "hit"
    MISS = "miss"                       # not in L3
    VERIFY_FAILED = "verify_failed"     # bad magic/format/header/size/key digest/KV checksum
    TOKEN_MISMATCH = "token_mismatch"   # a sound value, but of other tokens
    TIMEOUT = "timeout"
    OFF = "off"


class PutStatus(enum.Enum):
    STORED = "stored"
    ALREADY_PRESENT = "already_present"  # Mooncake keeps the old value: counted as stored
    FAILED = "failed"                    # the store refused it (no space, too large, RPC error)
    TIMEOUT = "timeout"
    OFF = "off"


@dataclass(frozen=True, slots=True)
class L3GetResult:
    key: L3Key
    status: GetStatus
    kv: torch.Tensor | None = None

    @property
    def hit(self) -> bool:
        return self.status is GetStatus.HIT


@dataclass(frozen=True, slots=True)
class L3PutResult:
    key: L3Key
    status: PutStatus
    nbytes: int = 0  # value bytes sent (0 unless STORED)

    @property
    def stored(self) -> bool:
        return self.status in (PutStatus.STORED, PutStatus.ALREADY_PRESENT)


def _key_digest(key: L3Key) -> int:
    return xxhash.xxh3_64_intdigest(key.name.encode())


def encode_block(block: L3Block) -> bytearray:
    """The value stored for ``block`` (module docstring)."""
    kv = block.kv.detach().to("cpu").contiguous()
    payload = kv.reshape(-1).view(torch.uint8).numpy()
    tokens = _token_bytes(block.tokens)
    shape = array("I", kv.shape).tobytes()
    kv_sum = xxhash.xxh3_64_intdigest(payload)
    fields = (MAGIC, FORMAT_VERSION, _DTYPE_CODES[kv.dtype], kv.dim(), len(block.tokens),
              _key_digest(block.key), payload.nbytes, kv_sum)
    head_sum = xxhash.xxh3_64_intdigest(_HEAD.pack(*fields, 0) + shape + tokens)
    head = _HEAD.pack(*fields, head_sum) + shape + tokens
    value = bytearray(len(head) + payload.nbytes)
    value[:len(head)] = head
    value[len(head):] = payload.data
    return value


def decode_block(value: bytes | bytearray | memoryview, lookup: L3Lookup) -> tuple[GetStatus, torch.Tensor | None]:
    """Verify ``value`` against ``lookup``; the KV (a fresh CPU tensor) only on HIT."""
    view = memoryview(value)
    if len(view) < _HEAD.size:
        return GetStatus.VERIFY_FAILED, None
    magic, fmt, dtype_code, ndim, n_tokens, key_sum, kv_bytes, kv_sum, head_sum = _HEAD.unpack_from(view)
    tokens_at = _HEAD.size + 4 * ndim
    kv_at = tokens_at + 4 * n_tokens
    if magic != MAGIC or fmt != FORMAT_VERSION or dtype_code not in _CODE_DTYPES or len(view) != kv_at + kv_bytes:
        return GetStatus.VERIFY_FAILED, None
    head = bytearray(view[:kv_at])
    head[_HEAD.size - 8:_HEAD.size] = bytes(8)
    if xxhash.xxh3_64_intdigest(head) != head_sum or key_sum != _key_digest(lookup.key):
        return GetStatus.VERIFY_FAILED, None
    dtype = _CODE_DTYPES[dtype_code]
    shape_u32 = array("I")
    shape_u32.frombytes(view[_HEAD.size:tokens_at])
    shape = tuple(shape_u32)
    if int(np.prod(shape, dtype=np.int64)) * dtype.itemsize != kv_bytes:
        return GetStatus.VERIFY_FAILED, None
    payload = view[kv_at:]
    if xxhash.xxh3_64_intdigest(payload) != kv_sum:
        return GetStatus.VERIFY_FAILED, None
    if view[tokens_at:kv_at] != _token_bytes(lookup.tokens):
        return GetStatus.TOKEN_MISMATCH, None
    kv = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if kv_bytes else torch.empty(0, dtype=torch.uint8)
    return GetStatus.HIT, kv.view(dtype).reshape(shape)
