"""serve_app/config.yaml is a complete, valid Serve config whose app builds."""

from pathlib import Path

import yaml
from ray.serve.config import AutoscalingConfig
from ray.serve.schema import ServeDeploySchema

CONFIG = Path(__file__).resolve().parents[2] / "serve_app" / "config.yaml"


def test_config_validates_with_serve_schema():
    cfg = yaml.safe_load(CONFIG.read_text())
    schema = ServeDeploySchema.model_validate(cfg)
    (app,) = schema.applications
    assert app.import_path == "serve_app.app:build_app" and app.route_prefix == "/"
    AutoscalingConfig.model_validate(app.args["autoscaling_config"])


def test_config_args_build_the_application():
    from serve_app.app import build_app

    cfg = yaml.safe_load(CONFIG.read_text())
    app = build_app(cfg["applications"][0]["args"])
    assert type(app).__name__ == "Application"


def test_unknown_args_are_rejected():
    import pytest

    from serve_app.app import build_app

    with pytest.raises(ValueError, match="unknown application args: \\['colour'\\]"):
        build_app({"colour": "blue"})


def test_keys_without_tenant_get_namespaces_of_their_own():
    from serve_app.auth import key_tenant, parse_keys

    keys = parse_keys("sk-shared-prefix-aaaa,sk-shared-prefix-bbbb,sk-other=team-x")
    assert keys["sk-other"] == "team-x"
    a, b = keys["sk-shared-prefix-aaaa"], keys["sk-shared-prefix-bbbb"]
    assert a != b and a == key_tenant("sk-shared-prefix-aaaa")
    assert "sk-shared" not in a   # derived from the whole key, and not the key itself


def test_policy_args_are_checked_when_the_app_is_built():
    import pytest

    from serve_app.app import build_app

    assert type(build_app({"policy_args": {"replicate_share": 1.5}})).__name__ == "Application"
    with pytest.raises(ValueError, match="unknown cost policy option\\(s\\) replicate_shar"):
        build_app({"policy_args": {"replicate_shar": 1.5}})
    with pytest.raises(ValueError, match="replicate_share must be a number >= 0"):
        build_app({"policy_args": {"replicate_share": -1}})
    with pytest.raises(ValueError, match="routing policy 'prefix' takes no option\\(s\\) replicate_share"):
        build_app({"routing_policy": "prefix", "policy_args": {"replicate_share": 1.5}})
    with pytest.raises(ValueError, match="policy_args must be a mapping"):
        build_app({"policy_args": "replicate_share=1.5"})


def test_the_old_policy_arg_is_refused_naming_routing_policy():
    import pytest

    from serve_app.app import build_app

    with pytest.raises(ValueError, match="the application arg 'policy' is now 'routing_policy'"):
        build_app({"policy": "cost"})
    with pytest.raises(ValueError, match="worker config key 'policy' is now 'eviction_policy'"):
        build_app({"worker": {"policy": "lfu"}})
    assert type(build_app({"routing_policy": "prefix", "worker": {"eviction_policy": "lfu"}})).__name__ == \
        "Application"


def test_replica_calls_default_to_grpc_and_a_bad_choice_is_named():
    """The ingress reaches the replicas over Serve's direct gRPC channel unless told
    ``object_ref``; a handle it is given is switched to it, anything else is kept."""
    import pytest
    from ray.serve.handle import DeploymentHandle

    from serve_app.app import build_app
    from serve_app.ingress import IngressCore

    assert type(build_app({"replica_calls": "object_ref"})).__name__ == "Application"
    with pytest.raises(ValueError, match="replica_calls must be one of \\['grpc', 'object_ref'\\], got 'rpc'"):
        build_app({"replica_calls": "rpc"})

    class Recording(DeploymentHandle):   # records how the ingress sets its handle up
        def __init__(self):
            self.calls = []

        def options(self, **kwargs):
            self.calls.append(kwargs)
            return self

    for choice, calls in (("grpc", [{"_by_reference": False}]), ("object_ref", [])):
        handle = Recording()
        IngressCore(handle, model=None, shared_replies=False, router=object(), replica_calls=choice)
        assert handle.calls == calls


def _replica_options(app) -> dict:
    """The CacheReplica deployment's Ray actor options in a built application."""
    return app._bound_deployment.init_args[0]._bound_deployment.ray_actor_options


def test_serve_checks_each_replica_twice_a_second_unless_told():
    """Issue 52: Serve learns of a dead replica's process at its next health check, so the
    period is part of a replacement's start."""
    from serve_app.app import build_app

    def period(app) -> float:
        return app._bound_deployment.init_args[0]._bound_deployment._deployment_config.health_check_period_s

    assert period(build_app({})) == 0.5
    assert period(build_app({"health_check_period_s": 3})) == 3.0


def test_the_gpu_claim_is_decided_from_the_cluster_and_logged(monkeypatch):
    """``gpus_per_replica`` unset: a GPU per replica where the cluster has GPUs, the CPU (with
    its preloaded runtimes) where it has none, one line in the deploy log each time; ``device:
    cuda`` without a GPU fails the build naming the setting (``serve_app.placement``)."""
    import logging

    import pytest

    from serve_app import app as app_module
    from serve_app.app import build_app
    from serve_app.placement import PlacementError

    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append((record.levelname, record.getMessage()))

    handler = Keep()
    app_module.log.addHandler(handler)
    try:
        monkeypatch.setattr(app_module, "cluster_resources", lambda: ({"CPU": 16.0, "GPU": 2.0}, "the Ray cluster"))
        options = _replica_options(build_app({}))
        assert options == {"num_gpus": 1.0, "num_cpus": 0}   # no CPU runtime preloads on a GPU replica
        assert lines == [("INFO", "prefix-cache deploy: cache replicas claim 1 GPU each: the Ray cluster has 2 GPUs "
                                  "and gpus_per_replica is unset (worker device 'auto')")]
        assert _replica_options(build_app({"gpus_per_replica": 0}))["num_gpus"] == 0.0   # honoured as given
        assert lines[-1][0] == "WARNING"

        lines.clear()
        monkeypatch.setattr(app_module, "cluster_resources", lambda: ({"CPU": 6.0}, "the Ray cluster"))
        options = _replica_options(build_app({}))
        assert (options["num_gpus"], options["num_cpus"]) == (0.0, 1)
        assert lines == [("INFO", "prefix-cache deploy: cache replicas run on the CPU: the Ray cluster has no GPU "
                                  "and gpus_per_replica is unset")]
        with pytest.raises(PlacementError, match="worker device is 'cuda' but the Ray cluster has no GPU"):
            build_app({"worker": {"device": "cuda"}})
    finally:
        app_module.log.removeHandler(handler)


def test_tenant_quotas_are_checked_and_keys_resolved_when_the_app_is_built():
    import pytest

    from serve_app.app import build_app

    app = build_app({"api_keys": "sk-a=team-a,sk-b=team-b",
                     "tenant_quotas": {"keys": {"sk-b": {"hot": {"guarantee": 0.5}}},
                                       "default": {"hot": {"cap": 0.75}}}})
    worker = app._bound_deployment.init_args[0]._bound_deployment.init_args[0]
    assert worker["tenant_quotas"] == {"default": {"hot": {"guarantee": 0.0, "cap": 0.75}},
                                       "tenants": {"team-b": {"hot": {"guarantee": 0.5, "cap": 1.0}}},
                                       "l3_blocks": 0}
    with pytest.raises(ValueError, match="tenant_quotas.tenants.x.warm: guarantee 0.9 exceeds cap 0.5"):
        build_app({"tenant_quotas": {"tenants": {"x": {"warm": {"guarantee": 0.9, "cap": 0.5}}}}})
    with pytest.raises(ValueError, match="not among the configured api_keys"):
        build_app({"api_keys": "sk-a=team-a", "tenant_quotas": {"keys": {"sk-z": {}}}})


def test_a_worker_config_error_is_one_line_naming_the_key_before_anything_starts(monkeypatch):
    """``build_app`` (``serve deploy``'s first step) and ``prefix-cache serve`` refuse a bad
    worker config before a node or a replica starts: one line, naming the key."""
    import argparse

    import pytest

    from serve_app import cli_serve
    from serve_app.app import build_app

    with pytest.raises(ValueError, match="^worker config: give kv_memory_mb or hot_blocks, not both$"):
        build_app({"worker": {"kv_memory_mb": 512, "hot_blocks": 64}})
    with pytest.raises(ValueError, match="^worker config: kv_memory_mb is HOT and WARM together on a CPU cache"):
        build_app({"worker": {"kv_memory_mb": 512, "warm_blocks": 64, "device": "cpu"}, "gpus_per_replica": 0})
    assert type(build_app({"worker": {"kv_memory_mb": 512}})).__name__ == "Application"
    started = []
    monkeypatch.setattr(cli_serve, "LocalCluster", lambda *a, **k: started.append(a) or pytest.fail("started"))
    monkeypatch.setattr(cli_serve, "prepare_model", lambda *a, **k: started.append(a) or pytest.fail("started"))
    p = argparse.ArgumentParser()
    cli_serve.add_arguments(p)
    with pytest.raises(SystemExit) as stopped:
        cli_serve.run(p.parse_args(["--args", '{"worker": {"kv_memory_mb": 0}}']))
    assert str(stopped.value) == ("prefix-cache serve: worker config: kv_memory_mb must be a positive number "
                                  "of MiB or null, got 0")
    assert started == []
