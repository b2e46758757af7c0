"""``prefix-cache bench tiers``: tier-move bandwidth and forward-pass stall.

Bandwidth, per direction, through the real tiered cache (tree bookkeeping,
copy engine, disk checksums), against a plain copy of the same bytes between
the same pools in the same run (disk: a plain write of the same bytes to a
file in the same directory, and a plain read of it into a buffer allocated
before the clock starts). Before each disk read, of either arm, the page
cache is dropped (``/proc/sys/vm/drop_caches``, else ``posix_fadvise``
DONTNEED on both files); the disk rows say which worked in ``page_cache``,
or that nothing did, in which case the reads may have come from memory.
Writes are not fsynced in either arm (the tier does not fsync). Every
timed demotion copies: the WARM copies that promoted nodes keep (inclusive
tiers) are dropped first. Stall: a loop of matmuls on the cache's device (on
the CPU, one thread), timed idle and while demotions of ``--gib`` run beside it.

The KV layout defaults to a Llama-3-8B-like one (32 layers, 8 KV heads,
head_dim 128, fp16): one 16-token block is 2 MiB, as in production.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from cluster.cache.kv_pool import KVLayout
from cluster.cache.tiered import TierConfig, TieredCache
from lab.bench.common import emit, rounded


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gib", type=float, default=1.0, help="bytes moved per direction, GiB (default 1)")
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--repeats", type=int, default=3, help="round trips per memory direction; the best is reported")
    p.add_argument("--disk-dir", default=None, help="directory for the disk tier (default: a temp dir)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--stall-steps", type=int, default=60, help="compute steps per stall measurement")
    p.add_argument("--paced-gb-per-s", type=float, default=1.0,
                   help="also measure the stall with host copies paced to this rate (CPU only; 0: skip)")


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fill(cache: TieredCache, nblocks: int, bt: int) -> list:
    """Insert ``nblocks`` full-block nodes of random KV; returns the nodes."""
    nodes = []
    g = torch.Generator(device="cpu").manual_seed(0)
    for i in range(nblocks):
        toks = [i % 50_000, i // 50_000] + [7] * (bt - 2)
        lease = cache.admit(toks, compute_last=False)
        block = torch.randn(cache.hot.tensor.shape[1:], generator=g).to(cache.hot.tensor.dtype)
        lease.append(block)   # one whole block: [layers, 2, bt, heads, dim]
        nodes.append(lease.commit(toks))
    return nodes


def _timed(cache: TieredCache, start_move, nodes: list) -> float:
    """Run one batched move of ``nodes`` to completion; returns its seconds."""
    t0 = time.perf_counter()
    start_move(nodes)
    cache.wait_all()
    _sync(cache.device)
    return time.perf_counter() - t0


def _drop_lower_copies(cache: TieredCache, nodes: list) -> None:
    """A node promoted from WARM keeps its WARM copy (inclusive tiers) and would go down
    again at no copy: drop those copies, so that a demotion copies every byte."""
    for n in nodes:
        cache.tree.drop_lower(n)


def _move_all(cache: TieredCache, nodes: list) -> float:
    """Demote every node one tier down (all in flight at once), copying every byte."""
    _drop_lower_copies(cache, nodes)
    return _timed(cache, cache.moves.start_demotion, nodes)


def _promote_all(cache: TieredCache, nodes: list) -> float:
    return _timed(cache, cache.moves.start_promotion, nodes)


def bandwidth(args: argparse.Namespace, disk_dir: str) -> None:
    layout = KVLayout(args.layers, args.kv_heads, args.head_dim, args.dtype)
    block_bytes = layout.bytes_per_token() * args.block_tokens
    nblocks = max(1, int(args.gib * 2**30) // block_bytes)
    cfg = TierConfig(hot_blocks=nblocks, warm_blocks=nblocks, cold_blocks=nblocks, block_tokens=args.block_tokens,
                     disk_dir=disk_dir, device=args.device, high_watermark=1.0, low_watermark=0.99)
    cache = TieredCache(cfg, layout)
    hot, warm, cold = cache.pools
    nbytes = nblocks * block_bytes
    nodes = _fill(cache, nblocks, args.block_tokens)
    _sync(cache.device)

    def plain(dst, src) -> float:
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        _sync(cache.device)
        return time.perf_counter() - t0

    # Memory tiers: best of --repeats round trips, each side (short copies are noisy).
    t_d2h = t_h2d = p_d2h = p_h2d = float("inf")
    for _ in range(args.repeats):
        t_d2h = min(t_d2h, _move_all(cache, nodes))
        t_h2d = min(t_h2d, _promote_all(cache, nodes))
        p_d2h = min(p_d2h, plain(warm.tensor, hot.tensor))
        p_h2d = min(p_h2d, plain(hot.tensor, warm.tensor))
    _move_all(cache, nodes)                     # HOT -> WARM
    t_h2c = _move_all(cache, nodes)             # WARM -> COLD
    path = os.path.join(disk_dir, "plain-copy.bin")
    data = warm.tensor.numpy() if warm.tensor.dtype != torch.bfloat16 else warm.tensor.view(torch.int16).numpy()
    t0 = time.perf_counter()
    with open(path, "wb") as fh:
        fh.write(memoryview(data).cast("B"))
    p_h2c = time.perf_counter() - t0
    # Disk reads: the page cache is dropped before each arm, so neither reads from memory.
    files = [path, str(cold.path)]
    drop_ours = drop_page_cache(files)
    t_c2h = _promote_all(cache, nodes)          # COLD -> HOT (through host on CUDA)
    buf = bytearray(nbytes)                     # the plain read's destination exists before the clock starts
    memoryview(buf)[::4096] = bytes(len(range(0, nbytes, 4096)))  # and its pages are mapped
    drop_plain = drop_page_cache(files)
    t0 = time.perf_counter()
    read_exactly(path, buf)
    p_c2h = time.perf_counter() - t0
    page_cache = drop_ours if drop_ours == drop_plain else f"ours: {drop_ours}; plain: {drop_plain}"
    for direction, ours, base in (("d2h", t_d2h, p_d2h), ("h2d", t_h2d, p_h2d),
                                  ("host_to_disk", t_h2c, p_h2c), ("disk_to_host", t_c2h, p_c2h)):
        gb, pgb = _gbps(nbytes, ours), _gbps(nbytes, base)
        row = {"bench": "tiers", "direction": direction, "bytes": nbytes, "gb_per_s": rounded(gb, 3),
               "plain_gb_per_s": rounded(pgb, 3), "ratio": rounded(gb / pgb if pgb else 0.0, 3),
               "blocks": nblocks, "block_bytes": block_bytes, "device": str(cache.device)}
        if direction == "disk_to_host":
            row.update(page_cache=page_cache, plain_read="preallocated buffer, readinto")
        elif direction == "host_to_disk":
            row.update(fsync=False)
        emit(row)
    os.unlink(path)
    cache.close()


def drop_page_cache(paths: list[str]) -> str:
    """Evict ``paths`` from the page cache; returns how, or why it could not."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("1\n")
        return "dropped (drop_caches)"
    except OSError as exc:
        why = f"drop_caches: {exc.strerror}"
    if not hasattr(os, "posix_fadvise"):
        return f"not dropped ({why}; no posix_fadvise): reads may come from memory"
    try:
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages cannot be evicted
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "dropped (fadvise DONTNEED)"
    except OSError as exc:
        return f"not dropped ({why}; fadvise: {exc.strerror}): reads may come from memory"


def read_exactly(path: str, buf: bytearray) -> None:
    """Read the file's first ``len(buf)`` bytes into ``buf`` (no intermediate copy)."""
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        got = 0
        while got < len(buf):
            n = fh.readinto(view[got:])
            if not n:
                raise OSError(f"{path}: short read ({got} of {len(buf)} bytes)")
            got += n


def _compute_steps(n: int, device: torch.device, size: int | None = None) -> list[float]:
    """``n`` timed steps of matmuls on ``device`` (the forward pass's stand-in:
    on CUDA the device computes while the copy engines move KV beside it)."""
    size = size or (2048 if device.type == "cuda" else 384)
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    times = []
    for _ in range(n):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(8):
            a = torch.tanh(a @ b * 0.01)
        _sync(device)   # the step's own end (the cache never synchronizes the device)
        times.append(time.perf_counter() - t0)
    return times


def stall(args: argparse.Namespace, disk_dir: str, paced_gb_per_s: float | None = None) -> None:
    layout = KVLayout(args.layers, args.kv_heads, args.head_dim, args.dtype)
    block_bytes = layout.bytes_per_token() * args.block_tokens
    nblocks = max(1, int(args.gib * 2**30) // block_bytes)
    cfg = TierConfig(hot_blocks=nblocks, warm_blocks=nblocks, block_tokens=args.block_tokens, device=args.device,
                     high_watermark=1.0, low_watermark=0.99, copy_gb_per_s=paced_gb_per_s)
    cache = TieredCache(cfg, layout)
    nodes = _fill(cache, nblocks, args.block_tokens)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the compute loop owns one core; copies run beside it
    moved = 0
    try:
        _compute_steps(5, cache.device)
        idle = sorted(_compute_steps(args.stall_steps, cache.device))
        busy: list[float] = []
        while len(busy) < args.stall_steps:
            # Demote the whole GiB in the background and keep computing until it lands.
            _drop_lower_copies(cache, nodes)
            cache.moves.start_demotion(nodes)
            while cache.in_flight() and len(busy) < 10 * args.stall_steps:
                busy.extend(_compute_steps(1, cache.device))
                cache.poll()
            cache.wait_all()
            moved += nblocks * block_bytes
            _promote_all(cache, nodes)   # back to HOT, untimed, for the next round
        busy.sort()
    finally:
        torch.set_num_threads(threads)
    mid = len(idle) // 2
    step_idle, step_busy = idle[mid] * 1e3, busy[mid] * 1e3
    emit({"bench": "tiers", "step_ms_idle": rounded(step_idle, 3), "step_ms_offload": rounded(step_busy, 3),
          "stall_pct": rounded(100 * (step_busy - step_idle) / step_idle, 2),
          "copy_pacing_gb_per_s": paced_gb_per_s, "offload_bytes_during_loop": moved,
          "steps_measured": len(busy), "device": str(cache.device)})
    cache.close()


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(dir=args.disk_dir) as tmp:
        bandwidth(args, tmp)
        stall(args, tmp)
        if args.paced_gb_per_s and torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                                                 else args.device if args.device != "auto" else "cpu").type == "cpu":
            stall(args, tmp, args.paced_gb_per_s)
    return 0
