"""SGLang ``RadixCache`` replay: a comparison baseline for ``bench radix`` only.

SGLang is NOT a dependency of this project. It is imported lazily, and only
when a benchmark asks for the comparison, from a scratch virtualenv:

    python -m venv --system-site-packages /opt/sglang-venv
    /opt/sglang-venv/bin/pip install --no-deps sglang psutil pybase64 msgspec dill \\
        pyzmq apache-tvm-ffi triton compressed-tensors loguru gguf sentencepiece

``sglang.srt.mem_cache.radix_cache`` pulls in most of SGLang's serving stack at
import time; the packages above are the ones it needs (written against
sglang 0.5.23). torchvision is only used by SGLang's multimodal preprocessing,
so when it is missing it is stubbed for imports made from SGLang code alone.

The tree is built the way SGLang builds its simulated cache (no GPU, no KV
pools, page_size=1); a counting stand-in takes the allocator's place, since
``evict`` hands the freed indices to ``token_to_kv_pool_allocator.free_segment``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import time
import types
import warnings
from array import array

from lab.bench.common import rounded
from lab.bench.footprint import footprint, per_token

INSTALL_HINT = (
    "sglang is not installed: it is a comparison baseline only, never a project dependency. "
    "Install it in a scratch venv: python -m venv --system-site-packages /opt/sglang-venv && "
    "/opt/sglang-venv/bin/pip install --no-deps sglang psutil pybase64 msgspec dill pyzmq "
    "apache-tvm-ffi triton compressed-tensors loguru gguf sentencepiece; "
    "then run the benchmark with /opt/sglang-venv/bin/python"
)


class _AnyMeta(type):
    def __getattr__(cls, name):
        return cls


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _AnyMeta(name, (), {})


class _SglangOnlyStubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers imports of ``names`` with empty stubs, only when SGLang code imports them."""

    def __init__(self, names: set[str]):
        self.names = names

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] not in self.names:
            return None
        f = sys._getframe(1)
        while f is not None and f.f_globals.get("__name__", "").startswith(("importlib", __name__)):
            f = f.f_back
        if f is None or not f.f_globals.get("__name__", "").startswith("sglang"):
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def _import_sglang() -> types.SimpleNamespace:
    if importlib.util.find_spec("sglang") is None:
        raise RuntimeError(INSTALL_HINT)
    stubs = _SglangOnlyStubs({n for n in ("torchvision",) if importlib.util.find_spec(n) is None})
    sys.meta_path.append(stubs)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import sglang
            from sglang.srt.mem_cache import base_prefix_cache as bpc
            from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
    except ImportError as exc:
        raise RuntimeError(f"{INSTALL_HINT} (import failed: {exc})") from exc
    finally:
        sys.meta_path.remove(stubs)
        for name in [m for m in sys.modules if m.split(".")[0] in stubs.names]:
            if isinstance(sys.modules[name], _StubModule):
                del sys.modules[name]  # later availability probes see the truth
    return types.SimpleNamespace(version=sglang.__version__, RadixCache=RadixCache, RadixKey=RadixKey,
                                 MatchPrefixParams=bpc.MatchPrefixParams, InsertParams=bpc.InsertParams,
                                 EvictParams=bpc.EvictParams)


def check_sglang() -> str:
    """SGLang's version, or RuntimeError with the install recipe."""
    return _import_sglang().version


class _CountingAllocator:
    """Stand-in for SGLang's TokenToKVPoolAllocator: ``evict`` only frees index tensors."""

    device, freed = "cpu", 0

    def free_segment(self, indices, start_pos: int = 0) -> None:
        self.freed += len(indices)


def run_sglang_replay(sequences: list[list[int]], capacity_tokens: int) -> dict:
    """Replay ``sequences`` through SGLang's RadixCache: match, lock, evict, insert, unlock."""
    sg = _import_sglang()
    import torch

    alloc = _CountingAllocator()
    cache = sg.RadixCache.create_simulated(mock_allocator=alloc, page_size=1)
    total = sum(len(s) for s in sequences)
    hit = 0
    counter = 0
    start = time.perf_counter()
    for seq in sequences:
        key = sg.RadixKey(array("q", seq))  # what the scheduler builds from req.fill_ids
        m = cache.match_prefix(sg.MatchPrefixParams(key=key))
        node, matched = m.last_device_node, m.device_prefix_len
        hit += matched
        prefix = cache.path_device_indices(node)[:matched]
        cache.inc_lock_ref(node)
        new = len(seq) - matched
        over = cache.evictable_size() + cache.protected_size() + new - capacity_tokens
        if capacity_tokens > 0 and over > 0:
            cache.evict(sg.EvictParams(num_tokens=over))
        fresh = torch.arange(counter, counter + new, dtype=torch.int64)
        counter += new
        value = fresh if matched == 0 else torch.cat((prefix, fresh))
        cache.insert(sg.InsertParams(key=key, value=value))
        cache.dec_lock_ref(node)
    seconds = time.perf_counter() - start

    nodes, stack = 0, [cache.root_node]
    while stack:
        n = stack.pop()
        nodes += 1
        stack.extend(n.children.values())
    cached = cache.evictable_size() + cache.protected_size()
    objects, index_bytes = footprint([cache.root_node])
    return {"impl": "sglang", "version": sg.version, "records": len(sequences), "tokens": total,
            "seconds": rounded(seconds), "match_insert_per_s": rounded(len(sequences) / seconds, 1),
            "tokens_per_s": rounded(total / seconds, 1), "hit_rate": rounded(hit / total if total else 0.0),
            "nodes": nodes - 1, "evicted_tokens": alloc.freed, "cached_tokens": cached,
            **per_token(nodes - 1, objects, index_bytes, cached)}
