"""Eviction policies: tiny strategy classes that rank nodes, lowest first out."""

from __future__ import annotations

from typing import Any

from cluster.errors import InvalidInputError


class LRUPolicy:
    """Least recently used first."""

    name = "lru"

    @staticmethod
    def priority(node: Any) -> float:
        return node.last_access


class LFUPolicy:
    """Least frequently hit first; recency breaks ties."""

    name = "lfu"

    @staticmethod
    def priority(node: Any) -> tuple[int, float]:
        return (node.hit_count, node.last_access)


POLICIES = {p.name: p for p in (LRUPolicy, LFUPolicy)}


def make_policy(name_or_policy: str | Any) -> Any:
    if not isinstance(name_or_policy, str):
        return name_or_policy
    try:
        return POLICIES[name_or_policy]()
    except KeyError:
        raise InvalidInputError(
            f"unknown eviction policy {name_or_policy!r}; choose one of {sorted(POLICIES)}") from None
