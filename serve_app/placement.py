"""Where the cache replicas run: on a GPU each, or on the CPU, decided when the app is built.

Every GPU is meant to run one cache replica, and a replica sees only the GPUs it claims
(Ray hides the others: a replica that claims none finds no CUDA device, and ``device:
auto`` then quietly means the CPU). So the claim is decided at deploy time, from what
the Ray cluster offers:

- ``gpus_per_replica`` unset: one GPU per replica when the cluster has GPUs, the CPU
  otherwise (a worker config that says ``device: cpu`` keeps the CPU either way);
- ``gpus_per_replica`` set (0 or more): honoured as given. Set it where the GPUs are not
  there yet when the app deploys: on KubeRay the autoscaler adds GPU pods for replicas
  that wait for one, so the manifests say 1 (``k8s/render/serve-overrides.yaml``);
- ``device: cuda`` for replicas that would get no GPU (none in the cluster, or
  ``gpus_per_replica: 0``) fails the deploy, naming the setting: such a replica could
  only fail at start.

``decide_placement`` is the decision alone (pure: the configured values and the
cluster's resources in, the claim and the deploy log's line out); ``serve_app.app``
reads the resources and logs the line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

# The configured value meaning "decide from the cluster".
AUTO = None


class PlacementError(ValueError):
    """The replicas' configuration cannot run on this cluster; the message names the setting."""


@dataclass(frozen=True)
class ReplicaPlacement:
    num_gpus: float
    reason: str            # the deploy log's line
    warning: bool = False  # the line says something is probably wrong (logged as a warning)

    @property
    def on_gpu(self) -> bool:
        return self.num_gpus > 0

    def actor_options(self) -> dict[str, Any]:
        # A GPU replica's engine thread drives the device; a CPU one computes on a core.
        return {"num_gpus": self.num_gpus, "num_cpus": 0 if self.on_gpu else 1}


def parse_gpus_per_replica(value: Any) -> float | None:
    """``gpus_per_replica`` as configured: None (unset: decide from the cluster) or a
    number >= 0 (``serve run ... gpus_per_replica=1`` passes it as text)."""
    if value is None:
        return AUTO
    if isinstance(value, bool):
        raise PlacementError(f"gpus_per_replica must be a number >= 0 or unset, got {value!r}")
    try:
        gpus = float(value)
    except (TypeError, ValueError):
        raise PlacementError(f"gpus_per_replica must be a number >= 0 or unset, got {value!r}") from None
    if not math.isfinite(gpus) or gpus < 0:
        raise PlacementError(f"gpus_per_replica must be a number >= 0 or unset, got {value!r}")
    return gpus


def _needs_gpu(device: str) -> bool:
    return device == "cuda" or device.startswith("cuda:")


def decide_placement(gpus_per_replica: float | None, device: str, cluster_resources: Mapping[str, float],
                     seen_by: str = "the Ray cluster") -> ReplicaPlacement:
    """The GPUs each cache replica claims. ``gpus_per_replica``: as configured (None:
    unset); ``device``: the worker config's ``device`` (``auto``, ``cpu``, ``cuda``,
    ``cuda:N``); ``cluster_resources``: ``ray.cluster_resources()`` (``GPU``: how many
    the cluster has); ``seen_by``: whose resources they are, for the log line.
    Raises ``PlacementError`` for ``device: cuda`` on replicas that would get no GPU."""
    gpus = parse_gpus_per_replica(gpus_per_replica)
    total = float(cluster_resources.get("GPU", 0) or 0)
    has = f"{seen_by} has {total:g} GPU{'s' if total != 1 else ''}"
    if gpus is AUTO:
        if total >= 1 and device != "cpu":
            return ReplicaPlacement(1.0, f"cache replicas claim 1 GPU each: {has} and gpus_per_replica is unset "
                                         f"(worker device {device!r})")
        if total >= 1:
            return ReplicaPlacement(0.0, f"cache replicas run on the CPU: the worker config says device 'cpu' "
                                         f"({has}, unused by them)")
        if _needs_gpu(device):
            raise PlacementError(
                f"worker device is {device!r} but {seen_by} has no GPU (resources: {_shown(cluster_resources)}): "
                f"set the worker's device to 'auto' or 'cpu', add GPU nodes, or set gpus_per_replica where an "
                f"autoscaler adds GPU nodes for replicas that wait for one")
        return ReplicaPlacement(0.0, f"cache replicas run on the CPU: {seen_by} has no GPU "
                                     f"and gpus_per_replica is unset")
    if gpus == 0:
        if _needs_gpu(device):
            raise PlacementError(
                f"worker device is {device!r} but gpus_per_replica is 0: a replica that claims no GPU sees "
                f"none (Ray hides them); set gpus_per_replica to 1 (or unset it) or the worker's device to "
                f"'auto' or 'cpu'")
        unused = f" ({has}, unused by them)" if total >= 1 else ""
        return ReplicaPlacement(0.0, f"cache replicas run on the CPU: gpus_per_replica is 0{unused}",
                                warning=total >= 1)
    claim = f"cache replicas claim {gpus:g} GPU each: gpus_per_replica is {gpus:g}"
    if device == "cpu":
        return ReplicaPlacement(gpus, f"{claim}, but the worker config says device 'cpu': the GPU goes unused",
                                warning=True)
    if total < gpus:
        return ReplicaPlacement(gpus, f"{claim}; {has} now: replicas wait until nodes with GPUs join "
                                      f"(an autoscaler adds them)", warning=True)
    return ReplicaPlacement(gpus, f"{claim} ({has})")


def _shown(resources: Mapping[str, float]) -> str:
    keys = [k for k in ("CPU", "GPU") if k in resources]
    return ", ".join(f"{k} {float(resources[k]):g}" for k in keys) or "none"
