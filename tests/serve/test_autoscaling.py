"""The Serve side of autoscaling (``serve_app.autoscaling``): Ray's ``AutoscalingContext`` into a
decision, through Serve's own policy wrapper too, and the app's choice of policy (config.yaml
builds with ours; ``serve_default`` keeps Serve's; bad keys are named)."""

from pathlib import Path

import pytest
import yaml
from ray.serve._private.common import DeploymentID, ReplicaID, TimeStampedValue
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from serve_app.autoscaling import POLICY_PATH, PrefixCacheAutoscalingPolicy, replica_signals

CONFIG = Path(__file__).resolve().parents[2] / "serve_app" / "config.yaml"
DEPLOYMENT = DeploymentID(name="CacheReplica", app_name="prefix-cache")
REPLICAS = [ReplicaID(f"r{i}", DEPLOYMENT) for i in range(4)]


def metrics(*per_replica):
    """Serve's aggregated metrics (metric -> replica -> value) of each replica's signal mapping,
    with Serve's own ``running_requests`` beside them, as the controller has it."""
    out = {"running_requests": {}}
    for replica, signals in zip(REPLICAS, per_replica):
        out["running_requests"][replica] = 1.0
        for name, value in signals.items():
            out.setdefault(name, {})[replica] = value
    return out


def signals(queued=0.0, blocked=0.0, ttft=0.0, running=0.0, rate=2000.0):   # 1 s of prefill: 2,000 tokens
    return {"queued_prompt_tokens": queued, "blocked_for_room": blocked, "ttft_p90_s": ttft,
            "engine_running": running, "prefill_tokens_per_s": rate}


def context(aggregated, *, target, now, state=None, running=None, lo=1, hi=8, config=None, raw=None):
    running = target if running is None else running
    return AutoscalingContext(
        deployment_id=DEPLOYMENT, deployment_name="CacheReplica", app_name="prefix-cache",
        current_num_replicas=running, target_num_replicas=target, running_replicas=REPLICAS[:running],
        total_num_requests=float(running), total_queued_requests=0.0, aggregated_metrics=aggregated,
        raw_metrics=raw if raw is not None else {}, capacity_adjusted_min_replicas=lo, capacity_adjusted_max_replicas=hi,
        policy_state=dict(state or {}), last_scale_up_time=None, last_scale_down_time=None,
        current_time=now, config=config)


def test_the_context_becomes_the_decision_and_the_state_keeps_serves_keys():
    policy = PrefixCacheAutoscalingPolicy(ttft_slo_s=1.0)
    ctx = context(metrics(signals(queued=3000), signals(ttft=0.2)), target=2, now=1000.0,
                  state={"__decision_counters": 0})
    replicas, state = policy(ctx)
    assert replicas == 2   # 1.5 replicas of queue on 2: under the mean threshold
    assert state == {"__decision_counters": 0, "prefix_cache_last_scale_at": None, "prefix_cache_low_since": None}
    ctx = context(metrics(signals(ttft=1.5), signals(ttft=0.2)), target=2, now=1000.0, state=state)
    replicas, state = policy(ctx)   # a replica's TTFT p90 over the 1 s SLO
    assert replicas == 3 and state["prefix_cache_last_scale_at"] == 1000.0
    ctx = context(metrics(signals(ttft=1.5), signals(ttft=0.2)), target=3, running=2, now=1005.0, state=state)
    assert policy(ctx)[0] == 3   # the third replica is still starting, and within the rate limit


def test_lazy_metrics_and_replicas_that_have_not_reported_are_handled():
    policy = PrefixCacheAutoscalingPolicy()
    calls = []

    def lazy():
        calls.append(1)
        return metrics(signals(queued=5000), {"queued_prompt_tokens": 9e9})   # r1 reported one metric only
    assert policy(context(lazy, target=2, now=1.0))[0] == 3   # r0's queue alone: 2.5 replicas of it
    assert calls == [1]
    assert replica_signals(lazy()) == replica_signals(metrics(signals(queued=5000)))
    assert policy(context({}, target=2, now=1.0))[0] == 2   # nothing reported yet: hold
    assert policy(context(None, target=2, now=1.0))[0] == 2


def queue_series(*per_replica):
    """Serve's raw metrics of the queue: replica -> its look-back's readings, 1 s apart."""
    return {"queued_prompt_tokens": {replica: [TimeStampedValue(100.0 + i, v) for i, v in enumerate(readings)]
                                     for replica, readings in zip(REPLICAS, per_replica)}}


def test_the_queue_readings_come_from_serves_raw_metrics_and_a_burst_holds():
    policy = PrefixCacheAutoscalingPolicy()   # 1 s of prefill at 2,000 tokens/s: 2,000 tokens
    aggregated = metrics(signals(queued=2200))
    burst = queue_series([0, 0, 5000, 6000, 0])   # 2 of 5 readings above: cleared
    assert replica_signals(aggregated, burst)[0].queued_readings == (0.0, 0.0, 5000.0, 6000.0, 0.0)
    replicas, state = policy(context(aggregated, target=1, now=105.0, raw=burst))
    assert (replicas, state["prefix_cache_last_scale_at"]) == (1, None)
    held = queue_series([0, 3000, 3000, 3000, 2000])   # 3 of 5 above
    replicas, state = policy(context(aggregated, target=1, now=105.0, raw=held))
    assert (replicas, state["prefix_cache_last_scale_at"]) == (2, 105.0)
    # A series with a value that is not a number is left out: the mean alone decides.
    bad = queue_series([0, float("nan"), 5000, 6000, 0])
    assert replica_signals(aggregated, bad)[0].queued_readings == ()
    assert policy(context(aggregated, target=1, now=105.0, raw=bad))[0] == 2


def test_through_serves_own_wrapper_the_decision_is_applied_without_serves_delays():
    """Serve wraps a custom policy in its delays and bounds; with the config build_app makes
    (both delays 0) a scale-out lands on the tick that decides it, and an idle deployment is
    back at min_replicas on the tick its window ends."""
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve.autoscaling_policy import _apply_autoscaling_config

    from serve_app.autoscaling import replica_autoscaling_config

    config = AutoscalingConfig.model_validate(replica_autoscaling_config({"min_replicas": 1, "max_replicas": 4}))
    wrapped = _apply_autoscaling_config(_resolve_policy_callable(config.policy))
    replicas, state = wrapped(context(metrics(signals(queued=3000)), target=1, now=100.0, config=config, hi=4))
    assert replicas == 2
    idle = metrics(signals(), signals())
    replicas, state = wrapped(context(idle, target=2, now=200.0, state=state, config=config, hi=4))
    assert replicas == 2 and state["prefix_cache_low_since"] == 200.0
    replicas, state = wrapped(context(idle, target=2, now=259.0, state=state, config=config, hi=4))
    assert replicas == 2
    replicas, state = wrapped(context(idle, target=2, now=260.0, state=state, config=config, hi=4))
    assert replicas == 1


def _replica_autoscaling(app) -> AutoscalingConfig | None:
    """The CacheReplica deployment's autoscaling config in a built application."""
    return app._bound_deployment.init_args[0]._bound_deployment._deployment_config.autoscaling_config


def test_config_yaml_builds_with_the_prefix_cache_policy_and_its_knobs():
    from serve_app.app import build_app

    args = yaml.safe_load(CONFIG.read_text())["applications"][0]["args"]
    scaling = _replica_autoscaling(build_app(args))
    assert scaling.policy.policy_function == POLICY_PATH
    assert scaling.policy.policy_kwargs == args["autoscaling_policy_args"]
    assert (scaling.min_replicas, scaling.max_replicas) == (1, 8)
    assert (scaling.upscale_delay_s, scaling.downscale_delay_s) == (0.0, 0.0)   # the policy's own limits instead
    assert (scaling.metrics_interval_s, scaling.look_back_period_s) == (2.0, 5.0)
    # Left out, the policy is still ours: it is the default whenever autoscaling is on.
    default = _replica_autoscaling(build_app({"autoscaling_config": {"min_replicas": 1, "max_replicas": 3}}))
    assert default.policy.policy_function == POLICY_PATH and default.policy.policy_kwargs == {}
    assert _replica_autoscaling(build_app({"num_replicas": 2})) is None


def test_serve_default_keeps_serves_policy_and_its_keys():
    from serve_app.app import build_app

    scaling = _replica_autoscaling(build_app({
        "autoscaling_policy": "serve_default",
        "autoscaling_config": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 8,
                               "downscale_delay_s": 120}}))
    assert scaling.policy.is_default_policy_function()
    assert (scaling.target_ongoing_requests, scaling.downscale_delay_s, scaling.upscale_delay_s) == (8, 120, 30)
    own = {"policy_function": "ray.serve.autoscaling_policy:default_autoscaling_policy"}
    scaling = _replica_autoscaling(build_app({"autoscaling_config": {"min_replicas": 1, "max_replicas": 2,
                                                                     "policy": own}}))
    assert scaling.policy.is_default_policy_function()   # a policy named in the config is used as given


@pytest.mark.parametrize("args, message", [
    ({"autoscaling_policy": "fancy"}, "autoscaling_policy must be one of \\['prefix_cache', 'serve_default'\\]"),
    ({"autoscaling_policy_args": {"ttft_slo": 1}}, "unknown autoscaling policy option\\(s\\) ttft_slo "),
    ({"autoscaling_policy_args": {"ttft_slo_s": -1}}, "ttft_slo_s must be > 0"),
    ({"autoscaling_policy_args": [1]}, "autoscaling_policy_args must be a mapping"),
    ({"target_ongoing_requests": 8}, "autoscaling_config.target_ongoing_requests belongs to Serve's default policy"),
    ({"downscale_delay_s": 120}, "downscale_delay_s belongs to .* uses downscale_window_s and scale_in_interval_s"),
    ({"autoscaling_policy": "serve_default", "autoscaling_policy_args": {"ttft_slo_s": 1}},
     "autoscaling_policy_args are the prefix_cache policy's options"),
    ({"policy": {"policy_function": "ray.serve.autoscaling_policy:default_autoscaling_policy"},
      "autoscaling_policy": "prefix_cache"}, "autoscaling_config.policy is set and used as given"),
])
def test_bad_autoscaling_args_fail_the_build_naming_the_key(args, message):
    from serve_app.app import build_app

    app_args = {"autoscaling_config": {"min_replicas": 1, "max_replicas": 2}}
    for key in ("autoscaling_policy", "autoscaling_policy_args"):
        if key in args:
            app_args[key] = args.pop(key)
    app_args["autoscaling_config"].update(args)
    with pytest.raises(ValueError, match=message):
        build_app(app_args)


def test_policy_args_without_autoscaling_are_refused():
    from serve_app.app import build_app

    with pytest.raises(ValueError, match="autoscaling_policy and autoscaling_policy_args need an autoscaling_config"):
        build_app({"num_replicas": 2, "autoscaling_policy_args": {"ttft_slo_s": 1}})


def test_serve_autoscale_flag_parses_min_max():
    import argparse

    from serve_app.cli_serve import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--autoscale", "1:4"]).autoscale == (1, 4)
    assert parser.parse_args([]).autoscale is None
    for bad in ("4", "3:2", "a:b", "0:0", "-1:2"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--autoscale", bad])
