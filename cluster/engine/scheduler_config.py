"""The scheduler's settings (``SchedulerConfig``), fixed when the engine is built.

A worker builds one from its config (``actors.config.WorkerConfig``: ``max_batch_tokens``,
``max_running``, ``time_slice_s``, ``shared_fills``, ``cache_final_token``,
``scheduling_policy``); tests and tools pass the fields they change to ``Engine``.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.engine.policies import POLICIES
from cluster.engine.stall_free import STALL_STEPS
from cluster.errors import InvalidInputError

# The default budget: a step computes at most this many tokens (decodes and prefill chunks
# together), so no step keeps running decodes waiting long behind a prompt.
DEFAULT_BATCH_TOKENS = 512
# What a serving worker runs with (``actors.config.WorkerConfig.time_slice_s``): the shortest time
# a decode runs before it may yield its HOT room to a waiting request, and then only where the
# measured gain beats the cost (``cluster.engine.preemption``).
DEFAULT_TIME_SLICE_S = 0.5


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """``max_batch_tokens``: the tokens one step computes at most. ``max_running``: requests in
    the batch at most. ``time_slice_s``: time slicing's shortest slice (None: no slicing;
    ``cluster.engine.preemption``). ``shared_fills``: a request waits for a running fill of
    its prompt's part beyond the cache instead of computing it beside it. ``cache_final_token``:
    when a request ends, also compute the KV of its last sampled token (one more forward, alone,
    per finished request) so the next turn finds the whole sequence cached; workers turn it off
    (``WorkerConfig.cache_final_token``), as vLLM and SGLang do. ``keep_logits``: every computed
    row's logits kept on the request. ``policy``: the waiting order, the victim choice and the
    budget split (``cluster.engine.policies``: fcfs, fair, priority); None: ``fair`` where the
    cache has tenant quotas, else ``fcfs``. ``stall_free_steps``: while decodes run, a step's
    prompt part is what the measured rates compute in this many decode steps' time less one
    (``cluster.engine.stall_free``; default ``STALL_STEPS``, 8); None: the whole budget."""

    max_batch_tokens: int = DEFAULT_BATCH_TOKENS
    max_running: int = 64
    time_slice_s: float | None = None
    shared_fills: bool = True
    cache_final_token: bool = True
    keep_logits: bool = False
    policy: str | None = None
    stall_free_steps: int | None = STALL_STEPS

    def __post_init__(self) -> None:
        for name in ("max_batch_tokens", "max_running"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidInputError(f"{name} must be an integer >= 1, got {value!r}")
        if self.time_slice_s is not None and (isinstance(self.time_slice_s, bool) or
                                              not isinstance(self.time_slice_s, (int, float))
                                              or not self.time_slice_s > 0):
            raise InvalidInputError(f"time_slice_s must be a positive number of seconds or None, "
                                    f"got {self.time_slice_s!r}")
        check_policy_name(self.policy, "policy")
        check_stall_free_steps(self.stall_free_steps, "stall_free_steps")

    def policy_for(self, has_quotas: bool) -> str:
        """The policy this scheduler runs: the configured one, else what the quotas select."""
        return self.policy or ("fair" if has_quotas else "fcfs")


def check_stall_free_steps(value, key: str) -> None:
    """``value`` is an integer >= 2 or None, else a one-line error naming ``key``."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 2):
        raise InvalidInputError(f"{key} must be an integer >= 2 (a step beside decodes takes about this many "
                                f"decode steps' time at most) or null (no cap but max_batch_tokens), got {value!r}")


def check_policy_name(name, key: str) -> None:
    """``name`` is a scheduling policy or None, else a one-line error naming ``key``."""
    if name is not None and (not isinstance(name, str) or name not in POLICIES):
        raise InvalidInputError(f"{key} must be one of {', '.join(POLICIES)} (or null: fair under "
                                f"tenant_quotas, else fcfs), got {name!r}")
