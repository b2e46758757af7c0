"""L3: the cluster-wide block store below COLD (Mooncake Store), as one package.

- ``store``: the client (``L3Store``, ``MooncakeL3Store``, ``L3Config``): keys,
  verification, deadlines, the "off" state; re-exported here, so
  ``from cluster.cache.l3 import MooncakeL3Store`` is the way in.
- ``wire``: keys and the value format (header, tokens, KV; every read verified).
- ``memory``: ``MemoryL3Store``, the same interface in process (tests, replays).
- ``tier``: ``L3Tier``, the cache's side: write behind, fetch ahead, inventories,
  on two I/O threads; ``tier_types``: its config, stats, jobs and results.
- ``link``: ``L3Link``, what ``TieredCache`` does with it on the owner thread
  (installing fetched blocks, hand-off writes, warm-up fetches).
- ``master``: ``L3Master``, a local ``mooncake_master`` and pool holder.

Pure library, like the rest of ``cluster/``: no Ray; ``mooncake`` is imported lazily.
"""

from cluster.cache.l3.store import *  # noqa: F401,F403  (the client's public names, listed in store.__all__)
from cluster.cache.l3.store import __all__  # noqa: F401
