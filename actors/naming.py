"""Names of the cluster's actors (defined once, in ``cluster.names``)."""

from cluster.names import DEFAULT_NAMESPACE, DIRECTORY_NAME, WORKER_PREFIX, worker_actor_name

__all__ = ["DEFAULT_NAMESPACE", "DIRECTORY_NAME", "WORKER_PREFIX", "worker_actor_name"]
