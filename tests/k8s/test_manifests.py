"""The manifests under k8s/, checked offline (no cluster): KubeRay CRD schemas, the operator's
own rules, the Serve config and its application, this project's cache-node rules, and
`prefix-cache k8s render --check`. Every check is also shown failing on a broken copy."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Callable

import pytest
import yaml

from cluster import cli
from serve_app import k8s_render
from tests.k8s import validation as v

RAY_KINDS = tuple(v.CRD_FILES)
MANIFESTS = v.manifests()
RAY_DOCS = [(name, doc) for name, doc in MANIFESTS if doc.get("kind") in RAY_KINDS]
BY_KIND = {doc.get("kind"): doc for _, doc in MANIFESTS}
DOCKERFILE = (v.K8S / "Dockerfile").read_text()


@pytest.fixture(scope="module")
def crds():
    """kind -> CRDValidator, each CRD (about 1 MB) loaded once and only when asked for."""
    folder = v.schemas_dir()
    if folder is None:
        pytest.skip(f"KubeRay CRDs not found: set {v.SCHEMAS_ENV} to a folder holding "
                    f"{' and '.join(v.CRD_FILES.values())} (KubeRay v1.7.0, "
                    f"ray-operator/config/crd/bases), or put them in ../shared/k8s-schemas beside the checkout")
    cache: dict[str, v.CRDValidator] = {}

    def get(kind: str) -> v.CRDValidator:
        if kind not in cache:
            cache[kind] = v.CRDValidator(v.load_crd_schema(folder / v.CRD_FILES[kind]))
        return cache[kind]
    return get


def rayservice() -> dict:
    return copy.deepcopy(BY_KIND["RayService"])


# ------------------------------------------------------------ committed files
def test_manifest_set():
    kinds = sorted(doc.get("kind") for _, doc in MANIFESTS)
    assert kinds == ["PodMonitor", "RayService", "Secret"], kinds


@pytest.mark.parametrize("name,doc", RAY_DOCS, ids=[n for n, _ in RAY_DOCS])
def test_ray_manifest_matches_crd(crds, name, doc):
    validator = crds(doc["kind"])
    assert validator.errors(doc, strict=True) == []
    assert v.operator_errors(doc) == []


def test_cluster_kuberay_creates_matches_raycluster_crd(crds):
    """The RayCluster KubeRay makes from rayClusterConfig passes the RayCluster CRD too."""
    cluster = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "prefix-cache-x1y2z"},
               "spec": rayservice()["spec"]["rayClusterConfig"]}
    assert crds("RayCluster").errors(cluster, strict=True) == []
    assert v.operator_errors(cluster) == []


@pytest.mark.parametrize("name,doc", [(n, d) for n, d in RAY_DOCS if d["kind"] == "RayService"],
                         ids=[n for n, d in RAY_DOCS if d["kind"] == "RayService"])
def test_serve_config_deploys(name, doc):
    assert v.serve_config_errors(doc["spec"]["serveConfigV2"]) == []


def test_cache_node_rules():
    assert v.cache_node_errors(rayservice()) == []


def test_cache_node_values():
    """The numbers the rules only bound: one GPU per pod, scaling ranges, the disk tier."""
    rs = rayservice()
    spec = rs["spec"]["rayClusterConfig"]
    (group,) = spec["workerGroupSpecs"]
    container = group["template"]["spec"]["containers"][0]
    args = v.serve_app_args(rs)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    assert (group["minReplicas"], group["maxReplicas"]) == (args["autoscaling_config"]["min_replicas"],
                                                            args["autoscaling_config"]["max_replicas"])
    assert args["worker"]["disk_dir"] in [m["mountPath"] for m in container["volumeMounts"]]
    assert v.cold_tier_bytes(args["worker"]) == 46000 * 360 * 1024   # 15.8 GiB at 360 KiB a block (bf16)
    assert {e["name"]: e.get("value") for e in container["env"]}["UCX_TLS"] == "rc,ud,tcp,sm,self,cuda_copy,cuda_ipc"


def test_podmonitor_secret_dockerfile():
    assert v.podmonitor_errors(BY_KIND["PodMonitor"], rayservice()) == []
    assert v.secret_errors(BY_KIND["Secret"], rayservice()) == []
    assert v.dockerfile_errors(DOCKERFILE, rayservice()) == []


# ------------------------------------------------------------------ render
def render_cli(*argv: str) -> int:
    assert ("k8s", "render") in cli._registered(), \
        "the k8s.render command is not registered: reinstall the package (pip install -e .)"
    return cli.main(["k8s", "render", *argv])


def test_render_check_passes_on_committed_files(capsys):
    assert render_cli("--check") == 0, capsys.readouterr().out


def test_render_check_fails_on_drifted_manifest(tmp_path, capsys):
    out = tmp_path / "rayservice.yaml"
    text = (v.K8S / "rayservice.yaml").read_text()
    assert "        maxReplicas: 8\n" in text
    out.write_text(text.replace("        maxReplicas: 8\n", "        maxReplicas: 9\n"))
    assert render_cli("--check", "--out", str(out)) == 1
    diff = capsys.readouterr().out
    assert "-        maxReplicas: 9" in diff and "+        maxReplicas: 8" in diff and "out of date" in diff


def test_render_check_fails_when_config_changes(tmp_path, capsys):
    config = tmp_path / "config.yaml"
    text = (v.REPO / "serve_app/config.yaml").read_text()
    assert "max_replicas: 8\n" in text
    config.write_text(text.replace("max_replicas: 8\n", "max_replicas: 12\n"))
    assert render_cli("--check", "--config", str(config)) == 1
    assert "+          max_replicas: 12" in capsys.readouterr().out


def test_render_writes_the_committed_bytes(tmp_path):
    out = tmp_path / "rayservice.yaml"
    assert render_cli("--out", str(out)) == 0
    assert out.read_text() == (v.K8S / "rayservice.yaml").read_text()


def test_serve_config_is_config_yaml_plus_documented_overrides():
    config = yaml.safe_load((v.REPO / "serve_app/config.yaml").read_text())
    settings, _ = k8s_render.split_template((v.K8S / "rayservice.template.yaml").read_text())
    expected, changes = k8s_render.apply_overrides(config, settings["serveConfigOverrides"])
    assert yaml.safe_load(rayservice()["spec"]["serveConfigV2"]) == expected
    rendered = (v.K8S / "rayservice.yaml").read_text()
    assert changes and all(f"#   {change}\n" in rendered for change in changes)
    # only the GPU-cluster values differ from config.yaml
    assert sorted(c.split(":")[0] for c in changes) == [
        "applications[prefix-cache].args.gpus_per_replica",
        "applications[prefix-cache].args.worker.cold_blocks",
        "applications[prefix-cache].args.worker.disk_dir",
        "applications[prefix-cache].args.worker.model.dtype"]


@pytest.mark.parametrize("overrides,message", [
    ({"applications": {"nope": {"args": {}}}}, "names application 'nope'"),
    ({"applications": {"prefix-cache": {"args": {"worker": 3}}}}, "would replace a mapping"),
    ({"applications": {"prefix-cache": {"import_path": {"x": 1}}}}, "is a mapping but"),
])
def test_render_rejects_bad_overrides(overrides, message):
    config = yaml.safe_load((v.REPO / "serve_app/config.yaml").read_text())
    with pytest.raises(ValueError, match=message):
        k8s_render.apply_overrides(config, overrides)


def test_render_needs_one_placeholder():
    config = (v.REPO / "serve_app/config.yaml").read_text()
    template = (v.K8S / "rayservice.template.yaml").read_text()
    with pytest.raises(ValueError, match="exactly one line"):
        k8s_render.render(config, template.replace(k8s_render.PLACEHOLDER, "x"))
    with pytest.raises(ValueError, match="must start with a document"):
        k8s_render.render(config, template.split("\n---\n", 1)[1])


# ------------------------------------------------------------ broken copies
def _group(doc: dict) -> dict:
    return doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]


def _worker(doc: dict) -> dict:
    return _group(doc)["template"]["spec"]["containers"][0]


def _head(doc: dict) -> dict:
    return doc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]


def _serve(edit: Callable[[dict], None]) -> Callable[[dict], None]:
    """A mutation of the first application in serveConfigV2."""
    def mutate(doc: dict) -> None:
        config = yaml.safe_load(doc["spec"]["serveConfigV2"])
        edit(config["applications"][0])
        doc["spec"]["serveConfigV2"] = yaml.safe_dump(config, sort_keys=False)
    return mutate


def _rename_autoscaling(doc):
    cfg = doc["spec"]["rayClusterConfig"]
    cfg["enableInTreeAutoscalling"] = cfg.pop("enableInTreeAutoscaling")


def _drop_env(name):
    def mutate(doc):
        for c in (_head(doc), _worker(doc)):
            c["env"] = [e for e in c["env"] if e["name"] != name]
    return mutate


# (id, stage, mutation, part of the expected message); stage "crd" needs the CRDs
BROKEN = [
    ("misspelled-field-strict", "crd", _rename_autoscaling, "'enableInTreeAutoscalling' was unexpected"),
    ("maxReplicas-wrong-type", "crd", lambda d: _group(d).update(maxReplicas="five"), "'five' is not of type"),
    ("gpu-not-a-quantity", "crd", lambda d: _worker(d)["resources"]["limits"].update({"nvidia.com/gpu": "one"}),
     "does not match"),
    ("upscalingMode-not-in-enum", "crd",
     lambda d: d["spec"]["rayClusterConfig"]["autoscalerOptions"].update(upscalingMode="Fast"), "is not one of"),
    ("serveConfigV2-mapping", "crd", lambda d: d["spec"].update(serveConfigV2={"applications": []}),
     "is not of type 'string'"),
    ("head-without-containers", "crd",
     lambda d: d["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"].pop("containers"),
     "'containers' is a required property"),
    ("min-above-max", "operator", lambda d: _group(d).update(minReplicas=9), "minReplicas 9 > maxReplicas 8"),
    ("negative-replicas", "operator", lambda d: _group(d).update(minReplicas=-1), "is negative"),
    ("bad-upgrade-type", "operator", lambda d: d["spec"]["upgradeStrategy"].update(type="Rolling"),
     "upgradeStrategy.type"),
    ("bad-import-attr", "serve", _serve(lambda a: a.update(import_path="serve_app.app:build_ap")), "import_path"),
    ("bad-import-module", "serve", _serve(lambda a: a.update(import_path="serve_app.nope:build_app")),
     "ModuleNotFoundError"),
    ("serve-autoscaling-min-above-max", "serve",
     _serve(lambda a: a["args"]["autoscaling_config"].update(min_replicas=5, max_replicas=2)),
     "must be greater than or equal to min_replicas"),
    ("unknown-app-arg", "serve", _serve(lambda a: a["args"].update(gpus_per_replca=1)), "unknown application args"),
    ("two-gpus-per-pod", "node", lambda d: _worker(d)["resources"]["limits"].update({"nvidia.com/gpu": 2}),
     "must be 1 per pod"),
    ("autoscaling-off", "node", lambda d: d["spec"]["rayClusterConfig"].update(enableInTreeAutoscaling=False),
     "enableInTreeAutoscaling must be true"),
    ("workers-below-serve-max", "node", lambda d: _group(d).update(maxReplicas=4), "would never get a GPU"),
    ("cpu-replicas", "node", _serve(lambda a: a["args"].update(gpus_per_replica=0)), "gpus_per_replica"),
    ("no-readiness", "node", lambda d: _worker(d).pop("readinessProbe"), "readinessProbe must GET /healthz"),
    ("head-readiness-on-app", "node",
     lambda d: _head(d).update(readinessProbe={"httpGet": {"path": "/healthz", "port": 8000}}),
     "head readinessProbe"),
    ("api-key-in-plain-env", "node",
     lambda d: [_drop_env("PREFIX_CACHE_API_KEYS")(d),
                _worker(d)["env"].append({"name": "PREFIX_CACHE_API_KEYS", "value": "k=t"})],
     "PREFIX_CACHE_API_KEYS must come from a secretKeyRef"),
    ("api-key-in-serve-args", "node", _serve(lambda a: a["args"].update(api_keys="k=t")), "plain text"),
    ("no-dev-shm", "node", lambda d: _worker(d).update(volumeMounts=[m for m in _worker(d)["volumeMounts"]
                                                                     if m["mountPath"] != "/dev/shm"]),
     "/dev/shm must be an emptyDir"),
    ("no-ipc-lock", "node", lambda d: _worker(d).pop("securityContext"), "IPC_LOCK"),
    ("disk-dir-not-mounted", "node", _serve(lambda a: a["args"]["worker"].update(disk_dir="/data/kv")),
     "is not a volume mounted"),
    ("disk-tier-too-big", "node", _serve(lambda a: a["args"]["worker"].update(cold_blocks=10**6)),
     "smaller than cold_blocks need"),
    ("ucx-without-tcp", "node", lambda d: [e.update(value="rc,ud,sm,self") for e in _worker(d)["env"]
                                           if e["name"] == "UCX_TLS"], "must include tcp"),
    ("no-memory-limit", "node", lambda d: _worker(d)["resources"]["limits"].pop("memory"), "requests and limits"),
]


def rayservice_errors(doc: dict, crds=None) -> list[str]:
    """Each stage runs only on what passed the one before: the cache-node rules trust types."""
    errors = crds("RayService").errors(doc) if crds else []
    errors = errors or v.operator_errors(doc)
    errors = errors or v.serve_config_errors(doc["spec"]["serveConfigV2"])
    return errors or v.cache_node_errors(doc)


@pytest.mark.parametrize("stage,mutate,message", [b[1:] for b in BROKEN], ids=[b[0] for b in BROKEN])
def test_broken_rayservice_rejected(request, stage, mutate, message):
    doc = rayservice()
    mutate(doc)
    crds = request.getfixturevalue("crds") if stage == "crd" else None
    errors = rayservice_errors(doc, crds)
    assert any(message in e for e in errors), errors


def test_misspelled_field_needs_strict_mode(crds):
    doc = rayservice()
    _rename_autoscaling(doc)
    assert crds("RayService").errors(doc, strict=False) == []   # what the apiserver accepts (and prunes)
    assert crds("RayService").errors(doc, strict=True)


def test_defaulting_before_required(crds):
    """A worker group without min/maxReplicas is valid once the CRD's defaults are in."""
    doc = rayservice()
    del _group(doc)["minReplicas"], _group(doc)["maxReplicas"]
    assert crds("RayService").errors(doc) == []


@pytest.mark.parametrize("mutate,message", [
    (lambda m: m.update(kind="ServiceMonitor"), "not a monitoring.coreos.com/v1 PodMonitor"),
    (lambda m: m["spec"]["podMetricsEndpoints"][0].update(port="dashboard"), "is not Ray's metrics port"),
    (lambda m: m["spec"]["selector"]["matchLabels"].update(app="other"), "is not on the head pods"),
    (lambda m: m["spec"]["selector"].pop("matchExpressions"), "ray.io/cluster"),
], ids=["kind", "port", "selector-label", "no-cluster-label"])
def test_broken_podmonitor_rejected(mutate, message):
    monitor = copy.deepcopy(BY_KIND["PodMonitor"])
    mutate(monitor)
    assert any(message in e for e in v.podmonitor_errors(monitor, rayservice()))


@pytest.mark.parametrize("mutate,message", [
    (lambda s: s["stringData"].update({"api-keys": "9f8e7d6c5b4a=tenant-a"}), "not a REPLACE_ME placeholder"),
    (lambda s: s["metadata"].update(name="keys"), "which this Secret lacks"),
    (lambda s: s["stringData"].pop("admin-keys"), "which this Secret lacks"),
], ids=["real-key", "name", "missing-key"])
def test_broken_secret_rejected(mutate, message):
    secret = copy.deepcopy(BY_KIND["Secret"])
    mutate(secret)
    assert any(message in e for e in v.secret_errors(secret, rayservice()))


@pytest.mark.parametrize("old,new,message", [
    ("rayproject/ray:2.60.0-py311-gpu", "rayproject/ray:2.59.0-py311-gpu", "is Ray 2.59.0"),
    ("rayproject/ray:2.60.0-py311-gpu", "rayproject/ray:2.60.0-py311", "not a rayproject/ray CUDA 12"),
    ('"nixl-cu12>=1.5"', "", "nixl-cu12"),
], ids=["ray-version", "cpu-image", "no-nixl"])
def test_broken_dockerfile_rejected(old, new, message):
    assert old in DOCKERFILE
    errors = v.dockerfile_errors(DOCKERFILE.replace(old, new), rayservice())
    assert any(message in e for e in errors), errors


def test_schemas_found_through_env(monkeypatch, tmp_path):
    folder = v.schemas_dir()
    if folder is None:
        pytest.skip("no KubeRay CRDs here to copy")
    for name in v.CRD_FILES.values():
        shutil.copy(folder / name, tmp_path / name)
    monkeypatch.setenv(v.SCHEMAS_ENV, str(tmp_path))
    assert v.schemas_dir() == tmp_path
    monkeypatch.setenv(v.SCHEMAS_ENV, str(tmp_path / "missing"))
    beside = v.REPO.parent / "shared" / "k8s-schemas"
    fallback = beside if all((beside / n).is_file() for n in v.CRD_FILES.values()) else None
    assert v.schemas_dir() == fallback   # a wrong variable falls back to ../shared/k8s-schemas, if there


def test_no_schemas_found(monkeypatch):
    monkeypatch.setenv(v.SCHEMAS_ENV, "/nonexistent")
    monkeypatch.setattr(v, "REPO", Path("/nonexistent/checkout"))
    assert v.schemas_dir() is None
