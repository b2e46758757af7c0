"""Failure handling inside one worker, without Ray: the watchdog on a wedged
engine, and migrations that never install the wrong KV or wait unbounded."""

import asyncio
import dataclasses

import pytest

from actors.core import EngineWedgedError, WorkerConfig, WorkerCore
from actors.migration import MigrationRefused, tokens_hash
from cluster.errors import InvalidInputError
from cluster.protocol import GenerateRequest, MeasuredRates, SamplingParams, Transport
from tests.unit.helpers import WORKER_MODEL, make_worker, run_worker

MODEL = WORKER_MODEL
make, run = make_worker, run_worker


# ------------------------------------------------------------------ watchdog
def test_watchdog_trips_only_with_work_queued():
    core = make("wd-a", watchdog_s=None)   # no watchdog thread: the test drives the check
    trips = []
    try:
        loop = core.loop
        now = [0.0]
        loop.clock, loop.watchdog_s = (lambda: now[0]), 5.0
        loop._on_trip = trips.append
        run(core, [1, 2, 3], max_tokens=2)          # the engine stamps progress on the fake clock
        core.inject_fault("wedge")    # the engine thread blocks in a command
        now[0] = 100.0
        assert loop.check_wedged() is False and core.healthy()   # stuck but idle: nobody waits

        async def request():
            return [i async for i in core.generate(GenerateRequest([4, 5, 6], SamplingParams(max_tokens=2)))]

        async def scenario():
            task = asyncio.ensure_future(request())
            await asyncio.sleep(0.05)   # the submit command is queued behind the wedge
            assert loop.check_wedged() is True
            with pytest.raises(EngineWedgedError, match="made no progress for 100.0 s"):
                await task
        asyncio.run(scenario())
        assert len(trips) == 1 and "watchdog bound 5 s" in trips[0]
        assert not core.healthy() and loop.watchdog_trips == 1
        with pytest.raises(EngineWedgedError):
            core.health()
        with pytest.raises(EngineWedgedError):   # new work is refused at once, not queued behind the wedge
            run(core, [7, 8, 9], max_tokens=2)
        assert loop.check_wedged() is True and loop.watchdog_trips == 1   # trips once
    finally:
        core.close()


def test_watchdog_thread_fails_a_wedged_engines_requests():
    core = make("wd-b", watchdog_s=0.3)
    try:
        run(core, [1, 2, 3], max_tokens=2)
        core.inject_fault("wedge")
        with pytest.raises(EngineWedgedError, match=r"watchdog bound 0.3 s"):
            run(core, [4, 5, 6], max_tokens=2)
        assert not core.healthy() and core.loop.watchdog_trips == 1
    finally:
        core.close()


def test_watchdog_bound_is_validated():
    with pytest.raises(InvalidInputError, match="watchdog_s"):
        WorkerConfig.from_dict({"model": MODEL, "watchdog_s": 0})
    with pytest.raises(InvalidInputError, match="migration_timeout_s"):
        WorkerConfig.from_dict({"model": MODEL, "migration_timeout_s": -1})


# ----------------------------------------------------------------- migration
class Link:
    """PeerLink to an in-process WorkerCore, with ways to misbehave."""

    transport = Transport.OBJECT_STORE

    def __init__(self, core, *, hang=False, other_tokens=None, corrupt=False, codec=None):
        self.core, self.hang, self.other_tokens, self.corrupt = core, hang, other_tokens, corrupt
        self.codec = codec   # the stored format the holder's answer names (None: its own)
        self.released = []

    async def export_prefix(self, tokens, tenant):
        if self.hang:
            await asyncio.Event().wait()   # a holder that never answers
        staged = await self.core.export_prefix(self.other_tokens or tokens, tenant)
        return dataclasses.replace(staged, codec=self.codec) if self.codec else staged

    async def info(self):
        return self.core.info()

    async def fetch_blocks(self, lease):
        array, dtype = await self.core.fetch_blocks(lease)
        if self.corrupt:
            array.reshape(-1)[3] += 1
        return array, dtype

    def release(self, lease):
        self.released.append(lease)
        self.core.loop.call(lambda: self.core.migration.release(lease))


@pytest.fixture(scope="module")
def pair():
    holder, target = make("mh", migration_timeout_s=0.2), make("mt", migration_timeout_s=0.2)
    target.migration.inject_fault("nixl")   # exercise the fallback path everywhere
    yield holder, target
    holder.close()
    target.close()


def migrate(target, link, prompt, tenant=None):
    return asyncio.run(asyncio.wait_for(target.migrate_from("mh", link, prompt, tenant), 30))


def test_a_holder_that_never_answers_means_recompute_within_the_bound(pair):
    holder, target = pair
    before = dict(target.migration.stats)
    got = migrate(target, Link(holder, hang=True), list(range(10, 42)))
    assert (got.transport, got.tokens) == (None, 0)
    assert target.migration.stats["migration_timeouts"] == before["migration_timeouts"] + 1
    assert target.migration.max_wait_s == pytest.approx(0.8)


def test_fallback_path_verifies_checksums(pair):
    holder, target = pair
    prompt = list(range(100, 148))
    run(holder, prompt, max_tokens=1)
    before = dict(target.migration.stats)
    link = Link(holder, corrupt=True)
    got = migrate(target, link, prompt)
    assert (got.transport, got.tokens) == (None, 0)
    assert target.migration.stats["refused_installs"] == before["refused_installs"] + 1
    assert len(link.released) == 1   # the lease is released either way
    got = migrate(target, Link(holder), prompt)   # the same pull, intact, installs
    assert (got.transport, got.tokens) == (Transport.OBJECT_STORE, 48)


def test_an_export_for_other_tokens_is_refused(pair):
    holder, target = pair
    theirs, mine = list(range(150, 182)), list(range(182, 214))
    run(holder, theirs, max_tokens=1)
    before = dict(target.migration.stats)
    got = migrate(target, Link(holder, other_tokens=theirs), mine)
    assert (got.transport, got.tokens) == (None, 0)
    assert target.migration.stats["refused_installs"] == before["refused_installs"] + 1
    items = run(target, mine, max_tokens=1)
    assert items[0].cached_tokens == 0   # nothing of the other tokens' KV was installed


def test_an_export_stored_in_another_format_is_refused(pair):
    """Same shape is not same format (another codec version during a rolling upgrade):
    the target recomputes rather than read the holder's bytes as its own."""
    holder, target = pair
    prompt = list(range(220, 252))
    run(holder, prompt, max_tokens=1)
    assert target.migration.stored_format == "none"
    before = dict(target.migration.stats)
    link = Link(holder, codec="int8v2")
    got = migrate(target, link, prompt)
    assert (got.transport, got.tokens) == (None, 0)
    assert target.migration.stats["refused_installs"] == before["refused_installs"] + 1
    assert len(link.released) == 1
    assert run(target, prompt, max_tokens=1)[0].cached_tokens == 0


def test_leases_are_unique_across_workers_and_checked(pair):
    holder, target = pair
    prompt = list(range(220, 252))
    run(holder, prompt, max_tokens=1)
    run(target, prompt, max_tokens=1)
    a = asyncio.run(holder.export_prefix(prompt, None))
    b = asyncio.run(target.export_prefix(prompt, None))
    try:
        assert a.lease.startswith("mh/") and b.lease.startswith("mt/") and a.lease != b.lease
        assert a.tokens_hash == tokens_hash(prompt[:a.tokens], None) != tokens_hash(prompt[:a.tokens], "t")
        with pytest.raises(MigrationRefused, match="issued by another worker"):
            asyncio.run(holder.fetch_blocks(b.lease))
        assert holder.migration.holder_stats["refused_lease_calls"] == 1
    finally:
        asyncio.run(holder.release(a.lease))
        asyncio.run(target.release(b.lease))


# ------------------------------------------------------------- fast restart
class RatesOnlyDirectory:
    """The part of ``DirectoryLink`` a starting worker uses, with a peer's rates."""

    def __init__(self, rates):
        self.rates, self.asked, self.registered = rates, [], []

    def measured_rates(self, bytes_per_token, block_tokens):
        self.asked.append((bytes_per_token, block_tokens))
        return self.rates

    def register(self, worker_id, rates, peer_address=None, fresh=True):
        self.registered.append(worker_id)

    def ask_publisher_epoch(self, worker_id):
        return None   # asked when the answer is read

    def publisher_epoch(self, worker_id, asked=None):
        return 7   # the directory's, whatever this node's clock says


def test_a_replacement_worker_reuses_a_peers_measured_rates():
    from cluster.routing.policies import CostModel

    peer = CostModel(prefill_tokens_per_s=1234.0, warm_promote_tokens_per_s=5e5, cold_promote_tokens_per_s=5e4,
                     transfer_tokens_per_s=2e5, block_tokens=16)
    cfg = WorkerConfig.from_dict(dict(model=MODEL, hot_blocks=128, warm_blocks=128, block_tokens=16))
    directory = RatesOnlyDirectory(MeasuredRates.of(peer, bytes_per_token=1024))
    core = WorkerCore("fast", cfg, directory=directory)
    try:
        assert directory.asked == [(core.layout.bytes_per_token(), 16)] and directory.registered == ["fast"]
        assert core.publisher.epoch == 7 and core.reporter.renew_epoch is None
        assert core.cost.prefill_tokens_per_s == 1234.0 and core.cost.transfer_tokens_per_s == 2e5
    finally:
        core.close()
    measured = WorkerCore("slow", WorkerConfig.from_dict(dict(model=MODEL, hot_blocks=128, warm_blocks=128,
                                                              block_tokens=16, reuse_peer_calibration=False)),
                          directory=RatesOnlyDirectory(MeasuredRates.of(peer, bytes_per_token=1024)))
    try:
        assert measured.cost.prefill_tokens_per_s != 1234.0   # measured, not taken
    finally:
        measured.close()


def test_the_directory_offers_rates_of_the_same_kv_shape_only():
    from actors.directory import DirectoryImpl

    directory = DirectoryImpl()
    rates = MeasuredRates(prefill_tokens_per_s=1.0, warm_promote_tokens_per_s=2.0, cold_promote_tokens_per_s=3.0,
                          transfer_tokens_per_s=4.0, block_tokens=16, bytes_per_token=512)
    asyncio.run(directory.register_worker("w1", rates))
    assert directory.measured_rates(512, 16) == rates
    assert directory.measured_rates(1024, 16) is None and directory.measured_rates(512, 32) is None
    asyncio.run(directory.drop_worker("w1"))
    assert directory.measured_rates(512, 16) is None
