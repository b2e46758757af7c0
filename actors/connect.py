"""Joining a running Ray cluster from a command (``serve --address``,
``loadtest --address``, ``bench transfer --address``) without hanging.

``ray.init(address=...)`` has no deadline of its own: when nothing answers
at the address, or when Ray rewrites a loopback address to this machine's
network address (it does unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is
set before Ray starts), it retries for as long as the process lives.
"""

from __future__ import annotations

import threading
from typing import Any

from cluster.errors import InvalidInputError

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


def is_loopback(address: str) -> bool:
    """Whether a ``host:port`` Ray address names this machine's loopback."""
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host in LOOPBACK_HOSTS


def connect(address: str, *, timeout_s: float = 30.0, **init_kwargs: Any) -> None:
    """``ray.init(address=address, **init_kwargs)``, or ``TimeoutError`` naming the
    address when no cluster answered within ``timeout_s``.

    A loopback address keeps this driver on loopback too (the cluster a
    ``prefix-cache serve`` started binds 127.0.0.1 only). The connecting
    thread is a daemon: a process that gives up exits without waiting for it.
    """
    if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise InvalidInputError(f"the connect timeout must be a positive number of seconds, got {timeout_s!r}")
    import ray

    if is_loopback(address):
        # Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, when it is imported,
        # into this switch; setting the switch works whenever Ray was imported.
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False

    done, failure = threading.Event(), []

    def join() -> None:
        try:
            ray.init(address=address, **init_kwargs)
        except BaseException as exc:   # handed to the caller below
            failure.append(exc)
        finally:
            done.set()

    threading.Thread(target=join, name="ray-connect", daemon=True).start()
    if not done.wait(timeout_s):
        raise TimeoutError(f"no Ray cluster answered at {address} within {timeout_s:g} s "
                           f"(is it running? `prefix-cache serve` prints its address as 'Ray cluster at ...')")
    if failure:
        raise failure[0]


__all__ = ["connect", "is_loopback", "LOOPBACK_HOSTS"]
