"""How many prompt tokens a step computes beside running decodes (stall-free batching).

Every running stream waits for each step that has its decode in it. While decodes run, the
prompt part of a step is what the measured prefill rate computes in ``stall_free_steps - 1``
times a step of decodes alone takes (``StepMeasures.decode_step_s``, its recent median; every
step's median until one is measured). ``stall_free_steps`` is ``SchedulerConfig``'s and the
worker key of the same name (default ``STALL_STEPS``): Sarathi-Serve's stall-free batching, with
the budget from the measured rates instead of a fixed token count. A stream waits at most about
that many decode steps' time for its next token, and a prompt still advances every step. With no
decode running, a step takes the whole ``max_batch_tokens``; until both rates are measured
nothing is capped. The unit was every step's median before: under a stream of prompts that is
a prompt step's, so the cap rose with the very load it is for (at twice the memory's working
set, streams beside prompts waited 0.8-1.0 s a step, as with no cap).

The cap holds prompts back for the running streams' sake, so it applies only while the step's
decodes are at least as many as the requests waiting on prompt compute (queued, or filling a
prompt): where those outnumber the streams it spares, the step takes the whole budget. Held in
every case (decode-step unit, 2026-12-07), a flood of prompts beside one tenant's streams
(``bench tenants``, no quotas) took 20-26% more steps, and the other tenant's later turns waited
16-51 s in the queue (141 ms to 10 s before): the steps the cap adds (each re-reads the weights
and carries the decodes) cost prompt throughput exactly when prompts queue.

The trade, measured at equal memory against vLLM (docs/benchmarks.md, issue 51): on two CPU
cores every step re-reads the weights (~14 ms of a 20 ms decode step), so the cap splits a
1,400-token first turn beside one stream into about seven steps instead of three (first turns
1,117-1,338 ms in three runs with it, 1,052-1,291 in six without); beside 16 streams in a burst
it keeps their ITL p99 at 122-138 ms against 146-330 without it. ``None`` turns it off (the whole
budget beside decodes, as vLLM's chunked prefill), for deployments whose streams are few and
first tokens matter most.
"""

from __future__ import annotations

STALL_STEPS = 8             # the default stall_free_steps: a step with decodes in it takes about 8 step times
MIN_PREFILL_TOKENS = 32     # a prompt beside decodes still advances at least this much a step


def prefill_cap(budget: int, step_s: float | None, prefill_s_per_token: float | None, block_tokens: int,
                stall_steps: int | None = STALL_STEPS, decodes: int = 0, prompts: int = 0) -> int:
    """The prompt tokens a step may compute beside running decodes, out of ``budget``:
    ``step_s`` the median time of a step of decodes alone, ``prefill_s_per_token`` the measured prefill cost
    (either None: not measured yet, the whole budget); ``stall_steps`` (None: no cap, the
    whole budget, as vLLM's chunked prefill). ``decodes``: the step's decodes; ``prompts``: the
    requests waiting on prompt compute (queued, or filling): where they outnumber the decodes,
    the whole budget (the cap would hold more requests back than it spares)."""
    if not step_s or not prefill_s_per_token or stall_steps is None or prompts > decodes:
        return budget
    tokens = int((stall_steps - 1) * step_s / prefill_s_per_token)
    tokens = max(MIN_PREFILL_TOKENS, tokens // block_tokens * block_tokens)
    return min(budget, tokens)
