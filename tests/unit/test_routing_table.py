"""A router's copy of the directory's routing table: it replays the directory's
ops in order and decides exactly what the directory decides; it starts over
from the whole table when it misses an op or the directory restarts."""

import asyncio
from types import SimpleNamespace

import pytest

from tests.requirements import require_module

require_module("ray")

from actors.directory import DirectoryImpl  # noqa: E402
from actors.table_follower import TableFollower  # noqa: E402
from cluster.cache.radix_tree import HOT, WARM  # noqa: E402
from cluster.hashing import block_hashes  # noqa: E402
from cluster.protocol import TableChange, TableUpdate  # noqa: E402
from cluster.protocol import LoadReport, MeasuredRates, Snapshot  # noqa: E402
from cluster.routing.events import EventBatch, KVEvent  # noqa: E402
from cluster.routing.policies import CostModel  # noqa: E402
from cluster.routing.table import ChangeLog, RoutingTable, TableReplica  # noqa: E402

BT = 4
RATES = MeasuredRates(prefill_tokens_per_s=1000.0, warm_promote_tokens_per_s=10_000.0, cold_promote_tokens_per_s=1000.0,
                      transfer_tokens_per_s=5000.0, block_tokens=16)


def prompt(n, start=0):
    return list(range(start, start + n))


def assert_same_table(a: RoutingTable, b: RoutingTable):
    assert sorted(a.workers) == sorted(b.workers)
    for w in a.workers:
        assert (a.workers[w].queued_tokens, a.workers[w].running) == (b.workers[w].queued_tokens, b.workers[w].running)
        assert a.index.entries(w) == b.index.entries(w) and a.index.last_seq(w) == b.index.last_seq(w)
    assert a.policy_name == b.policy_name and a.cost == b.cost
    b.index.check_invariants()


async def busy_directory(d: DirectoryImpl):
    """Every kind of op: registrations, batches (one with a gap), a snapshot, loads, a drop."""
    for w in ("a", "b", "c"):
        await d.register_worker(w, rates=RATES)
    sys_hashes = block_hashes(prompt(16), BT)
    await d.publish("a", EventBatch("a", 1, [KVEvent("stored", sys_hashes, HOT)]).encode(),
                    LoadReport(40, 1))
    await d.publish("b", EventBatch("b", 1, [KVEvent("stored", sys_hashes[:2], HOT)]).encode())
    await d.publish("b", EventBatch("b", 2, [KVEvent("tier", sys_hashes[:2], WARM)]).encode(),
                    LoadReport(7, 2))
    assert await d.publish("c", EventBatch("c", 5, [KVEvent("stored", sys_hashes[:1], HOT)]).encode()) == "gap"
    await d.load_snapshot("c", Snapshot(5, {h: HOT for h in sys_hashes[:3]}))
    await d.publish("a", EventBatch("a", 2, [KVEvent("removed", sys_hashes[3:], HOT)]).encode())


def test_a_replica_replays_the_log_and_decides_what_the_directory_decides():
    async def go():
        d = DirectoryImpl(policy="cost", block_tokens=BT, heartbeat_timeout_s=0, policy_kwargs={"inflight_s": 0})
        replica = TableReplica(tie_salt=0)                     # break exact ties as the directory does
        replica.apply(d.log.update(d.table, None, 0))          # new: the whole (empty) table
        await busy_directory(d)
        update = d.log.update(d.table, replica.epoch, replica.seq)
        assert update.state is None and [c.op for c in update.changes][:3] == ["register", "cost", "register"]
        replica.apply(update)
        assert replica.seq == d.log.seq and replica.usable()
        assert_same_table(d.table, replica.table)
        for p in (prompt(16), prompt(12) + [99] * 8, prompt(8, 100), prompt(20)):
            mine = replica.table.route(block_hashes(p, BT), len(p), reserve=False)
            theirs = await d.route(block_hashes(p, BT), len(p), reserve=False)
            assert (mine.worker_id, mine.reason, mine.cached_tokens, mine.migrate_from) == (
                theirs.worker_id, theirs.reason, theirs.cached_tokens, theirs.migrate_from)
        await d.drop_worker("a")
        await d.set_policy("least_loaded")
        replica.apply(d.log.update(d.table, replica.epoch, replica.seq))
        assert_same_table(d.table, replica.table)
        assert replica.table.policy_name == "least_loaded" and "a" not in replica.table.workers
    asyncio.run(go())


def test_a_replica_that_fell_out_of_the_log_or_follows_a_restarted_directory_gets_the_whole_table():
    async def go():
        d = DirectoryImpl(block_tokens=BT, heartbeat_timeout_s=0, log_capacity=4)
        replica = TableReplica()
        replica.apply(d.log.update(d.table, None, 0))
        await busy_directory(d)                               # far more than 4 ops
        assert d.log.since(replica.seq) is None
        update = d.log.update(d.table, replica.epoch, replica.seq)
        assert update.state is not None and update.changes == ()
        replica.apply(update)
        assert_same_table(d.table, replica.table)
        restarted = DirectoryImpl(block_tokens=BT, heartbeat_timeout_s=0)   # a new process: a new epoch
        await restarted.register_worker("b", rates=RATES)
        update = restarted.log.update(restarted.table, replica.epoch, replica.seq)
        assert update.state is not None and update.epoch != replica.epoch
        replica.apply(update)
        assert sorted(replica.table.workers) == ["b"] and replica.epoch == restarted.log.epoch
    asyncio.run(go())


def test_a_missed_change_makes_the_replica_ask_for_the_whole_table():
    log = ChangeLog()
    table = RoutingTable()
    replica = TableReplica()
    replica.apply(log.update(table, None, 0))
    replica.apply(TableUpdate(log.epoch, 3, (TableChange(3, "register", ("x", True)),)))   # 1 and 2 missed
    assert replica.epoch is None and replica.stats["out_of_order"] == 1 and not replica.usable()
    assert "x" not in replica.table.workers


def test_a_replica_decides_only_while_it_hears_from_the_directory():
    now = [0.0]
    replica = TableReplica(max_age_s=5.0, clock=lambda: now[0])
    assert not replica.usable()                       # nothing heard yet
    log, table = ChangeLog(), RoutingTable()
    table.apply("register", ("w", True))
    replica.apply(log.update(table, None, 0))
    assert replica.usable()
    now[0] = 5.5
    assert not replica.usable()                       # silent for longer than max_age_s
    replica.apply(log.update(table, replica.epoch, replica.seq))   # a long poll's empty answer
    assert replica.usable()
    replica.stale()
    assert not replica.usable()


def test_an_invalid_op_changes_nothing_and_is_not_logged():
    async def go():
        d = DirectoryImpl(block_tokens=BT, heartbeat_timeout_s=0)
        await d.register_worker("a")
        seq = d.log.seq
        with pytest.raises(Exception, match="snapshot entry"):
            await d.load_snapshot("a", Snapshot(1, {"not a hash": 0}))
        assert d.log.seq == seq and d.index.entries("a") == {}
        with pytest.raises(Exception, match="unknown routing table op"):
            d.table.apply("rm -rf", ())
    asyncio.run(go())


def test_the_long_poll_answers_at_the_first_change_or_after_its_wait():
    async def go():
        d = DirectoryImpl(block_tokens=BT, heartbeat_timeout_s=0)
        await d.register_worker("a")
        epoch, seq = d.log.epoch, d.log.seq
        idle = await d.subscribe(epoch, seq, wait_s=0.05)      # nothing changed: an empty answer
        assert idle.state is None and idle.changes == () and idle.seq == seq
        poll = asyncio.ensure_future(d.subscribe(epoch, seq, wait_s=30))
        await asyncio.sleep(0.01)
        assert not poll.done()
        await d.publish("a", None, LoadReport(5, 1))
        update = await asyncio.wait_for(poll, 5)
        assert [(c.op, c.args) for c in update.changes] == [("load", ("a", 5, 1))]
        await d.publish("a", None, LoadReport(5, 1))   # the same load: no op
        assert d.log.seq == update.seq
    asyncio.run(go())


def test_the_follower_routes_locally_only_on_a_usable_copy():
    follower = TableFollower(SimpleNamespace(block_tokens=BT))
    assert follower.route(prompt(8)) is None                     # no copy yet: ask the directory
    log, table = ChangeLog(), RoutingTable(policy="prefix", cost=CostModel(block_tokens=BT))
    for w in ("a", "b"):
        table.apply("register", (w, True))
    table.apply("batch", (EventBatch("b", 1, [KVEvent("stored", block_hashes(prompt(8), BT), HOT)]),))
    follower.replica.apply(log.update(table, None, 0))
    decision = follower.route(prompt(8) + [50, 51])
    assert (decision.worker_id, decision.source, decision.cached_tokens) == ("b", "router_view", 8)
    assert follower.route(prompt(8), exclude=["a", "b"]) is None   # nobody left: the directory says so
    assert follower.stats["local_decisions"] == 1


def test_each_replica_breaks_exact_ties_from_its_own_place():
    async def go():
        d = DirectoryImpl(policy="cost", block_tokens=BT, heartbeat_timeout_s=0, policy_kwargs={"inflight_s": 0})
        for w in ("a", "b", "c", "d"):
            await d.register_worker(w, rates=RATES)
        picks = []
        for salt in (0, 1, 2, 3):
            replica = TableReplica(tie_salt=salt)
            replica.apply(d.log.update(d.table, None, 0))
            assert replica.table.policy.tie_salt == salt
            # Four idle workers holding nothing: an exact tie on queue and recent work.
            picks.append(replica.table.route(block_hashes(prompt(8), BT), 8, reserve=False).worker_id)
        assert picks == ["a", "b", "c", "d"]     # independent routers do not herd onto one worker
        await d.set_policy("least_loaded")
        replica.apply(d.log.update(d.table, replica.epoch, replica.seq))
        assert replica.table.policy.tie_salt == 3  # a new policy keeps the copy's place
        assert TableReplica().tie_salt > 0        # routers draw their own at random
    asyncio.run(go())


def test_a_draining_worker_is_never_chosen_and_a_copy_learns_it_with_l3():
    table = RoutingTable(cost=CostModel(block_tokens=BT))
    for w in ("w0", "w1"):
        table.apply("register", (w, True))
    hashes = block_hashes(prompt(12), BT)
    table.apply("batch", (EventBatch("w0", 1, [KVEvent("stored", hashes, HOT), KVEvent("stored", hashes, 3)]),))
    assert table.route(hashes, 12).worker_id == "w0"
    assert table.apply("drain", ("w0",)) is True and table.draining == ["w0"]
    assert {table.route(hashes, 12).worker_id for _ in range(5)} == {"w1"}
    copy = RoutingTable.from_state(table.state("e", 7))
    assert copy.draining == ["w0"] and copy.index.l3_blocks(hashes) == 3
    assert copy.route(hashes, 12, reserve=False).worker_id == "w1"


def test_a_worker_whose_process_exits_is_dropped_at_once():
    """The directory holds an idle connection to each worker's peer channel; the
    kernel closes it when the process dies, and the worker goes then, long before
    its heartbeats would be missed: on a clock that never moves (no heartbeat can
    ever be missed), the closed connection alone drops it."""
    async def scenario():
        closed = asyncio.Event()
        conns = []

        async def accept(reader, writer):   # a peer channel that never answers, then dies
            conns.append(writer)
            await closed.wait()
            writer.transport.abort()   # what the kernel does to a killed process's sockets
        server = await asyncio.start_server(accept, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        d = DirectoryImpl(block_tokens=BT, heartbeat_timeout_s=3600, clock=lambda: 0.0)
        await d.register_worker("w0", RATES, f"127.0.0.1:{port}")
        await d.register_worker("w1", RATES, None)
        for _ in range(100):
            if conns:
                break
            await asyncio.sleep(0.01)
        assert d.live_workers() == ["w0", "w1"] and len(conns) == 1
        watch = d._watches["w0"]   # the task holding w0's connection
        closed.set()
        # Bounded only against a hang: what is checked is what dropped it, not how fast.
        await asyncio.wait_for(watch, timeout=60)
        assert d.live_workers() == ["w1"]
        assert d.stats["process_exits"] == 1 and d.stats["dropped_workers"] == 1
        assert await d.expire_silent_workers() == []   # the heartbeat path had nothing to drop
        server.close()
    asyncio.run(scenario())
