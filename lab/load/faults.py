"""The app's processes as the load and fault drills see them, through Ray's actor table.

``ClusterProbe`` finds the Serve replicas and the directory of one namespace,
reads their memory from /proc (the cluster runs on this machine), finds the
busiest replica (the directory's view of the workers' load reports), kills one (a replica: Serve starts another; the
directory: Ray restarts it), tells when the app is whole again, and reads
the app's counters from the Ray nodes' metrics endpoints. It kills only
actors of the app it was pointed at.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

REPLICA_CLASS = "CacheReplica"


@dataclass(frozen=True)
class ActorRecord:
    actor_id: str
    class_name: str
    name: str
    pid: int

    @property
    def worker_id(self) -> str:
        """The id a CacheReplica registers with the directory: its Serve replica id, the
        last part of the actor's name (``SERVE_REPLICA::app#CacheReplica#<id>``)."""
        return self.name.rsplit("#", 1)[-1]


class ClusterProbe:
    """The app's processes through Ray (the GCS actor table: no dashboard needed):
    memory, the kill, recovery."""

    def __init__(self, namespace: str):
        self.namespace = namespace

    def _actors(self) -> list[ActorRecord]:
        from ray._private import state

        return [ActorRecord(a["ActorID"], a["ActorClassName"] or "", a["Name"] or "", a["Pid"])
                for a in state.actors().values() if a["State"] == "ALIVE"]

    def replicas(self) -> list[ActorRecord]:
        return [a for a in self._actors() if REPLICA_CLASS in a.class_name]

    def _directory_handle(self):
        import ray

        from cluster.names import DIRECTORY_NAME

        try:
            return ray.get_actor(DIRECTORY_NAME, namespace=self.namespace)
        except ValueError:
            return None

    def directory(self) -> ActorRecord | None:
        handle = self._directory_handle()
        if handle is None:
            return None
        actor_id = handle._actor_id.hex()
        return next((a for a in self._actors() if a.actor_id == actor_id), None)

    def rss_mib(self) -> float | None:
        total, found = 0, False
        for a in self._actors():
            if a.class_name.startswith("ServeReplica") or a.class_name.startswith("Directory"):
                try:
                    with open(f"/proc/{a.pid}/status") as f:
                        rss = next(line for line in f if line.startswith("VmRSS:"))
                    total += int(rss.split()[1])
                    found = True
                except (OSError, StopIteration):
                    pass
        return round(total / 1024, 1) if found else None

    def live_workers(self) -> list[str]:
        """The workers the directory's routing table lists (empty when it does not answer)."""
        import ray

        handle = self._directory_handle()
        try:
            return ray.get(handle.live_workers.remote(), timeout=2) if handle is not None else []
        except Exception:
            return []

    def lifecycle(self, kind: str) -> list[dict]:
        """The directory's latest lifecycle notes of ``kind`` (handoff, warmup, startup)."""
        import ray

        handle = self._directory_handle()
        try:
            notes = ray.get(handle.get_stats.remote(), timeout=5)["lifecycle"] if handle is not None else []
        except Exception:
            return []
        return [n for n in notes if n.get("kind") == kind]

    def loads(self) -> dict[str, tuple[int, int]]:
        """Each worker's (queued tokens, running requests) as the directory last heard them
        (the load report every worker sends with its KV events: waiting prompt tokens plus
        the running requests' remaining tokens); empty when it does not answer."""
        import ray

        handle = self._directory_handle()
        try:
            stats = ray.get(handle.get_stats.remote(), timeout=2) if handle is not None else {}
        except Exception:
            return {}
        return {w: (s["queued_tokens"], s["running"]) for w, s in stats.get("workers", {}).items()}

    def busiest_replica(self, replicas: list[ActorRecord]) -> tuple[ActorRecord, int] | None:
        """Of ``replicas`` running requests, the one with the most work left (ties: the lowest
        actor id), and how many it runs; None while none runs any."""
        loads = self.loads()
        busy = [(loads[a.worker_id], a) for a in replicas if loads.get(a.worker_id, (0, 0))[1] > 0]
        if not busy:
            return None
        (_, running), victim = min(busy, key=lambda b: (-b[0][0], b[1].actor_id))
        return victim, running

    def kill(self, what: str, victim: ActorRecord | None = None, replicas: list[ActorRecord] | None = None) -> dict:
        """Kill one replica (``victim``, else a fixed choice among the live ones: ``replicas``, read
        from the actor table when not given) or the directory."""
        import ray

        if what == "replica":
            replicas = sorted(self.replicas() if replicas is None else replicas, key=lambda a: a.actor_id)
            if not replicas:
                raise RuntimeError("no CacheReplica actor is alive")
            victim = victim or random.Random(0).choice(replicas)
            ray.kill(ray.get_actor(victim.name, namespace="serve"), no_restart=True)
            return {"kind": "replica", "actor_id": victim.actor_id, "worker_id": victim.worker_id,
                    "replicas_before": len(replicas)}
        handle = self._directory_handle()
        if handle is None:
            raise RuntimeError(f"no directory in namespace {self.namespace!r}")
        ray.kill(handle, no_restart=False)   # Ray restarts it, empty
        return {"kind": "directory", "actor_id": handle._actor_id.hex(), "worker_id": None,
                "replicas_before": len(self.replicas())}

    def whole(self, killed: dict) -> bool:
        """Whole again: the killed actor gone (a directory: back), as many replicas alive as
        before, and the directory's routing table listing every live replica and no longer
        the killed one (until the directory drops it, routers may still choose it)."""
        replicas = self.replicas()
        if len(replicas) < killed["replicas_before"]:
            return False
        if killed["kind"] == "replica" and any(a.actor_id == killed["actor_id"] for a in replicas):
            return False
        if killed["kind"] == "directory" and self.directory() is None:
            return False
        listed = set(self.live_workers())
        if killed.get("worker_id") in listed:
            return False
        return all(a.worker_id in listed for a in replicas)

    def metric(self, name: str, nodes: list[dict] | None = None) -> dict[str, float] | None:
        """Every series of the Prometheus metric ``name`` (as Ray exports it: ``ray_`` first)
        on the alive nodes' metrics endpoints (``nodes``: ``ray.nodes()`` by default), keyed by
        node and labels; None when no node answered. Ray exports a process's metrics every
        ``metrics_report_interval_ms``."""
        import httpx

        if nodes is None:
            import ray

            nodes = ray.nodes()
        series, answered = {}, False
        for node in nodes:
            if not node.get("Alive") or not node.get("MetricsExportPort"):
                continue
            try:
                text = httpx.get(f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics",
                                 timeout=5).text
            except httpx.HTTPError:
                continue
            answered = True
            for line in text.splitlines():
                if line.startswith((name + "{", name + " ")):
                    labels, _, rest = line.rpartition("}") if "}" in line else line.partition(" ")
                    series[f"{node['NodeID']}|{labels}"] = float(rest.split()[0])
        return series if answered else None
