"""The real Ray autoscaler on the fake node provider (``autoscaling_cluster``): work that needs
a node gets one, and the node is given back once it is idle."""

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
