"""The cache replicas' autoscaling policy as Ray Serve calls it, and the app's choice of policy.

The policy itself is ``cluster.routing.autoscale`` (no Ray). Here:

- ``PrefixCacheAutoscalingPolicy``: what Serve's controller calls on every
  autoscaling tick (Ray 2.60's class-based ``AutoscalingPolicy``: built once
  with the ``policy_kwargs``, called with an ``AutoscalingContext``). It reads
  each running replica's signals from ``ctx.aggregated_metrics`` (what
  ``CacheWorker.record_autoscaling_stats`` reported, averaged by Serve over
  ``look_back_period_s``) with the look-back's own readings of the queue from
  ``ctx.raw_metrics`` (so a queue that persists is told from a burst), keeps
  its own state in ``ctx.policy_state``, and
  takes the time, the target and the bounds from the context.
- ``replica_autoscaling_config``: the CacheReplica deployment's
  ``autoscaling_config`` from the app args. ``autoscaling_policy``:
  ``prefix_cache`` (the default) or ``serve_default`` (Serve's request-count
  policy: the ``autoscaling_config`` goes to Serve as given);
  ``autoscaling_policy_args``: the ``prefix_cache`` policy's knobs
  (``AutoscaleConfig``). An ``autoscaling_config`` that names its own
  ``policy`` is used as given.

Under ``prefix_cache`` the policy's own window and rate limits replace Serve's
delays (Serve applies ``upscale_delay_s``/``downscale_delay_s`` on top of a
custom policy's answer, so both are set to 0 and refused in the config), and
replicas push their metrics every ``metrics_interval_s`` = 2 s over a 5 s
look-back unless the config sets them (Ray 2.60 reads the push period from that
deprecated key; its default of 10 s alone would delay a scale-out by up to 10 s).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import TYPE_CHECKING, Any, Mapping

from cluster.routing.autoscale import AutoscaleConfig, AutoscaleState, decide
from cluster.routing.autoscale_signals import QUEUED_PROMPT_TOKENS, ReplicaSignals

if TYPE_CHECKING:
    from ray.serve.config import AutoscalingContext

log = logging.getLogger("ray.serve")

PREFIX_CACHE = "prefix_cache"
SERVE_DEFAULT = "serve_default"
AUTOSCALING_POLICIES = (PREFIX_CACHE, SERVE_DEFAULT)
POLICY_PATH = "serve_app.autoscaling:PrefixCacheAutoscalingPolicy"
# Serve's settings under the prefix_cache policy, unless the autoscaling_config sets them.
PREFIX_CACHE_SERVE_SETTINGS = {"look_back_period_s": 5.0, "metrics_interval_s": 2.0}
# Serve's default policy's settings that the prefix_cache policy replaces with its own knobs.
REPLACED_BY_POLICY = {"target_ongoing_requests": "scale_out_queue_s and ttft_slo_s",
                      "upscale_delay_s": "scale_out_interval_s",
                      "downscale_delay_s": "downscale_window_s and scale_in_interval_s"}


def replica_signals(aggregated: Mapping[str, Mapping[Any, float]] | None,
                    raw: Mapping[str, Mapping[Any, Any]] | None = None) -> list[ReplicaSignals]:
    """Each replica's signals from Serve's aggregated custom metrics (metric -> replica -> value),
    in a fixed order; replicas that have not reported all four are left out. With Serve's raw
    metrics (metric -> replica -> time series), each carries its look-back's readings of the
    queue (``queued_readings``)."""
    by_replica: dict[Any, dict[str, float]] = {}
    for name, per_replica in (aggregated or {}).items():
        for replica, value in per_replica.items():
            by_replica.setdefault(replica, {})[name] = value
    series = (raw or {}).get(QUEUED_PROMPT_TOKENS) or {}
    out = []
    for replica in sorted(by_replica, key=str):
        signals = ReplicaSignals.from_metrics(by_replica[replica])
        if signals is not None:
            out.append(dataclasses.replace(signals, queued_readings=queue_readings(series.get(replica))))
    return out


def queue_readings(series: Any) -> tuple[float, ...]:
    """The values of one replica's time series (Serve's ``TimeStampedValue`` list, oldest first);
    empty where there is none or a value is not a finite number (the mean alone decides then)."""
    values = [getattr(point, "value", None) for point in series or ()]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
        return ()
    return tuple(max(0.0, float(v)) for v in values)


class PrefixCacheAutoscalingPolicy:
    """Serve's policy callable: ``(AutoscalingContext) -> (replicas, policy_state)``."""

    def __init__(self, **policy_kwargs: Any):
        self.config = AutoscaleConfig.from_kwargs(policy_kwargs)
        self._last_reason: str | None = None
        self._last_hold: tuple[str, ...] | None = None   # what held the replicas at the last call

    def __call__(self, ctx: "AutoscalingContext") -> tuple[int, dict[str, Any]]:
        now = ctx.current_time if ctx.current_time is not None else time.time()
        decision = decide(self.config, replica_signals(ctx.aggregated_metrics, getattr(ctx, "raw_metrics", None)),
                          target=ctx.target_num_replicas, running=ctx.current_num_replicas,
                          min_replicas=ctx.capacity_adjusted_min_replicas,
                          max_replicas=ctx.capacity_adjusted_max_replicas,
                          now=now, state=AutoscaleState.from_policy_state(ctx.policy_state))
        if decision.replicas != ctx.target_num_replicas:
            log.info("autoscaling %s: %d -> %d replicas (%s)", ctx.deployment_name, ctx.target_num_replicas,
                     decision.replicas, decision.reason)
        elif decision.reason == "queue_brief" and self._last_reason != "queue_brief":
            log.info("autoscaling %s: holding %d replicas (queue_brief: the queue passed its threshold "
                     "on the look-back's mean, but did not stay above it)", ctx.deployment_name, decision.replicas)
        elif decision.reason == "ttft_own_prefill" and self._last_reason != "ttft_own_prefill":
            log.warning("autoscaling %s: holding %d replicas (ttft_own_prefill: a replica's TTFT p90 is above "
                        "ttft_slo_s %.3g s, but it is its prompts' own prefill, not a wait more replicas would "
                        "shorten: raise ttft_slo_s or speed up the replicas)", ctx.deployment_name,
                        decision.replicas, self.config.ttft_slo_s)
        elif (decision.reason == "hold" and decision.held_by != self._last_hold
              and decision.replicas > ctx.capacity_adjusted_min_replicas):   # what keeps it from scaling in
            log.info("autoscaling %s: holding %d replicas (%s)", ctx.deployment_name, decision.replicas,
                     decision.detail)
        self._last_hold = decision.held_by if decision.reason == "hold" else None
        self._last_reason = decision.reason
        return decision.replicas, {**(ctx.policy_state or {}), **decision.state.as_policy_state()}


def replica_autoscaling_config(config: Mapping[str, Any] | None, policy: str | None = None,
                               policy_args: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """The CacheReplica deployment's ``autoscaling_config`` (None: autoscaling is off) from the
    app args ``autoscaling_config``, ``autoscaling_policy`` and ``autoscaling_policy_args``;
    each bad value fails naming its key."""
    if config is None:
        if policy is not None or policy_args is not None:
            raise ValueError("autoscaling_policy and autoscaling_policy_args need an autoscaling_config "
                             "(min_replicas, max_replicas)")
        return None
    if not isinstance(config, Mapping):
        raise ValueError(f"autoscaling_config must be a mapping of Serve's autoscaling keys, got {config!r}")
    config = dict(config)
    if "policy" in config:
        if policy is not None or policy_args is not None:
            raise ValueError("autoscaling_config.policy is set and used as given: leave out autoscaling_policy "
                             "and autoscaling_policy_args")
        return config
    policy = PREFIX_CACHE if policy is None else policy
    if policy not in AUTOSCALING_POLICIES:
        raise ValueError(f"autoscaling_policy must be one of {list(AUTOSCALING_POLICIES)}, got {policy!r}")
    if policy == SERVE_DEFAULT:
        if policy_args:
            raise ValueError("autoscaling_policy_args are the prefix_cache policy's options; serve_default "
                             "takes Serve's own keys in autoscaling_config")
        return config
    if policy_args is not None and not isinstance(policy_args, Mapping):
        raise ValueError(f"autoscaling_policy_args must be a mapping of the policy's option names to values, "
                         f"got {policy_args!r}")
    kwargs = dict(policy_args or {})
    AutoscaleConfig.from_kwargs(kwargs)   # an unknown option or a bad value fails here, naming it
    for key, instead in REPLACED_BY_POLICY.items():
        if key in config:
            raise ValueError(f"autoscaling_config.{key} belongs to Serve's default policy; the prefix_cache "
                             f"policy uses {instead} (autoscaling_policy_args), or set "
                             f"autoscaling_policy: serve_default")
    return {**PREFIX_CACHE_SERVE_SETTINGS, **config, "upscale_delay_s": 0.0, "downscale_delay_s": 0.0,
            "policy": {"policy_function": POLICY_PATH, "policy_kwargs": kwargs}}
