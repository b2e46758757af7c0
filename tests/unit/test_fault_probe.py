"""ClusterProbe's judgements for `prefix-cache loadtest`, on a stand-in cluster (no Ray):
when the app is whole again after a kill, which replica a kill picks, and how an
exported counter is read off the nodes' metrics endpoints."""

from __future__ import annotations

import time

import pytest

from lab.load.faults import ActorRecord, ClusterProbe


def replica(n: int) -> ActorRecord:
    return ActorRecord(f"actor-{n}", "ServeReplica:prefix-cache:CacheReplica",
                       f"SERVE_REPLICA::prefix-cache#CacheReplica#w{n}", 1000 + n)


class StandIn(ClusterProbe):
    """The actor table, the directory's routing table and its load view, set by the test."""

    def __init__(self):
        super().__init__("ns")
        self.alive: list[ActorRecord] = []
        self.listed: list[str] = []
        self.directory_up = True
        self.load: dict[str, tuple[int, int]] = {}

    def replicas(self):
        return list(self.alive)

    def live_workers(self):
        return list(self.listed)

    def directory(self):
        return ActorRecord("dir", "Directory", "prefix-cache-directory", 7) if self.directory_up else None

    def loads(self):
        return dict(self.load)


def test_the_worker_id_is_the_serve_replica_id():
    assert replica(3).worker_id == "w3"


def test_a_replica_kill_is_whole_only_once_the_directory_no_longer_lists_the_dead_worker():
    probe = StandIn()
    killed = {"kind": "replica", "actor_id": "actor-1", "worker_id": "w1", "replicas_before": 3}
    steps = [
        ([1, 2, 3], ["w1", "w2", "w3"], False),        # the killed actor is still in the actor table
        ([2, 3], ["w1", "w2", "w3"], False),           # gone, not yet replaced
        ([2, 3, 4], ["w1", "w2", "w3"], False),        # replaced, the new one not registered yet
        ([2, 3, 4], ["w1", "w2", "w3", "w4"], False),  # the live ones all answer: the dead one still routable
        ([2, 3, 4], ["w2", "w3", "w4"], True),         # dropped by the directory: whole
        ([2, 3, 4], ["w2", "w4"], False),              # a live replica the directory lost
    ]
    for alive, listed, whole in steps:
        probe.alive, probe.listed = [replica(n) for n in alive], listed
        assert probe.whole(killed) is whole, (alive, listed)


def test_a_directory_kill_is_whole_once_it_is_back_and_lists_every_replica():
    probe = StandIn()
    probe.alive = [replica(n) for n in (1, 2, 3)]
    killed = {"kind": "directory", "actor_id": "dir", "worker_id": None, "replicas_before": 3}
    probe.directory_up, probe.listed = False, []
    assert not probe.whole(killed)
    probe.directory_up, probe.listed = True, ["w1", "w3"]      # restarted, one replica not re-registered yet
    assert not probe.whole(killed)
    probe.listed = ["w1", "w2", "w3"]
    assert probe.whole(killed)


def test_the_kill_takes_the_running_replica_with_the_most_work_left():
    probe = StandIn()
    replicas = [replica(n) for n in (1, 2, 3)]
    probe.load = {"w1": (0, 0), "w2": (0, 0), "w3": (0, 0)}
    assert probe.busiest_replica(replicas) is None                 # nothing in flight: wait
    probe.load = {"w1": (40, 1), "w2": (300, 0), "w3": (90, 3)}    # w2's tokens are a routing reservation
    assert probe.busiest_replica(replicas) == (replicas[2], 3)
    probe.load = {"w1": (90, 2), "w3": (90, 3)}                     # a tie: the lowest actor id
    assert probe.busiest_replica(replicas) == (replicas[0], 2)


def test_a_counter_is_read_per_node_and_series(monkeypatch):
    import httpx

    pages = {
        "http://10.0.0.1:9001/metrics": ('# TYPE ray_prefix_cache_resumed_requests_total counter\n'
                                         'ray_prefix_cache_resumed_requests_total{WorkerId="a"} 2.0\n'
                                         'ray_prefix_cache_resumed_requests_total_created{WorkerId="a"} 1.7e9\n'
                                         'ray_prefix_cache_cut_streams_total{WorkerId="a"} 5.0\n'),
        "http://10.0.0.2:9002/metrics": 'ray_prefix_cache_resumed_requests_total 1.0 1700000000\n',
    }

    def get(url, timeout):
        if url not in pages:
            raise httpx.ConnectError("refused")
        return httpx.Response(200, text=pages[url])

    monkeypatch.setattr(httpx, "get", get)
    nodes = [   # what ray.nodes() lists
        {"NodeID": "n1", "Alive": True, "NodeManagerAddress": "10.0.0.1", "MetricsExportPort": 9001},
        {"NodeID": "n2", "Alive": True, "NodeManagerAddress": "10.0.0.2", "MetricsExportPort": 9002},
        {"NodeID": "n3", "Alive": True, "NodeManagerAddress": "10.0.0.3", "MetricsExportPort": 9003},  # no answer
        {"NodeID": "n4", "Alive": False, "NodeManagerAddress": "10.0.0.4", "MetricsExportPort": 9004}]
    series = ClusterProbe("ns").metric("ray_prefix_cache_resumed_requests_total", nodes)
    assert series == {'n1|ray_prefix_cache_resumed_requests_total{WorkerId="a"': 2.0,
                      "n2|ray_prefix_cache_resumed_requests_total": 1.0}
    assert ClusterProbe("ns").metric("ray_prefix_cache_resumed_requests_total", nodes[2:3]) is None   # nobody answered


@pytest.mark.parametrize("before, after, resumed", [
    ({}, {"n1|a": 3.0}, 3),                            # the series appeared with the resumes
    ({"n1|a": 2.0}, {"n1|a": 5.0, "n2|b": 1.0}, 4),    # an ingress that started meanwhile counts from 0
    ({"n1|a": 2.0, "n1|old": 9.0}, {"n1|a": 2.0}, 0),  # one that is gone counts nothing
    (None, {"n1|a": 1.0}, None),                       # no endpoint answered at the kill
])
def test_resumed_is_the_rise_of_the_counter_per_series(before, after, resumed):
    from lab.load import loadtest

    probe = StandIn()
    probe.metric = lambda name: after
    # The last request an hour ago: its increments are long exported, nothing to wait for.
    assert loadtest._resumed_since(probe, before, last_request=time.monotonic() - 3600) == resumed
