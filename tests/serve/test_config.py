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
        build_app({"policy": "prefix", "policy_args": {"replicate_share": 1.5}})
    with pytest.raises(ValueError, match="policy_args must be a mapping"):
        build_app({"policy_args": "replicate_share=1.5"})


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
