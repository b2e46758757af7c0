"""The ``priority`` policy (vLLM's): a request's ``priority`` (``SamplingParams.priority``, an int,
default 0) orders the waiting queue, lower value first; equal priorities keep first come, first
served (a preempted request back at the front of its priority). For room, the running request
of the highest value (the least urgent) yields first, the newest of them on ties."""

from __future__ import annotations

from typing import Iterable

from cluster.engine.policies.fcfs import FcfsPolicy


def priority_of(req) -> int:
    return req.params.priority


class PriorityPolicy(FcfsPolicy):
    name = "priority"

    def waiting_order(self, waiting: Iterable) -> list:
        return sorted(waiting, key=priority_of)   # stable: ties keep the queue's order

    def room_victim(self, candidates: list):
        return max(candidates, key=priority_of, default=None)   # max keeps the first (newest) on ties

    def slice_victim(self, running: list):
        return self.room_victim
