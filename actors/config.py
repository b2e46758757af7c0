"""WorkerConfig: everything one cache worker needs, from YAML, a dict or Ray args.

The tier settings are a ``TierConfig`` embedded whole, so every one of them
(sizes, watermarks, eviction policy, copy pacing, ``max_sessions``, ...) is a
key of the worker config in ``serve_app/config.yaml``, written flat beside the
worker's own keys::

    worker: {model: builtin, hot_blocks: 4096, high_watermark: 0.85, eviction_policy: lfu, max_batch_tokens: 4096}
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from cluster.cache.tiered import TierConfig
from cluster.engine.checkpoint import ModelSpec
from cluster.engine.scheduler_config import (DEFAULT_TIME_SLICE_S, SchedulerConfig, check_policy_name,
                                             check_stall_free_steps)
from cluster.engine.stall_free import STALL_STEPS
from cluster.errors import InvalidInputError

# A worker's tier sizes when the config names none (TierConfig itself has no default HOT size).
DEFAULT_TIERS = {"hot_blocks": 2048, "warm_blocks": 4096}
TIER_KEYS = tuple(f.name for f in dataclasses.fields(TierConfig))

# The raylet starts its worker processes (actors and Serve replicas, ours among them) at this
# niceness; Ray's default is 15, below the raylet, the GCS and any client on the machine, so a
# replica's engine thread lost its cores to each of them mid-step. At 0 (what vLLM's processes
# run at) its decode step is shorter (docs/benchmarks.md, "Why the defaults are what they are").
WORKER_NICENESS_VAR = "RAY_worker_niceness"

# The environment a serving cluster's Ray nodes start with; every process they start (the Serve
# proxy and controller, the replicas, the directory) inherits it. The local cluster, the test
# clusters and the Kubernetes manifests (k8s/base/rayservice.yaml, both pods) set the same.
# - workers at nice 0 (above);
# - Serve's proxy calls the Ingress over the direct gRPC channel, by value, as the Ingress
#   calls the cache replicas (``replica_calls: grpc``), instead of through Ray object refs
#   (a named-actor lookup and an object per request, an object per streamed message);
# - a replica runs its user code and its handles' router on its own event loop, not on two
#   extra threads: every request and every streamed token otherwise crosses two threads in
#   the Ingress (a wake-up and a GIL hand-over each), and this app's handlers never block.
# Both cut the Ingress's and the proxy's CPU time a request, CPU the engine's steps no longer
# lose (docs/benchmarks.md, "Why the defaults are what they are").
SERVING_ENV = {
    WORKER_NICENESS_VAR: "0",
    "RAY_SERVE_PROXY_USE_GRPC": "1",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
}


def prepare_serving_env() -> None:
    """Have Ray nodes started from this process (and its children) start with ``SERVING_ENV``,
    each variable unless the environment already chose. Call before the nodes start."""
    for name, value in SERVING_ENV.items():
        os.environ.setdefault(name, value)


@dataclass(frozen=True)
class WorkerConfig:
    # The model (cluster.engine.checkpoint.ModelSpec), parsed at construction from any form
    # ModelSpec.parse reads: None for the embedded default (SmolLM2-135M-Instruct), "builtin"
    # or a mapping of ModelConfig fields for the seeded test model, a local checkpoint
    # directory, a .gguf file or a hub id.
    model: ModelSpec | None = None
    tiers: TierConfig = field(default_factory=lambda: TierConfig(**DEFAULT_TIERS))
    # Tokens one engine step computes at most (decodes plus prefill chunks): a long
    # prompt is prefilled in chunks of this, interleaved with the running decodes.
    max_batch_tokens: int = 512
    max_running: int = 64
    # Attend the decoding requests of a step with the compiled CPU kernel (built once per
    # machine on first use; cluster.engine.kernels), else the torch path.
    decode_kernel: bool = True
    max_queued_requests: int = 256
    use_nixl: bool = True
    torch_threads: int = 1
    # The engine may go this long without finishing an iteration while it has work
    # before the watchdog declares it wedged (None: no watchdog). Above the longest
    # legitimate step (a full max_batch_tokens prefill on this hardware).
    watchdog_s: float | None = 10.0
    # When work comes to an idle engine, its first step waits for what follows closely, until
    # gather_quiet_ms pass without an arrival and gather_max_ms at most (0: no wait): a burst
    # of sessions behind one system prompt reaches the replica over tens of milliseconds, and
    # taken together the requests behind the prompt wait for its fill's checkpoint in one step.
    gather_quiet_ms: float = 10.0
    gather_max_ms: float = 60.0
    # The shared-fills policy (cluster.engine.scheduler): a request whose part beyond the cache
    # another's prefill computes waits for that fill's checkpoint. Off: each computes its own part.
    shared_fills: bool = True
    # Stall-free batching (cluster.engine.stall_free): while decodes run, a step's prompt chunk is
    # what the measured rates compute in this many decode steps' time less one (8: a running
    # stream's longest gap is about 8 decode steps). Null: the whole max_batch_tokens, as vLLM's
    # chunked prefill: a session's first turn beside one stream comes sooner (1,052-1,291 ms in
    # six runs against 1,117-1,338 in three), but 16 streams in a burst see an ITL p99 of 146-330
    # ms against 122-138 (docs/benchmarks.md), so the cap stays the default.
    stall_free_steps: int | None = STALL_STEPS
    # Time slicing (cluster.engine.preemption): a request waiting for HOT room that running
    # decodes hold may take the room of one that has decoded max(this, 8 measured steps)
    # (seconds; it yields: its KV goes to the cache and it resumes exactly), only where the
    # measured gain (the wait it avoids) beats the measured cost (the victim's swap out and
    # back, the waiting request's promotion, the victim's wait behind it), and a stream
    # yields at most once: a short answer does not wait behind a long one, and no running
    # stream stalls for a long one. Null: waiting requests always wait for decodes to finish.
    time_slice_s: float | None = DEFAULT_TIME_SLICE_S
    # The engine's scheduling policy (cluster.engine.policies): "fcfs" (first come, first served),
    # "fair" (the tenants' fair share of each step and of max_running) or "priority" (a request's
    # priority field, lower first; ties first come, first served). Null: "fair" under tenant_quotas,
    # else "fcfs".
    scheduling_policy: str | None = None
    # Bound on each remote call of a migration (export, info, object-store pull):
    # a holder that is gone or slow costs at most this per call, then recompute.
    migration_timeout_s: float = 2.0
    # A worker that starts while a peer of the same KV shape is registered takes the
    # peer's measured rates instead of calibrating (seconds of start-up: a replacement
    # replica is serving sooner). False: always measure.
    reuse_peer_calibration: bool = True
    # False (default): serve at once on the rates this machine's last replica of the model
    # measured (kept on disk: cluster.engine.machine_rates), else a peer's, else a prior
    # (``prior_rates``: a warm 64-token prefill and one WARM promotion, well under a second);
    # the engine's and the cache's own measurements replace them as they come (RateRefiner).
    # True: measure every rate first (actors.calibration.calibrate, 5-8 s of start-up on a
    # 2-core CPU replica). The default calibrated until L3's fetch
    # guard modelled a fetch's round trip and probed again (cluster.cache.l3.fetch_cost):
    # before, the prior's first small fetches turned L3 off for good under round-robin turns
    # (demo: reuse 0.85 against 0.998 calibrated).
    calibrate_at_start: bool = False
    # Compute the last sampled token's KV when a request ends (a lone forward per
    # finished request) so that the next turn hits one more token: see Engine.
    cache_final_token: bool = False
    # L3 (cluster.cache.l3.tier): the Mooncake master, "host:port" (None: no L3).
    # A master that cannot be reached leaves L3 off with one log line; nothing waits.
    l3_master: str | None = None
    # The master's HTTP server, "host:port" (mooncake_master's --metrics_port): the
    # worker lists L3's keys there for the directory's inventory. None: the master's
    # host and 9003, mooncake_master's default.
    l3_master_http: str | None = None
    # "commit": every committed sequence's full blocks are written behind the request
    # (a replica killed a moment later leaves its sessions in L3); "off": read only.
    l3_write: str = "commit"
    # "auto": fetch from L3 where the measured fetch rate beats prefill (a small model on
    # a fast device may compute faster than any store answers); "always"; "off".
    l3_fetch: str = "auto"
    # The nice value of the thread that writes to L3 (0-19; 0: the process's priority).
    # Writes wait for nobody: at 19 they take the cores the engine leaves free.
    l3_write_nice: int = 19
    # Fetch from L3 only when at least this many full blocks lie past the local prefix.
    l3_min_fetch_blocks: int = 2
    # Mooncake's staging buffer for this replica's puts and gets (bounds one batch).
    l3_buffer_mb: int = 64
    # Scale-in: a leaving replica hands its prefixes to L3 and to peers within this
    # many seconds (keep it under Serve's graceful_shutdown_timeout_s).
    handoff_s: float = 20.0
    # ... and pushes its most valuable prefixes (at most this many) to surviving replicas.
    handoff_peer_prefixes: int = 16
    # Scale-out: before it takes traffic, a new replica pulls the cluster's most valuable
    # prefixes (its peers' lists) from L3 or from a peer, within these bounds (0 s: off).
    warmup_s: float = 15.0
    warmup_mb: int = 256
    warmup_prefixes: int = 32

    def __post_init__(self):
        if self.model is not None and not isinstance(self.model, ModelSpec):
            object.__setattr__(self, "model", ModelSpec.parse(self.model))   # a bad spec fails here, naming it
        if self.watchdog_s is not None and not self.watchdog_s > 0:
            raise InvalidInputError(f"watchdog_s must be positive or null, got {self.watchdog_s!r}")
        for name in ("gather_quiet_ms", "gather_max_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1000:
                raise InvalidInputError(f"{name} must be a number of milliseconds in [0, 1000], got {value!r}")
        if self.time_slice_s is not None and (isinstance(self.time_slice_s, bool) or
                                              not isinstance(self.time_slice_s, (int, float)) or
                                              not 0 < self.time_slice_s <= 3600):
            raise InvalidInputError(f"time_slice_s must be a number of seconds in (0, 3600] or null, "
                                    f"got {self.time_slice_s!r}")
        check_stall_free_steps(self.stall_free_steps, "stall_free_steps")
        if not isinstance(self.shared_fills, bool):
            raise InvalidInputError(f"shared_fills must be true or false, got {self.shared_fills!r}")
        check_policy_name(self.scheduling_policy, "scheduling_policy")
        if not self.migration_timeout_s > 0:
            raise InvalidInputError(f"migration_timeout_s must be positive, got {self.migration_timeout_s!r}")
        for name in ("l3_master", "l3_master_http"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or ":" not in value):
                raise InvalidInputError(f"{name} must be 'host:port' or null, got {value!r}")
        if self.l3_write not in ("commit", "off"):
            raise InvalidInputError(f"l3_write must be 'commit' or 'off', got {self.l3_write!r}")
        if self.l3_fetch not in ("auto", "always", "off"):
            raise InvalidInputError(f"l3_fetch must be 'auto', 'always' or 'off', got {self.l3_fetch!r}")
        if isinstance(self.l3_write_nice, bool) or not isinstance(self.l3_write_nice, int) or \
                not 0 <= self.l3_write_nice <= 19:
            raise InvalidInputError(f"l3_write_nice must be an integer in 0..19, got {self.l3_write_nice!r}")
        for name in ("l3_min_fetch_blocks", "l3_buffer_mb", "handoff_peer_prefixes", "warmup_prefixes"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < (0 if name.endswith("prefixes") else 1):
                raise InvalidInputError(f"{name} must be a positive integer, got {v!r}")
        for name in ("handoff_s", "warmup_s", "warmup_mb"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or v < 0:
                raise InvalidInputError(f"{name} must be a number >= 0, got {v!r}")

    def scheduler_config(self) -> SchedulerConfig:
        """The engine's scheduler settings from this config."""
        return SchedulerConfig(max_batch_tokens=self.max_batch_tokens, max_running=self.max_running,
                               time_slice_s=self.time_slice_s, shared_fills=self.shared_fills,
                               stall_free_steps=self.stall_free_steps,
                               cache_final_token=self.cache_final_token, policy=self.scheduling_policy)

    @classmethod
    def from_dict(cls, data: dict | None) -> "WorkerConfig":
        """Flat keys: the worker's own and every ``TierConfig`` field. An unknown
        key, a bad value or a bad model spec fails here, naming it."""
        data = dict(data or {})
        if "policy" in data:
            raise InvalidInputError("worker config key 'policy' is now 'eviction_policy' (the app's routing "
                                    "policy is routing_policy)")
        if "riders" in data:
            raise InvalidInputError("worker config key 'riders' was removed: attention reads every request's KV "
                                    "in place in the HOT pool, so nothing rides on another's buffer; "
                                    "'shared_fills' is the policy for requests behind a prompt being filled")
        own = {f.name for f in dataclasses.fields(cls)} - {"tiers"}
        unknown = set(data) - own - set(TIER_KEYS)
        if unknown:
            raise InvalidInputError(f"unknown worker config keys: {sorted(unknown)} "
                                    f"(worker keys: {sorted(own)}; tier keys: {sorted(TIER_KEYS)})")
        given = {k: data.pop(k) for k in TIER_KEYS if k in data}
        # Block-count defaults only where the config sizes neither that tier nor the whole budget.
        defaults = {} if "kv_memory_mb" in given else \
            {k: v for k, v in DEFAULT_TIERS.items() if f"{k[:-len('_blocks')]}_mb" not in given}
        tiers = TierConfig(**{**defaults, **given})
        return cls(tiers=tiers, **data)   # a bad model spec fails here, naming the key, not in a replica

    def model_spec(self) -> ModelSpec:
        return ModelSpec.parse(self.model)

    def tier_config(self) -> TierConfig:
        return self.tiers

    def to_dict(self) -> dict:
        """The flat form ``from_dict`` reads."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "tiers"}
        return {**out, **dataclasses.asdict(self.tiers)}

    # The tier values the worker itself reads.
    @property
    def block_tokens(self) -> int:
        return self.tiers.block_tokens

    @property
    def hot_blocks(self) -> int:
        return self.tiers.hot_blocks

    @property
    def warm_blocks(self) -> int:
        return self.tiers.warm_blocks

    @property
    def cold_blocks(self) -> int:
        return self.tiers.cold_blocks
