"""The watchdog on a real worker (the one shell, ``CacheWorker``, as a Ray actor): a wedged engine fails its request,
the client finishes it on another worker, the worker's ``health`` raises and
the directory drops it at once (not after missed heartbeats)."""

import asyncio
import time

import pytest
import ray

from actors.engine_loop import EngineWedgedError
from actors.pytest_plugin import node_resource
from cluster.protocol import SamplingParams

pytestmark = pytest.mark.distributed


def test_a_wedged_worker_fails_over_and_is_dropped(cache_cluster):
    from actors.worker import start_worker

    cc = cache_cluster
    config = {**cc.config, "watchdog_s": 0.5}
    wedged = start_worker("wd", config, namespace=cc.namespace, resources={node_resource(0): 0.01}, num_gpus=0,
                          peer_secret=cc.peer_secret)
    try:
        cc.addresses["wd"] = ray.get(wedged.ready.remote(), timeout=120)
        deadline = time.monotonic() + 30
        while "wd" not in ray.get(cc.directory.live_workers.remote()):
            assert time.monotonic() < deadline, "the new worker never registered"
            time.sleep(0.1)
        ray.get(wedged.check_health.remote())   # healthy before the wedge
        cc.on_peer("wd", lambda peer: peer.inject_fault("wedge"))
        prompt = list(range(1, 41))
        result = asyncio.run(cc.client().complete(prompt, SamplingParams(max_tokens=4), worker_id="wd"))
        assert result.attempt == 1 and result.worker_id != "wd" and len(result.tokens) == 4
        with pytest.raises(EngineWedgedError, match="watchdog bound 0.5 s"):
            ray.get(wedged.check_health.remote())
        assert "wd" not in ray.get(cc.directory.live_workers.remote())
    finally:
        ray.kill(wedged, no_restart=True)
        cc.addresses.pop("wd", None)
