"""Prompt logprobs kept beside the KV, so an echo request does not recompute what the cache holds.

A prompt token's logprob comes from the logits at the position before it, and
the cache keeps KV, not logits: reading a cached prefix gives no logprob for
its tokens. So when a request asks for its prompt's logprobs (``echo`` with
``logprobs``), the engine computes the logits of every position it prefills,
and keeps, per full block of the prompt, each position's logprob and top
``TOP_K`` (44 bytes a token in all: the model's KV is about 1,000 times that),
under the block's tenant-salted chained hash (the tree's own). The next such
request reads those and computes only from the first position they do not
cover; one that finds none computes the whole prompt. For a multiple-choice
evaluation (one context, several continuations) the context is computed once.

Owned by the engine thread. Bounded: the oldest blocks go first.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Sequence

from cluster.engine.sampling import positions_logprobs
from cluster.hashing import block_hashes

TOP_K = 5   # OpenAI's completions API asks for at most 5


class PromptLogprobCache:
    def __init__(self, block_tokens: int, max_blocks: int = 1 << 16):
        self.block_tokens = block_tokens
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[int, list] = OrderedDict()   # hash -> [(logprob, top), ...] per position
        self.stats = {"hits_tokens": 0, "stored_blocks": 0}

    def covered(self, prompt: Sequence[int], namespace: Hashable, k: int) -> tuple[int, list]:
        """How many leading positions of ``prompt`` have known logprobs (the first
        always: it has none), and those entries, for a request wanting the top ``k``."""
        if k > TOP_K:
            return 1, [None]
        bt = self.block_tokens
        entries: list = []
        for h in block_hashes(prompt, bt, salt=namespace):
            block = self._blocks.get(h)
            if block is None:
                break
            self._blocks.move_to_end(h)
            entries.extend(block)
        if not entries:
            return 1, [None]
        entries[0] = None
        self.stats["hits_tokens"] += len(entries)
        return len(entries), entries

    def store(self, prompt: Sequence[int], namespace: Hashable, entries: Sequence) -> None:
        """Keep the full blocks of ``prompt`` whose positions all have entries
        (``entries[i]``: position i's (logprob, top), None for position 0)."""
        bt = self.block_tokens
        for b, h in enumerate(block_hashes(prompt[:len(entries)], bt, salt=namespace)):
            if h in self._blocks:
                self._blocks.move_to_end(h)
                continue
            block = list(entries[b * bt:(b + 1) * bt])
            if any(e is None for e in block[1 if b == 0 else 0:]):
                break
            self._blocks[h] = [None if e is None else (e[0], tuple(e[1][:TOP_K])) for e in block]
            self.stats["stored_blocks"] += 1
            if len(self._blocks) > self.max_blocks:
                self._blocks.popitem(last=False)


def wants_prompt_rows(req, start: int | None = None) -> bool:
    """Whether engine request ``req`` needs the logits of every position it computes from
    ``start`` (default: where it is): it wants its prompt's logprobs and is inside its prompt."""
    return req.params.prompt_logprobs is not None and (req.num_computed_tokens if start is None else start) < len(req.prompt) - 1 \
        and req.prompt_logprobs is not None


def record_prompt_logprobs(cache: PromptLogprobCache, req, start: int, logits) -> None:
    """The logprobs of ``req``'s prompt tokens that the rows of its chunk from ``start``
    predict (row i, at position start + i, predicts token start + i + 1); once the prompt is
    done, its full blocks go to ``cache``."""
    prompt = req.prompt
    rows = min(logits.shape[0], len(prompt) - 1 - start)
    if rows > 0:
        k = max(req.params.prompt_logprobs, TOP_K) if req.params.prompt_logprobs <= TOP_K else \
            req.params.prompt_logprobs
        found = positions_logprobs(logits[:rows], prompt[start + 1:start + 1 + rows], k)
        req.prompt_logprobs[start + 1:start + 1 + rows] = found
    if start + logits.shape[0] >= len(prompt) and req.params.prompt_logprobs <= TOP_K:
        cache.store(prompt, req.namespace, req.prompt_logprobs)
