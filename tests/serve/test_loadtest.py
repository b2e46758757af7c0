"""``prefix-cache loadtest`` against the Serve app on the loopback cluster, with
a cache replica killed mid-run (only actors of the app this module started)."""

import asyncio
import contextlib
import time

import httpx
import pytest

pytestmark = pytest.mark.distributed

NAMESPACE = "prefix-cache-loadtest"
SECRET = "loadtest-peer-secret"


@pytest.fixture(scope="module")
def app_url(ray_loopback_cluster):
    from ray import serve

    from actors.pytest_plugin import TEST_MODEL
    from serve_app.app import build_app
    from serve_app.local import free_port

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {"num_replicas": 3, "namespace": NAMESPACE, "health_check_period_s": 1.0, "peer_secret": SECRET,
            "limits": {"max_prompt_tokens": 2048, "max_tokens": 64},
            "worker": {"model": TEST_MODEL, "hot_blocks": 256, "warm_blocks": 256, "block_tokens": 16,
                       "torch_threads": 1, "watchdog_s": 1.0}}
    serve.run(build_app(args), name="prefix-cache", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


def test_loadtest_refuses_hosts_other_than_loopback():
    from lab.load.loadtest import check_url

    check_url("http://127.0.0.1:8000", False)
    with pytest.raises(SystemExit, match="--allow-remote-host"):
        check_url("http://192.0.2.7:8000", False)


def test_loadtest_refuses_a_connect_timeout_that_is_not_positive(capsys):
    from cluster.cli import main

    with pytest.raises(SystemExit, match="--connect-timeout must be a positive number of seconds, got 0.0"):
        main(["loadtest", "--url", "http://127.0.0.1:9", "--connect-timeout", "0"])


@contextlib.contextmanager
def _slow_engines(workers):
    """The 'slow' drill fault on these workers' engines while the block runs (off again on those still alive)."""
    import ray

    from actors.peer import PeerCallError, PeerClient
    from cluster.names import DIRECTORY_NAME

    directory = ray.get_actor(DIRECTORY_NAME, namespace=NAMESPACE)
    addresses = ray.get(directory.peer_addresses.remote(), timeout=30)
    peers = [PeerClient(w, addresses[w], secret=SECRET, timeout_s=30) for w in workers]
    for peer in peers:
        asyncio.run(peer.inject_fault("slow"))
    try:
        yield
    finally:
        for peer in peers:
            with contextlib.suppress(PeerCallError, OSError, asyncio.TimeoutError):   # the killed one is gone
                asyncio.run(peer.inject_fault("slow", False))


def test_a_replica_killed_under_load_loses_no_request_and_cuts_no_stream(app_url):
    """The kill lands on a replica running requests (the loadtest waits for one; the 'slow' drill fault makes
    each 64-token reply, the limit, take over 3 s, so they are still running when the kill lands after the
    load report it read); every one of the 48 completes, the ones the dead replica was serving resumed on
    the others."""
    from lab.load.faults import ClusterProbe
    from lab.load.loadtest import run_load

    probe = ClusterProbe(NAMESPACE)
    replicas = {a.actor_id: a.worker_id for a in probe.replicas()}
    assert len(replicas) == 3
    with _slow_engines(replicas.values()):
        report = asyncio.run(run_load(app_url, requests=48, concurrency=8, stream_fraction=0.5, max_tokens=64,
                                      prompt_tokens=96, kill="replica", kill_at=0.5, probe=probe, timeout=60,
                                      recovery_limit_s=90))
    print("loadtest report:", report)
    assert (report["completed"], report["failed_by_status"], report["lost"], report["cut_streams"]) == \
        (48, {}, 0, 0), report
    assert report["killed_worker"] in replicas.values(), report
    assert report["in_flight_at_kill"] >= 1, report      # it died with requests on it
    assert report["resumed"] >= 1, report                # and they went on elsewhere
    # Whole again: a new replica, and the directory's table lists it and no longer the dead one.
    assert report["recovery_s"] is not None, report
    after = {a.actor_id: a.worker_id for a in probe.replicas()}
    assert len(after) == 3 and [replicas[a] for a in set(replicas) - set(after)] == [report["killed_worker"]]
    live = probe.live_workers()
    assert report["killed_worker"] not in live and set(after.values()) <= set(live), (live, after)
    # Requests after the recovery are served by the new set of replicas.
    r = httpx.post(app_url + "/v1/completions", json={"model": "prefix-cache-byte", "prompt": [5] * 40,
                                                      "max_tokens": 4}, timeout=60)
    assert r.status_code == 200, r.text


def test_a_wedged_replica_fails_its_calls_and_is_replaced(app_url):
    import ray

    from actors.peer import PeerCallError, PeerClient
    from cluster.names import DIRECTORY_NAME
    from lab.load.faults import ClusterProbe

    probe = ClusterProbe(NAMESPACE)
    directory = ray.get_actor(DIRECTORY_NAME, namespace=NAMESPACE)
    addresses = ray.get(directory.peer_addresses.remote())
    victim = sorted(addresses)[0]
    peer = PeerClient(victim, addresses[victim], secret=SECRET, timeout_s=60)   # straight to it: no Serve
    asyncio.run(peer.inject_fault("wedge"))
    with pytest.raises(PeerCallError, match="watchdog bound 1 s") as failed:
        asyncio.run(peer.stats())   # queued behind the wedge: failed by the watchdog
    assert failed.value.kind == "wedged"
    deadline = time.monotonic() + 90
    while True:   # dropped by the directory, replaced by Serve (check_health raises)
        names = [a.name for a in probe.replicas()]
        live = ray.get(directory.live_workers.remote())
        if victim not in live and len(live) == 3 and not any(n.endswith(victim) for n in names):
            break
        assert time.monotonic() < deadline, (victim, live, names)
        time.sleep(0.2)


def test_a_hostile_tenant_gets_4xx_only_and_the_other_tenant_is_served(app_url):
    from lab.load.hostile import hostile_bodies
    from lab.load.loadtest import run_load

    report = asyncio.run(run_load(app_url, requests=24, concurrency=4, stream_fraction=0.5, max_tokens=8,
                                  prompt_tokens=96, timeout=60, hostile_concurrency=2, hostile_rate=0))
    assert (report["completed"], report["lost"], report["cut_streams"], report["failed_by_status"]) == (24, 0, 0, {})
    assert report["hostile_5xx_or_no_answer"] == 0 and report["hostile_requests"] >= len(hostile_bodies("m"))
    seen = report["hostile_by_kind"]
    assert set(seen) == {name for name, _ in hostile_bodies("m")}    # every kind was sent at least once
    for name in ("temperature_nan", "lone_surrogate", "nested_50k", "seed_2**70", "not_json", "stop_list_100"):
        assert set(seen[name]) <= {"400", "413", "422"}, (name, seen[name])
    assert set(report["hostile_by_status"]) <= {"400", "413", "415", "422"}
