"""EngineRequest: one request inside the engine, and what a step reports of it.

A request's sequence is its prompt followed by what it generated so far.
``num_computed_tokens`` counts the tokens of that sequence whose KV is
computed (the cached prefix included); the request runs until it reaches the
whole sequence, one budgeted chunk per step while it prefills, one token per
step once it decodes, and samples a token whenever it does. Its KV lives in
the HOT pool, where its lease says (``KVLease.slots``). Preempted, it gives
up its KV (committed to the cache for its return) and starts over from 0
when it is admitted again: what the cache still holds of its sequence is not
recomputed.

Every field is the engine's (its thread's) to change; the scheduler, the
model runner and the sampler read and write them by name.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, Hashable

import torch
import xxhash

from cluster.cache.lease import KVLease
from cluster.engine.sampling import Penalties
from cluster.names import COLD, HOT, L3, WARM
from cluster.protocol import FinishReason, SamplingParams, StepCounts


@dataclass(slots=True)
class StepTrace(StepCounts):
    """Where one request's time to first token went, counted in engine steps
    (``StepCounts``; the replica sends them with the first token, ``ReplicaTiming``),
    and the step counts the scheduler marks them by."""

    added_step: int = 0         # the engine's step count when it was handed over
    forward_step: int = 0       # the step count when its first forward was planned
    looked_step: int = -1       # the step count when the planning last looked at it

    def first_forward(self, req: "EngineRequest", items: list, step: int) -> None:
        """``req``'s first forward is in the step of ``items`` (ScheduledRequests), planned after ``step`` steps."""
        self.forward_step = step
        self.step_tokens = sum(i.num_tokens for i in items)
        self.step_rows = len(items)
        self.step_decodes = sum(1 for i in items if i.request.to_compute == 1)
        self.step_other_tokens = sum(i.num_tokens for i in items if i.request.namespace != req.namespace)


@dataclass
class EngineRequest:
    """One request inside the engine: its tokens, its lease on the KV cache and its timestamps."""

    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    namespace: Hashable = None
    session_id: Any = None
    request_id: int = 0
    # Filled in by the engine.
    output: list[int] = field(default_factory=list)
    cached_tokens: int = 0          # prompt tokens served from the cache (at its first admission)
    tier_hits: list[int] = field(default_factory=lambda: [0, 0, 0, 0])   # by source: HOT, WARM, COLD, L3
    # What the tiers held of its prompt when the engine first looked (HOT, WARM, COLD, L3 asked
    # for): beside ``tier_hits``, what it used, this says whether anything held went unused.
    tiers_found: list[int] = field(default_factory=lambda: [0, 0, 0, 0])
    preemptions: int = 0
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    submitted_at: float = 0.0
    # Where its time to first token went, on the engine's clock: the step that
    # admitted it began matching its prefix (scheduled), had it in the batch with its
    # cached KV read (admitted), started its first forward (forward), sampled its token.
    scheduled_at: float | None = None
    admitted_at: float | None = None
    running_since: float | None = None   # its latest admission (a preempted request is admitted again)
    forward_at: float | None = None
    first_token_at: float | None = None
    logits: list[torch.Tensor] = field(default_factory=list)   # kept when keep_logits
    # With params.logprobs: per sampled token (logprob, top k); with params.prompt_logprobs:
    # per prompt position (logprob of that token given the ones before, top k), None for the first.
    token_logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None
    # The engine's state of it.
    lease: KVLease | None = None        # its hold on the cache: prefix locked, its own KV, its slots
    num_computed_tokens: int = 0        # tokens of the sequence whose KV is computed
    preempted_len: int = 0              # what it had computed when it was last preempted
    first_look: list[int] | None = None   # where its prefix was when the scheduler first looked
    awaited: bool = False               # a waiting request counts on this prefill's checkpoint
    yielded_to: Any = None              # the waiting request it yielded its room to (time slicing)
    touched_at: float | None = None     # when it touched its cached prefix at submit (the cache's clock)
    generator: torch.Generator | None = None   # reseeded per position (see position_seed)
    matcher: Any = None                 # its grammar's matcher (structured output), fed every sampled token
    penalties: Penalties = field(default_factory=Penalties)   # its penalty state across its tokens
    trace: StepTrace = field(default_factory=StepTrace)   # its first token's wait in engine steps

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def to_compute(self) -> int:
        """Tokens of its sequence still without KV: 1 while it decodes, more while it (re)fills."""
        return len(self.prompt) + len(self.output) - self.num_computed_tokens


@dataclass(slots=True)
class TokenEvent:
    request: EngineRequest
    token: int | None      # None: the request ended without a new token (error, cancel)
    finished: bool


def position_seed(seed: int, position: int) -> int:
    """The sampling seed of the token at ``position`` of a sequence (prompt included).

    A function of (seed, position) only, not of how many tokens this engine
    sampled before: a request resumed elsewhere (or after a preemption) with
    the tokens already sent appended to its prompt samples exactly the tokens
    the first run would have.
    """
    return xxhash.xxh3_64_intdigest(struct.pack("<QQ", seed % (1 << 64), position))


def split_by_tier(cached: int, found: list[int]) -> list[int]:
    """``cached`` prefix tokens by where they came from: HOT, WARM, COLD as the
    scheduler first found them (the prefix runs in that order), then L3 for the
    rest when it waited for an L3 fetch (``found[L3]``: tokens asked for); else
    the rest was computed meanwhile by another request sharing it: HOT."""
    hot = min(cached, found[HOT])
    warm = min(cached - hot, found[WARM])
    cold = min(cached - hot - warm, found[COLD])
    rest = cached - hot - warm - cold
    if len(found) > L3 and found[L3]:
        return [hot, warm, cold, rest]
    return [hot + rest, warm, cold, 0]


def count_missed(stats: dict, missed: list[int], promoted: bool) -> None:
    """What the tiers held for a lease beyond what it got (``missed``, by tier) into the
    scheduler's ``stats``: recomputed by choice (a cost decision), or a defect
    (``recomputed_held_*``: must stay 0)."""
    total = sum(missed)
    if not total:
        return
    if not promoted:
        stats["recompute_chosen_tokens"] += total
        return
    stats["recomputed_held_tokens"] += total
    for tier, n in zip(("hot", "warm", "cold"), missed):
        stats[f"recomputed_held_{tier}_tokens"] += n
