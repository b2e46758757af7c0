"""What a radix tree costs in Python objects and bytes, counted the same way for this
project's tree and SGLang's (``lab.bench.radix``, ``lab.bench.sglang_baseline``)."""

from __future__ import annotations

import gc
import sys
import types

from lab.bench.common import rounded


def per_token(nodes: int, objects: int, index_bytes: int, cached: int) -> dict:
    return {"nodes_per_cached_token": rounded(nodes / max(cached, 1), 6),
            "objects_per_cached_token": rounded(objects / max(cached, 1), 6),
            "index_bytes_per_cached_token": rounded(index_bytes / max(cached, 1), 3)}


def footprint(roots: list) -> tuple[int, int]:
    """Python objects reachable from the tree roots and their sizes
    (``sys.getsizeof``, plus tensor storage), classes and modules excluded."""
    seen: set[int] = set()
    stack = list(roots)
    count = size = 0
    skip = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip) or obj is None:
            continue
        seen.add(id(obj))
        count += 1
        size += sys.getsizeof(obj)
        storage = getattr(obj, "untyped_storage", None)
        if storage is not None and callable(storage):
            size += storage().nbytes()
            continue
        stack.extend(gc.get_referents(obj))
    return count, size
