"""The app's processes as the load and fault drills see them, through Ray's actor table.

``ClusterProbe`` finds the Serve replicas and the directory of one namespace,
reads their memory from /proc (the cluster runs on this machine), kills one
(a replica: Serve starts another; the directory: Ray restarts it) and tells
when the app is whole again. It kills only actors of the app it was pointed at.
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
        import ray

        handle = self._directory_handle()
        try:
            return ray.get(handle.live_workers.remote(), timeout=2) if handle is not None else []
        except Exception:
            return []

    def kill(self, what: str) -> dict:
        import ray

        if what == "replica":
            victims = sorted(self.replicas(), key=lambda a: a.actor_id)
            if not victims:
                raise RuntimeError("no CacheReplica actor is alive")
            victim = random.Random(0).choice(victims)
            ray.kill(ray.get_actor(victim.name, namespace="serve"), no_restart=True)
            return {"kind": "replica", "actor_id": victim.actor_id, "replicas_before": len(victims)}
        handle = self._directory_handle()
        if handle is None:
            raise RuntimeError(f"no directory in namespace {self.namespace!r}")
        ray.kill(handle, no_restart=False)   # Ray restarts it, empty
        return {"kind": "directory", "actor_id": handle._actor_id.hex(), "replicas_before": len(self.replicas())}

    def whole(self, killed: dict) -> bool:
        replicas = self.replicas()
        if len(replicas) < killed["replicas_before"]:
            return False
        if killed["kind"] == "replica" and any(a.actor_id == killed["actor_id"] for a in replicas):
            return False
        if killed["kind"] == "directory" and self.directory() is None:
            return False
        return len(self.live_workers()) >= killed["replicas_before"]
