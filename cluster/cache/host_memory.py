"""Host memory for the CPU KV pools: zero from the start, its pages mapped later.

A pool of several GiB written with zeros at start-up costs seconds (the kernel maps and
zeroes every page on the first write), and a replica is not serving until it ends. Pages of
an anonymous mapping are zero by the operating system's guarantee, so a pool built on one
needs no write to be correct. What the zeroing also did, mapping the pages so the first
copies into the pool pay no page faults in the middle of serving, ``populate`` does without
writing: ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14) maps the pages and leaves their
contents alone, so it may run on a thread beside an engine already writing to the pool.
Where the kernel does not have it, pages are mapped by their first write instead.
"""

from __future__ import annotations

import mmap
import time

import torch

# Linux's value (include/uapi/asm-generic/mman-common.h); Python's mmap module names it from 3.13.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
# One madvise call at a time, so a populate can stop or pause between chunks (a closing
# worker, an engine with work): a call maps at most 16 MiB, so a pause waits for one call at most.
POPULATE_CHUNK_BYTES = 16 << 20
POPULATE_PAUSE_S = 0.05   # while paused, how often a populate looks again


def zeroed_host_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, mmap.mmap | None]:
    """A CPU tensor of ``shape``, all zeros, on an anonymous mapping whose pages the OS maps
    on first touch; and the mapping (``populate`` maps it ahead). An empty shape's tensor
    has no mapping."""
    nbytes = dtype.itemsize
    for n in shape:
        nbytes *= n
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype), None
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # frombuffer keeps a reference to the mapping: it is unmapped with the tensor's storage.
    return torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).view(shape), mapping


def populate(mapping: mmap.mmap, stop=lambda: False, pause=lambda: False) -> dict:
    """Map every page of ``mapping`` writable without changing what it holds (safe beside
    writers), ``POPULATE_CHUNK_BYTES`` a call, until done or ``stop()``; while ``pause()``
    it waits between calls. Returns ``{"bytes", "seconds", "supported"}``: ``supported`` False
    where the kernel has no MADV_POPULATE_WRITE (nothing was mapped: the pages fault in on
    first write)."""
    began, done, size = time.perf_counter(), 0, len(mapping)
    while done < size and not stop():
        if pause():
            time.sleep(POPULATE_PAUSE_S)
            continue
        length = min(POPULATE_CHUNK_BYTES, size - done)
        try:
            mapping.madvise(MADV_POPULATE_WRITE, done, length)
        except OSError:   # EINVAL: a kernel before 5.14 (or ENOMEM: no memory to map now)
            return {"bytes": done, "seconds": round(time.perf_counter() - began, 3), "supported": False}
        except ValueError:   # the mapping was closed (its pool is gone)
            break
        done += length
    return {"bytes": done, "seconds": round(time.perf_counter() - began, 3), "supported": True}
