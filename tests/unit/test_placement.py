"""The cache replicas' GPU claim, decided at deploy time from the Ray cluster's resources
(``serve_app.placement``): every case of the decision on fake cluster resources."""

import pytest

from serve_app.placement import PlacementError, ReplicaPlacement, decide_placement, parse_gpus_per_replica

GPUS = {"CPU": 64.0, "GPU": 8.0, "memory": 1e12}
NO_GPU = {"CPU": 6.0, "memory": 2e10}


@pytest.mark.parametrize("device", ["auto", "cuda", "cuda:0"])
def test_unset_claims_one_gpu_per_replica_where_the_cluster_has_gpus(device):
    placement = decide_placement(None, device, GPUS)
    assert placement == ReplicaPlacement(1.0, "cache replicas claim 1 GPU each: the Ray cluster has 8 GPUs and "
                                              f"gpus_per_replica is unset (worker device {device!r})")
    assert placement.actor_options() == {"num_gpus": 1.0, "num_cpus": 0}


def test_unset_runs_on_the_cpu_where_the_cluster_has_no_gpu():
    for resources in (NO_GPU, {**NO_GPU, "GPU": 0.0}):
        placement = decide_placement(None, "auto", resources)
        assert placement == ReplicaPlacement(0.0, "cache replicas run on the CPU: the Ray cluster has no GPU "
                                                  "and gpus_per_replica is unset")
        assert placement.actor_options() == {"num_gpus": 0.0, "num_cpus": 1}


def test_unset_with_device_cpu_keeps_the_cpu_on_a_gpu_cluster():
    assert decide_placement(None, "cpu", GPUS) == ReplicaPlacement(
        0.0, "cache replicas run on the CPU: the worker config says device 'cpu' (the Ray cluster has 8 GPUs, "
             "unused by them)")


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_device_cuda_on_a_cluster_without_gpus_fails_naming_the_setting(device):
    with pytest.raises(PlacementError) as info:
        decide_placement(None, device, NO_GPU)
    assert str(info.value) == (
        f"worker device is {device!r} but the Ray cluster has no GPU (resources: CPU 6): set the worker's device "
        "to 'auto' or 'cpu', add GPU nodes, or set gpus_per_replica where an autoscaler adds GPU nodes for "
        "replicas that wait for one")


def test_device_cuda_with_zero_gpus_per_replica_fails():
    with pytest.raises(PlacementError, match="worker device is 'cuda' but gpus_per_replica is 0: a replica that "
                                             "claims no GPU sees none"):
        decide_placement(0, "cuda", GPUS)


def test_an_explicit_zero_is_honoured_on_a_gpu_cluster_and_warned_about():
    assert decide_placement(0, "auto", GPUS) == ReplicaPlacement(
        0.0, "cache replicas run on the CPU: gpus_per_replica is 0 (the Ray cluster has 8 GPUs, unused by them)",
        warning=True)
    assert decide_placement("0", "cpu", NO_GPU) == ReplicaPlacement(
        0.0, "cache replicas run on the CPU: gpus_per_replica is 0")


def test_an_explicit_claim_is_honoured_as_given():
    assert decide_placement(1, "auto", GPUS) == ReplicaPlacement(
        1.0, "cache replicas claim 1 GPU each: gpus_per_replica is 1 (the Ray cluster has 8 GPUs)")
    half = decide_placement(0.5, "cuda", GPUS)
    assert half.num_gpus == 0.5 and half.actor_options() == {"num_gpus": 0.5, "num_cpus": 0}
    assert decide_placement("2", "auto", GPUS).num_gpus == 2.0   # `serve run ... gpus_per_replica=2`


def test_an_explicit_claim_on_a_cluster_without_gpus_waits_for_the_autoscaler():
    # KubeRay: the app deploys before any GPU pod joined; the claim makes the autoscaler add one.
    placement = decide_placement(1, "cuda", NO_GPU)
    assert placement == ReplicaPlacement(
        1.0, "cache replicas claim 1 GPU each: gpus_per_replica is 1; the Ray cluster has 0 GPUs now: replicas "
             "wait until nodes with GPUs join (an autoscaler adds them)", warning=True)


def test_an_explicit_claim_for_a_cpu_device_is_kept_and_warned_about():
    placement = decide_placement(1, "cpu", GPUS)
    assert placement.num_gpus == 1.0 and placement.warning
    assert placement.reason.endswith("but the worker config says device 'cpu': the GPU goes unused")


def test_whose_resources_the_line_names():
    placement = decide_placement(None, "auto", {"GPU": 1.0}, seen_by="this machine (Ray is not connected yet)")
    assert placement.reason.startswith("cache replicas claim 1 GPU each: this machine (Ray is not connected yet) "
                                       "has 1 GPU and")


@pytest.mark.parametrize("value", [-1, "one", True, float("nan"), float("inf"), [1]])
def test_a_bad_gpus_per_replica_is_named(value):
    with pytest.raises(PlacementError, match="gpus_per_replica must be a number >= 0 or unset, got "):
        parse_gpus_per_replica(value)
