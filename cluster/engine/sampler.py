"""The sampler: a step's logits into each request's next token.

For every planned request that completes its sequence this step it draws the
next token (``cluster.engine.sampling``: the grammar's mask, the processors,
greedy or a seeded draw), feeds the grammar's matcher and takes the token's
logprobs; plain greedy requests are argmaxed together. For every request it
keeps what it asked of the rows: all logits (``keep_logits``) and its prompt's
logprobs (``cluster.engine.prompt_logprobs``). It changes no queue and no
lease: the scheduler applies what it returns (``Scheduler.update``).
"""

from __future__ import annotations

from typing import Any

import torch

from cluster.engine.prompt_logprobs import PromptLogprobCache, record_prompt_logprobs, wants_prompt_rows
from cluster.engine.request import EngineRequest, position_seed
from cluster.engine.sampling import greedy_tokens, sample_token, token_logprobs
from cluster.engine.plan import Sampled, StepOutput, StepPlan
from cluster.errors import CacheError


class Sampler:
    def __init__(self, grammars: Any, block_tokens: int, keep_logits: bool = False):
        self.grammars = grammars
        self.keep_logits = keep_logits
        # Echo requests' prompt logprobs, kept beside the KV (cluster.engine.prompt_logprobs).
        self.prompt_logprob_cache = PromptLogprobCache(block_tokens)

    def prepare(self, req: EngineRequest) -> None:
        """At submit, for a request that wants its prompt's logprobs: the entries this sampler
        kept for its prompt (``PromptLogprobCache``); the scheduler takes no more of the
        cached prefix than they cover (positions without one are computed)."""
        k = req.params.prompt_logprobs
        if k is not None and req.prompt_logprobs is None:
            covered, entries = self.prompt_logprob_cache.covered(req.prompt, req.namespace, k)
            req.prompt_logprobs = entries + [None] * (len(req.prompt) - covered)

    def sample(self, plan: StepPlan, output: StepOutput) -> list[Sampled]:
        """One ``Sampled`` per planned request, in the plan's order (none after a failed forward)."""
        if output.error is not None:
            return []
        logits = output.logits
        greedy = greedy_tokens(plan, logits)
        out = []
        for item, rows in zip(plan.items, logits):
            req = item.request
            try:
                if self.keep_logits:
                    req.logits.append(rows)
                if wants_prompt_rows(req, item.start):
                    record_prompt_logprobs(self.prompt_logprob_cache, req, item.start, rows)
                out.append(self._draw(req, rows, greedy.get(id(req))) if item.samples else Sampled())
            except Exception as exc:   # this request fails, nothing else
                out.append(Sampled(error=f"{type(exc).__name__}: {exc}"))
        return out

    def _draw(self, req: EngineRequest, rows: torch.Tensor, greedy: int | None) -> Sampled:
        """``req``'s next token from the last of its ``rows`` (``greedy``: already taken)."""
        generator = req.generator
        if generator is not None:   # the token at position p depends on (seed, p) only
            generator.manual_seed(position_seed(req.params.seed, len(req.tokens)))
        mask = None
        if req.matcher is not None:
            mask = self.grammars.mask(req.matcher)
            if not mask.any():   # nothing can follow (an error state): end it here
                raise CacheError(f"the grammar allows no further token: {req.matcher.get_error()[:200]}")
        token = greedy if greedy is not None else sample_token(rows[-1], req.params, req.prompt, req.output,
                                                               generator, mask, req.penalties)
        if req.matcher is not None:
            req.matcher.consume_token(token)
        logprobs = token_logprobs(rows[-1], token, req.params.logprobs) if req.params.logprobs is not None \
            else None
        return Sampled(token, logprobs)
