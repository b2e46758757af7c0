"""ReplyStore: the ids behind the model's replies, shared by every ingress replica.

A chat client sends the assistant's last reply back as text; the ingress
that tokenizes the next turn needs the ids the model sampled for it (see
``cluster.engine.text.ReplyMemory``), but with several ingress replicas
the next turn may arrive at another one. Each ingress keeps its own
``ReplyMemory`` and writes every reply through to this named actor; a turn
whose assistant texts are not known locally asks it once, with a timeout
(``SharedReplies.prefetch``), before tokenizing. The store is a cache: a
lost or slow store only means re-tokenizing those texts (the cached prefix
then ends at the reply).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Sequence

import ray

from cluster.engine.text import ReplyMemory
from cluster.names import REPLY_STORE_NAME

log = logging.getLogger(__name__)


class ReplyStoreImpl:
    def __init__(self, max_entries: int = 200_000, max_tokens: int = 40_000_000):
        self.memory = ReplyMemory(max_entries, max_tokens)

    def remember(self, namespace: str, text: str, ids: list[int]) -> None:
        self.memory.remember(namespace, text, ids)

    def recall_many(self, namespace: str, texts: list[str]) -> list[list[int] | None]:
        return [self.memory.recall(namespace, t) for t in texts]


ReplyStore = ray.remote(ReplyStoreImpl)


class SharedReplies:
    """An ingress's reply memory: ``local`` (what its prompt builder reads)
    plus the cluster's ``ReplyStore`` behind it."""

    def __init__(self, namespace: str, local: ReplyMemory, *, timeout_s: float = 0.5):
        self.namespace, self.local, self.timeout_s = namespace, local, timeout_s
        self._store = None
        self.stats = {"remote_hits": 0, "remote_misses": 0, "remote_failures": 0}

    def _handle(self):
        if self._store is None:
            self._store = ReplyStore.options(name=REPLY_STORE_NAME, namespace=self.namespace, get_if_exists=True,
                                             lifetime="detached", max_restarts=-1, num_cpus=0).remote()
        return self._store

    def start(self) -> None:
        """Find or create the store now (its process starts in the background);
        a failure here is retried at the first use."""
        try:
            self._handle()
        except Exception as exc:   # the store is a cache: the ingress serves without it
            log.info("reply store unavailable at start (%s)", exc)

    def recall(self, tenant: str, text: str) -> list[int] | None:
        return self.local.recall(tenant, text)

    def remember(self, tenant: str, text: str, ids: Sequence[int]) -> None:
        self.local.remember(tenant, text, ids)
        try:
            self._handle().remember.remote(tenant, text, list(ids))   # fire and forget
        except Exception as exc:   # the store is a cache: this ingress still remembers
            self.stats["remote_failures"] += 1
            log.info("reply store unavailable (%s)", exc)

    async def prefetch(self, tenant: str, texts: list[str]) -> None:
        """Bring the ids of ``texts`` this ingress does not know from the store."""
        missing = [t for t in dict.fromkeys(texts) if t and self.local.recall(tenant, t) is None]
        if not missing:
            return
        try:
            handle = await asyncio.to_thread(self._handle) if self._store is None else self._store
            found = await asyncio.wait_for(handle.recall_many.remote(tenant, missing), self.timeout_s)
        except Exception as exc:   # slow or gone: these texts are tokenized as sent
            self._store = None
            self.stats["remote_failures"] += 1
            log.info("reply store did not answer (%s); tokenizing the replies as sent", type(exc).__name__)
            return
        for text, ids in zip(missing, found):
            if ids:
                self.local.remember(tenant, text, ids)
                self.stats["remote_hits"] += 1
            else:
                self.stats["remote_misses"] += 1
