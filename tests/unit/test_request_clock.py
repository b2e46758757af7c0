"""The latency breakdown adds up to the ingress's own total, from the request's timestamps."""

import pytest

from cluster.protocol import ReplicaTiming, RouteDecision
from serve_app.timing import RequestClock


def test_breakdown_splits_the_total_into_its_parts():
    clock = RequestClock(received=100.0, received_wall=5000.0)
    clock.body_read, clock.parsed = 100.0015, 100.002        # 1.5 ms body, 0.5 ms parse and tokenize
    replica = ReplicaTiming(queue_s=0.001, prefix_load_s=0.0005, forward_s=0.0035, migrate_s=0.0,
                            received_at=5000.006)
    clock.mark_first(call_wall=5000.003, route_s=0.0015, timing=replica,
                     routing=RouteDecision("w", "local", source="router_view", decision_us=120.0))
    clock.first_wall = 5000.0125                             # sampled at 5000.011: 1.5 ms back
    parts = clock.breakdown_ms(done=100.014)
    # 1 ms between the parse and the call: the ingress's own; 1.5 ms after the first token: the response.
    assert parts == pytest.approx({"read_body": 1.5, "parse_tokenize": 0.5, "route": 1.5, "to_replica": 1.5, "migrate": 0.0,
                                   "replica_queue": 1.0, "prefix_load": 0.5, "first_forward": 3.5, "stream_back": 1.5,
                                   "ingress_other": 1.0, "respond": 1.5, "ttft": 12.5, "total": 14.0,
                                   "route_decision": 0.12}, abs=1e-6)
    assert clock.routed_by == "router_view"
    assert clock.step_counts() == {"steps_waited": 0, "promotion_waits": 0, "prompt_steps": 0, "step_tokens": 0,
                                   "step_rows": 0, "step_decodes": 0, "step_other_tokens": 0, "room_waits": 0,
                                   "unreached": 0}
    assert RequestClock(received=1.0, received_wall=1.0).step_counts() == {}   # no replica timing
    to_first = sum(v for k, v in parts.items() if k not in ("respond", "ttft", "total", "route_decision"))
    assert to_first == pytest.approx(parts["ttft"]) and to_first + parts["respond"] == pytest.approx(parts["total"])


def test_only_the_first_token_is_stamped_and_a_failed_request_gives_the_ingress_parts():
    clock = RequestClock(received=10.0, received_wall=1.0)
    clock.parsed = 10.001
    assert clock.breakdown_ms(done=10.005) == pytest.approx({"read_body": 0.0, "parse_tokenize": 1.0, "total": 5.0})
    clock.mark_first(2.0, 0.001, ReplicaTiming(received_at=2.0))
    first = clock.first_wall
    clock.mark_first(3.0, 0.5, None, RouteDecision("w", "x"))   # a later token (or a resumed attempt) changes nothing
    assert (clock.first_wall, clock.call_wall, clock.route_s) == (first, 2.0, 0.001)
