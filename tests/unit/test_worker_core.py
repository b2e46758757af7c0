"""WorkerCore without Ray: the engine thread, streaming, queue bound, and a
prefix moving between two workers over a real NIXL READ."""

import asyncio

import pytest
import torch

from actors.core import QueueFullError, WorkerConfig, WorkerCore
from cluster.engine.model import DecoderModel, ModelConfig
from cluster.transfer.nixl_transport import nixl_available

MODEL = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128, seed=5)


def make(worker_id, **kw):
    cfg = WorkerConfig(model=MODEL, hot_blocks=128, warm_blocks=128, block_tokens=16, **kw)
    return WorkerCore(worker_id, cfg)


def run(core, prompt, max_tokens=4):
    async def go():
        return [item async for item in core.generate(prompt, {"max_tokens": max_tokens})]
    return asyncio.run(go())


def greedy(prompt, n):
    model = DecoderModel(ModelConfig(**MODEL))
    toks = list(prompt)
    for _ in range(n):
        toks.append(int(model.forward_one(torch.tensor(toks), 0, None)[0][-1].argmax()))
    return toks[len(prompt):]


def test_streams_tokens_and_caches_the_turn():
    core = make("w-a")
    try:
        prompt = list(range(40))
        items = run(core, prompt)
        assert [i["token"] for i in items] == greedy(prompt, 4) and items[-1]["finished"]
        again = run(core, prompt + [i["token"] for i in items] + [1, 2])
        assert again[0]["cached_tokens"] == 44
        stats = core.call(core.collect_stats).result()
        assert stats["protected_tokens"] == 0 and stats["engine"]["requests_finished"] == 2
    finally:
        core.close()


def test_queue_bound_rejects_with_queue_full():
    core = make("w-b", max_queued_requests=0)
    try:
        with pytest.raises(QueueFullError, match="requests queued"):
            run(core, [1, 2, 3])
        assert core.stats["rejected_queue_full"] == 1
    finally:
        core.close()


def test_unknown_worker_config_keys_are_rejected():
    with pytest.raises(ValueError, match="unknown worker config keys: \\['hot_block'\\]"):
        WorkerConfig.from_dict({"hot_block": 3})


@pytest.mark.skipif(not nixl_available(), reason="nixl cannot create a UCX backend here")
def test_prefix_moves_between_workers_over_nixl():
    holder, target = make("w-holder"), make("w-target")
    try:
        prompt = list(range(100, 180))
        run(holder, prompt, max_tokens=1)
        staged = holder.call(lambda: holder.export_prefix(prompt)).result()
        assert staged["tokens"] == 80 and len(staged["blocks"]) == 5
        peer = target.nixl.connect(holder.nixl.metadata())
        kv = target.pull_blocks_nixl(peer, staged)
        holder.call(lambda: holder.release(staged["lease"])).result()
        _, ref = DecoderModel(ModelConfig(**MODEL)).forward_one(torch.tensor(prompt), 0, None)
        assert torch.allclose(kv, ref, atol=1e-5)
        assert target.call(lambda: target.install_prefix(prompt, None, kv)).result() == 80
        items = run(target, prompt + [7])
        assert items[0]["cached_tokens"] == 80
        assert [i["token"] for i in items] == greedy(prompt + [7], 4)
    finally:
        holder.close()
        target.close()


class InProcessLink:
    """PeerLink to another WorkerCore in this process (what the Ray and Serve links wrap)."""

    def __init__(self, core):
        self.core = core

    async def export_prefix(self, tokens, tenant):
        return await asyncio.wrap_future(self.core.call(lambda: self.core.export_prefix(tokens, tenant)))

    async def info(self):
        return self.core.info()

    async def export_array(self, lease):
        return await asyncio.wrap_future(self.core.call(lambda: self.core.export_array(lease)))

    def release(self, lease):
        self.core.call(lambda: self.core.release(lease))


@pytest.mark.skipif(not nixl_available(), reason="nixl cannot create a UCX backend here")
def test_migration_falls_back_from_nixl_to_the_object_store_to_recompute():
    holder, target = make("m-holder"), make("m-target")
    try:
        link = InProcessLink(holder)
        prompts = [list(range(10, 74)), list(range(80, 144)), list(range(150, 214))]
        for p in prompts:
            run(holder, p, max_tokens=1)
        got = asyncio.run(target.migrate_from("m-holder", link, prompts[0], None))
        assert (got["transport"], got["tokens"]) == ("nixl", 64)
        target.faults.add("nixl")
        got = asyncio.run(target.migrate_from("m-holder", link, prompts[1], None))
        assert (got["transport"], got["tokens"]) == ("object_store", 64)
        holder.faults.add("object_store")
        got = asyncio.run(target.migrate_from("m-holder", link, prompts[2], None))
        assert (got["transport"], got["tokens"]) == (None, 0)
        got = asyncio.run(target.migrate_from("m-holder", link, [250, 251, 252], None))
        assert got["transport"] is None and target.stats["stale_migrations"] == 1
        for p in prompts[:2]:   # what arrived is used, and equals a full prefill
            items = run(target, p + [1])
            assert items[0]["cached_tokens"] == 64 and [i["token"] for i in items] == greedy(p + [1], 4)
        assert target.stats["object_store_fallbacks"] == 1 and target.stats["recomputed_after_failed_migration"] == 1
        # Every lease was released: the holder's host pool holds no staging blocks.
        assert holder.call(lambda: holder.cache.pools[1].allocator.used_tokens).result() == 0
    finally:
        holder.close()
        target.close()
