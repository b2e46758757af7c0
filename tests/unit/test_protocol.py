"""Wire formats of cluster/protocol.py: every message type round-trips (as Ray moves it, pickled,
and in its dict form), a wrong WIRE_VERSION is refused, and malformed input fails with a
MalformedMessageError that names the field and the problem."""

from __future__ import annotations

import dataclasses
import math
import pickle

import pytest

from cluster.errors import InvalidInputError
from cluster.protocol import (RATE_FIELDS, WIRE_VERSION, FinishReason, GenerateRequest, LoadReport,
                              MalformedMessageError, MigrationResult, PeerCall, RouteDecision, StreamItem,
                              Transport, rates_from_wire, rates_to_wire, target_of)
from cluster.routing.policies.base import CostModel

DECISION = RouteDecision("w1", "cached_prefix", expected_ttft_s=0.125, cached_tokens=48, migrate_from="w2")
DECISION_WIRE = {"worker_id": "w1", "reason": "cached_prefix", "expected_ttft_s": 0.125, "cached_tokens": 48,
                 "migrate_from": "w2"}   # what Directory.route returns
COST = CostModel(prefill_tokens_per_s=12_000.0, warm_promote_tokens_per_s=150_000.0,
                 cold_promote_tokens_per_s=21_000.0, transfer_tokens_per_s=80_000.0, block_tokens=16)
RATES_WIRE = {"v": 1, "prefill_tokens_per_s": 12_000.0, "warm_promote_tokens_per_s": 150_000.0,
              "cold_promote_tokens_per_s": 21_000.0, "transfer_tokens_per_s": 80_000.0, "block_tokens": 16,
              "promote_tokens_per_s": 150_000.0, "bytes_per_token": 46080}


def test_wire_version_and_enum_values():
    """The strings other processes (and HTTP clients) read: changing one is a wire change."""
    assert WIRE_VERSION == 1
    assert [r.value for r in FinishReason] == ["stop", "length", "error", "cancelled", "client_disconnected"]
    assert [t.value for t in Transport] == ["nixl", "object_store"]
    assert FinishReason("length") is FinishReason.LENGTH and Transport("nixl") is Transport.NIXL
    assert issubclass(MalformedMessageError, InvalidInputError)


# ------------------------------------------------------------------ round trips
ALL_MESSAGES = [
    DECISION,
    RouteDecision.pinned("w3"),
    RouteDecision.fallback(),
    GenerateRequest([1, 2, 3], {"max_tokens": 4, "temperature": 0.0}, "tenant-a", "chat-1", DECISION),
    PeerCall("w2", tokens=[5, 6, 7], tenant="tenant-a", session_id="chat-1"),
    StreamItem(42, False, cached_tokens=16, tier_hits=(16, 0, 0), prompt_tokens=20, worker_id="w1",
               reason="cached_prefix"),
    StreamItem(None, True, FinishReason.STOP, prompt_tokens=20,
               migration=MigrationResult("w2", Transport.OBJECT_STORE, 32, 1_474_560), attempt=1),
    StreamItem(None, True, FinishReason.ERROR, error="engine step failed"),
    MigrationResult("w2", Transport.NIXL, 64, 2_949_120),
    MigrationResult("w2"),
    LoadReport(128, 2, 1, 75_000.0),
    LoadReport(0, 0, 0),
]


@pytest.mark.parametrize("message", ALL_MESSAGES, ids=lambda m: type(m).__name__)
def test_every_type_survives_pickle(message):
    """Ray pickles these between the ingress, router, replicas and directory."""
    back = pickle.loads(pickle.dumps(message))
    assert type(back) is type(message) and back == message
    for field in dataclasses.fields(message):
        value = getattr(back, field.name)
        if isinstance(value, (FinishReason, Transport)):
            assert value is getattr(message, field.name)   # enum members stay members, not bare strings


def test_route_decision_round_trip():
    assert RouteDecision.from_wire(DECISION_WIRE) == DECISION
    assert RouteDecision.from_wire(dataclasses.asdict(DECISION)) == DECISION
    assert RouteDecision.from_wire(DECISION) is DECISION
    assert RouteDecision.from_wire({"worker_id": None, "reason": "fallback_least_loaded",
                                    "source": "fallback"}) == RouteDecision.fallback()
    assert RouteDecision.from_wire(DECISION_WIRE).source == "directory"   # who decided, when unsaid
    with pytest.raises(MalformedMessageError, match="source must be a string"):
        RouteDecision.from_wire({**DECISION_WIRE, "source": 3})
    assert RouteDecision.from_wire({**DECISION_WIRE, "v": WIRE_VERSION}) == DECISION
    # a count sent as an integral float is read as an int
    decoded = RouteDecision.from_wire({**DECISION_WIRE, "cached_tokens": 48.0, "expected_ttft_s": 1})
    assert decoded.cached_tokens == 48 and type(decoded.cached_tokens) is int
    assert decoded.expected_ttft_s == 1.0 and type(decoded.expected_ttft_s) is float
    assert RouteDecision.from_wire({**DECISION_WIRE, "cached_tokens": None}).cached_tokens == 0


def test_generate_request_round_trip():
    wire = {"prompt": [1, 2, 3], "params": {"max_tokens": 4}, "tenant": "tenant-a", "session_id": "chat-1",
            "routing": DECISION_WIRE}
    request = GenerateRequest.from_wire(wire)
    assert request == GenerateRequest([1, 2, 3], {"max_tokens": 4}, "tenant-a", "chat-1", DECISION)
    assert isinstance(request.routing, RouteDecision)
    assert GenerateRequest.from_wire(request) is request
    bare = GenerateRequest.from_wire({"prompt": (7, 8)})
    assert (bare.prompt, bare.params, bare.tenant, bare.session_id, bare.routing) == ((7, 8), None, None, None, None)


def test_peer_call_round_trip():
    wire = {"target_worker": "w2", "tokens": [5, 6], "tenant": "t", "session_id": "s"}
    assert PeerCall.from_wire(wire) == PeerCall("w2", [5, 6], "t", None, "s")
    call = PeerCall("w2")
    assert PeerCall.from_wire(call) is call
    assert PeerCall.from_wire(None) is None
    assert PeerCall.from_wire({"target_worker": None, "tokens": [1]}) is None   # untargeted
    assert target_of(call) == "w2" and target_of(wire) == "w2"
    assert target_of({"prompt": [1]}) is None and target_of("x") is None


def test_load_report_round_trip():
    report = LoadReport(128, 2, 1, 75_000.0)
    wire = report.to_wire()
    assert wire == {"v": 1, "queued_tokens": 128, "running": 2, "waiting": 1, "transfer_tokens_per_s": 75_000.0}
    assert LoadReport.from_wire(wire) == report
    assert LoadReport.from_wire(LoadReport(0, 0, 0).to_wire()) == LoadReport(0, 0, 0, None)
    assert LoadReport.from_wire({"v": 1, "queued_tokens": 3, "running": 1}) == LoadReport(3, 1, 0, None)


def test_rates_round_trip():
    wire = rates_to_wire(COST, bytes_per_token=46080)
    assert wire == RATES_WIRE
    kwargs = rates_from_wire(wire)
    assert kwargs == {"prefill_tokens_per_s": 12_000.0, "warm_promote_tokens_per_s": 150_000.0,
                      "cold_promote_tokens_per_s": 21_000.0, "transfer_tokens_per_s": 80_000.0, "block_tokens": 16}
    assert CostModel(**kwargs) == COST
    assert "bytes_per_token" not in rates_to_wire(COST)
    assert tuple(RATE_FIELDS) == ("prefill_tokens_per_s", "warm_promote_tokens_per_s", "cold_promote_tokens_per_s",
                                  "transfer_tokens_per_s")


def test_json_forms():
    assert MigrationResult("w2", Transport.NIXL, 64, 2_949_120).to_json() == {
        "from": "w2", "transport": "nixl", "tokens": 64, "bytes": 2_949_120}
    assert MigrationResult("w2").to_json() == {"from": "w2", "transport": None, "tokens": 0, "bytes": 0}
    assert StreamItem(1, False, tier_hits=(3, 2, 1)).cached_by_tier() == {"hot": 3, "warm": 2, "cold": 1}


# ------------------------------------------------------------------- versions
@pytest.mark.parametrize("decode,wire,what", [
    (LoadReport.from_wire, {**LoadReport(1, 1, 0).to_wire(), "v": 2}, "load report has wire version 2"),
    (LoadReport.from_wire, {"queued_tokens": 1, "running": 1}, "load report has wire version None"),
    (LoadReport.from_wire, {**LoadReport(1, 1, 0).to_wire(), "v": "1"}, "load report has wire version '1'"),
    (rates_from_wire, {**RATES_WIRE, "v": 0}, "rates has wire version 0"),
    (rates_from_wire, {k: v for k, v in RATES_WIRE.items() if k != "v"}, "rates has wire version None"),
    (RouteDecision.from_wire, {**DECISION_WIRE, "v": 2}, "route decision has wire version 2"),
    (GenerateRequest.from_wire, {"prompt": [1], "v": 2}, "generate request has wire version 2"),
    (PeerCall.from_wire, {"target_worker": "w1", "v": 2}, "peer call has wire version 2"),
], ids=["load-v2", "load-no-v", "load-v-str", "rates-v0", "rates-no-v", "decision-v2", "request-v2", "call-v2"])
def test_wrong_wire_version_refused(decode, wire, what):
    with pytest.raises(MalformedMessageError) as info:
        decode(wire)
    assert str(info.value) == f"{what}; this build reads 1"


# ------------------------------------------------------------------ malformed
def _load(**change):
    wire = LoadReport(128, 2, 1, 75_000.0).to_wire()
    wire.update(change)
    return {k: v for k, v in wire.items() if v is not _DROP}


def _rates(**change):
    return {k: v for k, v in {**RATES_WIRE, **change}.items() if v is not _DROP}


def _decision(**change):
    return {k: v for k, v in {**DECISION_WIRE, **change}.items() if v is not _DROP}


_DROP = object()

MALFORMED = [
    # load reports
    ("load-not-dict", LoadReport.from_wire, [1, 2], "load report must be a dict, got list"),
    ("load-no-queued", LoadReport.from_wire, _load(queued_tokens=_DROP), "load report lacks ['queued_tokens']"),
    ("load-no-running", LoadReport.from_wire, _load(running=_DROP), "load report lacks ['running']"),
    ("load-negative", LoadReport.from_wire, _load(running=-1),
     "load report running must be a non-negative integer, got -1"),
    ("load-str-count", LoadReport.from_wire, _load(queued_tokens="5"),
     "load report queued_tokens must be a non-negative integer, got '5'"),
    ("load-bool-count", LoadReport.from_wire, _load(waiting=True),
     "load report waiting must be a non-negative integer, got True"),
    ("load-fractional", LoadReport.from_wire, _load(queued_tokens=1.5),
     "load report queued_tokens must be a non-negative integer, got 1.5"),
    ("load-nan-rate", LoadReport.from_wire, _load(transfer_tokens_per_s=math.nan),
     "load report transfer_tokens_per_s must be a non-negative finite number or None, got nan"),
    ("load-str-rate", LoadReport.from_wire, _load(transfer_tokens_per_s="fast"),
     "load report transfer_tokens_per_s must be a non-negative finite number or None, got 'fast'"),
    # rates
    ("rates-not-dict", rates_from_wire, "rates", "rates must be a dict, got str"),
    ("rates-missing", rates_from_wire, _rates(prefill_tokens_per_s=_DROP, block_tokens=_DROP),
     "rates lack ['prefill_tokens_per_s', 'block_tokens']"),
    ("rates-zero", rates_from_wire, _rates(transfer_tokens_per_s=0),
     "rates transfer_tokens_per_s must be a positive finite number, got 0"),
    ("rates-inf", rates_from_wire, _rates(prefill_tokens_per_s=math.inf),
     "rates prefill_tokens_per_s must be a positive finite number, got inf"),
    ("rates-str", rates_from_wire, _rates(cold_promote_tokens_per_s="1e4"),
     "rates cold_promote_tokens_per_s must be a positive finite number, got '1e4'"),
    ("rates-bool", rates_from_wire, _rates(warm_promote_tokens_per_s=True),
     "rates warm_promote_tokens_per_s must be a positive finite number, got True"),
    ("rates-block-zero", rates_from_wire, _rates(block_tokens=0), "rates block_tokens must be positive, got 0"),
    ("rates-block-str", rates_from_wire, _rates(block_tokens="16"),
     "rates block_tokens must be a non-negative integer, got '16'"),
    # route decisions
    ("decision-not-dict", RouteDecision.from_wire, ["w1", "x"], "not a route decision: list"),
    ("decision-no-worker", RouteDecision.from_wire, _decision(worker_id=_DROP), "route decision lacks 'worker_id'"),
    ("decision-no-reason", RouteDecision.from_wire, _decision(reason=_DROP), "route decision lacks 'reason'"),
    ("decision-worker-int", RouteDecision.from_wire, _decision(worker_id=3),
     "route decision worker_id must be a string or None, got 3"),
    ("decision-reason-none", RouteDecision.from_wire, _decision(reason=None),
     "route decision reason must be a string, got None"),
    ("decision-migrate-from-list", RouteDecision.from_wire, _decision(migrate_from=["w2"]),
     "route decision migrate_from must be a string or None, got ['w2']"),
    ("decision-negative-cached", RouteDecision.from_wire, _decision(cached_tokens=-16),
     "route decision cached_tokens must be a non-negative integer, got -16"),
    ("decision-str-cached", RouteDecision.from_wire, _decision(cached_tokens="many"),
     "route decision cached_tokens must be a non-negative integer, got 'many'"),
    ("decision-ttft-str", RouteDecision.from_wire, _decision(expected_ttft_s="soon"),
     "route decision expected_ttft_s must be a non-negative finite number or None, got 'soon'"),
    # generate requests
    ("request-not-dict", GenerateRequest.from_wire, [1, 2, 3], "not a generate request: list"),
    ("request-no-prompt", GenerateRequest.from_wire, {"params": {}}, "not a generate request: dict"),
    ("request-prompt-str", GenerateRequest.from_wire, {"prompt": "hello"},
     "generate request prompt must be a list of token ids, got str"),
    ("request-negative-token", GenerateRequest.from_wire, {"prompt": [1, -2, 3]},
     "generate request prompt[1] must be a non-negative integer token id, got -2"),
    ("request-float-token", GenerateRequest.from_wire, {"prompt": [1, 2.0]},
     "generate request prompt[1] must be a non-negative integer token id, got 2.0"),
    ("request-bool-token", GenerateRequest.from_wire, {"prompt": [True]},
     "generate request prompt[0] must be a non-negative integer token id, got True"),
    ("request-params-list", GenerateRequest.from_wire, {"prompt": [1], "params": [("max_tokens", 4)]},
     "generate request params must be a dict or None, got list"),
    ("request-bad-routing", GenerateRequest.from_wire, {"prompt": [1], "routing": {"reason": "x"}},
     "route decision lacks 'worker_id'"),
    # peer calls
    ("call-not-dict", PeerCall.from_wire, "w2", "not a peer call: str"),
    ("call-target-int", PeerCall.from_wire, {"target_worker": 7}, "peer call target_worker must be a string, got 7"),
    ("call-tokens-str", PeerCall.from_wire, {"target_worker": "w2", "tokens": "abc"},
     "peer call tokens must be a list of token ids, got str"),
    ("call-token-none", PeerCall.from_wire, {"target_worker": "w2", "tokens": [1, None]},
     "peer call tokens[1] must be a non-negative integer token id, got None"),
]


@pytest.mark.parametrize("decode,wire,message", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_input_names_the_problem(decode, wire, message):
    with pytest.raises(MalformedMessageError) as info:
        decode(wire)
    assert str(info.value) == message
