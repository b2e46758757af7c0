"""``prefix-cache bench transfer``: moving KV blocks between Ray nodes, NIXL vs object store.

Starts a loopback Ray cluster of two nodes (or joins ``--address``), puts one
``TransferPeer`` actor on each, each owning a preallocated block-first pool,
and moves 64 KiB .. 256 MiB from one to the other:

- ``nixl``: the receiver issues one NIXL READ (UCX backend) into its pool;
- ``object_store``: the sender returns the blocks from a Ray call, the
  receiver gets them through the object store and copies them into its pool;
- ``plain_copy``: an in-process ``copy_`` of the same bytes (the ceiling).

Every transfer is verified (checksum of the received bytes equals the
sender's). UCX runs with ``UCX_TLS=sm,self`` on one machine (measured best,
see cluster/transfer/nixl_transport.py) unless the environment sets it.
"""

from __future__ import annotations

import argparse
import os
import time

from cluster.bench.common import emit, rounded

BLOCK_BYTES = 64 * 1024


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=None, help="existing Ray cluster (default: start two loopback nodes)")
    p.add_argument("--min-bytes", type=int, default=64 * 1024)
    p.add_argument("--max-bytes", type=int, default=256 * 1024 * 1024)
    p.add_argument("--repeats", type=int, default=3, help="best of N per size and transport")


def _peer_class():
    import ray
    import torch
    import xxhash

    @ray.remote(num_cpus=1)
    class TransferPeer:
        def __init__(self, num_blocks: int):
            from cluster.transfer.nixl_transport import NixlEndpoint, nixl_available, recommended_ucx_env

            self.pool = torch.zeros(num_blocks, BLOCK_BYTES, dtype=torch.uint8)
            self.nixl = None
            if nixl_available():
                self.nixl = NixlEndpoint(f"peer-{os.getpid()}", self.pool, ucx_env=recommended_ucx_env())
            self.peer = None

        def node_id(self) -> str:
            return ray.get_runtime_context().get_node_id()

        def fill(self, seed: int) -> None:
            g = torch.Generator().manual_seed(seed)
            self.pool.copy_(torch.randint(0, 256, self.pool.shape, generator=g, dtype=torch.uint8))

        def metadata(self):
            return self.nixl.metadata() if self.nixl else None

        def connect(self, md) -> None:
            self.peer = self.nixl.connect(md)

        def checksum(self, nblocks: int) -> int:
            return xxhash.xxh3_64_intdigest(self.pool[:nblocks].numpy().tobytes())

        def blocks(self, nblocks: int):
            # numpy, not torch: Ray ships numpy zero-copy through plasma, while a
            # torch tensor takes a slow pickling path (~0.2 s each, measured).
            return self.pool[:nblocks].numpy()

        def pull_nixl(self, nblocks: int) -> float:
            self.pool[:nblocks].zero_()
            ids = list(range(nblocks))
            t0 = time.perf_counter()
            self.nixl.read_blocks(self.peer, ids, ids)
            return time.perf_counter() - t0

        def pull_object_store(self, sender, nblocks: int) -> float:
            self.pool[:nblocks].zero_()
            t0 = time.perf_counter()
            data = ray.get(sender.blocks.remote(nblocks))
            self.pool[:nblocks].copy_(torch.from_numpy(data))
            return time.perf_counter() - t0

        def plain_copy(self, nblocks: int) -> float:
            src = self.pool[:nblocks].clone()
            dst = self.pool[:nblocks]   # resident pool memory, as a transfer's destination is
            t0 = time.perf_counter()
            dst.copy_(src)
            return time.perf_counter() - t0

    return TransferPeer


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    cluster = None
    if args.address:
        ray.init(address=args.address, log_to_driver=False)
    else:
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 2, "resources": {"xfer_a": 1}, "include_dashboard": False})
        cluster.add_node(num_cpus=2, resources={"xfer_b": 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
    try:
        nblocks = args.max_bytes // BLOCK_BYTES
        Peer = _peer_class()
        a = Peer.options(resources={"xfer_a": 0.01} if cluster else {}).remote(nblocks)
        b = Peer.options(resources={"xfer_b": 0.01} if cluster else {}).remote(nblocks)
        nodes = ray.get([a.node_id.remote(), b.node_id.remote()])
        ray.get(a.fill.remote(1))
        md = ray.get(a.metadata.remote())
        if md is not None:
            ray.get(b.connect.remote(md))
        size = args.min_bytes
        while size <= args.max_bytes:
            n = max(1, size // BLOCK_BYTES)
            want = ray.get(a.checksum.remote(n))
            results = {}
            for transport in ("nixl", "object_store", "plain_copy"):
                if transport == "nixl" and md is None:
                    continue
                best = float("inf")
                for _ in range(args.repeats):
                    if transport == "nixl":
                        secs = ray.get(b.pull_nixl.remote(n))
                    elif transport == "object_store":
                        secs = ray.get(b.pull_object_store.remote(a, n))
                    else:
                        secs = ray.get(b.plain_copy.remote(n))
                    if transport != "plain_copy" and ray.get(b.checksum.remote(n)) != want:
                        raise RuntimeError(f"{transport} delivered corrupt bytes at {size} bytes")
                    best = min(best, secs)
                results[transport] = best
            for transport, secs in results.items():
                emit({"bench": "transfer", "transport": transport, "bytes": n * BLOCK_BYTES,
                      "gb_per_s": rounded(n * BLOCK_BYTES / secs / 1e9, 3), "seconds": rounded(secs, 6),
                      "cross_node": nodes[0] != nodes[1], "ucx_tls": os.environ.get("UCX_TLS", "sm,self")})
            size *= 4
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
    return 0
