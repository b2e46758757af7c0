"""How the engine schedules a burst of requests that share a prefix (``Engine``'s part):
what one request computes for others instead of each computing it.

- A waiting request whose part beyond the cache a prompt being filled computes (at least a
  block of it, or all of it but its last token) waits for that fill's checkpoint
  (``_behind_shared_prefill``).
- When the fill runs in this very step, on the torch path and to its end, and the request's
  rest is a kernel item's, the request rides on it: it computes its rest in the same step,
  reading the shared positions from the fill's buffer as each layer writes them, and takes
  its lease from the fill's checkpoint after the step (``_ride``, ``_seat``).
- A request whose sequence is exactly a fill's starts from it at the end of the step: its
  whole prompt cached, its first token sampled from the fill's last logits row (``_fork_twins``).

vLLM gets the like from caching a block when it is scheduled, within the step; here the
tree only takes a prefix at a checkpoint, so the sharing is planned. All of it runs on the
engine thread, as the rest of ``Engine``.
"""

from __future__ import annotations

import torch

from cluster.engine.attention import EXTEND_MAX
from cluster.engine.request import EngineRequest, TokenEvent
from cluster.protocol import FinishReason
from cluster.tokens import common_prefix


class BurstScheduling:
    """``Engine``'s methods for requests that share a prefix with a fill (see the module)."""

    def _behind_shared_prefill(self, req: EngineRequest, cached: int) -> bool:
        """Whether a running request still filling its prompt computes at least a block of
        what ``req`` would compute beyond the cache, or all of it but ``req``'s last token (an
        identical prompt): ``req`` then waits for that prefill's checkpoint (taken even for
        less than a block once awaited) instead of computing the same KV beside it; one whose
        sequence is that fill's starts from it at the end of this step (``_fork_twins``). One step:
        a waiting request is looked at only with budget left, so every fill was planned to its end."""
        seq, need = req.tokens, min(self.cache.hot.allocator.block_tokens, len(req.tokens) - 1 - cached)
        if need < 1:   # only its last token left: nothing another fill could save it
            return False
        fills = [o for o in self.running if o.to_compute > 1 and o.namespace == req.namespace
                 and common_prefix(seq, o.tokens) - cached >= need]
        if not fills:
            return False
        same = next((o for o in fills if o.tokens == seq), None)
        (same or fills[0])._awaited = True
        if same is not None:
            self._twin(req, same)
        return True

    def _twin(self, req: EngineRequest, fill: EngineRequest) -> bool:
        """``req``'s sequence is ``fill``'s: it starts from the fill after the step
        (``_fork_twins``), for which the fill checkpoints even less than a block. Not one
        that wants its prompt's logprobs (it needs its own rows): False, and it waits."""
        if req.params.prompt_logprobs is not None:
            return False
        fill._awaited = True
        self._twins.setdefault(id(fill), []).append(req)
        return True

    def _twins_past_budget(self, plan: list[tuple[EngineRequest, int]], left: list[EngineRequest]) -> None:
        """The waiting requests ``left`` out of a step whose budget ran out:
        those whose sequence is exactly a prompt this step fills to its end start from it after
        the step all the same (``_fork_twins``): they compute nothing, so they need no budget.
        Without this, twins behind the budget's end computed their last token a step later."""
        fills = {(fill.namespace, tuple(fill.tokens)): fill for fill, n in reversed(plan)
                 if n > 1 and fill._len + n == len(fill.tokens)}
        for req in left:
            fill = fills.get((req.namespace, tuple(req.tokens)))
            if fill is not None and self._twin(req, fill):
                self.stats["waits_for_shared_prefix"] += 1

    def _ride(self, req: EngineRequest, cached: int, plan: list[tuple[EngineRequest, int]], budget: int) -> bool:
        """Whether ``req`` rides on a prompt this step fills to its end on the torch path: it
        shares more than the cache holds with it and the rest of ``req`` is a kernel item's
        (at most ``EXTEND_MAX`` tokens, within the budget). Then ``req`` computes that rest in
        the same step, reading the shared positions from the fill's buffer as each layer
        writes them (``cluster.engine.attention.kernel_items``), instead of waiting a step for
        the fill's checkpoint; its lease comes after the step, from that checkpoint (``_seat``)."""
        if not self.riders or req.output or req.params.prompt_logprobs is not None:
            return False
        seq = req.tokens
        for fill, n in plan:
            if fill._len + n != len(fill.tokens) or (fill._len and n <= EXTEND_MAX) or \
                    fill.namespace != req.namespace or fill.output:
                continue
            shared = common_prefix(seq, fill.tokens)
            if shared <= cached or not 0 < len(seq) - shared <= min(EXTEND_MAX, budget):
                continue
            fill._awaited = True   # it checkpoints even less than a block: the rider's lease reads it
            self._give_scratch(req)
            req._kv = self.scratch.take(req.capacity)
            req._len, req._rider = shared, (fill, shared)
            req.scheduled_at = self.clock() if req.scheduled_at is None else req.scheduled_at
            self.waiting.remove(req)
            self.running.append(req)
            plan.append((req, len(seq) - shared))
            self.stats["riders"] += 1
            return True
        return False

    def _seat(self, req: EngineRequest) -> bool:
        """A rider's lease after the step: what it read, now in the tree, locked, and its rest's
        room reserved. False when the tree holds less (its fill failed) or HOT has no room: it
        waits again, and computes that rest again when it is admitted."""
        _, shared = req._rider
        req._rider = None
        if self._admit(req, len(req.tokens), need=shared) is not None:
            return True
        self.running.remove(req)
        req._len, req.forward_at = 0, None
        self._give_scratch(req)
        if not req.finished:   # else the cache refused its prompt: it ended
            self.waiting.appendleft(req)
        self.stats["riders_back"] += 1
        return False

    def _fork_twins(self, plan: list[tuple[EngineRequest, int]], outputs: list[torch.Tensor],
                    events: list[TokenEvent]) -> None:
        """Waiting requests whose sequence is exactly what a fill of this step just completed
        (``_behind_shared_prefill``) start from it: the fill's checkpoint holds all of their
        KV and its last logits row is theirs too (the same tokens at the same positions), so
        each is admitted with nothing to compute and samples its first token from that row
        (its own parameters and seed) now, a step before it would have computed its last
        token. One whose admission finds less (the fill failed, no room) stays waiting."""
        twins, self._twins = self._twins, {}
        for (fill, _), logits in zip(plan, outputs):
            if id(fill) not in twins or fill.error is not None or fill._len != len(fill.tokens) - 1:
                continue
            for twin in twins[id(fill)]:
                if twin.finished or twin not in self.waiting or len(self.running) >= self.max_running or \
                        self._admit(twin, 0, need=len(twin.tokens)) is None:
                    continue
                self.waiting.remove(twin)
                self.running.append(twin)
                twin.scheduled_at = twin.scheduled_at or fill.scheduled_at
                twin.forward_at = twin.forward_at or fill.forward_at
                self.stats["forked_prompts"] += 1
                if self.keep_logits:
                    twin.logits.append(logits[-1:])
                try:
                    token = self._sample(twin, logits)
                except Exception as exc:   # as in ``step``: this request fails, nothing else
                    self._finish(twin, FinishReason.ERROR, keep=False, error=f"{type(exc).__name__}: {exc}")
                    continue
                self._emitted(twin, token, events)
