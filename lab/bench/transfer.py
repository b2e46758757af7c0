"""``prefix-cache bench transfer``: moving KV blocks between Ray nodes, NIXL vs object store.

Starts a loopback Ray cluster of two nodes (or joins ``--address``), puts one
``TransferPeer`` actor on each, each owning a preallocated block-first pool,
and moves 64 KiB .. 256 MiB from one to the other:

- ``nixl``: the receiver issues one NIXL READ (UCX backend) into its pool
  (``staging_rpc: false``: the bytes are already in the sender's registered
  memory, the best case);
- ``nixl_staged``: what every real pull does (``WorkerCore.migrate_from``):
  one Ray call asks the sender to stage the blocks (copy them into whole
  registered host blocks and checksum each), then one READ, then the receiver
  verifies every block's checksum (``staging_rpc: true``);
- ``peer``: the cache workers' fallback when NIXL fails (``actors.peer``,
  what ``CacheWorker`` serves and pulls through): one ``fetch_blocks`` call on
  the sender's peer channel stages the blocks and sends them in one msgpack
  frame over TCP, the receiver copies them into its pool;
- ``object_store``: the sender returns the blocks from a Ray call, the
  receiver gets them through the object store and copies them into its pool
  (for reference: no worker moves KV this way any more);
- ``plain_copy``: an in-process ``copy_`` of the same bytes (the ceiling).

Every transfer is verified (checksum of the received bytes equals the
sender's). UCX settings are the workers' own (``recommended_ucx_env`` unless
the environment sets them); ``ucx_tls`` is what the receiving worker had, and
``ucx_transports`` is what UCX actually chose for the READ, read from its
protocol selection report (``UCX_PROTO_INFO=y``) in the receiving worker.

This benchmark needs Ray, so it lives beside the actors; the pure benchmarks
are in ``lab/bench``.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import re
import tempfile
import time
import warnings

from lab.bench.common import emit, rounded

BLOCK_BYTES = 64 * 1024


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=None, help="existing Ray cluster (default: start two loopback nodes)")
    p.add_argument("--min-bytes", type=int, default=64 * 1024)
    p.add_argument("--max-bytes", type=int, default=256 * 1024 * 1024)
    p.add_argument("--repeats", type=int, default=3, help="best of N per size and transport")


def _peer_class():
    import ray

    return ray.remote(num_cpus=1)(TransferPeer)


class TransferPeer:
    """One node's side: a block-first pool (its second half the staging area) and the ways to fill it."""

    def __init__(self, num_blocks: int):
        import torch

        from cluster.transfer.nixl_transport import NixlEndpoint, nixl_available, recommended_ucx_env

        # The second half of the pool is the staging area a real holder copies into.
        self.num_blocks = num_blocks
        self.pool = torch.zeros(2 * num_blocks, BLOCK_BYTES, dtype=torch.uint8)
        self.nixl = None
        self.transports: list[str] | None = None
        os.environ["UCX_PROTO_INFO"] = "y"  # UCX reports the protocols it selects (stdout)
        if nixl_available():
            self.nixl = NixlEndpoint(f"peer-{os.getpid()}", self.pool, ucx_env=recommended_ucx_env())
        self.peer = None

    def ucx_tls(self) -> str:
        return os.environ.get("UCX_TLS", "(UCX default)")

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def fill(self, seed: int) -> None:
        import torch

        g = torch.Generator().manual_seed(seed)
        self.pool.copy_(torch.randint(0, 256, self.pool.shape, generator=g, dtype=torch.uint8))

    def metadata(self):
        return self.nixl.metadata() if self.nixl else None

    def connect(self, md) -> None:
        self.peer = self.nixl.connect(md)

    def checksum(self, nblocks: int) -> int:
        import xxhash

        return xxhash.xxh3_64_intdigest(self.pool[:nblocks].numpy().tobytes())

    def blocks(self, nblocks: int):
        # numpy, not torch: Ray ships numpy zero-copy through plasma, while a
        # torch tensor takes a slow pickling path.
        return self.pool[:nblocks].numpy()

    def pull_nixl(self, nblocks: int) -> float:
        self.pool[:nblocks].zero_()
        ids = list(range(nblocks))
        if self.transports is None:  # the first READ selects the protocol: capture the report
            self.transports, secs = _capture_read_transports(lambda: self.nixl.read_blocks(self.peer, ids, ids))
            return secs
        t0 = time.perf_counter()
        self.nixl.read_blocks(self.peer, ids, ids)
        return time.perf_counter() - t0

    def read_transports(self) -> list[str] | None:
        return self.transports

    def stage(self, nblocks: int) -> list[int]:
        """The holder's side of a real pull: blocks into registered staging, checksummed."""
        import xxhash

        staged = self.pool[self.num_blocks:self.num_blocks + nblocks]
        staged.copy_(self.pool[:nblocks])
        return [xxhash.xxh3_64_intdigest(row.numpy()) for row in staged]

    def pull_nixl_staged(self, sender, nblocks: int) -> float:
        import ray
        import xxhash

        self.pool[:nblocks].zero_()
        local = list(range(nblocks))
        remote = [self.num_blocks + i for i in local]
        t0 = time.perf_counter()
        sums = ray.get(sender.stage.remote(nblocks))
        self.nixl.read_blocks(self.peer, remote, local)
        for i, row in enumerate(self.pool[:nblocks]):
            if xxhash.xxh3_64_intdigest(row.numpy()) != sums[i]:
                raise RuntimeError(f"staged block {i} failed its checksum")
        return time.perf_counter() - t0

    def serve_peer(self) -> str:
        """Open this sender's peer channel; its address."""
        import ray

        from actors.peer import PeerServer

        self.peer_server = PeerServer(f"xfer-{os.getpid()}", _StagedBlocks(self), host=ray.util.get_node_ip_address())
        return self.peer_server.address

    def pull_peer(self, address: str, nblocks: int) -> float:
        import torch

        from actors.peer import PeerClient

        self.pool[:nblocks].zero_()

        async def fetch():
            client = PeerClient("sender", address, timeout_s=120.0)
            try:
                return await client.fetch_blocks(f"blocks:{nblocks}")
            finally:
                client.close()
        t0 = time.perf_counter()
        array, _ = asyncio.run(fetch())
        with warnings.catch_warnings():   # a read-only view of the frame: only read from
            warnings.simplefilter("ignore", UserWarning)
            self.pool[:nblocks].copy_(torch.from_numpy(array).view(nblocks, BLOCK_BYTES))
        return time.perf_counter() - t0

    def pull_object_store(self, sender, nblocks: int) -> float:
        import ray
        import torch

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


class _StagedBlocks:
    """The sender's side of the ``peer`` arm: a peer service that answers
    ``fetch_blocks`` as a holder does (the blocks copied into its staging
    half first); the lease names the block count."""

    def __init__(self, peer: TransferPeer):
        self.peer = peer

    async def fetch_blocks(self, lease: str):
        n = int(lease.split(":", 1)[1])
        staged = self.peer.pool[self.peer.num_blocks:self.peer.num_blocks + n]
        staged.copy_(self.peer.pool[:n])
        return staged.numpy(), "uint8"


def _capture_read_transports(read) -> tuple[list[str], float]:
    """Run ``read`` with fd 1 redirected; returns the UCX transports of the
    remote-read protocol UCX reported selecting (e.g. ``cma/memory``) and the
    read's seconds."""
    libc = ctypes.CDLL(None)
    with tempfile.TemporaryFile(mode="w+") as out:
        libc.fflush(None)
        saved = os.dup(1)
        os.dup2(out.fileno(), 1)
        try:
            t0 = time.perf_counter()
            read()
            secs = time.perf_counter() - t0
            libc.fflush(None)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        out.seek(0)
        return parse_read_transports(out.read()), secs


def parse_read_transports(report: str) -> list[str]:
    """Config cells of the "remote memory read" tables of a UCX_PROTO_INFO report."""
    found: list[str] = []
    borders = -1  # -1: outside a read table
    for line in report.splitlines():
        if "remote memory read" in line:
            borders = 0
            continue
        if borders < 0:
            continue
        body = line.split("]", 2)[-1].strip()
        if body.startswith("+"):
            borders += 1
            if borders == 3:
                borders = -1
            continue
        cells = [c.strip() for c in body.strip("|").split("|")]
        if borders == 2 and len(cells) >= 3:
            for cfg in re.split(r"[,\s]+", cells[-1]):
                if cfg and cfg not in found:
                    found.append(cfg)
    return found


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    cluster = None
    if args.address:
        from actors.connect import connect

        connect(args.address, log_to_driver=False)
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
        ucx_tls = ray.get(b.ucx_tls.remote())
        if md is not None:
            ray.get(b.connect.remote(md))
        address = ray.get(a.serve_peer.remote())
        size = args.min_bytes
        while size <= args.max_bytes:
            n = max(1, size // BLOCK_BYTES)
            want = ray.get(a.checksum.remote(n))
            results = {}
            for transport in ("nixl", "nixl_staged", "peer", "object_store", "plain_copy"):
                if transport.startswith("nixl") and md is None:
                    continue
                best = float("inf")
                for _ in range(args.repeats):
                    if transport == "nixl":
                        secs = ray.get(b.pull_nixl.remote(n))
                    elif transport == "nixl_staged":
                        secs = ray.get(b.pull_nixl_staged.remote(a, n))
                    elif transport == "peer":
                        secs = ray.get(b.pull_peer.remote(address, n))
                    elif transport == "object_store":
                        secs = ray.get(b.pull_object_store.remote(a, n))
                    else:
                        secs = ray.get(b.plain_copy.remote(n))
                    if transport != "plain_copy" and ray.get(b.checksum.remote(n)) != want:
                        raise RuntimeError(f"{transport} delivered corrupt bytes at {size} bytes")
                    best = min(best, secs)
                results[transport] = best
            transports = ray.get(b.read_transports.remote())
            for transport, secs in results.items():
                row = {"bench": "transfer", "transport": transport, "bytes": n * BLOCK_BYTES,
                       "gb_per_s": rounded(n * BLOCK_BYTES / secs / 1e9, 3), "seconds": rounded(secs, 6),
                       "cross_node": nodes[0] != nodes[1], "staging_rpc": transport in ("nixl_staged", "peer", "object_store")}
                if transport.startswith("nixl"):
                    row.update(ucx_tls=ucx_tls, ucx_transports=transports)
                emit(row)
            size *= 4
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
    return 0
