"""NixlEndpoint: real NIXL/UCX transfers between two processes, no mocks.

A second process (``spawn``, so it gets its own UCX context) owns a pool of
known random data and serves it; this process pulls blocks with
``read_blocks`` and checks the bytes. Layout/range/peer errors are checked
against endpoints in this process (no transfer is posted for them).
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import numpy as np
import pytest
import torch

from cluster.transfer.nixl_transport import (
    NixlEndpoint,
    TransferError,
    _runs,
    recommended_ucx_env,
)

# [num_blocks, num_layers, K/V, block_tokens, kv_heads, head_dim], block first.
NUM_BLOCKS = 64
BLOCK_SHAPE = (2, 2, 16, 2, 16)  # 4 KiB per block in float16
DTYPE = torch.float16
SEED = 1234


@pytest.fixture
def _require_nixl() -> None:
    # A fixture, not a module-level skipif: the spawned owner re-imports this
    # module and must not pay for (or depend on) the probe.
    from tests.requirements import require_nixl

    require_nixl()   # fails under CI, skips elsewhere


needs_nixl = pytest.mark.usefixtures("_require_nixl")


def _make_pool(seed: int, num_blocks: int = NUM_BLOCKS) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((num_blocks, *BLOCK_SHAPE), generator=gen).to(DTYPE)


def _serve_pool(conn: Any, name: str, seed: int, progress_delay_us: int | None) -> None:
    """Owner process: register a pool, publish metadata and its bytes, serve until told to stop."""
    import os

    for key, value in recommended_ucx_env().items():
        os.environ.setdefault(key, value)
    pool = _make_pool(seed)
    try:
        ep = NixlEndpoint(name, pool, progress_delay_us=progress_delay_us)
    except Exception as e:  # report instead of leaving the test waiting
        conn.send(("error", repr(e)))
        return
    with ep:
        conn.send((ep.metadata(), pool.view(torch.uint8).numpy().tobytes()))
        conn.poll(120)  # READs are one-sided: nothing to do here but stay alive


class _Owner:
    def __init__(self, name: str, seed: int, progress_delay_us: int | None = 100) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_serve_pool, args=(child, name, seed, progress_delay_us), daemon=True
        )
        self._proc.start()
        if not self._conn.poll(60):
            self.stop()
            raise RuntimeError("owner process did not publish its metadata")
        msg = self._conn.recv()
        if msg[0] == "error":
            self.stop()
            raise RuntimeError(f"owner process failed: {msg[1]}")
        self.metadata, raw = msg
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        self.pool = flat.view(DTYPE).view(NUM_BLOCKS, *BLOCK_SHAPE)  # what the owner registered

    def stop(self) -> None:
        try:
            self._conn.send("stop")
        except (BrokenPipeError, OSError):
            pass
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)


@needs_nixl
def test_read_blocks_copies_exact_bytes_across_processes() -> None:
    owner = _Owner("owner-a", SEED)
    try:
        got = torch.zeros((NUM_BLOCKS, *BLOCK_SHAPE), dtype=DTYPE)
        with NixlEndpoint("reader-b", got) as reader:
            _check_reads(owner, reader, got)
    finally:
        owner.stop()


def _check_reads(owner: _Owner, reader: NixlEndpoint, got: torch.Tensor) -> None:
    peer = reader.connect(owner.metadata)
    assert peer == "owner-a"
    assert reader.connect(owner.metadata) == peer  # idempotent
    assert reader.peers == [peer]

    # A contiguous run (one descriptor), singles, a reversed pair and both
    # pool edges, landing on different local ids.
    remote = [3, 4, 5, 6, 10, 0, 63, 20, 19, 40, 41]
    local = [40, 41, 42, 43, 7, 8, 0, 30, 31, 62, 63]
    moved = reader.read_blocks(peer, remote, local)
    assert moved == len(remote) * reader.block_bytes

    for r, l in zip(remote, local):
        assert torch.equal(got[l].view(torch.uint8), owner.pool[r].view(torch.uint8)), (r, l)
    untouched = sorted(set(range(NUM_BLOCKS)) - set(local))
    assert not got[untouched].view(torch.uint8).any(), "bytes written outside the requested blocks"

    # The same connection serves a second, whole-pool transfer.
    assert reader.read_blocks(peer, list(range(NUM_BLOCKS)), list(range(NUM_BLOCKS))) == got.nbytes
    assert torch.equal(got.view(torch.uint8), owner.pool.view(torch.uint8))
    assert reader.read_blocks(peer, [], []) == 0


@needs_nixl
def test_incompatible_layout_raises_value_error() -> None:
    with NixlEndpoint("wide", torch.zeros((8, 2, 2, 16, 2, 32), dtype=DTYPE)) as wide, \
         NixlEndpoint("bf16", torch.zeros((8, *BLOCK_SHAPE), dtype=torch.bfloat16)) as bf16, \
         NixlEndpoint("mine", torch.zeros((8, *BLOCK_SHAPE), dtype=DTYPE)) as mine:
        with pytest.raises(ValueError, match=r"block_bytes.*block_shape"):
            mine.connect(wide.metadata())
        with pytest.raises(ValueError, match=r"dtype: ours='torch.float16' peer='torch.bfloat16'"):
            mine.connect(bf16.metadata())
        with pytest.raises(ValueError, match="malformed"):
            mine.connect(b"not msgpack at all")
        assert mine.peers == []


@needs_nixl
def test_out_of_range_block_ids_raise_transfer_error() -> None:
    with NixlEndpoint("small", torch.zeros((4, *BLOCK_SHAPE), dtype=DTYPE)) as small, \
         NixlEndpoint("big", torch.zeros((16, *BLOCK_SHAPE), dtype=DTYPE)) as big:
        peer = big.connect(small.metadata())
        with pytest.raises(TransferError, match=r"remote block id 4 out of range \[0, 4\)"):
            big.read_blocks(peer, [0, 4], [0, 1])
        with pytest.raises(TransferError, match=r"local block id -1 out of range"):
            big.read_blocks(peer, [0], [-1])
        with pytest.raises(TransferError, match=r"local block id 16 out of range \[0, 16\)"):
            big.read_blocks(peer, [1], [16])
        with pytest.raises(ValueError, match="duplicates"):
            big.read_blocks(peer, [0, 1], [2, 2])
        with pytest.raises(ValueError, match="2 remote block ids but 1 local"):
            big.read_blocks(peer, [0, 1], [2])


@needs_nixl
def test_unknown_peer_and_closed_endpoint_raise_transfer_error() -> None:
    ep = NixlEndpoint("lonely", torch.zeros((4, *BLOCK_SHAPE), dtype=DTYPE))
    with pytest.raises(TransferError, match="unknown peer 'nobody'"):
        ep.read_blocks("nobody", [0], [0])
    ep.disconnect("nobody")  # no-op
    ep.close()
    ep.close()  # idempotent
    with pytest.raises(TransferError, match="closed"):
        ep.read_blocks("nobody", [0], [0])
    with pytest.raises(TransferError, match="closed"):
        ep.metadata()


@needs_nixl
def test_timeout_raises_and_endpoint_stays_usable() -> None:
    # An owner without a progress thread never answers the wireup, so the
    # READ cannot finish: it must time out, release its handle, and leave
    # the endpoint able to close cleanly.
    stuck = _Owner("owner-stuck", SEED + 1, progress_delay_us=None)
    try:
        with NixlEndpoint("reader-t", torch.zeros((NUM_BLOCKS, *BLOCK_SHAPE), dtype=DTYPE)) as ep:
            peer = ep.connect(stuck.metadata)
            with pytest.raises(TransferError, match="timed out"):
                ep.read_blocks(peer, [0, 1], [0, 1], timeout_s=1.0)
            ep.disconnect(peer)
            assert ep.peers == []
    finally:
        stuck.stop()


@needs_nixl
def test_rejects_pools_that_are_not_block_contiguous() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        NixlEndpoint("strided", torch.zeros((4, 8, 8)).transpose(1, 2))
    with pytest.raises(ValueError, match="num_blocks"):
        NixlEndpoint("empty", torch.zeros((0, 8)))


def test_runs_coalesce_only_when_both_sides_are_consecutive() -> None:
    remote = np.array([1, 2, 3, 7, 8, 5, 4])
    local = np.array([5, 6, 7, 9, 10, 11, 12])
    r_start, l_start, length = _runs(remote, local)
    assert list(zip(r_start, l_start, length)) == [(1, 5, 3), (7, 9, 2), (5, 11, 1), (4, 12, 1)]


@needs_nixl
def test_dead_peer_fails_fast_and_restarted_peer_reconnects() -> None:
    got = torch.zeros((NUM_BLOCKS, *BLOCK_SHAPE), dtype=DTYPE)
    with NixlEndpoint("reader-r", got) as reader:
        first = _Owner("owner-r", SEED)
        try:
            peer = reader.connect(first.metadata)
            reader.read_blocks(peer, [1], [1])
        finally:
            first.stop()
        # UCX peer-failure handling (needs tcp in UCX_TLS) reports the dead
        # peer at once instead of letting the READ run into its timeout.
        with pytest.raises(TransferError, match="DISCONNECT"):
            reader.read_blocks(peer, [2], [2], timeout_s=5.0)
        second = _Owner("owner-r", SEED + 7)  # same name, new agent and pool
        try:
            assert reader.connect(second.metadata) == peer
            assert reader.peers == [peer]
            reader.read_blocks(peer, [5, 6], [5, 6])
            assert torch.equal(got[5:7].view(torch.uint8), second.pool[5:7].view(torch.uint8))
        finally:
            second.stop()


EXIT_CHILD = """
import torch
from cluster.transfer.nixl_transport import NixlEndpoint, nixl_available
assert nixl_available()
with NixlEndpoint("exit-check", torch.zeros((4, 2, 2, 16, 2, 16), dtype=torch.float16)) as ep:
    print(ep.num_blocks, flush=True)
"""


@needs_nixl
def test_a_process_that_used_nixl_exits_cleanly() -> None:
    """Where rdma-core is installed system-wide, UCX's InfiniBand modules load a second
    libnl whose destructor crashed every NIXL process at exit (SIGSEGV, exit 139)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}
    done = subprocess.run([sys.executable, "-c", EXIT_CHILD], env=env, capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode, done.stdout.splitlines()[-1:]) == (0, ["4"]), done.stderr[-2000:]
