"""How many prompt tokens a step computes beside running decodes (stall-free batching).

Every running stream waits for each step that has its decode in it. A step that also
computes a 512-token prefill chunk takes 0.6-1 s on two CPU cores, where a decode step
alone takes ~35 ms: measured at equal memory against vLLM (issue 51), a new session's
first turn beside running streams put their ITL p99 at 1.0 s (vLLM's 0.12 s) and e2e
at 2.4x. So while decodes run, the prompt part of a step is what the measured prefill
rate computes in ``STALL_STEPS - 1`` measured step times (Sarathi-Serve's stall-free
batching, with the budget from the measured rates instead of a fixed token count):
a stream waits at most about ``STALL_STEPS`` steps' time for its next token, and a
prompt still advances every step. With no decode running, a step takes the whole
``max_batch_tokens``; until both rates are measured nothing is capped.
"""

from __future__ import annotations

STALL_STEPS = 8             # a step with decodes in it takes about this many step times at most
MIN_PREFILL_TOKENS = 32     # a prompt beside decodes still advances at least this much a step


def prefill_cap(budget: int, step_s: float | None, prefill_s_per_token: float | None, block_tokens: int) -> int:
    """The prompt tokens a step may compute beside running decodes, out of ``budget``:
    ``step_s`` the median step time, ``prefill_s_per_token`` the measured prefill cost
    (either None: not measured yet, the whole budget)."""
    if not step_s or not prefill_s_per_token:
        return budget
    tokens = int((STALL_STEPS - 1) * step_s / prefill_s_per_token)
    tokens = max(MIN_PREFILL_TOKENS, tokens // block_tokens * block_tokens)
    return min(budget, tokens)
