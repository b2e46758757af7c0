"""RequestClock: where one request's time to first token went, from its own timestamps.

The ingress stamps its side (handler entered, body parsed and tokenized, the
replica call issued, the first item back, the response ready); the router
adds how long its decision took (``GenerateRequest.route_s``); the replica
sends its side with the first token (``ReplicaTiming``: queue, migration,
first forward, and a wall-clock stamp of when it received the request).
``breakdown_ms`` turns them into the parts that add up to
the ingress's own total:

- ``read_body``: the request body arriving (Serve's ingress reads it from the proxy);
- ``parse_tokenize``: parsing and validating the JSON, tokenizing (chat template);
- ``route``: the routing decision (on the router's copy of the directory's
  table, or the directory's answer), hashing the prompt's blocks included;
  ``route_decision`` says how much of it was the policy's own ``choose``;
- ``to_replica``: the call's way to the replica (Serve's handle, the hop),
  the routing decision excluded;
- ``migrate``: pulling the prefix from a peer before the prefill;
- ``replica_queue``: waiting for the engine (the batch before, the command queue);
- ``prefix_load``: matching the prompt in the radix tree, promoting WARM/COLD
  blocks, reading the cached KV for the forward;
- ``first_forward``: the model's forward over the uncached suffix, and the sample;
- ``stream_back``: the first token's way back to the ingress, from the moment
  it was sampled (the engine thread's hand-off to the replica's event loop included);
- ``ingress_other``: the rest of the time to first token, spent in the ingress
  between the parts above (building the message, Serve's handle call before
  the router runs): ``ttft`` is the sum of the parts so far;
- ``respond``: from the first token to the response ready (``total - ttft``):
  the text and the JSON, and for a stream or a longer answer the other tokens.

Beside the parts, ``step_counts`` (the app's ``prefix_cache.timing_steps``:
counts, ``STEP_COUNTS``) from the replica say the same wait in engine steps:
``steps_waited`` (steps planned from the hand-over to the step that admitted it), ``promotion_waits`` (of those, the
steps it was passed over while its prefix was promoted up to HOT),
``prompt_steps`` (the steps its prompt took, 1: whole in one step), and of the
step of its first forward ``step_tokens``, ``step_rows``, ``step_decodes``
and ``step_other_tokens`` (other tenants' tokens in it).

The two hops use wall clocks of two processes: exact on one host, as good
as the hosts' clock sync across hosts (their sum with the replica's own
durations is always exact). Without a replica timing (an error before the
first token) only the ingress's own parts are given.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from cluster.protocol import STEP_COUNTS, ReplicaTiming, RouteDecision


# The parts of ``breakdown_ms`` that add up to the time to first token, in order.
TTFT_PARTS = ("read_body", "parse_tokenize", "route", "to_replica", "migrate", "replica_queue", "prefix_load",
              "first_forward", "stream_back", "ingress_other")


@dataclass(slots=True)
class RequestClock:
    received: float                      # perf_counter at the handler's start
    received_wall: float                 # the same moment, wall clock
    body_read: float | None = None       # perf_counter once the body's bytes are in
    parsed: float | None = None          # perf_counter once the body is a ApiRequest
    call_wall: float | None = None       # wall clock when the replica call that answered was issued
    route_s: float = 0.0                 # the router's decision time for that call
    first_wall: float | None = None      # wall clock when its first token arrived
    replica: ReplicaTiming | None = None
    routed_by: str | None = None         # RouteDecision.source of that call
    decision_us: float | None = None     # RouteDecision.decision_us: the policy's own time, within ``route``

    @classmethod
    def start(cls) -> "RequestClock":
        return cls(time.perf_counter(), time.time())

    def mark_body_read(self) -> None:
        self.body_read = time.perf_counter()

    def mark_parsed(self) -> None:
        self.parsed = time.perf_counter()

    def mark_first(self, call_wall: float, route_s: float, timing: ReplicaTiming | None,
                   routing: RouteDecision | None = None) -> None:
        """The first token of the request arrived (from the call issued at ``call_wall``,
        routed by ``routing``)."""
        if self.first_wall is None:
            self.first_wall, self.call_wall, self.route_s, self.replica = time.time(), call_wall, route_s, timing
            if routing is not None:
                self.routed_by, self.decision_us = routing.source, routing.decision_us

    def step_counts(self) -> dict:
        """The replica's counts in engine steps (``STEP_COUNTS``; empty without a replica timing)."""
        return {name: getattr(self.replica, name) for name in STEP_COUNTS} if self.replica is not None else {}

    def breakdown_ms(self, done: float | None = None) -> dict:
        """Milliseconds per part (module docstring); ``done`` is the perf_counter
        time the response was ready (default: now)."""
        done = time.perf_counter() if done is None else done
        total = done - self.received
        body = self.body_read if self.body_read is not None else self.received
        parts = {"read_body": body - self.received,
                 "parse_tokenize": (self.parsed - body) if self.parsed is not None else 0.0}
        if self.first_wall is not None and self.call_wall is not None and self.replica is not None:
            r = self.replica
            parts["route"] = self.route_s
            parts["to_replica"] = max(0.0, r.received_at - self.call_wall - self.route_s)
            parts["migrate"] = r.migrate_s
            parts["replica_queue"] = r.queue_s
            parts["prefix_load"] = r.prefix_load_s
            parts["first_forward"] = r.forward_s
            sampled_wall = r.received_at + r.migrate_s + r.queue_s + r.prefix_load_s + r.forward_s
            parts["stream_back"] = max(0.0, self.first_wall - sampled_wall)
            ttft = self.first_wall - self.received_wall
            parts["ingress_other"] = max(0.0, ttft - sum(parts.values()))
            parts["respond"] = max(0.0, total - ttft)
            out = {k: round(v * 1e3, 3) for k, v in parts.items()}
            out["ttft"] = round(ttft * 1e3, 3)
            if self.decision_us is not None:   # inside ``route``: not a part of its own
                out["route_decision"] = round(self.decision_us / 1e3, 4)
        else:
            out = {k: round(v * 1e3, 3) for k, v in parts.items()}
        out["total"] = round(total * 1e3, 3)
        return out
