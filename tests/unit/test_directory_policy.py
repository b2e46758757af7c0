"""The directory updates its policy in place: what the policy learned survives
workers joining, rates changing and other workers leaving."""

import asyncio
import dataclasses

from tests.requirements import require_module

require_module("ray")

from actors.directory import DirectoryImpl  # noqa: E402
from cluster.cache.radix_tree import HOT  # noqa: E402
from cluster.protocol import LoadReport, MeasuredRates  # noqa: E402
from cluster.routing.events import EventBatch, KVEvent  # noqa: E402

RATES = MeasuredRates(prefill_tokens_per_s=1000.0, warm_promote_tokens_per_s=10_000.0, cold_promote_tokens_per_s=1000.0,
                      transfer_tokens_per_s=5000.0, block_tokens=16)
SYSTEM = [1, 2, 3]


def test_learned_state_survives_a_worker_joining_and_a_rate_change():
    async def scenario():
        d = DirectoryImpl(policy="cost", block_tokens=100, heartbeat_timeout_s=0,
                          policy_kwargs={"inflight_s": 0, "replicate_share": 0})   # a keeps the prefix
        for w in ("a", "b"):
            await d.register_worker(w, rates=RATES)
        policy = d.policy
        await d.publish("a", EventBatch("a", 1, [KVEvent("stored", SYSTEM, HOT)]).encode())
        first = await d.route(SYSTEM + [10], 400, reserve=False)
        second = await d.route(SYSTEM + [11], 400, reserve=False)        # 3 continued two ways: a branch point
        learned = policy.recent_work_s(first.worker_id)
        assert (first.worker_id, second.worker_id) == ("a", "a")      # local hits beat recomputing
        assert learned > 0
        await d.register_worker("c", rates=dataclasses.replace(RATES, prefill_tokens_per_s=500.0))   # joins, slower
        assert d.policy is policy                                       # not rebuilt
        assert policy.cost.prefill_tokens_per_s == 500.0                # re-priced in place
        assert policy.recent_work_s(first.worker_id) == learned      # learned work kept
        assert policy._branches.observe(SYSTEM + [12], 4) == 3          # branch point kept
        await d.publish("b", None, LoadReport(0, 0, 0, 20_000.0))
        assert d.policy is policy and policy.cost.transfer_tokens_per_s == 5000.0   # min over workers
        await d.drop_worker("b")
        assert policy.recent_work_s("b") == 0.0 and policy.recent_work_s("a") == learned
        assert d.live_workers() == ["a", "c"]

    asyncio.run(scenario())
