"""MemoryL3Store: an L3 store inside one process, for unit tests and simulations.

It keeps the encoded values (``cluster.cache.l3.wire``) in a dict, so every
read runs the same verification as a read from Mooncake, and it evicts the
oldest values past ``capacity_bytes`` as Mooncake evicts under pressure. It
is not shared between processes: a cluster uses ``MooncakeL3Store``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from cluster.cache.l3.store import L3Stats, L3Store
from cluster.cache.l3.wire import (GetStatus, L3Block, L3GetResult, L3Key, L3Lookup, L3PutResult, PutStatus,
                                     decode_block, encode_block)


class MemoryL3Store(L3Store):
    def __init__(self, capacity_bytes: int = 1 << 30):
        self.capacity_bytes = capacity_bytes
        self._values: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._closed = False
        self._counts = {"hits": 0, "misses": 0, "verify_failures": 0, "token_mismatches": 0, "puts": 0,
                        "put_existing": 0, "put_failures": 0, "put_bytes": 0, "get_bytes": 0}

    def put_blocks(self, blocks: Sequence[L3Block]) -> tuple[L3PutResult, ...]:
        out = []
        with self._lock:
            for b in blocks:
                name = b.key.name
                if self._closed:
                    out.append(L3PutResult(b.key, PutStatus.OFF))
                elif name in self._values:
                    self._counts["put_existing"] += 1
                    out.append(L3PutResult(b.key, PutStatus.ALREADY_PRESENT))
                else:
                    value = bytes(encode_block(b))
                    if len(value) > self.capacity_bytes:
                        self._counts["put_failures"] += 1
                        out.append(L3PutResult(b.key, PutStatus.FAILED))
                        continue
                    self._values[name] = value
                    self._bytes += len(value)
                    while self._bytes > self.capacity_bytes:
                        _, old = self._values.popitem(last=False)
                        self._bytes -= len(old)
                    self._counts["puts"] += 1
                    self._counts["put_bytes"] += len(value)
                    out.append(L3PutResult(b.key, PutStatus.STORED, len(value)))
        return tuple(out)

    def get_blocks(self, lookups: Sequence[L3Lookup]) -> tuple[L3GetResult, ...]:
        out = []
        with self._lock:
            for q in lookups:
                value = None if self._closed else self._values.get(q.key.name)
                if value is None:
                    self._counts["misses"] += 1
                    out.append(L3GetResult(q.key, GetStatus.OFF if self._closed else GetStatus.MISS))
                    continue
                self._counts["get_bytes"] += len(value)
                status, kv = decode_block(value, q)
                self._counts["hits" if status is GetStatus.HIT else "misses"] += 1
                if status is GetStatus.VERIFY_FAILED:
                    self._counts["verify_failures"] += 1
                elif status is GetStatus.TOKEN_MISMATCH:
                    self._counts["token_mismatches"] += 1
                out.append(L3GetResult(q.key, status, kv))
        return tuple(out)

    def contains(self, keys: Sequence[L3Key]) -> tuple[bool, ...]:
        with self._lock:
            return tuple(not self._closed and k.name in self._values for k in keys)

    def remove_prefix(self, prefix: str) -> int:
        with self._lock:
            names = [n for n in self._values if n.startswith(prefix)]
            for n in names:
                self._bytes -= len(self._values.pop(n))
            return len(names)

    def remove_keys(self, keys: Sequence[L3Key]) -> int:
        return sum(self.remove(k) for k in keys)

    def list_names(self, prefix: str) -> list[str] | None:
        with self._lock:
            return [n for n in self._values if n.startswith(prefix)]

    def remove(self, key: L3Key) -> bool:
        """Forget one value (as an eviction would); True if it was there."""
        with self._lock:
            value = self._values.pop(key.name, None)
            if value is not None:
                self._bytes -= len(value)
            return value is not None

    def corrupt(self, key: L3Key) -> None:
        """Flip a byte of the stored KV (tests: a read must refuse it)."""
        with self._lock:
            value = bytearray(self._values[key.name])
            value[-1] ^= 0xFF
            self._values[key.name] = bytes(value)

    @property
    def num_values(self) -> int:
        return len(self._values)

    def close(self) -> None:
        with self._lock:
            self._closed = True

    def stats(self) -> L3Stats:
        with self._lock:
            return L3Stats(state="closed" if self._closed else "on", **self._counts)
