"""L3 block store on Mooncake Store: the value format (no Mooncake needed) and
the client against a real ``mooncake_master`` plus pool holder on loopback."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from cluster.cache.kv_pool import KVLayout
from cluster.cache.l3 import (GetStatus, L3Block, L3Config, L3Lookup, MooncakeL3Store, PutStatus, decode_block,
                              encode_block, kv_layout_version, l3_key)
from cluster.cache.l3.master import L3Master, L3MasterConfig, L3MasterError, find_mooncake_binary
from cluster.errors import InvalidInputError
from cluster.hashing import block_hashes
from tests.requirements import require_mooncake

REPO = Path(__file__).resolve().parents[2]
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16")
BLOCK_TOKENS = 4
VERSION = kv_layout_version(LAYOUT, BLOCK_TOKENS)
CLIENT_TTL_S = 2

@pytest.fixture
def _needs_mooncake() -> None:
    require_mooncake()   # fails under CI, skips elsewhere (tests.requirements)


needs_mooncake = pytest.mark.usefixtures("_needs_mooncake")


def make_blocks(model: str, tenant: str, n: int, seed: int) -> list[L3Block]:
    """``n`` chained blocks of one prompt, KV drawn from ``seed`` (rebuilt the same in other processes)."""
    tokens = [1000 * seed + i for i in range(n * BLOCK_TOKENS)]
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, h in enumerate(block_hashes(tokens, BLOCK_TOKENS, salt=tenant)):
        kv = torch.randn(LAYOUT.num_layers, 2, BLOCK_TOKENS, LAYOUT.num_kv_heads, LAYOUT.head_dim, generator=gen)
        out.append(L3Block(l3_key(model, VERSION, h), tuple(tokens[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS]),
                           kv.to(torch.bfloat16)))
    return out


def lookups(blocks: list[L3Block]) -> list[L3Lookup]:
    return [L3Lookup(b.key, b.tokens) for b in blocks]


def l3_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "cluster.cache.l3" and r.levelno == logging.WARNING]


# ----------------------------------------------------------- format (no Mooncake)
def test_key_names_layout_version_and_tenant_salt():
    assert VERSION == "f1-L2-H2-D8-bfloat16-B4"
    assert l3_key("smollm2-135m", VERSION, 0xAB).name == "pc/smollm2-135m/f1-L2-H2-D8-bfloat16-B4/00000000000000ab"
    a, b = make_blocks("m", "tenant-a", 1, seed=1)[0], make_blocks("m", "tenant-b", 1, seed=1)[0]
    assert a.tokens == b.tokens and a.key != b.key
    with pytest.raises(InvalidInputError):
        l3_key("has space", VERSION, 1)
    with pytest.raises(InvalidInputError):
        l3_key("m", VERSION, -1)


def test_decode_verifies_header_checksum_key_and_tokens():
    block = make_blocks("m", "t", 2, seed=3)[1]
    value = encode_block(block)
    status, kv = decode_block(value, L3Lookup(block.key, block.tokens))
    assert status is GetStatus.HIT and kv.dtype == torch.bfloat16 and torch.equal(kv, block.kv)

    wrong_tokens = block.tokens[:-1] + (block.tokens[-1] + 1,)
    assert decode_block(value, L3Lookup(block.key, wrong_tokens)) == (GetStatus.TOKEN_MISMATCH, None)
    other_key = l3_key("m", VERSION, block.key.block_hash ^ 1)
    assert decode_block(value, L3Lookup(other_key, block.tokens)) == (GetStatus.VERIFY_FAILED, None)
    flipped_kv = bytearray(value)
    flipped_kv[-1] ^= 0xFF
    assert decode_block(flipped_kv, L3Lookup(block.key, block.tokens)) == (GetStatus.VERIFY_FAILED, None)
    flipped_token = bytearray(value)
    flipped_token[len(value) - block.kv.numel() * 2 - 1] ^= 0x01  # last token byte: the header checksum catches it
    assert decode_block(flipped_token, L3Lookup(block.key, block.tokens)) == (GetStatus.VERIFY_FAILED, None)
    for garbage in (b"", b"PCL3", bytes(value[:-1]), os.urandom(len(value))):
        assert decode_block(garbage, L3Lookup(block.key, block.tokens)) == (GetStatus.VERIFY_FAILED, None)


def test_store_without_mooncake_is_off_and_says_how_to_install(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # import raises ImportError
    caplog.set_level(logging.WARNING, logger="cluster.cache.l3")
    store = MooncakeL3Store(L3Config(master_address="127.0.0.1:1"))
    blocks = make_blocks("m", "t", 2, seed=4)
    assert [r.status for r in store.put_blocks(blocks)] == [PutStatus.OFF] * 2
    assert [r.status for r in store.get_blocks(lookups(blocks))] == [GetStatus.OFF] * 2
    stats = store.stats()
    assert (stats.state, stats.off_calls, stats.misses, stats.put_failures) == ("off", 2, 2, 2)
    assert "mooncake-transfer-engine-non-cuda" in stats.off_reason and "libibverbs1" in stats.off_reason
    assert len(l3_warnings(caplog)) == 1


def test_missing_binary_names_the_packages():
    with pytest.raises(L3MasterError, match="mooncake-transfer-engine-non-cuda.*libibverbs1"):
        find_mooncake_binary("mooncake_no_such_binary")


# ----------------------------------------------------------- real master
@pytest.fixture(scope="module")
def l3():
    require_mooncake()
    with L3Master(L3MasterConfig(holder_segment_bytes=64 << 20, client_ttl_s=CLIENT_TTL_S)) as master:
        yield master


@pytest.fixture(scope="module")
def store(l3):
    s = MooncakeL3Store(L3Config(master_address=l3.address, local_buffer_bytes=8 << 20))
    assert s.stats().state == "on", s.stats().off_reason
    yield s
    s.close()


@pytest.fixture()
def raw_client(l3):
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    assert client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 8 << 20, "tcp", "", l3.address) == 0
    yield client
    client.close()


def delta(before, after, *names):
    return tuple(getattr(after, n) - getattr(before, n) for n in names)


@needs_mooncake
def test_round_trip_of_several_blocks_with_their_tokens(store):
    blocks = make_blocks("round-trip", "t", 5, seed=10)
    before = store.stats()
    put = store.put_blocks(blocks)
    assert [r.status for r in put] == [PutStatus.STORED] * 5
    assert [r.nbytes for r in put] == [len(encode_block(b)) for b in blocks]
    assert store.contains([b.key for b in blocks] + [l3_key("round-trip", VERSION, 7)]) == (True,) * 5 + (False,)
    got = store.get_blocks(lookups(blocks))
    assert [r.status for r in got] == [GetStatus.HIT] * 5
    assert all(torch.equal(r.kv, b.kv) for r, b in zip(got, blocks))
    # Mooncake keeps the first value of a key: a second put is reported as already stored.
    assert [r.status for r in store.put_blocks(blocks[:2])] == [PutStatus.ALREADY_PRESENT] * 2
    after = store.stats()
    assert delta(before, after, "puts", "put_existing", "hits", "misses", "put_bytes", "get_bytes") == \
        (5, 2, 5, 0, sum(r.nbytes for r in put), sum(r.nbytes for r in put))


@needs_mooncake
def test_batches_larger_than_the_staging_buffer_are_split(l3):
    small = MooncakeL3Store(L3Config(master_address=l3.address, local_buffer_bytes=1 << 20))
    try:
        gen = torch.Generator().manual_seed(5)
        blocks = [L3Block(l3_key("split", VERSION, i), (i,), torch.randn(96 * 1024, generator=gen)) for i in range(6)]
        assert [r.status for r in small.put_blocks(blocks)] == [PutStatus.STORED] * 6  # 384 KiB each, 512 KiB batches
        got = small.get_blocks([L3Lookup(b.key, b.tokens) for b in blocks])
        assert [r.status for r in got] == [GetStatus.HIT] * 6
        assert all(torch.equal(r.kv, b.kv) for r, b in zip(got, blocks))
        too_big = L3Block(l3_key("split", VERSION, 99), (99,), torch.zeros(1 << 18))  # 1 MiB > half the buffer
        assert small.put_blocks([too_big])[0].status is PutStatus.FAILED
    finally:
        small.close()


@needs_mooncake
def test_wrong_expected_tokens_is_a_counted_miss(store):
    blocks = make_blocks("tokens", "t", 2, seed=11)
    assert all(r.stored for r in store.put_blocks(blocks))
    before = store.stats()
    wrong = [L3Lookup(blocks[0].key, blocks[1].tokens), L3Lookup(blocks[1].key, blocks[1].tokens)]
    got = store.get_blocks(wrong)
    assert [r.status for r in got] == [GetStatus.TOKEN_MISMATCH, GetStatus.HIT]
    assert got[0].kv is None and not got[0].hit
    assert delta(before, store.stats(), "hits", "misses", "token_mismatches", "verify_failures") == (1, 1, 1, 0)


@needs_mooncake
def test_corrupted_values_are_verify_failures_not_data(store, raw_client):
    garbage, tampered = make_blocks("corrupt", "t", 2, seed=12)
    assert raw_client.put(garbage.key.name, os.urandom(len(encode_block(garbage)))) == 0
    value = encode_block(tampered)
    value[-3] ^= 0x40
    assert raw_client.put(tampered.key.name, bytes(value)) == 0
    before = store.stats()
    got = store.get_blocks(lookups([garbage, tampered]))
    assert [(r.status, r.kv) for r in got] == [(GetStatus.VERIFY_FAILED, None)] * 2
    assert delta(before, store.stats(), "hits", "misses", "verify_failures") == (0, 2, 2)


READER = """
import json, sys
import torch
from cluster.cache.l3 import L3Config, MooncakeL3Store
from tests.unit.test_l3 import make_blocks, lookups
args = json.loads(sys.argv[1])
store = MooncakeL3Store(L3Config(master_address=args["master"], local_buffer_bytes=8 << 20))
blocks = make_blocks(args["model"], "t", args["n"], seed=args["seed"])
got = store.get_blocks(lookups(blocks))
print(json.dumps({"status": [r.status.value for r in got],
                  "equal": [r.kv is not None and torch.equal(r.kv, b.kv) for r, b in zip(got, blocks)]}), flush=True)
store.close()
"""

WRITER = """
import json, sys, time
from cluster.cache.l3 import L3Config, MooncakeL3Store
from tests.unit.test_l3 import make_blocks
args = json.loads(sys.argv[1])
store = MooncakeL3Store(L3Config(master_address=args["master"], local_buffer_bytes=8 << 20))
put = store.put_blocks(make_blocks(args["model"], "t", args["n"], seed=args["seed"]))
print(json.dumps([r.status.value for r in put]), flush=True)
time.sleep(600)  # killed by the test
"""


def _python(code: str, args: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, json.dumps(args)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)


@needs_mooncake
def test_removing_a_prefix_takes_blocks_just_read_too(store):
    """An admin flush right after traffic: Mooncake leases what was read (10 s
    here) and its plain remove skips leased objects; the flush must not."""
    read, unread = make_blocks("rm-m", "t", 3, 31), make_blocks("rm-m", "t", 2, 32)
    other = make_blocks("rm-k", "t", 2, 33)
    assert all(r.status is PutStatus.STORED for r in store.put_blocks(read + unread + other))
    assert all(r.status is GetStatus.HIT for r in store.get_blocks(lookups(read)))
    assert store.remove_prefix("pc/rm-m/") == 5
    assert store.contains([b.key for b in read + unread]) == (False,) * 5
    assert store.contains([b.key for b in other]) == (True, True)   # another model's stay


@needs_mooncake
def test_another_process_reads_what_this_one_wrote(l3, store):
    blocks = make_blocks("shared", "t", 3, seed=13)
    assert all(r.status is PutStatus.STORED for r in store.put_blocks(blocks))
    reader = _python(READER, {"master": l3.address, "model": "shared", "n": 3, "seed": 13})
    out, _ = reader.communicate(timeout=60)
    assert reader.returncode == 0
    assert json.loads(out.splitlines()[-1]) == {"status": ["hit"] * 3, "equal": [True] * 3}


@needs_mooncake
def test_blocks_of_a_writer_killed_with_sigkill_stay_readable(l3, store):
    writer = _python(WRITER, {"master": l3.address, "model": "killed", "n": 4, "seed": 14})
    try:
        assert json.loads(writer.stdout.readline()) == ["stored"] * 4
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait(timeout=30)
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    # Past client_ttl the master has given up on the dead client; it owned no segment
    # (a consumer), so the holder still has every block it wrote.
    time.sleep(CLIENT_TTL_S + 1.5)
    blocks = make_blocks("killed", "t", 4, seed=14)
    got = store.get_blocks(lookups(blocks))
    assert [r.status for r in got] == [GetStatus.HIT] * 4
    assert all(torch.equal(r.kv, b.kv) for r, b in zip(got, blocks))


@needs_mooncake
def test_unreachable_master_turns_the_store_off_without_raising(caplog):
    caplog.set_level(logging.WARNING, logger="cluster.cache.l3")
    with socket.socket() as refused:  # a port nobody listens on
        refused.bind(("127.0.0.1", 0))
        refused_port = refused.getsockname()[1]
    silent = socket.socket()  # accepts connections (kernel backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    blocks = make_blocks("off", "t", 2, seed=15)
    try:
        for port, why in ((refused_port, "unreachable at setup"), (silent.getsockname()[1], "setup against")):
            caplog.clear()
            store = MooncakeL3Store(L3Config(master_address=f"127.0.0.1:{port}", setup_timeout_s=30))
            assert store.stats().state == "off" and why in store.stats().off_reason
            assert [r.status for r in store.put_blocks(blocks)] == [PutStatus.OFF] * 2
            assert [r.status for r in store.get_blocks(lookups(blocks))] == [GetStatus.OFF] * 2
            assert store.contains([b.key for b in blocks]) == (False, False)
            stats = store.stats()
            assert (stats.off_calls, stats.misses, stats.hits, stats.put_failures, stats.timeouts) == (3, 2, 0, 2, 0)
            assert len(l3_warnings(caplog)) == 1
            store.close()
    finally:
        silent.close()


class ManualClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@needs_mooncake
def test_a_master_that_stops_answering_trips_the_store_off_and_back_on(caplog):
    caplog.set_level(logging.INFO, logger="cluster.cache.l3")
    clock = ManualClock()
    with L3Master(L3MasterConfig(holder_segment_bytes=0)) as master:
        store = MooncakeL3Store(L3Config(master_address=master.address, op_timeout_s=1.0, trip_after_failures=2,
                                         retry_after_s=30.0), clock=clock)
        key = l3_key("trip", VERSION, 1)
        assert store.contains([key]) == (False,)
        os.kill(master.master.pid, signal.SIGSTOP)
        try:
            for _ in range(40):  # each call ends by its deadline or Mooncake's RPC timeout
                assert store.contains([key]) == (False,)
                if store.stats().state == "off":
                    break
                time.sleep(0.2)
            stats = store.stats()
            assert stats.state == "off" and "unreachable" in stats.off_reason
            assert stats.rpc_failures + stats.timeouts >= 2  # trip_after_failures
            assert store.contains([key]) == (False,) and store.stats().off_calls == 1
        finally:
            os.kill(master.master.pid, signal.SIGCONT)
        clock.now += 30.0  # retry_after_s: the next call probes the master and resumes
        statuses = None
        for _ in range(40):  # the call stuck since SIGSTOP must come back first (TIMEOUT until then)
            statuses = [r.status for r in store.get_blocks([L3Lookup(key, (1,))])]
            if statuses == [GetStatus.MISS]:
                break
            time.sleep(0.2)
        assert statuses == [GetStatus.MISS] and store.stats().state == "on"
        messages = [r.getMessage() for r in caplog.records if r.name == "cluster.cache.l3"]
        assert [m.split(":")[0] for m in messages if m.startswith(("L3 off", "L3 back on"))] == ["L3 off", "L3 back on"]
        store.close()


class SlowClient:
    """A Mooncake client whose ``batch_is_exist`` blocks until ``gate`` opens (or raises)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Semaphore(0)
        self.raises = False

    def batch_is_exist(self, names):
        if self.raises:
            raise RuntimeError("the master hung up")
        self.entered.release()
        assert self.gate.wait(30), "the test never opened the gate"
        return [0] * len(names)

    def close(self) -> None:
        pass


class FakeClientStore(MooncakeL3Store):
    """The store's own logic (lane, deadlines, trip) on a fake client: no Mooncake needed."""

    def __init__(self, client: SlowClient, config: L3Config):
        self.fake = client
        super().__init__(config, clock=ManualClock())

    def _setup(self) -> None:
        self._client, self._replicate, self._state = self.fake, None, "on"


def test_calls_that_time_out_queued_behind_a_call_within_its_deadline_never_trip_the_store():
    client = SlowClient()
    store = FakeClientStore(client, L3Config(op_timeout_s=60.0, trip_after_failures=2))
    key = l3_key("trip", VERSION, 1)
    slow: list = []
    runner = threading.Thread(target=lambda: slow.append(store.contains([key])))
    runner.start()                                    # A: running, within its 60 s
    assert client.entered.acquire(timeout=30)
    store.config = dataclasses.replace(store.config, op_timeout_s=0.01)
    for _ in range(3):                                # B: queued behind A until their deadline: never ran
        assert store.contains([key]) == (False,)
    stats = store.stats()
    assert (stats.state, stats.timeouts, stats.queued_timeouts, stats.off_calls) == ("on", 3, 3, 0)
    client.gate.set()
    runner.join(30)
    assert slow == [(False,)] and not client.entered.acquire(blocking=False)   # B's calls never reached it

    # Calls that fail themselves do count: one that ran past its own deadline, then one that raised.
    client.gate.clear()
    assert store.contains([key]) == (False,)          # ran, and was still running at its deadline
    assert client.entered.acquire(timeout=30)
    client.gate.set()
    store._worker.call(lambda: None, 30.0)            # the lane is free again (nothing stuck)
    assert store.stats().state == "on" and store.stats().timeouts == 4
    client.raises = True
    assert store.contains([key]) == (False,)
    stats = store.stats()
    assert (stats.state, stats.timeouts, stats.queued_timeouts) == ("off", 4, 3)
    assert "2 failed calls in a row" in stats.off_reason and "raised" in stats.off_reason
    store.close()


@needs_mooncake
def test_l3_master_lifecycle():
    master = L3Master(L3MasterConfig(holder_segment_bytes=32 << 20))
    with master as m:
        procs = (m.master, m.holder)
        assert all(p.poll() is None for p in procs)
        assert m.address == f"127.0.0.1:{m.rpc_port}"
        metrics = m.metrics()
        assert metrics["master_total_capacity_bytes"] == 32 << 20 and metrics["master_key_count"] == 0
        socket.create_connection(("127.0.0.1", m.rpc_port), timeout=2).close()
    assert all(p.poll() is not None for p in procs) and master.master is None and master.holder is None
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", master.rpc_port), timeout=2).close()
    master.stop()  # idempotent
    assert master.metrics() == {}


def test_l3_master_that_cannot_start_says_why(tmp_path, monkeypatch):
    fake = tmp_path / "bin" / "mooncake_master"  # found first through $MOONCAKE_BIN_DIR
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'E1202 00:00:00.000000 1 master.cpp:1] bind failed: address in use' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setenv("MOONCAKE_BIN_DIR", str(fake.parent))
    assert find_mooncake_binary("mooncake_master") == fake
    master = L3Master(L3MasterConfig(holder_segment_bytes=0, log_dir=str(tmp_path)))
    with pytest.raises(L3MasterError, match=r"(?s)mooncake master exited with status 3 .*bind failed: address in use"):
        master.start()
    assert master.master is None
