"""Serve's custom-metrics hook on a real worker (``CacheWorker`` as a Ray actor, the class the
Serve replica is): every signal, as the numbers Serve accepts, and a served request's TTFT."""

import asyncio

import pytest
import ray

from cluster.protocol import SamplingParams
from cluster.routing.autoscale_signals import METRIC_NAMES

pytestmark = pytest.mark.distributed


def test_a_worker_reports_its_autoscaling_signals(cache_cluster):
    cc = cache_cluster
    worker = cc.worker_ids[0]
    result = asyncio.run(cc.client().complete(list(range(1, 41)), SamplingParams(max_tokens=2), worker_id=worker))
    assert result.worker_id == worker
    stats = ray.get(cc.workers[worker].record_autoscaling_stats.remote(), timeout=30)
    assert set(stats) == set(METRIC_NAMES) and all(type(v) is float for v in stats.values())
    assert stats["ttft_p90_s"] > 0 and stats["prefill_tokens_per_s"] > 0
    assert (stats["queued_prompt_tokens"], stats["blocked_for_room"]) == (0.0, 0.0)   # served: nothing waits
