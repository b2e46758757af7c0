"""Names every layer shares: the tiers, the KV/model dtypes, the actors' names.

One home, so a tier index, a dtype string or an actor name means the same
thing in the cache, the engine, the wire types, the actors and the ingress.
"""

from __future__ import annotations

from enum import IntEnum

import torch


class Tier(IntEnum):
    """Where a node's KV lives; the value indexes per-tier lists (pools, counters)."""

    HOT = 0    # device pool (a CPU tensor without CUDA)
    WARM = 1   # host pool, pinned with CUDA, registered with NIXL
    COLD = 2   # preallocated file of checksummed block slots

    @property
    def label(self) -> str:
        return TIER_NAMES[self]


# Plain ints for the hot paths (tree and allocator code index lists with them).
HOT, WARM, COLD = int(Tier.HOT), int(Tier.WARM), int(Tier.COLD)
TIER_NAMES = ("hot", "warm", "cold")
# L3 is not a tier of one replica's tree (no pool, no node lives there): it is the
# cluster-wide block store (cluster.cache.l3). As a *source* of a request's cached
# tokens, and in KV events and the directory's index, it is number 3.
L3 = 3
SOURCE_NAMES = TIER_NAMES + ("l3",)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

DIRECTORY_NAME = "prefix-cache-directory"
REPLY_STORE_NAME = "prefix-cache-replies"
WORKER_PREFIX = "prefix-cache-worker:"
DEFAULT_NAMESPACE = "prefix-cache"


def worker_actor_name(worker_id: str) -> str:
    return WORKER_PREFIX + worker_id
