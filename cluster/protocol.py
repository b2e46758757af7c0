"""Wire types: every message that crosses a process, in one place.

Ray pickles these between the ingress, the cache replicas and the directory;
the peer channel between workers (``actors.peer``) sends them as msgpack
maps of their fields (``to_fields``/``from_fields``); the KV event batches
keep their own msgpack format (``cluster.routing.events``). Each message
has exactly one accepted form, its class: no dict stands in for one.
Messages whose fields come from another process's numbers (loads, measured
rates) validate them when built, naming the field and the problem.

Nothing here imports Ray or the rest of the library: every layer uses it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, NamedTuple, NewType

from cluster.errors import InvalidInputError
from cluster.names import SOURCE_NAMES

# The version of the peer channel's frames (``actors.peer``): a peer of another
# version is refused with a clear error instead of misreading a message.
WIRE_VERSION = 2

Tenant = NewType("Tenant", str)
"""A tenant's cache salt (from its API key): its KV never matches another tenant's.
None is the shared namespace of a deployment without keys."""


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

    NIXL = "nixl"                    # RDMA READ of the holder's staged host blocks
    OBJECT_STORE = "object_store"    # the staged blocks through Ray's object store (no shell uses it now)
    PEER = "peer"                    # the staged blocks over the peer channel (Serve replicas)


# Below this temperature sampling is greedy (as in vLLM): dividing logits by a
# tiny temperature overflows to inf and softmax turns that into NaN.
GREEDY_TEMPERATURE = 1e-5


class Range(NamedTuple):
    """The values a numeric parameter takes: [lo, hi], or (lo, hi] with ``lo_open``."""

    lo: float
    hi: float
    lo_open: bool = False

    def holds(self, value: float) -> bool:
        return self.lo < value <= self.hi if self.lo_open else self.lo <= value <= self.hi

    def text(self) -> str:
        return f"{'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}]"


# The one source of the sampling parameters' ranges: ``SamplingParams`` checks them
# and the HTTP request models (``serve_app.params``) declare them, so the OpenAPI
# schema, the 400s and the engine's own check cannot disagree.
SAMPLING_RANGES: dict[str, Range] = {
    "temperature": Range(0.0, 2.0),
    "top_p": Range(0.0, 1.0, lo_open=True),
    "presence_penalty": Range(-2.0, 2.0),    # over this generation's own tokens
    "frequency_penalty": Range(-2.0, 2.0),   # likewise
    "repetition_penalty": Range(0.0, 2.0, lo_open=True),   # over prompt and output (transformers' rule)
    "min_p": Range(0.0, 1.0),
}
LOGIT_BIAS_RANGE = Range(-100.0, 100.0)
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1
PRIORITY_MIN, PRIORITY_MAX = -(1 << 31), (1 << 31) - 1   # a request's scheduling priority (lower first)
MAX_LOGPROBS = 20                    # top-k logprobs per token, at most


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request samples; validated where it is built (a bad value is the
    caller's ``InvalidInputError``), carried inside ``GenerateRequest``."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    # Processors (cluster.engine.sampling; each off at its default). Ranges: SAMPLING_RANGES.
    top_k: int = 0                       # 0: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias in LOGIT_BIAS_RANGE)
    min_tokens: int = 0                  # stop tokens are masked until this many were generated
    # Logprobs of the sampled tokens: None, or k >= 0 (the token's own and the top k).
    logprobs: int | None = None
    # Logprobs of the prompt's tokens (echo): None, or k >= 0.
    prompt_logprobs: int | None = None
    # The prompt's last ``prior_output`` tokens are this generation's own (a resumed
    # request): penalties and min_tokens count them as output.
    prior_output: int = 0
    # A structured-output constraint (``cluster.engine.grammar.GrammarSpec``), or None.
    grammar: Any = None
    # The request's scheduling priority under the engine's ``priority`` policy (vLLM's): lower
    # is served first, ties first come, first served; other policies ignore it. Not a sampling
    # setting: it rides here so that it reaches the engine with the request's other settings.
    priority: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidInputError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        for name, allowed in SAMPLING_RANGES.items():
            _real(getattr(self, name), name, allowed)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            raise InvalidInputError(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int) or \
                not PRIORITY_MIN <= self.priority <= PRIORITY_MAX:
            raise InvalidInputError(f"priority must be an integer in [-2**31, 2**31), got {self.priority!r}")
        ids = self.stop_token_ids
        if not isinstance(ids, tuple) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidInputError(f"stop_token_ids must be a tuple of ints, got {ids!r:.80}")
        for name in ("top_k", "min_tokens", "prior_output"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise InvalidInputError(f"{name} must be an integer >= 0, got {v!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_LOGPROBS):
                raise InvalidInputError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {v!r}")
        if not isinstance(self.logit_bias, tuple):
            raise InvalidInputError(f"logit_bias must be a tuple of (token id, bias), got {self.logit_bias!r:.80}")
        for pair in self.logit_bias:
            if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], int)
                    and not isinstance(pair[0], bool) and pair[0] >= 0):
                raise InvalidInputError(f"logit_bias entries must be (token id >= 0, bias), got {pair!r:.80}")
            _real(pair[1], "logit_bias value", LOGIT_BIAS_RANGE)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def _real(value: Any, what: str, allowed: Range) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not allowed.holds(value):
        raise InvalidInputError(f"{what} must be a number in {allowed.text()}, got {value!r}")


@dataclass(slots=True)
class MigrationResult:
    """What a migration did: ``transport`` None means recompute."""

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
    """Where one request goes: what every route method answers (a policy's
    ``choose``, the routing table, the directory, a router's table copy), or
    a fallback when none could answer."""

    worker_id: str | None
    reason: str                      # which rule decided ("local", "migrate", "balance", ...)
    expected_ttft_s: float | None = None
    cached_tokens: int = 0           # tokens the chosen worker will not prefill (its own + pulled)
    migrate_from: str | None = None  # pull blocks from this worker first
    migrate_blocks: int = 0          # how many (after the chosen worker's own prefix)
    source: str = "directory"        # who decided: "directory", "router_view" (a table copy), "fallback", "pinned"
    decision_us: float | None = None   # the policy's own time for it (its choose, thread CPU)
    l3_blocks: int = 0               # blocks the chosen worker will read from L3 past its own prefix

    @classmethod
    def pinned(cls, worker_id: str) -> "RouteDecision":
        return cls(worker_id, "pinned", source="pinned")

    @classmethod
    def fallback(cls) -> "RouteDecision":
        """No directory answer: the caller picks the least loaded worker."""
        return cls(None, "fallback_least_loaded", source="fallback")


@dataclass(slots=True)
class GenerateRequest:
    """One generation, from the ingress (or a client) to a cache worker.

    ``route`` is the decision the sender made before sending: the worker it
    chose and, when that worker should pull the prefix from another one
    first, ``route.migrate_from``. Nobody writes into a request after it
    was sent."""

    prompt: list[int]
    params: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    tenant: Tenant | None = None
    session_id: str | None = None
    route: RouteDecision | None = None
    exclude: tuple[str, ...] = ()    # workers this request already failed on (a resumed request)

    def __post_init__(self) -> None:
        if not isinstance(self.params, SamplingParams):
            raise MalformedMessageError(f"generate request params must be SamplingParams, "
                                        f"got {type(self.params).__name__}")
        if self.tenant is not None and not isinstance(self.tenant, str):
            raise MalformedMessageError(f"generate request tenant must be a string or None, got {self.tenant!r:.80}")
        if self.session_id is not None and not isinstance(self.session_id, str):
            raise MalformedMessageError(f"generate request session_id must be a string or None, "
                                        f"got {self.session_id!r:.80}")


@dataclass(frozen=True, slots=True)
class StagedPrefix:
    """A holder's answer to an export: ``tokens`` of the asked-for prefix,
    copied into whole host blocks (``blocks``, one checksum each) and kept
    for the target under ``lease`` until it releases them (or they expire).
    ``tokens == 0``: nothing cached any more (a stale decision)."""

    holder: str
    tokens: int = 0
    blocks: tuple[int, ...] = ()
    checksums: tuple[int, ...] = ()
    lease: str | None = None         # "<worker>/<process uuid>/<n>": unique across workers
    block_tokens: int = 0
    tokens_hash: int = 0             # of the tokens covered and their tenant: the target compares its own
    codec: str = "none"              # the staged bytes' stored format (``cluster.cache.codec.format_id``)

    def to_fields(self) -> dict:
        return {f: getattr(self, f) for f in self.__slots__}

    @classmethod
    def from_fields(cls, fields: Any) -> "StagedPrefix":
        if not isinstance(fields, dict):
            raise MalformedMessageError(f"staged prefix must be a map, got {type(fields).__name__}")
        try:
            return cls(str(fields["holder"]), _count(fields["tokens"], "staged prefix tokens"),
                       tuple(_count(b, "staged prefix block") for b in fields["blocks"]),
                       tuple(int(c) for c in fields["checksums"]), fields.get("lease"),
                       _count(fields["block_tokens"], "staged prefix block_tokens"), int(fields["tokens_hash"]),
                       # A holder that names no format stores uncompressed (what came before the codecs).
                       str(fields.get("codec", "none")))
        except MalformedMessageError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise MalformedMessageError(f"staged prefix is malformed: {exc!r}") from None


@dataclass(frozen=True, slots=True)
class PrefixOffer:
    """A prefix a worker holds, and what it is worth to keep
    (``cluster.cache.prefix_value``): what a leaving worker asks a peer to pull,
    and what a new worker hears of its peers' shared prefixes."""

    holder: str
    tenant: Tenant | None
    tokens: tuple[int, ...]
    value: float = 0.0

    def to_fields(self) -> dict:
        return {"holder": self.holder, "tenant": self.tenant, "tokens": list(self.tokens), "value": self.value}

    @classmethod
    def from_fields(cls, fields: Any) -> "PrefixOffer":
        if not isinstance(fields, dict):
            raise MalformedMessageError(f"prefix offer must be a map, got {type(fields).__name__}")
        try:
            tenant = fields["tenant"]
            if tenant is not None and not isinstance(tenant, str):
                raise MalformedMessageError(f"prefix offer tenant must be a string or null, got {tenant!r:.40}")
            _check_tokens(fields["tokens"], "prefix offer tokens")
            return cls(str(fields["holder"]), tenant, tuple(fields["tokens"]),
                       _number(fields.get("value", 0.0), "prefix offer value"))
        except MalformedMessageError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise MalformedMessageError(f"prefix offer is malformed: {exc!r}") from None


RATE_FIELDS = ("prefill_tokens_per_s", "warm_promote_tokens_per_s", "cold_promote_tokens_per_s",
               "transfer_tokens_per_s")


@dataclass(frozen=True, slots=True)
class MeasuredRates:
    """What a worker measured at start-up (``actors.calibration``): the
    ``CostModel`` rates it registers with, and the KV shape they hold for
    (a replacement worker of the same shape may reuse them)."""

    prefill_tokens_per_s: float
    warm_promote_tokens_per_s: float
    cold_promote_tokens_per_s: float
    transfer_tokens_per_s: float
    block_tokens: int
    bytes_per_token: int | None = None
    l3_fetch_tokens_per_s: float | None = None   # reading (and verifying) blocks from L3; None: no L3

    def __post_init__(self) -> None:
        for name in RATE_FIELDS:
            _number(getattr(self, name), f"rates {name}", positive=True)
        _number(self.l3_fetch_tokens_per_s, "rates l3_fetch_tokens_per_s", optional=True, positive=True)
        if _count(self.block_tokens, "rates block_tokens") == 0:
            raise MalformedMessageError("rates block_tokens must be positive, got 0")
        if self.bytes_per_token is not None:
            _count(self.bytes_per_token, "rates bytes_per_token")

    @classmethod
    def of(cls, cost: Any, bytes_per_token: int | None = None) -> "MeasuredRates":
        """The rates of a ``CostModel``."""
        l3 = float(getattr(cost, "l3_fetch_tokens_per_s", 0.0) or 0.0)
        return cls(*(float(getattr(cost, name)) for name in RATE_FIELDS), int(cost.block_tokens),
                   None if bytes_per_token is None else int(bytes_per_token), l3 or None)

    def cost_kwargs(self) -> dict:
        """``CostModel`` keyword arguments."""
        return {**{name: getattr(self, name) for name in RATE_FIELDS}, "block_tokens": self.block_tokens,
                "l3_fetch_tokens_per_s": self.l3_fetch_tokens_per_s or 0.0}

    def with_transfer(self, tokens_per_s: float) -> "MeasuredRates":
        return dataclasses.replace(self, transfer_tokens_per_s=tokens_per_s)


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What a worker says about itself (``info``): how to reach it and what it runs."""

    worker_id: str
    peer_address: str | None         # "host:port" of its peer channel (``actors.peer``)
    nixl: bytes | None               # its NIXL agent metadata (None: no NIXL)
    nixl_name: str | None
    block_tokens: int
    rates: MeasuredRates
    vocab_size: int
    model_id: str
    ownership_checks: bool = False

    def to_fields(self) -> dict:
        out = {f: getattr(self, f) for f in self.__slots__}
        out["rates"] = {f: getattr(self.rates, f) for f in self.rates.__slots__}
        return out

    @classmethod
    def from_fields(cls, fields: Any) -> "WorkerInfo":
        if not isinstance(fields, dict):
            raise MalformedMessageError(f"worker info must be a map, got {type(fields).__name__}")
        try:
            return cls(**{**fields, "rates": MeasuredRates(**fields["rates"])})
        except (KeyError, TypeError) as exc:
            raise MalformedMessageError(f"worker info is malformed: {exc}") from None


class Snapshot(NamedTuple):
    """A worker's whole cached-block index: what the directory rebuilds it from
    after a gap. ``entries``: block hash -> tier, as of event batch ``seq``."""

    seq: int
    entries: dict[int, int]
    epoch: int = 0   # the publisher's epoch (``PublisherEpoch``): a snapshot of an older life is refused


@dataclass(frozen=True, slots=True)
class PublisherEpoch:
    """The epoch the directory hands a starting worker's KV event publisher
    (``cluster.routing.events``): above every epoch it issued or saw for that
    worker id, whatever the worker's clock says."""

    worker_id: str
    epoch: int

    def __post_init__(self) -> None:
        if not isinstance(self.worker_id, str) or not self.worker_id:
            raise MalformedMessageError(f"publisher epoch worker_id must be a non-empty string, got {self.worker_id!r}")
        if type(self.epoch) is not int or not 0 < self.epoch < 1 << 64:
            raise MalformedMessageError(f"publisher epoch must be an integer in (0, 2**64), got {self.epoch!r}")


@dataclass(slots=True)
class StepCounts:
    """One request's wait for its first token, counted in engine steps: steps planned before
    the one that admitted it, of those the ones it waited for its prefix's promotion, found no
    room or was never looked at; the steps its prompt took; and its first forward's step:
    tokens, rows, decode rows, other tenants' tokens. The engine counts them
    (``cluster.engine.request.StepTrace``); ``ReplicaTiming`` carries them to the ingress."""

    steps_waited: int = 0
    promotion_waits: int = 0
    prompt_steps: int = 0
    step_tokens: int = 0
    step_rows: int = 0
    step_decodes: int = 0
    step_other_tokens: int = 0
    room_waits: int = 0          # of the steps waited: looked at, no room (promotion or chunk)
    unreached: int = 0           # of the steps waited: never looked at (budget spent, planning halted)


# The counts in engine steps, by name (``StepCounts``'s fields).
STEP_COUNTS = tuple(f.name for f in dataclasses.fields(StepCounts))


@dataclass(slots=True)
class ReplicaTiming(StepCounts):
    """Where the replica spent one request's time to first token, carried by the
    first token's ``StreamItem``: the same wait in engine steps (``StepCounts``) and
    these durations. Durations are the replica's own; the wall-clock stamp
    (``time.time()``) lets the ingress split the hops to and from the replica (exact
    on one host, as good as the clocks across hosts)."""

    queue_s: float = 0.0        # handed to the engine until the step that admitted it began
    prefix_load_s: float = 0.0  # that step: matching the prefix, promoting it, reading its cached KV
    forward_s: float = 0.0      # the forward over the uncached suffix and the sampled token
    migrate_s: float = 0.0      # pulling the prefix from a peer first (0: no migration)
    received_at: float = 0.0    # wall clock: the replica's generate() began


@dataclass(frozen=True, slots=True)
class StreamItem:
    """One element of a generation stream: a token, or the end of the request.
    Built once, by the worker's engine loop, with everything the ingress
    reports about it; nobody changes it afterwards."""

    token: int | None
    finished: bool
    finish_reason: FinishReason | None = None
    error: str | None = None
    cached_tokens: int = 0
    tier_hits: tuple[int, ...] = (0, 0, 0, 0)   # cached tokens by where they came from: SOURCE_NAMES
    prompt_tokens: int = 0
    worker_id: str | None = None     # the worker that served it
    reason: str | None = None        # the routing decision's reason
    migration: MigrationResult | None = None
    timing: ReplicaTiming | None = None   # on the first token's item
    # With SamplingParams.logprobs: the token's logprob and the top k (token id, logprob).
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    # With SamplingParams.prompt_logprobs, on the first item: per prompt token
    # (logprob or None for the first, top k), the same shape as above.
    prompt_logprobs: tuple | None = None
    # What the tiers held of its prompt when the engine first looked, by SOURCE_NAMES (L3: asked
    # for): beside ``tier_hits``, what it used.
    tiers_found: tuple[int, ...] = (0, 0, 0, 0)

    def cached_by_tier(self) -> dict[str, int]:
        return dict(zip(SOURCE_NAMES, self.tier_hits))

    def found_by_tier(self) -> dict[str, int]:
        return dict(zip(SOURCE_NAMES, self.tiers_found))


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
    l3: tuple[int, ...] = ()                     # block hashes L3 holds
    draining: tuple[str, ...] = ()               # workers taking no new requests


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
    waiting: int = 0
    transfer_tokens_per_s: float | None = None

    def __post_init__(self) -> None:
        _count(self.queued_tokens, "load report queued_tokens")
        _count(self.running, "load report running")
        _count(self.waiting, "load report waiting")
        _number(self.transfer_tokens_per_s, "load report transfer_tokens_per_s", optional=True)


@dataclass(frozen=True, slots=True)
class L3ShareCounts:
    """Each tenant's L3 blocks as the directory counts them across the cluster (from every
    replica's L3 KV events), less those the asking replica wrote: it counts its own exactly
    and adds them on top (``TenantQuotas.set_l3_others``). ``blocks``: ``(namespace,
    blocks)`` pairs, a namespace a str, an int or None (the shared one)."""

    blocks: tuple[tuple[str | int | None, int], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.blocks, tuple):
            raise MalformedMessageError(f"L3 share blocks must be a tuple of pairs, got {type(self.blocks).__name__}")
        for pair in self.blocks:
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise MalformedMessageError(f"L3 share blocks hold (namespace, blocks) pairs, got {pair!r:.60}")
            ns, n = pair
            if ns is not None and (isinstance(ns, bool) or not isinstance(ns, (str, int))):
                raise MalformedMessageError(f"L3 share namespace must be a str, an int or None, got {ns!r:.60}")
            _count(n, f"L3 share blocks of {ns!r:.60}")

    def as_dict(self) -> dict[str | int | None, int]:
        return dict(self.blocks)


@dataclass(frozen=True, slots=True)
class PublishReply:
    """The directory's answer to a worker's events and load when the worker asks for the
    tenants' L3 counts (``publish(..., want_l3_shares=True)``): the status as a plain
    ``publish`` returns it, and the counts (None when the batch was not taken: a stale
    epoch, a malformed batch)."""

    status: str
    l3_shares: L3ShareCounts | None = None


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


__all__ = ["WIRE_VERSION", "Tenant", "MalformedMessageError", "FinishReason", "Transport", "GREEDY_TEMPERATURE",
           "Range", "SAMPLING_RANGES", "LOGIT_BIAS_RANGE", "SEED_MIN", "SEED_MAX", "PRIORITY_MIN", "PRIORITY_MAX", "MAX_LOGPROBS", "SamplingParams", "MigrationResult", "RouteDecision", "GenerateRequest", "StagedPrefix", "RATE_FIELDS",
           "PrefixOffer",
           "MeasuredRates", "WorkerInfo", "Snapshot", "ReplicaTiming", "StepCounts", "STEP_COUNTS", "StreamItem", "TableChange", "TableState",
           "TableUpdate", "LoadReport", "L3ShareCounts", "PublishReply"]
