"""WorkerCore without Ray: the engine thread, streaming, queue bound, thread
ownership, and a prefix moving between two workers over a real NIXL READ."""

import asyncio
import dataclasses
import math
import time

import pytest
import torch

from actors.core import QueueFullError, WorkerConfig, WorkerCore
from cluster.cache.tier_types import Readiness
from cluster.ownership import ENV_VAR, OwnershipError
from cluster.protocol import FinishReason, Transport
from cluster.engine.model import DecoderModel, ModelConfig
from cluster.transfer.nixl_transport import nixl_available
from tests.unit.helpers import WORKER_MODEL, TickClock, greedy_reference, make_worker, run_worker
from tests.unit.reference_forward import forward_one

MODEL = WORKER_MODEL
make, run = make_worker, run_worker


def greedy(prompt, n):
    return greedy_reference(prompt, n, MODEL)


def test_streams_tokens_and_caches_the_turn():
    core = make("w-a")
    try:
        prompt = list(range(40))
        items = run(core, prompt)
        assert [i.token for i in items] == greedy(prompt, 4) and items[-1].finished
        again = run(core, prompt + [i.token for i in items] + [1, 2])
        assert again[0].cached_tokens == 43   # the last token's KV was never computed (cache_final_token off)
        assert items[-1].finish_reason is FinishReason.LENGTH and items[-1].worker_id == "w-a"
        stats = asyncio.run(core.stats())
        assert stats["protected_tokens"] == 0 and stats["engine"]["requests_finished"] == 2
    finally:
        core.close()


def test_the_first_token_carries_the_replica_timing():
    core = make("w-t")
    try:
        # The engine's injectable clock ticks once a call: handed to the engine (1),
        # submitted (2), its step admits it (3), has its cached KV read (4), starts the
        # forward (5), samples (6). The timing is those stamps' differences, exactly.
        core.engine.clock = TickClock()
        before = time.time()
        items = run(core, list(range(40)), max_tokens=3)
        first = items[0].timing
        assert all(i.timing is None for i in items[1:])
        assert (first.queue_s, first.prefix_load_s, first.forward_s, first.migrate_s) == (2.0, 2.0, 1.0, 0.0)
        assert before <= first.received_at <= time.time()   # the wall-clock stamp the ingress splits hops by
    finally:
        core.close()


def test_a_request_that_cannot_run_yet_makes_the_loop_wait_not_spin():
    """Work queued that no step can take yet (its prefix on its way up to HOT): the engine
    loop waits between the empty steps (``PENDING_WAIT_S``, or until woken), then runs it."""
    from actors import engine_loop

    core = make("w-p")
    try:
        waits = []

        class Recording(type(core.loop._wake)):
            def wait(self, timeout=None):
                waits.append(timeout)
                return super().wait(timeout)

        core.loop._wake = Recording()
        real_ready, not_ready = core.engine.cache.ready, [5]

        def ready(*args, **kwargs):   # the first five looks: the prefix is still on its way up
            if not_ready[0]:
                not_ready[0] -= 1
                return Readiness(False, [0, 0, 0, 0])
            return real_ready(*args, **kwargs)

        core.engine.cache.ready = ready
        prompt = list(range(40))
        items = run(core, prompt)
        assert [i.token for i in items] == greedy(prompt, 4)
        assert core.engine.stats["waits_for_promotion"] == 5
        # One wait after each of the five empty steps (none after a step that ran a forward).
        assert waits.count(engine_loop.PENDING_WAIT_S) == 5
    finally:
        core.close()


def test_queue_bound_rejects_with_queue_full():
    core = make("w-b", max_queued_requests=0)
    try:
        with pytest.raises(QueueFullError, match="requests queued"):
            run(core, [1, 2, 3])
        assert asyncio.run(core.stats())["worker"]["rejected_queue_full"] == 1
    finally:
        core.close()


def test_a_burst_reaching_an_idle_worker_computes_its_shared_prompt_once():
    """Four requests behind one uncached 48-token prompt reach an idle worker a few
    milliseconds apart: the first step waits for them (the gather window) and plans them
    together: the first fills the prompt, the other three wait that step for its checkpoint
    (shared fills) and then compute only their own tokens; each request's tokens the model's own."""
    from cluster.protocol import GenerateRequest, SamplingParams

    core = make("w-burst", gather_quiet_ms=200, gather_max_ms=1000)
    system = [(7 * i) % 60 for i in range(48)]
    prompts = [system + [i + 1, i + 2, i + 3] for i in range(4)]

    async def one(prompt, delay):
        await asyncio.sleep(delay)
        return [item async for item in core.generate(GenerateRequest(prompt, SamplingParams(max_tokens=3)))]

    async def burst():
        return await asyncio.gather(*[one(p, 0.005 * k) for k, p in enumerate(prompts)])

    try:
        results = asyncio.run(burst())
        assert [[i.token for i in items] for items in results] == [greedy(p, 3) for p in prompts]
        stats = core.engine.stats
        assert stats["waits_for_shared_prefix"] == 3 and stats["computed_tokens"] == 51 + 2 + 3 * (3 + 2)
        assert stats["steps"] == 1 + 3   # the fill's step, then the others' three
    finally:
        core.close()


def test_only_a_new_fill_waits_for_followers_a_sessions_next_turn_starts_at_once():
    """The gather window waits for followers only when the work that woke the engine is mostly
    beyond the cache (a fill they may share): the first turn (nothing cached) waits its quiet
    time, the session's next turn (its prompt cached but for the reply's last token and the
    new question) does not; a new prompt that shares only a short cached prefix waits again."""
    core = make("w-gather", gather_quiet_ms=1, gather_max_ms=2)
    try:
        first = list(range(40))
        items = run(core, first)
        gathers = asyncio.run(core.stats())["worker"]["gathers"]
        assert gathers == 1
        turn = first + [i.token for i in items] + [5, 6]   # 43 of 46 tokens cached
        assert [i.token for i in run(core, turn)] == greedy(turn, 4)
        assert asyncio.run(core.stats())["worker"]["gathers"] == 1
        fresh = first[:8] + [(3 * i + 1) % 60 for i in range(40)]   # 8 of 48 cached
        assert [i.token for i in run(core, fresh)] == greedy(fresh, 4)
        assert asyncio.run(core.stats())["worker"]["gathers"] == 2
    finally:
        core.close()


def test_gather_window_settings_are_checked():
    with pytest.raises(ValueError, match="gather_max_ms must be a number of milliseconds"):
        WorkerConfig.from_dict({"gather_max_ms": -1})
    with pytest.raises(ValueError, match="gather_quiet_ms must be a number of milliseconds"):
        WorkerConfig.from_dict({"gather_quiet_ms": True})


def test_scheduling_policy_settings_are_checked_and_reach_the_engine():
    for bad, message in (({"time_slice_s": 0}, "time_slice_s must be a number of seconds"),
                         ({"time_slice_s": True}, "time_slice_s must be a number of seconds"),
                         ({"riders": False}, "worker config key 'riders' was removed"),
                         ({"shared_fills": 1}, "shared_fills must be true or false")):
        with pytest.raises(ValueError, match=message):
            WorkerConfig.from_dict(bad)
    assert (WorkerConfig().time_slice_s, WorkerConfig().shared_fills) == (0.5, True)
    core = make("w-policies", time_slice_s=None, shared_fills=False)
    try:
        config = core.engine.scheduler.config
        assert (config.time_slice_s, config.shared_fills) == (None, False)
    finally:
        core.close()


def test_unknown_worker_config_keys_are_rejected():
    with pytest.raises(ValueError, match="unknown worker config keys: \\['hot_block'\\]"):
        WorkerConfig.from_dict({"hot_block": 3})


def test_the_old_policy_key_is_refused_naming_eviction_policy():
    with pytest.raises(ValueError, match="worker config key 'policy' is now 'eviction_policy'"):
        WorkerConfig.from_dict({"policy": "lfu"})


def test_every_tier_setting_is_a_worker_key():
    cfg = WorkerConfig.from_dict({"model": MODEL, "hot_blocks": 64, "high_watermark": 0.8, "low_watermark": 0.5,
                                  "eviction_policy": "lfu", "max_sessions": 7, "copy_gb_per_s": 2.0})
    assert (cfg.tiers.hot_blocks, cfg.tiers.high_watermark, cfg.tiers.eviction_policy, cfg.tiers.max_sessions,
            cfg.tiers.copy_gb_per_s) == (64, 0.8, "lfu", 7, 2.0)
    assert WorkerConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="watermarks out of order"):
        WorkerConfig.from_dict({"high_watermark": 0.5, "low_watermark": 0.6})


def test_a_memory_budget_replaces_the_block_defaults_and_the_worker_splits_it(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cfg = WorkerConfig.from_dict({"model": MODEL, "kv_memory_mb": 2})
    assert (cfg.tiers.kv_memory_mb, cfg.tiers.hot_blocks, cfg.tiers.warm_blocks) == (2, 0, 0)
    core = WorkerCore("w-memory", WorkerConfig.from_dict({"model": MODEL, "kv_memory_mb": 2}))
    try:
        tiers = core.cache.config
        block = core.cache.pools[0].block_bytes
        assert tiers.hot_blocks == int(2 * (1 << 20) * 7 / 8) // block
        assert (tiers.hot_blocks + tiers.warm_blocks) * block <= 2 << 20 < (tiers.hot_blocks + tiers.warm_blocks + 2) * block
        assert tiers.cold_blocks == 4 * (2 << 20) // block and tiers.disk_dir == str(tmp_path / "prefix-cache" / "cold")
    finally:
        core.close()
    for bad, message in (({"kv_memory_mb": 2, "hot_blocks": 8}, "give kv_memory_mb or hot_blocks, not both"),
                         ({"kv_memory_mb": "lots"}, "kv_memory_mb must be a positive number of MiB")):
        with pytest.raises(ValueError, match=message):
            WorkerConfig.from_dict(bad)


def test_cache_touched_off_the_engine_thread_fails_in_debug_mode(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1")
    core = make("w-own")
    try:
        run(core, list(range(20)))   # through the engine thread: fine
        with pytest.raises(OwnershipError, match="TieredCache.admit .* engine-w-own"):
            core.cache.admit(list(range(20)))
        with pytest.raises(OwnershipError, match="Engine.step"):
            core.engine.step()
        assert core.loop.call(lambda: core.cache.lookup([1, 2]).length).result() == 0
        assert asyncio.run(core.stats())["worker"]["ownership_violations"] == 2
    finally:
        core.close()


def test_calibration_measures_every_rate_through_the_worker(tmp_path):
    core = make("w-cal", cold_blocks=32, disk_dir=str(tmp_path), calibrate_at_start=True)   # every tier and rate
    try:
        cost = core.cost
        # Calibration produced a measurement for each rate (its size is the benchmarks' business).
        measured = (cost.prefill_tokens_per_s, cost.warm_promote_tokens_per_s, cost.cold_promote_tokens_per_s,
                    cost.transfer_tokens_per_s)
        assert all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in measured), measured
        # Measured, not the fallback ratios calibration uses for a tier or a NIXL it lacks.
        assert cost.cold_promote_tokens_per_s != cost.warm_promote_tokens_per_s / 10
        if nixl_available():
            assert cost.transfer_tokens_per_s != cost.warm_promote_tokens_per_s / 4
        assert cost.block_tokens == 16
        rates = core.info().rates
        assert dataclasses.astuple(rates)[:4] == measured   # what the worker registers is what it measured
        # Calibration leaves nothing behind.
        tiers = asyncio.run(core.stats())["tiers"]
        assert [tiers[t]["used_tokens"] for t in ("hot", "warm", "cold")] == [0, 0, 0]
    finally:
        core.close()


@pytest.mark.usefixtures("needs_nixl")
def test_prefix_moves_between_workers_over_nixl():
    holder, target = make("w-holder"), make("w-target")
    try:
        prompt = list(range(100, 180))
        run(holder, prompt, max_tokens=1)
        staged = asyncio.run(holder.export_prefix(prompt))
        assert staged.tokens == 80 and len(staged.blocks) == 5
        peer = target.nixl.connect(holder.nixl.metadata())
        kv, nbytes = target.migration.pull_blocks_nixl(peer, staged.blocks, staged.checksums, staged.tokens)
        assert nbytes == 5 * 16 * target.layout.bytes_per_token()
        asyncio.run(holder.release(staged.lease))
        _, ref = forward_one(DecoderModel(ModelConfig(**MODEL)), torch.tensor(prompt), 0, None)
        assert torch.allclose(kv, ref, atol=1e-5)
        assert target.loop.call(lambda: target.cache.install(prompt, None, kv)).result() == 80
        items = run(target, prompt + [7])
        assert items[0].cached_tokens == 80
        assert [i.token for i in items] == greedy(prompt + [7], 4)
    finally:
        holder.close()
        target.close()


class InProcessLink:
    """PeerLink to another WorkerCore in this process (what the Ray and Serve links wrap)."""

    transport = Transport.OBJECT_STORE

    def __init__(self, core):
        self.core = core

    async def export_prefix(self, tokens, tenant):
        return await self.core.export_prefix(tokens, tenant)

    async def info(self):
        return self.core.info()

    async def fetch_blocks(self, lease):
        return await self.core.fetch_blocks(lease)

    def release(self, lease):
        self.core.loop.call(lambda: self.core.migration.release(lease))


@pytest.mark.usefixtures("needs_nixl")
def test_migration_falls_back_from_nixl_to_the_object_store_to_recompute():
    holder, target = make("m-holder"), make("m-target")
    try:
        link = InProcessLink(holder)
        prompts = [list(range(10, 74)), list(range(80, 144)), list(range(150, 214))]
        for p in prompts:
            run(holder, p, max_tokens=1)
        got = asyncio.run(target.migrate_from("m-holder", link, prompts[0], None))
        assert (got.transport, got.tokens) == (Transport.NIXL, 64)
        target.migration.inject_fault("nixl")
        got = asyncio.run(target.migrate_from("m-holder", link, prompts[1], None))
        assert (got.transport, got.tokens) == (Transport.OBJECT_STORE, 64)
        holder.migration.inject_fault("fallback")
        got = asyncio.run(target.migrate_from("m-holder", link, prompts[2], None))
        assert (got.transport, got.tokens) == (None, 0)
        got = asyncio.run(target.migrate_from("m-holder", link, [250, 251, 252], None))
        assert got.transport is None and target.migration.stats["stale_migrations"] == 1
        for p in prompts[:2]:   # what arrived is used, and equals a full prefill
            items = run(target, p + [1])
            assert items[0].cached_tokens == 64 and [i.token for i in items] == greedy(p + [1], 4)
        assert target.migration.stats["fallback_pulls"] == 1
        assert target.migration.stats["recomputed_after_failed_migration"] == 1
        # Every lease was released: the holder's host pool holds no staging blocks.
        assert asyncio.run(holder.stats())["tiers"]["warm"]["used_tokens"] == 0
    finally:
        holder.close()
        target.close()


def test_a_model_that_cannot_load_stops_the_worker_before_it_starts(tmp_path):
    """A replica that cannot load its model never reports ready: the worker's
    constructor raises an error naming the problem (Serve marks the replica failed)."""
    from cluster.engine.checkpoint import CheckpointError

    missing = tmp_path / "no-such-model"
    with pytest.raises(CheckpointError, match="no-such-model"):
        WorkerCore("w-bad", WorkerConfig.from_dict(dict(model=str(missing), hot_blocks=16, block_tokens=16)))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(CheckpointError, match="gpt2"):
        WorkerCore("w-bad", WorkerConfig.from_dict(dict(model=str(tmp_path / "broken"), hot_blocks=16,
                                                        block_tokens=16)))


def test_a_migration_between_serve_style_workers_runs_over_their_peer_channel():
    """Replica to replica, no Serve and no Ray in between: the target asks the holder's
    peer channel for the export, READs over NIXL (or, with NIXL broken, fetches the
    staged blocks over the same channel), installs, and the result equals a full prefill."""
    from actors.peer import PeerClient, PeerRefusedError

    holder = make("p-holder", peer_host="127.0.0.1", peer_secret="s3")
    target = make("p-target", peer_host="127.0.0.1", peer_secret="s3")
    try:
        prompts = [list(range(10, 74)), list(range(80, 144))]
        for p in prompts:
            run(holder, p, max_tokens=1)

        async def pull(prompt):
            link = PeerClient("p-holder", holder.peer.address, secret="s3")
            return await target.migrate_from("p-holder", link, prompt, None)

        want = Transport.NIXL if nixl_available() else Transport.PEER
        got = asyncio.run(pull(prompts[0]))
        assert (got.transport, got.tokens) == (want, 64)
        target.migration.inject_fault("nixl")
        got = asyncio.run(pull(prompts[1]))
        assert (got.transport, got.tokens) == (Transport.PEER, 64)
        for p in prompts:
            items = run(target, p + [1])
            assert items[0].cached_tokens == 64 and [i.token for i in items] == greedy(p + [1], 4)

        async def wrong_secret():
            return await PeerClient("p-holder", holder.peer.address, secret="nope").info()
        with pytest.raises(PeerRefusedError, match="wrong or missing secret"):
            asyncio.run(wrong_secret())
        # Every lease was released over the channel: no staging blocks left on the holder.
        assert asyncio.run(holder.stats())["tiers"]["warm"]["used_tokens"] == 0
    finally:
        holder.close()
        target.close()


def fails_once(fn, exc: Exception):
    """``fn`` that raises ``exc`` on its first call, and the list of its calls."""
    calls = []

    def wrapped():
        calls.append(1)
        if len(calls) == 1:
            raise exc
        fn()
    return wrapped, calls


@pytest.mark.parametrize("hook, counter", [("tick", "tick_failures"), ("idle", "idle_failures")])
def test_a_tick_or_idle_housekeeping_that_fails_leaves_the_engine_thread_serving(hook, counter):
    core = make(f"w-{hook}")
    try:
        if hook == "tick":   # the rate refiner runs in every tick (the start-up race raised there)
            core.refiner.tick, calls = fails_once(core.refiner.tick, AttributeError("a start-up race"))
        else:
            core.cache.housekeeping, calls = fails_once(core.cache.housekeeping, RuntimeError("a housekeeping bug"))
        core.loop.wake()   # an iteration now: an idle gap and its tick
        deadline = time.monotonic() + 30
        while not calls and time.monotonic() < deadline:
            time.sleep(0.01)
        prompt = list(range(40))
        assert [i.token for i in run(core, prompt)] == greedy(prompt, 4)   # served after the failure
        assert core.loop.stats[counter] == 1 and core.loop.alive()
    finally:
        core.close()


def test_a_rate_measured_before_the_worker_registered_waits_for_its_registration():
    class Directory:
        def __init__(self):
            self.calls = []

        def register(self, worker_id, rates, peer_address, fresh):
            self.calls.append((worker_id, peer_address, fresh))

    core = make("w-rates")
    try:
        # A refiner's rate change on the engine thread while the constructor still runs: the
        # directory is known, the peer channel not yet open, the worker not yet registered.
        directory = Directory()
        core.directory, core.registered = directory, False
        core.loop.call(lambda: core._rates_changed(core.cost)).result(timeout=30)
        assert directory.calls == []   # the constructor's registration carries the new rates
        core.registered = True
        core.loop.call(lambda: core._rates_changed(core.cost)).result(timeout=30)
        assert directory.calls == [("w-rates", None, False)]
    finally:
        core.directory = None
        core.close()
