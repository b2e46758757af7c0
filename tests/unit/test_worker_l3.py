"""Two WorkerCores on one real Mooncake master (no Ray): a turn one worker
served is read by the other from L3, exactly; with the master gone, L3 is off
and the worker serves anyway."""

import asyncio

import pytest

from cluster.cache.l3.master import L3Master, L3MasterConfig
from tests.requirements import require_mooncake
from tests.unit.helpers import greedy_reference as greedy, make_worker, run_worker

require_mooncake()   # fails under CI where Mooncake is missing, skips elsewhere


def wait_written(core, blocks, timeout_s=10.0):
    """Until ``blocks`` blocks were written and reported (the I/O thread runs behind)."""
    async def go():
        for _ in range(int(timeout_s / 0.05)):
            stats = await core.stats()
            if stats["l3"]["blocks_written"] >= blocks:
                return stats
            await asyncio.sleep(0.05)
        return stats
    return asyncio.run(go())


@pytest.fixture(scope="module")
def master():
    with L3Master(L3MasterConfig(holder_segment_bytes=64 << 20)) as m:
        yield m


def test_a_turn_served_by_one_worker_is_read_by_another_from_l3(master):
    a = make_worker("l3-a", l3_master=master.address, reuse_peer_calibration=False)
    b = make_worker("l3-b", l3_master=master.address)
    try:
        assert a.l3.store.stats().state == b.l3.store.stats().state == "on"
        # This tiny model computes faster than any store can answer (the guard would
        # rightly skip L3): price L3 as the real model's would be, to test the path.
        b.l3.set_rates(fetch_tokens_per_s=1e6, prefill_tokens_per_s=1e3)
        prompt = [(7 * i) % 250 + 1 for i in range(70)]
        first = run_worker(a, prompt, max_tokens=4)
        seq = prompt + [i.token for i in first]
        stats = wait_written(a, 4)   # 70 + 3 computed tokens: 4 full 16-token blocks and a partial one of 9
        assert stats["l3"]["blocks_written"] == 4 and stats["l3"]["write_failures"] == 0
        assert stats["l3"]["tails_written"] == 1      # in the same write as the blocks
        follow = seq + [5, 6, 7]
        second = run_worker(b, follow, max_tokens=4)
        assert second[0].cached_tokens == 73 and second[0].tier_hits == (0, 0, 0, 73)
        assert [i.token for i in second] == greedy(follow, 4)
        got = asyncio.run(b.stats())["l3"]
        assert got["fetches"] == 1 and got["fetch_blocks_hit"] == 4 and got["installed_tokens"] == 73
        assert got["tails_fetched"] == 1
    finally:
        a.close()
        b.close()


def test_without_a_reachable_master_l3_is_off_and_the_worker_serves(caplog):
    core = make_worker("l3-none", l3_master="127.0.0.1:9")   # nothing listens there
    try:
        assert core.l3 is None and core.cache.l3 is None and core.cost.l3_fetch_tokens_per_s == 0
        items = run_worker(core, list(range(1, 40)), max_tokens=2)
        assert items[-1].finished and items[-1].error is None
    finally:
        core.close()


class SharesDirectory:
    """The ``DirectoryLink`` calls a starting worker makes; every batch is answered with
    the tenants' L3 counts (as ``DirectoryImpl.publish(..., want_l3_shares=True)``)."""

    def __init__(self):
        self.asked = []

    def measured_rates(self, bytes_per_token, block_tokens):
        return None

    def register(self, worker_id, rates, peer_address=None, fresh=True):
        pass

    def ask_publisher_epoch(self, worker_id):
        return None

    def publisher_epoch(self, worker_id, asked=None):
        return 7

    def publish(self, worker_id, batch, load, want_l3_shares=False):
        from concurrent.futures import Future

        from cluster.protocol import L3ShareCounts, PublishReply

        self.asked.append(want_l3_shares)
        fut = Future()
        fut.set_result(PublishReply("ok", L3ShareCounts((("t", 5),))))
        return fut

    def push_snapshot(self, worker_id, snapshot):
        pass


def test_a_worker_with_l3_shares_takes_the_directorys_counts_on_its_engine_thread(master):
    from actors.core import WorkerConfig, WorkerCore
    from cluster.protocol import GenerateRequest, SamplingParams
    from tests.unit.helpers import WORKER_MODEL

    cfg = WorkerConfig.from_dict(dict(model=WORKER_MODEL, hot_blocks=128, warm_blocks=128, block_tokens=16,
                                      l3_master=master.address, calibrate_at_start=False,
                                      tenant_quotas={"l3_blocks": 64, "tenants": {"t": {"l3": {"cap": 0.5}}}}))
    directory = SharesDirectory()
    core = WorkerCore("l3-shares", cfg, directory=directory)
    try:
        quotas = core.cache.quotas
        assert quotas.l3_counts_ttl_s == 3.0 and not quotas.l3_counts_fresh()   # none yet: nothing written

        async def go():
            req = GenerateRequest([(5 * i) % 250 + 1 for i in range(40)], SamplingParams(max_tokens=2), tenant="t")
            return [item async for item in core.generate(req)]
        asyncio.run(go())
        assert directory.asked and all(directory.asked)
        assert quotas.l3_others == {"t": 5} and quotas.l3_counts_fresh()
    finally:
        core.close()
