"""A NIXL transfer between two processes' KV pools in device memory: the `nixl-device` step of
scripts/gpu-check.sh (``--device cpu`` runs the same between host pools, anywhere NIXL runs).

An owner process registers a pool of seeded blocks with NIXL (``NixlEndpoint``, what a
replica registers) and publishes its metadata; this process registers a pool of zeros on the
same device, connects, reads a mix of runs and single blocks and then the whole pool, and
compares every byte with the owner's. One JSON row: the memory type NIXL registered on each
side, the bytes read, GB/s of the whole-pool read, whether every byte matched, ``failed``.
UCX gets ``cuda_copy`` and ``cuda_ipc`` for device pools unless ``UCX_TLS`` is set.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

BLOCK_SHAPE = (30, 2, 16, 3, 64)   # one block of SmolLM2-135M: 30 layers, K/V, 16 tokens, 3 heads x 64
DTYPE_NAME = "bfloat16"


def _ucx_env(device: str) -> dict[str, str]:
    from cluster.transfer.nixl_transport import recommended_ucx_env

    env = dict(recommended_ucx_env())
    if device.startswith("cuda") and "UCX_TLS" not in os.environ:
        env["UCX_TLS"] = "tcp,sm,self,cuda_copy,cuda_ipc"
    return env


def _pool(device: str, blocks: int, seed: int | None):
    import torch

    if seed is None:
        return torch.zeros((blocks, *BLOCK_SHAPE), dtype=getattr(torch, DTYPE_NAME), device=device)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((blocks, *BLOCK_SHAPE), generator=gen).to(getattr(torch, DTYPE_NAME)).to(device)


def _owner(conn, device: str, blocks: int, seed: int) -> None:
    for key, value in _ucx_env(device).items():
        os.environ.setdefault(key, value)
    from cluster.transfer.nixl_transport import NixlEndpoint

    pool = _pool(device, blocks, seed)
    try:
        endpoint = NixlEndpoint("gpu-check-owner", pool)
    except Exception as exc:   # report instead of leaving the reader waiting
        conn.send(("error", repr(exc)))
        return
    with endpoint:
        conn.send(("ok", endpoint.metadata(), endpoint._layout.mem_type))
        conn.poll(300)   # READs are one-sided: stay alive until told to stop


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda | cpu (default cuda)")
    p.add_argument("--blocks", type=int, default=512, help="blocks in each pool (default 512: 360 MiB in bfloat16)")
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args(argv)
    for key, value in _ucx_env(args.device).items():
        os.environ.setdefault(key, value)
    import torch

    from cluster.transfer.nixl_transport import NixlEndpoint, nixl_available

    row: dict = {"device": args.device, "blocks": args.blocks, "ucx_tls": os.environ.get("UCX_TLS")}
    failed: list[str] = []
    if not nixl_available():
        row["failed"] = ["nixl is not importable or cannot create a UCX backend here"]
        print(json.dumps(row), flush=True)
        return 1
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_owner, args=(child, args.device, args.blocks, args.seed), daemon=True)
    proc.start()
    try:
        if not conn.poll(120):
            raise RuntimeError("the owner process did not publish its metadata within 120 s")
        msg = conn.recv()
        if msg[0] == "error":
            raise RuntimeError(f"the owner could not register its pool: {msg[1]}")
        _, metadata, row["owner_mem"] = msg
        got = _pool(args.device, args.blocks, None)
        want = _pool("cpu", args.blocks, args.seed)   # the owner's bytes, drawn the same way
        with NixlEndpoint("gpu-check-reader", got) as reader:
            row["reader_mem"] = reader._layout.mem_type
            peer = reader.connect(metadata)
            remote = [3, 4, 5, 6, 10, 0, args.blocks - 1, 20, 19]
            local = [40, 41, 42, 43, 7, 8, 0, 30, 31]
            reader.read_blocks(peer, remote, local)
            mixed = all(torch.equal(got[l].cpu().view(torch.uint8), want[r].view(torch.uint8))
                        for r, l in zip(remote, local))
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            began = time.perf_counter()
            moved = reader.read_blocks(peer, list(range(args.blocks)), list(range(args.blocks)))
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            seconds = time.perf_counter() - began
            whole = torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))
        row.update(bytes=moved, gb_per_s=round(moved / seconds / 1e9, 3), exact=bool(mixed and whole))
        if not row["exact"]:
            failed.append("the bytes read differ from the owner's")
        if args.device.startswith("cuda") and (row.get("owner_mem"), row.get("reader_mem")) != ("VRAM", "VRAM"):
            failed.append(f"not device memory on both sides: {row.get('owner_mem')} -> {row.get('reader_mem')}")
    except Exception as exc:
        failed.append(f"{type(exc).__name__}: {exc}")
    finally:
        try:
            conn.send("stop")
        except (BrokenPipeError, OSError):
            pass
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    row["failed"] = failed
    print(json.dumps(row), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
