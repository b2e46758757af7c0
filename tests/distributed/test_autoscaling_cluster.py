"""The real Ray autoscaler on the fake node provider (``autoscaling_cluster``): work that needs
a node gets one (an actor, a Serve replica), and the node is given back once it is idle."""

import asyncio
import concurrent.futures

import pytest
import ray

from actors.pytest_plugin import AUTOSCALED_RESOURCE

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@ray.remote(num_cpus=1, resources={AUTOSCALED_RESOURCE: 1})
class NeedsANode:
    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


def test_a_scale_out_that_needs_a_node_gets_one_and_a_scale_in_gives_it_back(autoscaling_cluster):
    head = autoscaling_cluster.wait_nodes(1, timeout_s=30)[0]
    assert head["Resources"].get(AUTOSCALED_RESOURCE) is None   # no node of the head's can take it
    actor = NeedsANode.remote()
    placed_on = ray.get(actor.node_id.remote(), timeout=120)
    nodes = autoscaling_cluster.wait_nodes(2, timeout_s=60)
    added = [n for n in nodes if n["NodeID"] != head["NodeID"]]
    assert [n["NodeID"] for n in added] == [placed_on]
    assert added[0]["Resources"][AUTOSCALED_RESOURCE] == 1.0
    ray.kill(actor)
    remaining = autoscaling_cluster.wait_nodes(1, timeout_s=120)
    assert [n["NodeID"] for n in remaining] == [head["NodeID"]]


def test_a_serve_replica_that_needs_a_node_gets_one_and_gives_it_back(autoscaling_cluster):
    """What KubeRay does for the cache replicas: Serve asks for a replica no node can hold, the
    autoscaler adds a node, the replica serves there; the app deleted, the node goes."""
    from ray import serve

    from serve_app.local import free_port

    head = autoscaling_cluster.wait_nodes(1, timeout_s=120)[0]

    @serve.deployment(ray_actor_options={"num_cpus": 1, "resources": {AUTOSCALED_RESOURCE: 1}})
    class Where:
        def __call__(self) -> str:
            return ray.get_runtime_context().get_node_id()

    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
    deploying = concurrent.futures.ThreadPoolExecutor(1)   # serve.run waits for the replica, unbounded

    async def deploy_ask_delete() -> tuple[str, list[dict]]:   # handles route on the caller's event loop
        try:
            await asyncio.wait_for(asyncio.wrap_future(deploying.submit(
                serve.run, Where.bind(), name="needs-a-node", route_prefix=None)), 180)
            placed_on = await asyncio.wait_for(serve.get_app_handle("needs-a-node").remote(), 60)
            return placed_on, await asyncio.to_thread(autoscaling_cluster.wait_nodes, 2, 60)
        finally:
            await serve.shutdown_async()
            deploying.shutdown(wait=False)

    placed_on, nodes = asyncio.run(deploy_ask_delete())
    assert [n["NodeID"] for n in nodes if n["NodeID"] != head["NodeID"]] == [placed_on]
    remaining = autoscaling_cluster.wait_nodes(1, timeout_s=120)
    assert [n["NodeID"] for n in remaining] == [head["NodeID"]]
