"""The manifests under k8s/, checked offline (no cluster) as Kustomize builds them
(`kubectl kustomize k8s/` and each overlay, run here through subprocess): KubeRay CRD schemas,
the operator's own rules, the Serve config and its application, this project's cache-node
rules and `prefix-cache k8s render --check` (the Grafana dashboard: test_dashboards.py).
Every check is also shown failing on a broken copy."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Callable

import pytest
import yaml

from cluster import cli
from lab import k8s_render
from tests.k8s import validation as v
from tests.k8s.builds import built, by_kind, rayservice
from tests.requirements import K8S_SCHEMAS, require

TARGETS = tuple(v.KUSTOMIZE_TARGETS)          # k8s (= the base), base, tcp
DOCKERFILE = (v.K8S / "Dockerfile").read_text()
SECRET = yaml.safe_load((v.K8S / "secret.example.yaml").read_text())
SERVE_CONFIG = v.K8S / "base" / "serve-config.yaml"


@pytest.fixture(scope="module")
def crds():
    """kind -> CRDValidator, each CRD (about 1 MB) loaded once and only when asked for."""
    folder = v.schemas_dir()
    require(K8S_SCHEMAS, folder is not None,
            f"set {v.SCHEMAS_ENV} to a folder holding {' and '.join(v.CRD_FILES.values())} (KubeRay v1.7.0, "
            f"ray-operator/config/crd/bases), or put them in ../shared/k8s-schemas beside the checkout")
    cache: dict[str, v.CRDValidator] = {}

    def get(kind: str) -> v.CRDValidator:
        if kind not in cache:
            cache[kind] = v.CRDValidator(v.load_crd_schema(folder / v.CRD_FILES[kind]))
        return cache[kind]
    return get


# ------------------------------------------------------------ what kustomize builds
@pytest.mark.parametrize("target", TARGETS)
def test_build_holds_exactly_these_objects(target):
    """The serve-config ConfigMap is a build input (local-config) and never reaches the cluster;
    no Secret: the real one is created by hand (k8s/README.md, step 3)."""
    names = sorted((d["apiVersion"], d["kind"], d["metadata"]["name"]) for d in built(target))
    assert names == [("apps/v1", "Deployment", "prefix-cache-l3-master"),
                     ("apps/v1", "Deployment", "prefix-cache-l3-pool"),
                     ("monitoring.coreos.com/v1", "PodMonitor", "prefix-cache-ray"),
                     ("ray.io/v1", "RayService", "prefix-cache"),
                     ("v1", "ConfigMap", "prefix-cache-grafana-dashboard"),
                     ("v1", "Service", "prefix-cache-l3-master")]
    for doc in built(target):
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "prefix-cache"
        assert "namespace" not in doc["metadata"]   # `kubectl -n NAMESPACE apply -k` decides


def test_k8s_is_the_base():
    """`kubectl apply -k k8s/` applies the base, nothing else."""
    assert built("k8s") == built("base")


def test_top_level_yaml_files_are_kubernetes_objects():
    """Render inputs live in k8s/render/, outside every kustomization; what lies in k8s/ itself is
    the entry kustomization or a Kubernetes object (the Secret example)."""
    found = {}
    for path in sorted(v.K8S.glob("*.y*ml")):
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        found[path.name] = [(d.get("apiVersion"), d.get("kind")) for d in docs]
    assert found == {"kustomization.yaml": [("kustomize.config.k8s.io/v1beta1", "Kustomization")],
                     "secret.example.yaml": [("v1", "Secret")]}


@pytest.mark.parametrize("target", TARGETS)
def test_serve_config_v2_is_the_rendered_file(target):
    """Kustomize copies k8s/base/serve-config.yaml into serveConfigV2 byte for byte."""
    assert rayservice(target)["spec"]["serveConfigV2"] == SERVE_CONFIG.read_text()


@pytest.mark.parametrize("target", TARGETS)
def test_ray_manifest_matches_crd(crds, target):
    doc = rayservice(target)
    assert crds("RayService").errors(doc, strict=True) == []
    assert v.operator_errors(doc) == []


@pytest.mark.parametrize("target", TARGETS)
def test_cluster_kuberay_creates_matches_raycluster_crd(crds, target):
    """The RayCluster KubeRay makes from rayClusterConfig passes the RayCluster CRD too."""
    cluster = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "prefix-cache-x1y2z"},
               "spec": rayservice(target)["spec"]["rayClusterConfig"]}
    assert crds("RayCluster").errors(cluster, strict=True) == []
    assert v.operator_errors(cluster) == []


@pytest.mark.parametrize("target", TARGETS)
def test_serve_config_deploys(target):
    assert v.serve_config_errors(rayservice(target)["spec"]["serveConfigV2"]) == []


@pytest.mark.parametrize("target", TARGETS)
def test_cache_node_rules(target):
    assert v.cache_node_errors(rayservice(target)) == []


def test_cache_node_values():
    """The numbers the rules only bound: one GPU per pod, scaling ranges, the disk tier, RDMA."""
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
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert (env["UCX_TLS"], env["UCX_NET_DEVICES"]) == ("rc,ud,tcp,sm,self,cuda_copy,cuda_ipc", "mlx5_0:1")
    for which in ("requests", "limits"):
        assert container["resources"][which]["rdma/hca_shared_devices_a"] == 1
    # Both pods' raylets start workers (the Ingress and the proxy may land on the head) with the
    # serving environment the local and test clusters use: nice 0, not the raylet's default 15,
    # and Serve's gRPC and event-loop settings (actors.config.SERVING_ENV).
    from actors.config import SERVING_ENV

    for c in (_head(rs), container):
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert {name: env.get(name) for name in SERVING_ENV} == SERVING_ENV


def test_tcp_overlay_changes_only_ucx_and_rdma():
    """The tcp overlay is the base without RDMA: UCX_TLS without rc,ud, no UCX_NET_DEVICES, no
    rdma/ resource; every other byte the same."""
    expected = by_kind("base")
    worker = _worker(expected["RayService"])
    worker["env"] = [e for e in worker["env"] if e["name"] != "UCX_NET_DEVICES"]
    next(e for e in worker["env"] if e["name"] == "UCX_TLS")["value"] = "tcp,sm,self,cuda_copy,cuda_ipc"
    for which in ("requests", "limits"):
        del worker["resources"][which]["rdma/hca_shared_devices_a"]
    assert by_kind("tcp") == expected


def test_readme_overlay_sets_image_and_drops_podmonitor(tmp_path, crds):
    """The overlay k8s/README.md shows (step 4), built beside a copy of the checkout's k8s/."""
    built("base")
    readme = (v.K8S / "README.md").read_text()
    blocks = [b.split("```", 1)[0] for b in readme.split("```yaml\n")[1:]]
    (overlay,) = [b for b in blocks if "newName:" in b]
    shutil.copytree(v.K8S, tmp_path / "prefix-cache-cluster" / "k8s")
    (tmp_path / "deploy").mkdir()
    (tmp_path / "deploy" / "kustomization.yaml").write_text(overlay)
    docs = {d["kind"]: d for d in v.kustomize_build(tmp_path / "deploy")}
    assert sorted(docs) == ["ConfigMap", "Deployment", "RayService", "Service"]
    for d in v.kustomize_build(tmp_path / "deploy"):   # the L3 pods run the same image
        if d["kind"] == "Deployment":
            assert [c["image"] for c in d["spec"]["template"]["spec"]["containers"]] == \
                ["registry.mycorp.io/prefix-cache:0.1.1"]
    rs = docs["RayService"]
    assert [c["image"] for _, _, c in v._containers(v.cluster_spec(rs))] == \
        ["registry.mycorp.io/prefix-cache:0.1.1"] * 2
    assert crds("RayService").errors(rs) == [] and v.cache_node_errors(rs) == []


def test_podmonitor_secret_dockerfile():
    assert v.podmonitor_errors(by_kind()["PodMonitor"], rayservice()) == []
    assert v.secret_errors(SECRET, rayservice()) == []
    assert v.dockerfile_errors(DOCKERFILE, rayservice()) == []


# ------------------------------------------------------------------ render
def render_cli(*argv: str) -> int:
    assert ("k8s", "render") in cli._registered(), \
        "the k8s.render command is not registered: reinstall the package (pip install -e .)"
    return cli.main(["k8s", "render", *argv])


def test_render_check_passes_on_committed_files(capsys):
    assert render_cli("--check") == 0, capsys.readouterr().out


def test_render_check_fails_on_drifted_file(tmp_path, capsys):
    out = tmp_path / "serve-config.yaml"
    text = SERVE_CONFIG.read_text()
    assert "    max_replicas: 8\n" in text
    out.write_text(text.replace("    max_replicas: 8\n", "    max_replicas: 9\n"))
    assert render_cli("--check", "--out", str(out)) == 1
    diff = capsys.readouterr().out
    assert "-      max_replicas: 9" in diff and "+      max_replicas: 8" in diff and "out of date" in diff


def test_render_check_fails_when_config_changes(tmp_path, capsys):
    config = tmp_path / "config.yaml"
    text = (v.REPO / "serve_app/config.yaml").read_text()
    assert "max_replicas: 8\n" in text
    config.write_text(text.replace("max_replicas: 8\n", "max_replicas: 12\n"))
    assert render_cli("--check", "--config", str(config)) == 1
    assert "+      max_replicas: 12" in capsys.readouterr().out


def test_render_check_fails_when_overrides_change(tmp_path, capsys):
    overrides = tmp_path / "serve-overrides.yaml"
    text = (v.K8S / "render/serve-overrides.yaml").read_text()
    assert "cold_blocks: 46000\n" in text
    overrides.write_text(text.replace("cold_blocks: 46000\n", "cold_blocks: 40000\n"))
    assert render_cli("--check", "--overrides", str(overrides)) == 1
    out = capsys.readouterr().out
    assert "+#   applications[prefix-cache].args.worker.cold_blocks: 0 -> 40000" in out
    assert "+      cold_blocks: 40000" in out


def test_render_writes_the_committed_bytes(tmp_path):
    out = tmp_path / "serve-config.yaml"
    assert render_cli("--out", str(out)) == 0
    assert out.read_text() == SERVE_CONFIG.read_text()
    assert render_cli("--overrides", str(v.K8S / "render/serve-overrides.yaml"), "--out", str(out)) == 0
    assert out.read_text() == SERVE_CONFIG.read_text()


def test_serve_config_is_config_yaml_plus_documented_overrides():
    config = yaml.safe_load((v.REPO / "serve_app/config.yaml").read_text())
    overrides = k8s_render.load_overrides((v.K8S / "render/serve-overrides.yaml").read_text())
    expected, changes = k8s_render.apply_overrides(config, overrides)
    assert yaml.safe_load(rayservice()["spec"]["serveConfigV2"]) == expected
    assert changes and all(f"#   {change}\n" in SERVE_CONFIG.read_text() for change in changes)
    # only the GPU-cluster values differ from config.yaml
    assert changes == [
        'applications[prefix-cache].args.gpus_per_replica: (unset) -> 1',
        'applications[prefix-cache].args.worker.model.dtype: "float32" -> "bfloat16"',
        'applications[prefix-cache].args.worker.cold_blocks: 0 -> 46000',
        'applications[prefix-cache].args.worker.disk_dir: (unset) -> "/mnt/nvme"',
        'applications[prefix-cache].args.worker.max_batch_tokens: 512 -> 4096',
        'applications[prefix-cache].args.worker.l3_master: (unset) -> "prefix-cache-l3-master:50051"']


@pytest.mark.parametrize("overrides,message", [
    ({"applications": {"nope": {"args": {}}}}, "names application 'nope'"),
    ({"applications": {"prefix-cache": {"args": {"worker": 3}}}}, "would replace a mapping"),
    ({"applications": {"prefix-cache": {"import_path": {"x": 1}}}}, "is a mapping but"),
])
def test_render_rejects_bad_overrides(overrides, message):
    config = yaml.safe_load((v.REPO / "serve_app/config.yaml").read_text())
    with pytest.raises(ValueError, match=message):
        k8s_render.apply_overrides(config, overrides)


def test_render_rejects_bad_override_files():
    config = (v.REPO / "serve_app/config.yaml").read_text()
    with pytest.raises(ValueError, match="must be a mapping of Serve config overrides, not list"):
        k8s_render.render(config, "- a\n- b\n")
    with pytest.raises(ValueError, match="old rayservice.template.yaml format"):
        k8s_render.render(config, "render:\n  serveConfigOverrides: {}\n")
    with pytest.raises(ValueError, match="is not a Serve config"):
        k8s_render.render("proxy_location: EveryNode\n", "")
    assert "#   (none)\n" in k8s_render.render(config, "")   # no overrides: config.yaml as it is


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
    ("cpu-replicas", "node", _serve(lambda a: a["args"].update(gpus_per_replica=0)), "gpus_per_replica is 0, "),
    # Unset, the claim follows the GPUs present at deploy time: none before the autoscaler adds GPU pods.
    ("gpus-decided-at-deploy", "node", _serve(lambda a: a["args"].pop("gpus_per_replica")),
     "gpus_per_replica is unset, not 1"),
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
    ("ucx-without-cuda-copy", "node", lambda d: [e.update(value="rc,ud,tcp,sm,self") for e in _worker(d)["env"]
                                                 if e["name"] == "UCX_TLS"], "must include cuda_copy"),
    ("rdma-without-device", "node", lambda d: [_worker(d)["resources"][w].pop("rdma/hca_shared_devices_a")
                                               for w in ("requests", "limits")], "asks for no rdma/ device"),
    ("rdma-without-net-devices", "node", _drop_env("UCX_NET_DEVICES"), "UCX_NET_DEVICES is not set"),
    ("no-memory-limit", "node", lambda d: _worker(d)["resources"]["limits"].pop("memory"), "requests and limits"),
    ("serveConfigV2-placeholder", "serve",
     lambda d: d["spec"].update(serveConfigV2="# placeholder: build with kustomize (kubectl apply -k k8s/)"),
     "serveConfigV2 is empty or only comments"),
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
    monitor = by_kind()["PodMonitor"]
    mutate(monitor)
    assert any(message in e for e in v.podmonitor_errors(monitor, rayservice()))


@pytest.mark.parametrize("mutate,message", [
    (lambda s: s["stringData"].update({"api-keys": "9f8e7d6c5b4a=tenant-a"}), "not a REPLACE_ME placeholder"),
    (lambda s: s["metadata"].update(name="keys"), "which this Secret lacks"),
    (lambda s: s["stringData"].pop("admin-keys"), "which this Secret lacks"),
], ids=["real-key", "name", "missing-key"])
def test_broken_secret_rejected(mutate, message):
    secret = copy.deepcopy(SECRET)
    mutate(secret)
    assert any(message in e for e in v.secret_errors(secret, rayservice()))


@pytest.mark.parametrize("old,new,message", [
    ("rayproject/ray:2.60.0-py311-gpu", "rayproject/ray:2.59.0-py311-gpu", "is Ray 2.59.0"),
    ("rayproject/ray:2.60.0-py311-gpu", "rayproject/ray:2.60.0-py311", "not a rayproject/ray CUDA 12"),
    ('"nixl-cu12>=1.5"', "", "nixl-cu12"),
    ("COPY --chown=ray:users serve_app ./serve_app\n",
     "COPY --chown=ray:users serve_app ./serve_app\nCOPY --chown=ray:users bench ./bench\n",
     "COPY bench: not in the build context"),
], ids=["ray-version", "cpu-image", "no-nixl", "copy-missing-dir"])
def test_broken_dockerfile_rejected(old, new, message):
    assert old in DOCKERFILE
    errors = v.dockerfile_errors(DOCKERFILE.replace(old, new), rayservice())
    assert any(message in e for e in errors), errors


# Broken copies of the k8s/ tree itself, built by kubectl kustomize from a temporary folder.
def _edit(path: str, old: str, new: str) -> Callable[[Path], None]:
    def mutate(root: Path) -> None:
        text = (root / path).read_text()
        assert text.count(old) == 1, (path, old)
        (root / path).write_text(text.replace(old, new))
    return mutate


_UCX_TLS = '                  - {name: UCX_TLS, value: "rc,ud,tcp,sm,self,cuda_copy,cuda_ipc"}\n'
_UCX_NET = '                  - {name: UCX_NET_DEVICES, value: "mlx5_0:1"}\n'
BROKEN_TREES = [
    # the tcp patch finds the env entries by position: a reordered base fails the build, naming the entry
    ("tcp-patch-on-reordered-env", "overlays/tcp", _edit("base/rayservice.yaml", _UCX_TLS + _UCX_NET, _UCX_NET + _UCX_TLS),
     "testing value /spec/rayClusterConfig/workerGroupSpecs/0/template/spec/containers/0/env/9/name failed"),
    ("no-rendered-serve-config", "", lambda root: (root / "base/serve-config.yaml").unlink(),
     "serve-config.yaml: no such file or directory"),
    # a base that already lost its RDMA resource: the overlay says which key it could not remove
    ("tcp-patch-on-base-without-rdma", "overlays/tcp",
     _edit("base/rayservice.yaml", "                    rdma/hca_shared_devices_a: 1\n", ""),
     "Unable to remove nonexistent key: rdma/hca_shared_devices_a"),
]


@pytest.mark.parametrize("target,mutate,message", [b[1:] for b in BROKEN_TREES], ids=[b[0] for b in BROKEN_TREES])
def test_broken_tree_fails_the_build(tmp_path, target, mutate, message):
    built("base")   # skips without kubectl
    root = tmp_path / "k8s"
    shutil.copytree(v.K8S, root)
    mutate(root)
    with pytest.raises(v.KustomizeError) as info:
        v.kustomize_build(root / target)
    assert message in str(info.value), str(info.value)


def test_tree_without_the_replacement_builds_a_placeholder(tmp_path):
    """Without the replacement the RayService keeps its placeholder: the Serve check refuses it."""
    built("base")
    root = tmp_path / "k8s"
    shutil.copytree(v.K8S, root)
    text = (root / "base/kustomization.yaml").read_text()
    (root / "base/kustomization.yaml").write_text(text[:text.index("replacements:")])
    (doc,) = [d for d in v.kustomize_build(root) if d["kind"] == "RayService"]
    assert doc["spec"]["serveConfigV2"] == "# placeholder: build with kustomize (kubectl apply -k k8s/)"
    assert v.serve_config_errors(doc["spec"]["serveConfigV2"]) == [
        "serveConfigV2 is empty or only comments: the RayService's placeholder, not the Serve config "
        "(k8s/base/rayservice.yaml gets it from Kustomize's replacement)"]


def test_tree_without_the_local_config_annotation_ships_the_input(tmp_path):
    """Without config.kubernetes.io/local-config the serve-config ConfigMap would be applied too."""
    built("base")
    root = tmp_path / "k8s"
    shutil.copytree(v.K8S, root)
    _edit("base/kustomization.yaml", '        config.kubernetes.io/local-config: "true"\n',
          '        example.com/unrelated: "true"\n')(root)
    names = sorted(d["metadata"]["name"] for d in v.kustomize_build(root) if d["kind"] == "ConfigMap")
    assert names == ["prefix-cache-grafana-dashboard", "prefix-cache-serve-config"]


def test_schemas_found_through_env(monkeypatch, tmp_path):
    folder = v.schemas_dir()
    require(K8S_SCHEMAS, folder is not None, "no KubeRay CRDs here to copy")
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


def test_the_replicas_reach_the_l3_master_and_the_pool_registers_with_it():
    """L3 (k8s/base/l3.yaml): the serve config names the master's Service and port, the Service
    selects the master's pods by their port names, and the pool pods point at the same address
    with their own IP as the segment's host."""
    docs = by_kind("base")
    master, pool, service = (docs["Deployment/prefix-cache-l3-master"], docs["Deployment/prefix-cache-l3-pool"],
                             docs["Service/prefix-cache-l3-master"])
    config = yaml.safe_load(rayservice("base")["spec"]["serveConfigV2"])
    (app,) = config["applications"]
    host, port = app["args"]["worker"]["l3_master"].split(":")
    assert host == service["metadata"]["name"]
    rpc = next(p for p in service["spec"]["ports"] if p["name"] == "rpc")
    assert rpc["port"] == int(port)
    (container,) = master["spec"]["template"]["spec"]["containers"]
    assert f"--rpc_port={rpc['port']}" in container["args"] and container["command"] == ["mooncake_master"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]}[rpc["targetPort"]] == rpc["port"]
    labels = master["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in service["spec"]["selector"].items())
    assert master["spec"]["strategy"]["type"] == "Recreate" and master["spec"]["replicas"] == 1
    (holder,) = pool["spec"]["template"]["spec"]["containers"]
    script = " ".join(holder["args"])
    assert f"--master_server_address={host}:{port}" in script and '--host="$POD_IP"' in script
    assert {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in holder["env"]} == {"POD_IP": "status.podIP"}
    # Guaranteed QoS: requests equal limits, and the memory covers the segment.
    res = holder["resources"]
    assert res["requests"] == res["limits"]
    segment_gb = int(script.split("--global_segment_size=")[1].split("GB")[0])
    assert int(res["limits"]["memory"].rstrip("Gi")) > segment_gb
    for d in (master, pool):
        assert d["spec"]["selector"]["matchLabels"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
