"""The Serve application: ``serve run serve_app.app:build_app`` or ``serve deploy serve_app/config.yaml``.

Two deployments: ``Ingress`` (FastAPI, OpenAI-compatible) and ``CacheReplica``
(one per GPU, autoscaled), with ``DirectoryRouter`` choosing the replica of
every request from the directory's decision.

``build_app(args)`` takes the application's ``args`` (from the config file or
``serve run ... key=value``):

- ``model_name``: the model id clients send and ``/v1/models`` lists (default:
  the model's own id, e.g. ``SmolLM2-135M-Instruct``)
- ``namespace``: Ray namespace of the directory (default ``prefix-cache``)
- ``routing_policy``: routing policy of the directory (default ``cost``), and
  ``policy_args`` its options (``policy`` is refused: it was ambiguous with the
  worker's ``eviction_policy``)
- ``worker``: ``actors.core.WorkerConfig`` fields: ``model`` (a model spec: omitted
  for the embedded SmolLM2-135M-Instruct, a hub id, a checkpoint directory, a
  .gguf file, or ``builtin`` for the seeded test model), tier sizes, ...
- ``limits``: ``max_prompt_tokens``, ``max_tokens``, ``max_body_bytes``
- ``api_keys``: ``"key=tenant,..."`` (else env ``PREFIX_CACHE_API_KEYS``; none: auth off)
- ``admin_keys``: comma-separated (else env ``PREFIX_CACHE_ADMIN_KEYS``)
- ``admin_without_keys``: with no key configured at all, admin endpoints are
  off (403) unless this is true (the local demo sets it)
- ``num_replicas`` or ``autoscaling_config`` for the cache replicas,
  ``max_ongoing_requests``, ``max_queued_requests``; with ``autoscaling_config``,
  ``autoscaling_policy`` (``prefix_cache``, the default: queued prefill, TTFT and
  HOT room; ``serve_default``: Serve's request-count policy) and
  ``autoscaling_policy_args`` (the ``prefix_cache`` policy's knobs, e.g.
  ``ttft_slo_s``): ``serve_app.autoscaling``, docs/deployment.md "Autoscaling"
- ``gpus_per_replica``: unset (the default), one GPU per replica when the Ray
  cluster has GPUs and the CPU otherwise, decided when the app is built and said
  in the deploy log; a number (0 or more) is honoured as given
  (``serve_app.placement``)
- ``health_check_period_s`` (default 0.5): how often Serve asks each replica's
  ``check_health`` (it raises once the watchdog declared the engine wedged); Serve
  learns of a replica whose process died at its next check, so this is also how
  long a replacement may wait to be started (the check reads a flag: it costs nothing)
- ``max_resumes`` (default 2): how many times the ingress resumes a request
  on another replica after its replica failed mid-request
- ``ingress_replicas`` (default 1) or ``ingress_autoscaling_config``: the
  HTTP ingress deployment's size; every ingress replica decides on its own
  copy of the routing table and shares the reply memory (``ReplyStore``)
- ``peer_secret``: the secret of the workers' peer channel (default: a random
  one per deployment, or env ``PREFIX_CACHE_PEER_SECRET``)
- ``tenant_quotas``: each tenant's guaranteed share and cap of HOT, WARM, COLD
  and L3, by tenant id (``tenants``) or API key (``keys``, resolved here to the
  key's tenant), ``default`` for the rest (``cluster.cache.quota_config``;
  docs/cache.md "Per-tenant quotas"); checked here, carried to every replica
"""



import logging
import os
import secrets
from typing import Any, Mapping

from ray import serve
from ray.serve.config import RequestRouterConfig

from fastapi import Request

from actors.core import WorkerConfig
from cluster.cache.quota_config import QuotaConfig
from cluster.engine.worker_env import cpu_worker_env
from cluster.errors import InvalidInputError
from cluster.routing.policies import make_policy
from serve_app import admin
from serve_app.auth import parse_keys
from serve_app.autoscaling import replica_autoscaling_config
from serve_app.http_app import make_fastapi
from serve_app.ingress import IngressCore, handle_generation, replica_calls_of
from serve_app.placement import decide_placement
from serve_app.replica import CacheReplica as CacheReplicaImpl
from serve_app.router import DirectoryRouter

APP_NAME = "prefix-cache"
log = logging.getLogger("ray.serve")
CacheReplica = serve.deployment(name="CacheReplica")(CacheReplicaImpl)
fastapi_app = make_fastapi()


# The ingress only parses and streams: let it hold many requests (Serve's default is 5).
@serve.deployment(name="Ingress", max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0})
@serve.ingress(fastapi_app)
class Ingress:
    """HTTP front door; the logic lives in ``serve_app.ingress.IngressCore``."""

    def __init__(self, workers, settings: dict):
        self.core = IngressCore(workers, ingress_id=serve.get_replica_context().replica_id.unique_id, **settings)
        self.core.install_openapi(fastapi_app)

    @fastapi_app.post("/v1/completions")
    async def completions(self, request: Request):
        return await handle_generation(self.core, request, "completions", chat=False)

    @fastapi_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await handle_generation(self.core, request, "chat", chat=True)

    @fastapi_app.get("/v1/models")
    async def models(self, request: Request):
        self.core.authenticate(request)
        return {"object": "list", "data": [{"id": self.core.model_name, "object": "model", "created": 0,
                                            "owned_by": "prefix-cache-cluster"}]}

    @fastapi_app.post("/tokenize")
    async def tokenize(self, request: Request):
        tenant = self.core.authenticate(request)
        return await self.core.tokenize(await self.core.body(request), tenant)

    @fastapi_app.get("/tokenizer_info")
    async def tokenizer_info(self, request: Request):
        self.core.authenticate(request)
        return self.core.tokenizer_info()

    @fastapi_app.post("/detokenize")
    async def detokenize(self, request: Request):
        self.core.authenticate(request)
        return self.core.detokenize(await self.core.body(request))

    @fastapi_app.get("/healthz")
    async def healthz(self):
        return {"status": "ok"}

    @fastapi_app.post("/v1/sessions/{session_id}/prefetch")
    async def prefetch(self, session_id: str, request: Request):
        tenant = self.core.authenticate(request)
        await self.core.body(request, empty_ok=True)   # JSON only: no cross-site form POSTs
        return await admin.prefetch(self.core, tenant, session_id)

    @fastapi_app.get("/v1/cache/stats")
    async def cache_stats(self, request: Request):
        self.core.authenticate(request, admin=True)
        return await admin.cache_stats(self.core)

    @fastapi_app.post("/v1/cache/flush")
    async def flush(self, request: Request):
        self.core.authenticate(request, admin=True)
        await self.core.body(request, empty_ok=True)   # JSON only: no cross-site form POSTs
        return await admin.flush(self.core)

    @fastapi_app.post("/v1/admin/policy")
    async def set_policy(self, request: Request):
        self.core.authenticate(request, admin=True)
        body = await self.core.body(request)
        return await admin.set_policy(self.core, body.get("policy"))


def cluster_resources() -> tuple[Mapping[str, float], str]:
    """What the replicas' GPU claim is decided from (``serve_app.placement``), and whose it is.

    Connected to Ray (``serve deploy``, whose build runs on the cluster; ``prefix-cache
    serve``; a script that called ``ray.init``): the cluster's resources. Not connected
    (``serve run IMPORT_PATH`` builds the app before it connects, and then starts Ray on
    this machine unless given an address; a test building the app): this machine's GPUs."""
    import ray

    if ray.is_initialized():
        return ray.cluster_resources(), "the Ray cluster"
    import torch

    from cluster.cache.kv_pool import cuda_available

    return ({"GPU": float(torch.cuda.device_count())} if cuda_available() else {}), \
        "this machine (Ray is not connected yet)"


def worker_config_of(args: dict[str, Any]) -> tuple[dict, WorkerConfig]:
    """The app args' ``worker`` mapping with ``tenant_quotas`` (keys resolved to tenants: the
    replicas never see a key), and that mapping as a checked ``WorkerConfig``. Nothing starts: ``prefix-cache
    serve`` calls it before any node does, ``build_app`` before any replica. An error is one
    line naming the key (``worker config: ...``)."""
    worker = dict(args.get("worker", {}) or {})
    try:
        if "tenant_quotas" in args:
            keys = parse_keys(args.get("api_keys") or os.environ.get("PREFIX_CACHE_API_KEYS"))
            worker["tenant_quotas"] = QuotaConfig.parse(args["tenant_quotas"], keys).to_dict()
        return worker, WorkerConfig.from_dict(worker)
    except ValueError as exc:
        raise InvalidInputError(f"worker config: {exc}") from None


def build_app(args: dict[str, Any] | None = None):
    args = dict(args or {})
    namespace = args.pop("namespace", "prefix-cache")
    if "policy" in args:
        raise ValueError("the application arg 'policy' is now 'routing_policy' (the worker's eviction policy "
                         "is worker: eviction_policy)")
    policy = args.pop("routing_policy", "cost")
    policy_args = args.pop("policy_args", None) or {}
    if not isinstance(policy_args, dict):
        raise ValueError(f"policy_args must be a mapping of the policy's option names to values, got {policy_args!r}")
    make_policy(policy, **policy_args)   # an unknown policy or option fails here, naming it
    peer_secret = str(args.pop("peer_secret", None) or os.environ.get("PREFIX_CACHE_PEER_SECRET")
                      or secrets.token_hex(16))
    worker, worker_config = worker_config_of(args)   # a bad worker config or model spec fails here, naming the key
    args.pop("worker", None), args.pop("tenant_quotas", None)
    block_tokens = worker_config.block_tokens
    resources, seen_by = cluster_resources()
    placement = decide_placement(args.pop("gpus_per_replica", None), worker_config.tiers.device, resources, seen_by)
    try:
        worker_config.tiers.check_budget("cuda" if placement.on_gpu else "cpu")
    except InvalidInputError as exc:
        raise InvalidInputError(f"worker config: {exc}") from None
    (log.warning if placement.warning else log.info)("prefix-cache deploy: %s", placement.reason)
    actor_opts: dict[str, Any] = placement.actor_options()
    # A CPU replica's process: its allocator, its OpenMP runtime, whether its linears may run packed.
    if not placement.on_gpu and (env := cpu_worker_env()):
        actor_opts["runtime_env"] = {"env_vars": env}
    replica_opts: dict[str, Any] = {
        "ray_actor_options": actor_opts,
        "max_ongoing_requests": int(args.pop("max_ongoing_requests", 64)),
        "max_queued_requests": int(args.pop("max_queued_requests", 256)),
        "health_check_period_s": float(args.pop("health_check_period_s", 0.5)),
        "health_check_timeout_s": 10.0,
        # A stopping replica drains, then hands its cache on (worker handoff_s) in its
        # destructor: Serve force-kills it after this long.
        "graceful_shutdown_timeout_s": float(args.pop("graceful_shutdown_timeout_s",
                                                      worker_config.handoff_s + 10.0)),
        "request_router_config": RequestRouterConfig(request_router_class=DirectoryRouter),
    }
    autoscaling = replica_autoscaling_config(args.pop("autoscaling_config", None),
                                             args.pop("autoscaling_policy", None),
                                             args.pop("autoscaling_policy_args", None))
    num_replicas = args.pop("num_replicas", None)
    if autoscaling is not None:
        replica_opts["autoscaling_config"] = autoscaling
    else:
        replica_opts["num_replicas"] = int(num_replicas or 1)
    settings = {"model": worker_config.model, "model_name": args.pop("model_name", None), "namespace": namespace,
                "api_keys": args.pop("api_keys", None), "admin_keys": args.pop("admin_keys", None),
                "admin_without_keys": bool(args.pop("admin_without_keys", False)),
                "limits": args.pop("limits", None), "max_resumes": int(args.pop("max_resumes", 2)),
                "block_tokens": block_tokens, "peer_secret": peer_secret,
                "replica_calls": replica_calls_of(args.pop("replica_calls", "grpc"))}
    ingress_opts: dict[str, Any] = {}
    ingress_autoscaling = args.pop("ingress_autoscaling_config", None)
    ingress_replicas = args.pop("ingress_replicas", None)
    if ingress_autoscaling is not None:
        ingress_opts["autoscaling_config"] = ingress_autoscaling
    else:
        ingress_opts["num_replicas"] = int(ingress_replicas or 1)
    if args:
        raise ValueError(f"unknown application args: {sorted(args)}")
    replicas = CacheReplica.options(name="CacheReplica", **replica_opts).bind(
        worker, namespace, policy, policy_args, peer_secret)
    return Ingress.options(**ingress_opts).bind(replicas, settings)

