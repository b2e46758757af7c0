"""Wire types: every message that crosses a process, in one place.

Ray pickles these between the ingress, the router, the cache replicas and
the directory; the KV event batches keep their own msgpack format
(``cluster.routing.events``, ``{"v": 1, ...}``). Messages the directory reads
as plain dicts (load reports, measured rates) carry ``"v": WIRE_VERSION`` and
are decoded with ``from_wire``, which names what is wrong.

Nothing here imports Ray or the rest of the library: both layers use it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from cluster.errors import InvalidInputError
from cluster.names import TIER_NAMES

WIRE_VERSION = 1


class MalformedMessageError(InvalidInputError):
    """A message from another process that this version cannot read."""


class FinishReason(StrEnum):
    """Why a request ended. ``stop`` and ``length`` are the OpenAI values the
    ingress returns; the others end a stream early."""

    STOP = "stop"                    # EOS or a stop token id
    LENGTH = "length"                # max_tokens reached
    ERROR = "error"                  # the step, the cache or the model failed this request
    CANCELLED = "cancelled"
    CLIENT_DISCONNECTED = "client_disconnected"


class Transport(StrEnum):
    """How a migrated prefix arrived."""

    NIXL = "nixl"
    OBJECT_STORE = "object_store"


@dataclass(slots=True)
class MigrationResult:
    """What ``migrate_from`` did: ``transport`` None means recompute."""

    holder: str
    transport: Transport | None = None
    tokens: int = 0
    bytes: int = 0

    def to_json(self) -> dict:
        """The ``prefix_cache.migration`` field of an HTTP response."""
        return {"from": self.holder, "transport": None if self.transport is None else self.transport.value,
                "tokens": self.tokens, "bytes": self.bytes}


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """Where one request goes: the directory's answer, or a fallback."""

    worker_id: str | None
    reason: str
    expected_ttft_s: float | None = None
    cached_tokens: int = 0
    migrate_from: str | None = None
    source: str = "directory"     # who decided: "directory", "router_view" (a router's table copy), "fallback"
    decision_us: float | None = None   # the policy's own time for it (its choose, thread CPU), where it was made

    @classmethod
    def from_wire(cls, obj: Any) -> "RouteDecision":
        if isinstance(obj, cls):
            return obj
        if isinstance(obj, dict):
            _check_optional_version(obj, "route decision")
            try:
                worker_id, reason = obj["worker_id"], obj["reason"]
            except KeyError as exc:
                raise MalformedMessageError(f"route decision lacks {exc}") from None
            for name, value in (("worker_id", worker_id), ("migrate_from", obj.get("migrate_from"))):
                if value is not None and not isinstance(value, str):
                    raise MalformedMessageError(f"route decision {name} must be a string or None, got {value!r}")
            source = obj.get("source", "directory")
            for name, value in (("reason", reason), ("source", source)):
                if not isinstance(value, str):
                    raise MalformedMessageError(f"route decision {name} must be a string, got {value!r}")
            return cls(worker_id, reason,
                       _number(obj.get("expected_ttft_s"), "route decision expected_ttft_s", optional=True),
                       _count(obj.get("cached_tokens") or 0, "route decision cached_tokens"), obj.get("migrate_from"),
                       source, _number(obj.get("decision_us"), "route decision decision_us", optional=True))
        raise MalformedMessageError(f"not a route decision: {type(obj).__name__}")

    @classmethod
    def pinned(cls, worker_id: str) -> "RouteDecision":
        return cls(worker_id, "pinned")

    @classmethod
    def fallback(cls) -> "RouteDecision":
        """No directory answer: the caller picks the least loaded worker."""
        return cls(None, "fallback_least_loaded", source="fallback")


@dataclass(slots=True)
class GenerateRequest:
    """One generation, from the ingress (or a client) to a cache worker.
    ``routing`` is filled in once by whoever asked the directory."""

    prompt: list[int]
    params: dict | None = None
    tenant: Any = None
    session_id: Any = None
    routing: RouteDecision | None = None
    exclude: tuple[str, ...] = ()    # workers this request already failed on (a resumed request)
    route_s: float = 0.0             # how long the router's decision took (for the latency breakdown)

    @classmethod
    def from_wire(cls, obj: Any) -> "GenerateRequest":
        """The request itself, or its dict form ``{"prompt", "params", "tenant",
        "session_id", "routing", "exclude"}`` (what the ingress sends)."""
        if isinstance(obj, cls):
            return obj
        if not isinstance(obj, dict) or "prompt" not in obj:
            raise MalformedMessageError(f"not a generate request: {type(obj).__name__}")
        _check_optional_version(obj, "generate request")
        _check_tokens(obj["prompt"], "generate request prompt")
        if obj.get("params") is not None and not isinstance(obj["params"], dict):
            raise MalformedMessageError(f"generate request params must be a dict or None, "
                                        f"got {type(obj['params']).__name__}")
        routing = obj.get("routing")
        exclude = obj.get("exclude") or ()
        if not isinstance(exclude, (list, tuple)) or not all(isinstance(w, str) for w in exclude):
            raise MalformedMessageError(f"generate request exclude must be a list of worker ids, got {exclude!r:.80}")
        return cls(obj["prompt"], obj.get("params"), obj.get("tenant"), obj.get("session_id"),
                   None if routing is None else RouteDecision.from_wire(routing), tuple(exclude))


@dataclass(frozen=True, slots=True)
class PeerCall:
    """A call aimed at one worker (migration, prefetch, admin): the router
    sends it to ``target_worker`` and nowhere else."""

    target_worker: str
    tokens: list[int] | None = None
    tenant: Any = None
    lease: str | None = None      # "<worker>/<process uuid>/<n>": unique across workers
    session_id: Any = None

    @classmethod
    def from_wire(cls, obj: Any) -> "PeerCall | None":
        """The call itself, its dict form (``{"target_worker": ..., ...}``), or
        None for an untargeted call."""
        if obj is None or isinstance(obj, cls):
            return obj
        if isinstance(obj, dict):
            if obj.get("target_worker") is None:
                return None
            _check_optional_version(obj, "peer call")
            if not isinstance(obj["target_worker"], str):
                raise MalformedMessageError(f"peer call target_worker must be a string, got {obj['target_worker']!r}")
            if obj.get("tokens") is not None:
                _check_tokens(obj["tokens"], "peer call tokens")
            return cls(obj["target_worker"], obj.get("tokens"), obj.get("tenant"), obj.get("lease"),
                       obj.get("session_id"))
        raise MalformedMessageError(f"not a peer call: {type(obj).__name__}")


def target_of(message: Any) -> str | None:
    """The worker a message must reach, if it names one (routers read this)."""
    if isinstance(message, PeerCall):
        return message.target_worker
    if isinstance(message, dict):
        return message.get("target_worker")
    return None


@dataclass(slots=True)
class ReplicaTiming:
    """Where the replica spent one request's time to first token, carried by the
    first token's ``StreamItem``. Durations are the replica's own; the
    wall-clock stamp (``time.time()``) lets the ingress split the hops to and
    from the replica (exact on one host, as good as the clocks across hosts)."""

    queue_s: float = 0.0        # handed to the engine until the step that admitted it began
    prefix_load_s: float = 0.0  # that step: matching the prefix, promoting it, reading its cached KV
    forward_s: float = 0.0      # the forward over the uncached suffix and the sampled token
    migrate_s: float = 0.0      # pulling the prefix from a peer first (0: no migration)
    received_at: float = 0.0    # wall clock: the replica's generate() began


@dataclass(slots=True)
class StreamItem:
    """One element of a generation stream: a token, or the end of the request."""

    token: int | None
    finished: bool
    finish_reason: FinishReason | None = None
    error: str | None = None
    cached_tokens: int = 0
    tier_hits: tuple[int, int, int] = (0, 0, 0)
    prompt_tokens: int = 0
    worker_id: str | None = None     # filled in by the shell that served it
    reason: str | None = None        # the routing decision's reason
    migration: MigrationResult | None = None
    attempt: int = 0                 # retries before this item (ClusterClient)
    timing: ReplicaTiming | None = None   # on the first token's item

    def cached_by_tier(self) -> dict[str, int]:
        return dict(zip(TIER_NAMES, self.tier_hits))


@dataclass(frozen=True, slots=True)
class TableChange:
    """One op on the directory's routing table (``cluster.routing.table``), numbered."""

    seq: int
    op: str
    args: tuple


@dataclass(frozen=True, slots=True)
class TableState:
    """The whole routing table as of log position ``seq`` of directory process ``epoch``."""

    epoch: str
    seq: int
    policy: str
    policy_kwargs: dict
    cost: dict                                   # CostModel fields
    workers: dict[str, tuple[int, int]]          # worker -> (queued_tokens, running)
    index: dict[str, tuple[int, dict]]           # worker -> (last batch seq, {block hash: tier})


@dataclass(frozen=True, slots=True)
class TableUpdate:
    """The directory's answer to a router's long poll: the changes after the
    router's cursor, or (``state``) the whole table when it fell behind."""

    epoch: str
    seq: int
    changes: tuple[TableChange, ...] = ()
    state: TableState | None = None


@dataclass(frozen=True, slots=True)
class LoadReport:
    """A worker's load, sent with its KV events every 20-100 ms (a heartbeat)."""

    queued_tokens: int
    running: int
    waiting: int
    transfer_tokens_per_s: float | None = None

    def to_wire(self) -> dict:
        return {"v": WIRE_VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_wire(cls, data: Any) -> "LoadReport":
        _check_version(data, "load report")
        missing = [name for name in ("queued_tokens", "running") if name not in data]
        if missing:
            raise MalformedMessageError(f"load report lacks {missing}")
        return cls(_count(data["queued_tokens"], "load report queued_tokens"),
                   _count(data["running"], "load report running"),
                   _count(data.get("waiting", 0), "load report waiting"),
                   _number(data.get("transfer_tokens_per_s"), "load report transfer_tokens_per_s", optional=True))


RATE_FIELDS = ("prefill_tokens_per_s", "warm_promote_tokens_per_s", "cold_promote_tokens_per_s",
               "transfer_tokens_per_s")


def rates_to_wire(cost: Any, *, bytes_per_token: int | None = None) -> dict:
    """A measured ``CostModel`` as the dict a worker registers with. The field
    names are ``CostModel``'s; ``promote_tokens_per_s`` repeats the WARM rate
    for directories that still read the old name."""
    out = {"v": WIRE_VERSION, **{name: float(getattr(cost, name)) for name in RATE_FIELDS},
           "block_tokens": int(cost.block_tokens)}
    out["promote_tokens_per_s"] = out["warm_promote_tokens_per_s"]
    if bytes_per_token is not None:
        out["bytes_per_token"] = int(bytes_per_token)
    return out


def rates_from_wire(data: Any) -> dict:
    """``CostModel`` keyword arguments from ``rates_to_wire``'s dict."""
    _check_version(data, "rates")
    missing = [name for name in RATE_FIELDS + ("block_tokens",) if name not in data]
    if missing:
        raise MalformedMessageError(f"rates lack {missing}")
    rates = {name: _number(data[name], f"rates {name}", positive=True) for name in RATE_FIELDS}
    block_tokens = _count(data["block_tokens"], "rates block_tokens")
    if block_tokens == 0:
        raise MalformedMessageError("rates block_tokens must be positive, got 0")
    return {**rates, "block_tokens": block_tokens}


def _count(value: Any, what: str) -> int:
    """A non-negative integer field; an integral float (3.0) is read as its integer."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
            or value < 0 or int(value) != value):
        raise MalformedMessageError(f"{what} must be a non-negative integer, got {value!r}")
    return int(value)


def _number(value: Any, what: str, *, optional: bool = False, positive: bool = False) -> float | None:
    """A finite number >= 0 (> 0 with ``positive``), or None when ``optional``."""
    if value is None and optional:
        return None
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
            or value < 0 or (positive and value == 0)):
        kind = "a positive" if positive else "a non-negative"
        raise MalformedMessageError(f"{what} must be {kind} finite number{' or None' if optional else ''}, "
                                    f"got {value!r}")
    return float(value)


def _check_tokens(tokens: Any, what: str) -> None:
    if not isinstance(tokens, (list, tuple)):
        raise MalformedMessageError(f"{what} must be a list of token ids, got {type(tokens).__name__}")
    for i, token in enumerate(tokens):
        if isinstance(token, bool) or not isinstance(token, numbers.Integral) or token < 0:
            raise MalformedMessageError(f"{what}[{i}] must be a non-negative integer token id, got {token!r}")


def _check_optional_version(data: dict, what: str) -> None:
    """Messages that travel as dicts without a version may carry one; a wrong one is refused."""
    if "v" in data and data["v"] != WIRE_VERSION:
        raise MalformedMessageError(f"{what} has wire version {data['v']!r}; this build reads {WIRE_VERSION}")


def _check_version(data: Any, what: str) -> None:
    if not isinstance(data, dict):
        raise MalformedMessageError(f"{what} must be a dict, got {type(data).__name__}")
    if data.get("v") != WIRE_VERSION:
        raise MalformedMessageError(f"{what} has wire version {data.get('v')!r}; this build reads {WIRE_VERSION}")


__all__ = ["WIRE_VERSION", "MalformedMessageError", "FinishReason", "Transport", "MigrationResult",
           "RouteDecision", "GenerateRequest", "PeerCall", "target_of", "ReplicaTiming", "StreamItem", "TableChange", "TableState",
           "TableUpdate", "LoadReport", "RATE_FIELDS",
           "rates_to_wire", "rates_from_wire"]
