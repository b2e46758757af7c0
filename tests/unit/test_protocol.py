"""Wire types of cluster/protocol.py: every message type round-trips as Ray moves it (pickled)
and, for the peer channel's, as msgpack field maps; each has one accepted form (its class);
numbers that come from another process are validated when a message is built, with a
MalformedMessageError that names the field and the problem."""

from __future__ import annotations

import dataclasses
import math
import pickle

import msgpack
import pytest

from cluster.errors import InvalidInputError
from cluster.protocol import (RATE_FIELDS, WIRE_VERSION, FinishReason, GenerateRequest, LoadReport,
                              MalformedMessageError, MeasuredRates, MigrationResult, ReplicaTiming, RouteDecision,
                              SamplingParams, Snapshot, StagedPrefix, StreamItem, Transport, WorkerInfo)
from cluster.routing.policies.base import CostModel

DECISION = RouteDecision("w1", "cached_prefix", expected_ttft_s=0.125, cached_tokens=48, migrate_from="w2")
COST = CostModel(prefill_tokens_per_s=12_000.0, warm_promote_tokens_per_s=150_000.0,
                 cold_promote_tokens_per_s=21_000.0, transfer_tokens_per_s=80_000.0, block_tokens=16)
RATES = MeasuredRates(12_000.0, 150_000.0, 21_000.0, 80_000.0, 16, 46080)
STAGED = StagedPrefix("w2", 40, (3, 9, 4), (11, 12, 13), "w2/abc/7", 16, 987654321, "int8v2")
INFO = WorkerInfo("w2", "127.0.0.1:4100", b"\x00nixl-meta", "w2-agent", 16, RATES, 49152, "SmolLM2", True)


def test_wire_version_and_enum_values():
    """The strings other processes (and HTTP clients) read: changing one is a wire change."""
    assert WIRE_VERSION == 2
    assert [r.value for r in FinishReason] == ["stop", "length", "error", "cancelled", "client_disconnected"]
    assert [t.value for t in Transport] == ["nixl", "object_store", "peer"]
    assert FinishReason("length") is FinishReason.LENGTH and Transport("nixl") is Transport.NIXL
    assert issubclass(MalformedMessageError, InvalidInputError)


# ------------------------------------------------------------------ round trips
ALL_MESSAGES = [
    DECISION,
    RouteDecision.pinned("w3"),
    RouteDecision.fallback(),
    SamplingParams(4, 0.7, 0.9, 42, (2,)),
    GenerateRequest([1, 2, 3], SamplingParams(max_tokens=4), "tenant-a", "chat-1", DECISION, ("w9",)),
    StreamItem(42, False, cached_tokens=16, tier_hits=(16, 0, 0), prompt_tokens=20, worker_id="w1",
               reason="cached_prefix", timing=ReplicaTiming(queue_s=0.1, prefix_load_s=0.2, forward_s=0.3, migrate_s=0.0, received_at=1.5e9)),
    StreamItem(None, True, FinishReason.STOP, prompt_tokens=20,
               migration=MigrationResult("w2", Transport.OBJECT_STORE, 32, 1_474_560)),
    StreamItem(None, True, FinishReason.ERROR, error="engine step failed"),
    MigrationResult("w2", Transport.NIXL, 64, 2_949_120),
    MigrationResult("w2"),
    LoadReport(128, 2, 1, 75_000.0),
    LoadReport(0, 0, 0),
    RATES,
    STAGED,
    INFO,
]


@pytest.mark.parametrize("message", ALL_MESSAGES, ids=lambda m: type(m).__name__)
def test_every_type_survives_pickle(message):
    """Ray pickles these between the ingress, the replicas and the directory."""
    back = pickle.loads(pickle.dumps(message))
    assert type(back) is type(message) and back == message
    for field in dataclasses.fields(message):
        value = getattr(back, field.name)
        if isinstance(value, (FinishReason, Transport)):
            assert value is getattr(message, field.name)   # enum members stay members, not bare strings


@pytest.mark.parametrize("message", [STAGED, INFO, StagedPrefix("w5")], ids=lambda m: type(m).__name__)
def test_peer_channel_messages_round_trip_through_msgpack(message):
    """What the peer channel sends: the field map, packed and unpacked, rebuilds the same message."""
    fields = msgpack.unpackb(msgpack.packb(message.to_fields(), use_bin_type=True), raw=False)
    assert type(message).from_fields(fields) == message


def test_a_staged_prefix_that_names_no_format_is_uncompressed():
    """A holder from before the tier codecs sends no ``codec``: its bytes are the model's dtype."""
    assert StagedPrefix.from_fields(_fields(STAGED, codec=_DROP)).codec == "none"
    assert StagedPrefix.from_fields(_fields(STAGED)).codec == "int8v2"


def test_snapshot_and_decision_shapes():
    seq, entries, epoch = Snapshot(7, {11: 0, 12: 1})   # unpacks like a tuple (epoch defaults to 0)
    assert (seq, entries) == (7, {11: 0, 12: 1})
    assert RouteDecision.fallback() == RouteDecision(None, "fallback_least_loaded", source="fallback")
    assert RouteDecision.pinned("w3").source == "pinned" and DECISION.source == "directory"


def test_rates_of_a_cost_model():
    rates = MeasuredRates.of(COST, bytes_per_token=46080)
    assert rates == RATES
    assert CostModel(**rates.cost_kwargs()) == COST
    assert MeasuredRates.of(COST).bytes_per_token is None
    assert rates.with_transfer(5.0).transfer_tokens_per_s == 5.0 and rates.transfer_tokens_per_s == 80_000.0
    assert tuple(RATE_FIELDS) == ("prefill_tokens_per_s", "warm_promote_tokens_per_s", "cold_promote_tokens_per_s",
                                  "transfer_tokens_per_s")


def test_json_forms():
    assert MigrationResult("w2", Transport.NIXL, 64, 2_949_120).to_json() == {
        "from": "w2", "transport": "nixl", "tokens": 64, "bytes": 2_949_120}
    assert MigrationResult("w2").to_json() == {"from": "w2", "transport": None, "tokens": 0, "bytes": 0}
    assert StreamItem(1, False, tier_hits=(3, 2, 1)).cached_by_tier() == {"hot": 3, "warm": 2, "cold": 1}


# ------------------------------------------------------------------ malformed
def _rates(**change):
    return {**dataclasses.asdict(RATES), **change}


def _load(**change):
    return {**dataclasses.asdict(LoadReport(128, 2, 1, 75_000.0)), **change}


def _fields(message, **change):
    return {k: v for k, v in {**message.to_fields(), **change}.items() if v is not _DROP}


_DROP = object()

MALFORMED = [
    # load reports
    ("load-negative", lambda: LoadReport(**_load(running=-1)),
     "load report running must be a non-negative integer, got -1"),
    ("load-str-count", lambda: LoadReport(**_load(queued_tokens="5")),
     "load report queued_tokens must be a non-negative integer, got '5'"),
    ("load-bool-count", lambda: LoadReport(**_load(waiting=True)),
     "load report waiting must be a non-negative integer, got True"),
    ("load-fractional", lambda: LoadReport(**_load(queued_tokens=1.5)),
     "load report queued_tokens must be a non-negative integer, got 1.5"),
    ("load-nan-rate", lambda: LoadReport(**_load(transfer_tokens_per_s=math.nan)),
     "load report transfer_tokens_per_s must be a non-negative finite number or None, got nan"),
    ("load-str-rate", lambda: LoadReport(**_load(transfer_tokens_per_s="fast")),
     "load report transfer_tokens_per_s must be a non-negative finite number or None, got 'fast'"),
    # rates
    ("rates-zero", lambda: MeasuredRates(**_rates(transfer_tokens_per_s=0)),
     "rates transfer_tokens_per_s must be a positive finite number, got 0"),
    ("rates-inf", lambda: MeasuredRates(**_rates(prefill_tokens_per_s=math.inf)),
     "rates prefill_tokens_per_s must be a positive finite number, got inf"),
    ("rates-str", lambda: MeasuredRates(**_rates(cold_promote_tokens_per_s="1e4")),
     "rates cold_promote_tokens_per_s must be a positive finite number, got '1e4'"),
    ("rates-bool", lambda: MeasuredRates(**_rates(warm_promote_tokens_per_s=True)),
     "rates warm_promote_tokens_per_s must be a positive finite number, got True"),
    ("rates-block-zero", lambda: MeasuredRates(**_rates(block_tokens=0)), "rates block_tokens must be positive, got 0"),
    ("rates-block-str", lambda: MeasuredRates(**_rates(block_tokens="16")),
     "rates block_tokens must be a non-negative integer, got '16'"),
    # generate requests: one accepted form each
    ("request-params-dict", lambda: GenerateRequest([1], {"max_tokens": 4}),
     "generate request params must be SamplingParams, got dict"),
    ("request-tenant-int", lambda: GenerateRequest([1], SamplingParams(), tenant=3),
     "generate request tenant must be a string or None, got 3"),
    ("request-session-list", lambda: GenerateRequest([1], SamplingParams(), session_id=["s"]),
     "generate request session_id must be a string or None, got ['s']"),
    # the peer channel's maps
    ("staged-not-map", lambda: StagedPrefix.from_fields([1, 2]), "staged prefix must be a map, got list"),
    ("staged-negative-block", lambda: StagedPrefix.from_fields(_fields(STAGED, blocks=[1, -2])),
     "staged prefix block must be a non-negative integer, got -2"),
    ("staged-no-holder", lambda: StagedPrefix.from_fields(_fields(STAGED, holder=_DROP)),
     "staged prefix is malformed: KeyError('holder')"),
    ("info-not-map", lambda: WorkerInfo.from_fields("w2"), "worker info must be a map, got str"),
    ("info-bad-rates", lambda: WorkerInfo.from_fields(_fields(INFO, rates={**dataclasses.asdict(RATES),
                                                                            "block_tokens": 0})),
     "rates block_tokens must be positive, got 0"),
]


@pytest.mark.parametrize("build,message", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_input_names_the_problem(build, message):
    with pytest.raises(MalformedMessageError) as info:
        build()
    assert str(info.value) == message


@pytest.mark.parametrize("kw,message", [
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1, got 0"),
    ({"temperature": math.nan}, "temperature must be a number in [0, 2], got nan"),
    ({"top_p": 0}, "top_p must be a number in (0, 1], got 0"),
    ({"seed": 2 ** 64}, "seed must be an integer in [-2**63, 2**64), got 18446744073709551616"),
    ({"stop_token_ids": [1]}, "stop_token_ids must be a tuple of ints, got [1]"),
])
def test_sampling_params_name_the_bad_value(kw, message):
    with pytest.raises(InvalidInputError) as info:
        SamplingParams(**kw)
    assert str(info.value) == message
