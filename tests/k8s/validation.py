"""Offline checks of the manifests under k8s/, each returning a list of problems.

The manifests are what Kustomize builds (``kubectl kustomize k8s/`` and each
overlay, run by ``kustomize_build``), not the files as they lie: the base's
RayService gets its ``serveConfigV2`` from k8s/base/serve-config.yaml only in
the build.

KubeRay documents: the CRD's ``openAPIV3Schema`` with jsonschema's
Draft4Validator, after apiserver-style defaulting (nulls of non-nullable
fields dropped, ``default`` filled in where a field is missing), optionally in
strict mode (``additionalProperties: false`` on every object schema with
properties and without ``x-kubernetes-preserve-unknown-fields``, as
``kubectl --validate=strict`` rejects unknown fields), plus what only the
operator checks. Method and caveats: shared/k8s-schemas/README.md.

``serveConfigV2``: Ray Serve's ``ServeDeploySchema`` (what ``serve deploy``
runs), every autoscaling_config through ``AutoscalingConfig``, and the
application's import path imported and called with its args.

The rest is this project's own rules for a cache node (GPU per pod, probes,
secrets, /dev/shm, memlock, NVMe), for the PodMonitor, the Secret and the
Dockerfile. The Grafana dashboard's checks are in ``tests.k8s.dashboards``.
"""

from __future__ import annotations

import copy
import importlib
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Callable

import jsonschema
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
SCHEMAS_ENV = "PREFIX_CACHE_K8S_SCHEMAS"
CRD_FILES = {"RayService": "ray.io_rayservices.yaml", "RayCluster": "ray.io_rayclusters.yaml"}
UPGRADE_TYPES = {"NewCluster", "None", "NewClusterWithIncrementalUpgrade"}
INT32_MAX = 2**31 - 1


# ----------------------------------------------------------------- loading
def schemas_dir() -> Path | None:
    """``$PREFIX_CACHE_K8S_SCHEMAS``, else ``shared/k8s-schemas`` beside the checkout."""
    env = os.environ.get(SCHEMAS_ENV)
    for candidate in ([Path(env)] if env else []) + [REPO.parent / "shared" / "k8s-schemas"]:
        if all((candidate / name).is_file() for name in CRD_FILES.values()):
            return candidate
    return None


def load_crd_schema(path: Path, version: str = "v1") -> dict:
    crd = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            return v["schema"]["openAPIV3Schema"]
    raise LookupError(f"{path} has no version {version}")


KUSTOMIZE_TARGETS = {"k8s": K8S, "base": K8S / "base", "tcp": K8S / "overlays" / "tcp"}
KUBECTL_ENV = "KUBECTL"


class KustomizeError(RuntimeError):
    """``kubectl kustomize`` refused to build; the message is its stderr."""


def kubectl() -> str | None:
    """``$KUBECTL``, else kubectl on the PATH (its built-in Kustomize builds the manifests)."""
    return os.environ.get(KUBECTL_ENV) or shutil.which("kubectl")


def kustomize_build(path: Path) -> list[dict]:
    """The documents ``kubectl kustomize path`` prints (what ``kubectl apply -k path`` applies)."""
    exe = kubectl()
    if exe is None:
        raise FileNotFoundError(f"kubectl not found (set {KUBECTL_ENV})")
    proc = subprocess.run([exe, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise KustomizeError(f"kubectl kustomize {path}: {proc.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc is not None]


# ------------------------------------------------------------ schema checks
def prepare_schema(schema: dict, strict: bool) -> dict:
    """A copy with ``nullable`` as a JSON-Schema type union and, if ``strict``, closed objects.

    Walks schema keywords only (properties, additionalProperties, items, anyOf/allOf/oneOf),
    so a field that happens to be named ``properties`` is not mistaken for the keyword.
    """
    out = dict(schema)
    if "properties" in schema:
        out["properties"] = {name: prepare_schema(child, strict) for name, child in schema["properties"].items()}
    for keyword in ("additionalProperties", "items"):
        if isinstance(schema.get(keyword), dict):
            out[keyword] = prepare_schema(schema[keyword], strict)
    for keyword in ("anyOf", "allOf", "oneOf"):
        if keyword in schema:
            out[keyword] = [prepare_schema(child, strict) for child in schema[keyword]]
    if schema.get("nullable") and isinstance(schema.get("type"), str):
        out["type"] = [schema["type"], "null"]
    if (strict and schema.get("properties") and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def apply_defaults(value: Any, schema: dict) -> Any:
    """What the apiserver does before validation: drop nulls of non-nullable fields, fill defaults."""
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        out = {}
        for key, item in value.items():
            child = props.get(key, extra if isinstance(extra, dict) else None)
            if item is None and child is not None and not child.get("nullable"):
                continue
            out[key] = apply_defaults(item, child) if child is not None else item
        for key, child in props.items():
            if key not in out and "default" in child:
                out[key] = copy.deepcopy(child["default"])
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(item, schema["items"]) for item in value]
    return value


class CRDValidator:
    """One CRD version, lenient (what the apiserver accepts) and strict (``--validate=strict``)."""

    def __init__(self, schema: dict):
        self.schema = schema
        self.lenient = jsonschema.Draft4Validator(prepare_schema(schema, strict=False))
        self.strict = jsonschema.Draft4Validator(prepare_schema(schema, strict=True))

    def errors(self, doc: dict, strict: bool = True) -> list[str]:
        validator = self.strict if strict else self.lenient
        defaulted = apply_defaults(doc, self.schema)
        return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
                for e in sorted(validator.iter_errors(defaulted), key=lambda e: list(map(str, e.path)))]


def cluster_spec(doc: dict) -> dict:
    spec = doc.get("spec") or {}
    return spec.get("rayClusterConfig") or {} if doc.get("kind") == "RayService" else spec


def operator_errors(doc: dict) -> list[str]:
    """What ray-operator/controllers/ray/utils/validation.go rejects and the CRD does not."""
    errors = []
    spec = cluster_spec(doc)
    autoscaling = spec.get("enableInTreeAutoscaling") is True
    for group in spec.get("workerGroupSpecs") or []:
        name = group.get("groupName")
        for key in ("replicas", "minReplicas", "maxReplicas"):
            if isinstance(group.get(key), int) and group[key] < 0:
                errors.append(f"worker group {name}: {key} {group[key]} is negative")
        if not autoscaling and ("minReplicas" not in group or "maxReplicas" not in group):
            errors.append(f"worker group {name}: minReplicas and maxReplicas are required without autoscaling")
        low, high = group.get("minReplicas", 0), group.get("maxReplicas", INT32_MAX)
        if isinstance(low, int) and isinstance(high, int) and low > high:
            errors.append(f"worker group {name}: minReplicas {low} > maxReplicas {high}")
        if group.get("suspend") and autoscaling:
            errors.append(f"worker group {name}: cannot be suspended while the autoscaler is on")
    if doc.get("kind") == "RayService":
        kind = ((doc.get("spec") or {}).get("upgradeStrategy") or {}).get("type")
        if kind is not None and kind not in UPGRADE_TYPES:
            errors.append(f"upgradeStrategy.type {kind!r} is not one of {sorted(UPGRADE_TYPES)}")
        if kind == "NewClusterWithIncrementalUpgrade" and not autoscaling:
            errors.append("an incremental upgrade needs enableInTreeAutoscaling")
    return errors


# ------------------------------------------------------------ serve checks
def _exc(e: Exception) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:400]}"


def load_import_path(import_path: str) -> Callable:
    module, _, attr = import_path.partition(":") if ":" in import_path else import_path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def serve_config_errors(text: Any) -> list[str]:
    """``serveConfigV2`` as ``serve deploy`` and the application would see it."""
    from pydantic import ValidationError
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import ServeDeploySchema

    if not isinstance(text, str):
        return [f"serveConfigV2 must be a YAML string, got {type(text).__name__}"]
    try:
        config = yaml.safe_load(text)
        if config is None:
            return ["serveConfigV2 is empty or only comments: the RayService's placeholder, not the "
                    "Serve config (k8s/base/rayservice.yaml gets it from Kustomize's replacement)"]
        ServeDeploySchema.model_validate(config)
    except (yaml.YAMLError, ValidationError) as e:
        return [f"serveConfigV2: {_exc(e)}"]
    errors = []
    for app in config["applications"]:
        name, args = app.get("name"), dict(app.get("args") or {})
        scaling = [("args", args.get("autoscaling_config"))]
        scaling += [(d.get("name"), d.get("autoscaling_config")) for d in app.get("deployments") or []]
        for where, cfg in scaling:
            if cfg is not None:
                try:
                    AutoscalingConfig.model_validate(cfg)
                except ValidationError as e:
                    errors.append(f"application {name} {where} autoscaling_config: {_exc(e)}")
        try:
            builder = load_import_path(app["import_path"])
        except (ImportError, AttributeError, ValueError) as e:
            errors.append(f"application {name}: import_path {app['import_path']!r}: {_exc(e)}")
            continue
        try:
            builder(args)
        except Exception as e:  # whatever the application's builder raises, the deploy would fail on it
            errors.append(f"application {name}: {app['import_path']}(args) raised {_exc(e)}")
    return errors


# -------------------------------------------------------------- quantities
_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
           "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18, "m": 1e-3, "": 1}


def quantity(value: Any) -> float:
    """A Kubernetes resource quantity ("16Gi", "500m", 1) as a number."""
    match = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(value))
    if not match or match[2] not in _SUFFIX:
        raise ValueError(f"not a quantity: {value!r}")
    return float(match[1]) * _SUFFIX[match[2]]


# ------------------------------------------------------ this project's rules
def _containers(spec: dict) -> list[tuple[str, dict, dict]]:
    """(group name, group spec, Ray container) of the head and each worker group."""
    head = spec.get("headGroupSpec") or {}
    groups = [("head", head)] + [(g.get("groupName"), g) for g in spec.get("workerGroupSpecs") or []]
    out = []
    for name, group in groups:
        containers = ((group.get("template") or {}).get("spec") or {}).get("containers") or [{}]
        out.append((name, group, containers[0]))   # KubeRay: the Ray container is the first
    return out


def _volumes(group: dict) -> dict[str, dict]:
    return {v.get("name"): v for v in ((group.get("template") or {}).get("spec") or {}).get("volumes") or []}


def _mounted(group: dict, container: dict, path: str) -> dict | None:
    """The pod volume mounted at ``path`` in ``container``."""
    for mount in container.get("volumeMounts") or []:
        if mount.get("mountPath") == path:
            return _volumes(group).get(mount.get("name"))
    return None


def _gpus(container: dict, which: str = "limits") -> float:
    return quantity(((container.get("resources") or {}).get(which) or {}).get("nvidia.com/gpu", 0))


def _port(container: dict, port: Any) -> Any:
    """A probe's port as a number (named ports resolved through the container's ports)."""
    for p in container.get("ports") or []:
        if port == p.get("name"):
            return p.get("containerPort")
    return port


def _env(container: dict) -> dict[str, dict]:
    return {e.get("name"): e for e in container.get("env") or []}


def serve_app_args(doc: dict) -> dict:
    """The args of the RayService's (first) Serve application."""
    config = yaml.safe_load(doc["spec"]["serveConfigV2"])
    return dict(config["applications"][0].get("args") or {})


def cold_tier_bytes(worker: dict) -> int:
    """Bytes of the COLD tier file the worker preallocates for ``worker`` (WorkerConfig args)."""
    from actors.core import WorkerConfig
    from cluster.cache.kv_pool import KVLayout

    cfg = WorkerConfig.from_dict(worker)
    spec = cfg.model_spec()
    if spec.source == "builtin":
        mc = spec.builtin_config()
        shape = (mc.num_layers, mc.num_kv_heads, mc.head_dim)
    elif spec.source in KNOWN_KV_SHAPES:   # offline: the manifest's hub model cannot be fetched here
        shape = KNOWN_KV_SHAPES[spec.source]
    else:
        raise ValueError(f"add the KV shape of model {spec.source!r} to KNOWN_KV_SHAPES to size its tiers")
    layout = KVLayout(*shape, spec.dtype)
    return cfg.cold_blocks * cfg.block_tokens * layout.bytes_per_token()


# (num_layers, num_kv_heads, head_dim) of the models the manifests name, from their config.json.
KNOWN_KV_SHAPES = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": (30, 3, 64),
    "smollm2-135m-instruct": (30, 3, 64),
}


API_KEY_ENV = ("PREFIX_CACHE_API_KEYS", "PREFIX_CACHE_ADMIN_KEYS")
SECRET_ARGS = ("api_keys", "admin_keys")


def cache_node_errors(doc: dict) -> list[str]:
    """What a GPU cache node of this project needs, checked on a RayService that passed the
    CRD, operator and Serve checks (it trusts the types those checks established)."""
    errors: list[str] = []
    spec = cluster_spec(doc)
    serve = yaml.safe_load(doc["spec"]["serveConfigV2"])
    args = serve_app_args(doc)
    scaling = args.get("autoscaling_config") or {}
    worker = args.get("worker") or {}
    containers = _containers(spec)
    head_c, workers = containers[0][2], containers[1:]
    gpu_workers = [(n, g, c) for n, g, c in workers if _gpus(c) > 0]

    # GPU and autoscaling
    if spec.get("enableInTreeAutoscaling") is not True:
        errors.append("enableInTreeAutoscaling must be true (the Ray autoscaler adds GPU pods)")
    if not spec.get("autoscalerOptions"):
        errors.append("autoscalerOptions missing")
    if _gpus(head_c) or _gpus(head_c, "requests"):
        errors.append("the head asks for GPUs: cache replicas belong on the GPU worker group")
    if not gpu_workers:
        errors.append("no worker group with nvidia.com/gpu limits")
    for name, group, c in gpu_workers:
        if _gpus(c) != 1 or _gpus(c, "requests") not in (0, 1):
            errors.append(f"worker group {name}: nvidia.com/gpu must be 1 per pod (one cache replica per GPU)")
    if args.get("gpus_per_replica") != 1:
        shown = "unset" if args.get("gpus_per_replica") is None else repr(args.get("gpus_per_replica"))
        errors.append(f"gpus_per_replica is {shown}, not 1 (one replica per GPU; explicit, because GPU pods "
                      f"the autoscaler adds later are not in the cluster when the app deploys)")
    if not scaling:
        errors.append("the cache deployment has no autoscaling_config")
    else:
        low, high = scaling.get("min_replicas", 1), scaling.get("max_replicas", 1)
        if not 0 <= low <= high:
            errors.append(f"autoscaling_config min_replicas {low} / max_replicas {high}")
        if not scaling.get("target_ongoing_requests", 2) > 0:
            errors.append("autoscaling_config target_ongoing_requests must be > 0")
        pods_max = sum(g.get("maxReplicas", INT32_MAX) for _, g, _ in gpu_workers)
        pods_min = sum(g.get("minReplicas", 0) for _, g, _ in gpu_workers)
        if pods_max < high:
            errors.append(f"GPU worker maxReplicas ({pods_max}) < Serve max_replicas ({high}): "
                          f"replicas Serve asks for would never get a GPU")
        if pods_min > low:
            errors.append(f"GPU worker minReplicas ({pods_min}) > Serve min_replicas ({low}): idle GPU pods")

    # probes: traffic readiness through the application's /healthz on Serve's port
    port = (serve.get("http_options") or {}).get("port", 8000)
    if port != 8000:
        errors.append(f"Serve http_options.port is {port}; the serve Service and probes use 8000")
    for name, _, c in gpu_workers:
        get = (c.get("readinessProbe") or {}).get("httpGet") or {}
        if get.get("path") != "/healthz" or _port(c, get.get("port")) != port:
            errors.append(f"worker group {name}: readinessProbe must GET /healthz on port {port}")
    for kind in ("readinessProbe", "livenessProbe"):
        if ((head_c.get(kind) or {}).get("httpGet") or {}).get("path") == "/healthz":
            errors.append(f"head {kind} on the application's /healthz: KubeRay deploys the application only "
                          f"once the head is Ready, and restarting the head restarts the cluster")

    # API keys from a Secret only
    for name, _, c in [containers[0]] + gpu_workers:
        env = _env(c)
        for var in API_KEY_ENV:
            ref = ((env.get(var) or {}).get("valueFrom") or {}).get("secretKeyRef")
            if not ref or "value" in (env.get(var) or {}):
                errors.append(f"{name}: {var} must come from a secretKeyRef")
    for key in SECRET_ARGS:
        if args.get(key):
            errors.append(f"serveConfigV2 args.{key} holds keys in plain text; use the Secret")

    # /dev/shm for the object store, on every Ray pod
    for name, group, c in containers:
        shm = _mounted(group, c, "/dev/shm") or {}
        empty = shm.get("emptyDir")
        if not isinstance(empty, dict) or empty.get("medium") != "Memory":
            errors.append(f"{name}: /dev/shm must be an emptyDir with medium Memory")
            continue
        store = (group.get("rayStartParams") or {}).get("object-store-memory")
        if store and "sizeLimit" in empty and quantity(empty["sizeLimit"]) < quantity(store):
            errors.append(f"{name}: /dev/shm sizeLimit {empty['sizeLimit']} < object-store-memory {store}")

    for name, group, c in gpu_workers:
        # memlock for the pinned, RDMA-registered WARM pool
        if "IPC_LOCK" not in (((c.get("securityContext") or {}).get("capabilities") or {}).get("add") or []):
            errors.append(f"worker group {name}: securityContext.capabilities.add needs IPC_LOCK")
        # UCX: TCP stays (NIXL needs peer-failure handling); RDMA transports need an RDMA device
        env = _env(c)
        tls = (env.get("UCX_TLS") or {}).get("value", "")
        if "tcp" not in tls.split(","):
            errors.append(f"worker group {name}: UCX_TLS {tls!r} must include tcp")
        if "cuda_copy" not in tls.split(","):
            errors.append(f"worker group {name}: UCX_TLS {tls!r} must include cuda_copy (NIXL registers the "
                          f"GPU pool; without it UCX treats VRAM as host memory)")
        if {"rc", "ud", "dc"} & set(tls.split(",")):
            limits = (c.get("resources") or {}).get("limits") or {}
            if not any(k.startswith("rdma/") for k in limits):
                errors.append(f"worker group {name}: UCX_TLS uses RDMA but the pod asks for no rdma/ device")
            if "UCX_NET_DEVICES" not in env:
                errors.append(f"worker group {name}: UCX_TLS uses RDMA but UCX_NET_DEVICES is not set")
        # the COLD tier on the NVMe volume
        if worker.get("cold_blocks", 0) > 0:
            disk = worker.get("disk_dir")
            volume = _mounted(group, c, disk) if disk else None
            if volume is None:
                errors.append(f"worker group {name}: worker.disk_dir {disk!r} is not a volume mounted in the container")
            elif (volume.get("emptyDir") or {}).get("medium") == "Memory":
                errors.append(f"worker group {name}: the disk tier volume is memory-backed")
            else:
                size = (volume.get("emptyDir") or {}).get("sizeLimit")
                if size is not None and quantity(size) < cold_tier_bytes(worker):
                    errors.append(f"worker group {name}: the disk tier volume ({size}) is smaller than "
                                  f"cold_blocks need ({cold_tier_bytes(worker)} bytes)")

    # requests and limits, one image
    for name, _, c in containers:
        resources = c.get("resources") or {}
        for res in ("cpu", "memory"):
            req, lim = (resources.get("requests") or {}).get(res), (resources.get("limits") or {}).get(res)
            if req is None or lim is None:
                errors.append(f"{name}: set both requests and limits for {res}")
            elif quantity(req) > quantity(lim):
                errors.append(f"{name}: {res} request {req} > limit {lim}")
    if len({c.get("image") for _, _, c in containers}) != 1:
        errors.append("the head and the workers must run the same image")
    return errors


def podmonitor_errors(monitor: dict, rayservice: dict) -> list[str]:
    errors = []
    if monitor.get("apiVersion") != "monitoring.coreos.com/v1" or monitor.get("kind") != "PodMonitor":
        errors.append("not a monitoring.coreos.com/v1 PodMonitor")
    spec = monitor.get("spec") or {}
    selector = spec.get("selector") or {}
    if "ray.io/cluster" not in [e.get("key") for e in selector.get("matchExpressions") or []] + list(
            selector.get("matchLabels") or {}):
        errors.append("the selector does not use KubeRay's ray.io/cluster label")
    containers = _containers(cluster_spec(rayservice))
    for name, group, c in containers:
        labels = ((group.get("template") or {}).get("metadata") or {}).get("labels") or {}
        for key, value in (selector.get("matchLabels") or {}).items():
            if labels.get(key) != value:
                errors.append(f"the selector's {key}={value} is not on the {name} pods")
    endpoints = spec.get("podMetricsEndpoints") or []
    if not endpoints:
        errors.append("no podMetricsEndpoints")
    for endpoint in endpoints:
        for name, group, c in containers:
            metrics_port = int((group.get("rayStartParams") or {}).get("metrics-export-port", 8080))
            if _port(c, endpoint.get("port")) != metrics_port:
                errors.append(f"port {endpoint.get('port')!r} is not Ray's metrics port {metrics_port} "
                              f"in the {name} container")
    return errors


def secret_errors(secret: dict, rayservice: dict) -> list[str]:
    errors = []
    if secret.get("apiVersion") != "v1" or secret.get("kind") != "Secret":
        errors.append("not a v1 Secret")
    data = {**(secret.get("data") or {}), **(secret.get("stringData") or {})}
    name = (secret.get("metadata") or {}).get("name")
    for group, _, c in _containers(cluster_spec(rayservice)):
        for var in API_KEY_ENV:
            ref = ((_env(c).get(var) or {}).get("valueFrom") or {}).get("secretKeyRef") or {}
            if ref and (ref.get("name") != name or ref.get("key") not in data):
                errors.append(f"{group}: {var} reads {ref.get('name')}/{ref.get('key')}, which this Secret lacks")
    for key, value in (secret.get("stringData") or {}).items():
        if "REPLACE_ME" not in str(value):
            errors.append(f"stringData.{key} is not a REPLACE_ME placeholder: never commit real keys")
    if secret.get("data"):
        errors.append("use stringData placeholders, not base64 data, in the example")
    return errors


def dockerfile_errors(text: str, rayservice: dict, root: Path = REPO) -> list[str]:
    """The image recipe against the manifests and the checkout (``docker build -f k8s/Dockerfile .``
    from ``root``: every COPY source must exist there)."""
    errors = []
    for sources in re.findall(r"^COPY\s+(?:--\S+\s+)*(.+?)\s+\S+\s*$", text, re.MULTILINE):
        for source in sources.split():
            if not (root / source).exists():
                errors.append(f"COPY {source}: not in the build context {root}")
    spec = cluster_spec(rayservice)
    version = spec.get("rayVersion")
    args = dict(re.findall(r"^ARG\s+(\w+)=(\S+)", text, re.MULTILINE))
    base = re.search(r"^FROM\s+(\S+)", text, re.MULTILINE)
    image = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m[1], m[0]), base[1]) if base else ""
    match = re.fullmatch(r"rayproject/ray:([0-9.]+)-py3\d+-(gpu|cu12\d*)", image)
    if not match:
        errors.append(f"FROM {image!r} is not a rayproject/ray CUDA 12 (gpu/cu12x) image")
    elif match[1] != version:
        errors.append(f"FROM {image} is Ray {match[1]}, the manifests' rayVersion is {version}")
    installs = [arg.strip("'\"") for arg in
                " ".join(re.findall(r"^RUN\s+pip install([^\n]*)", text, re.MULTILINE)).split()]
    if not any(arg == "." or arg.startswith(".[") for arg in installs) or \
            not any(arg.startswith("nixl-cu12") for arg in installs):
        errors.append("the image must `RUN pip install .` (or with extras) with nixl-cu12")
    if not any(arg.startswith(".[") and "l3-cuda" in arg for arg in installs):
        errors.append("the image must install the l3-cuda extra: the L3 pods run mooncake_master from it")
    for _, _, c in _containers(spec):
        if c.get("image") and c["image"] not in text:
            errors.append(f"the Dockerfile does not say it builds {c['image']}")
    return errors


# ------------------------------------------------------------------ Grafana
