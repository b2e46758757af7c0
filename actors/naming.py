"""Names of the cluster's actors, shared by every layer that looks them up."""

DIRECTORY_NAME = "prefix-cache-directory"
WORKER_PREFIX = "prefix-cache-worker:"


def worker_actor_name(worker_id: str) -> str:
    return WORKER_PREFIX + worker_id
