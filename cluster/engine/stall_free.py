"""How many prompt tokens a step computes beside running decodes (stall-free batching, opt-in).

Every running stream waits for each step that has its decode in it. With the setting
``stall_free_steps`` (``SchedulerConfig``, the worker key of the same name), while decodes
run the prompt part of a step is what the measured prefill rate computes in
``stall_free_steps - 1`` measured step times (Sarathi-Serve's stall-free batching, with the
budget from the measured rates instead of a fixed token count): a stream waits at most about
that many steps' time for its next token, and a prompt still advances every step. With no
decode running, a step takes the whole ``max_batch_tokens``; until both rates are measured
nothing is capped.

Off by default (None: the whole budget beside decodes, as vLLM's chunked prefill). On two CPU
cores every step re-reads the weights (~14 ms of a 20 ms decode step), so splitting a 1,400-token
first turn into about seven capped steps instead of three made it 25-35% slower and stalled the
streams beside it as long in all, in more gaps; measured at equal memory against vLLM
(docs/benchmarks.md, issue 51): sessions first turns 1,095 ms without the cap against
1,360-1,458 ms with it (``STALL_STEPS`` 8), the other figures within the runs' spread, and on
shared prefixes no worse. Turn it on where a bound on the longest gap matters more than the
first token and the total.
"""

from __future__ import annotations

STALL_STEPS = 8             # a suggested stall_free_steps: a step with decodes in it takes about 8 step times
MIN_PREFILL_TOKENS = 32     # a prompt beside decodes still advances at least this much a step


def prefill_cap(budget: int, step_s: float | None, prefill_s_per_token: float | None, block_tokens: int,
                stall_steps: int | None = STALL_STEPS) -> int:
    """The prompt tokens a step may compute beside running decodes, out of ``budget``:
    ``step_s`` the median step time, ``prefill_s_per_token`` the measured prefill cost
    (either None: not measured yet, the whole budget); ``stall_steps`` (None: no cap, the
    whole budget, as vLLM's chunked prefill)."""
    if not step_s or not prefill_s_per_token or stall_steps is None:
        return budget
    tokens = int((stall_steps - 1) * step_s / prefill_s_per_token)
    tokens = max(MIN_PREFILL_TOKENS, tokens // block_tokens * block_tokens)
    return min(budget, tokens)
