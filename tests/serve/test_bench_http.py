"""``bench http`` against the app and the bare echo app on the loopback cluster:
its rows, and what they rest on (decisions made on the router's table copy,
a breakdown that adds up to each request's time to first token).

No duration is asserted: that is what the command measures. What is asserted
is arithmetic and provenance: where each decision was made, and that every
request's parts add up to its own TTFT."""

from argparse import Namespace

import pytest

from serve_app.timing import TTFT_PARTS

pytestmark = pytest.mark.distributed

NAMESPACE = "prefix-cache-bench-http"
MODEL = "prefix-cache-byte"


@pytest.fixture(scope="module")
def app_url(ray_loopback_cluster):
    from ray import serve

    from actors.pytest_plugin import TEST_MODEL
    from lab.load.echo_app import APP_NAME, ROUTE_PREFIX, build_echo_app
    from serve_app.app import build_app
    from serve_app.local import free_port

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {"num_replicas": 2, "namespace": NAMESPACE,
            "worker": {"model": TEST_MODEL, "hot_blocks": 256, "warm_blocks": 256, "block_tokens": 16}}
    serve.run(build_app(args), name="prefix-cache", route_prefix="/")
    serve.run(build_echo_app(2), name=APP_NAME, route_prefix=ROUTE_PREFIX)
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


def test_bench_http_rows_breakdown_and_local_decisions(app_url):
    import ray

    from lab.bench.http import Arms, measure, rows

    prompt = [100 + i % 150 for i in range(256)]   # byte-level vocabulary: ids below 256
    arms = Arms(app_url, MODEL, prompt, suffix_tokens=16, vocab=256, seed=3)
    try:
        m = measure(arms, requests=5, warmup=2)
    finally:
        arms.close()
    directory = ray.get_actor("prefix-cache-directory", namespace=NAMESPACE)
    args = Namespace(replicas=2, model_id=MODEL, prompt_tokens=256, suffix_tokens=16)
    echo, ours, summary = rows(m, args, ray.get(directory.get_stats.remote(), timeout=30))
    assert (echo["impl"], ours["impl"], summary["impl"]) == ("ray-serve-echo", "prefix-cache", "summary")
    assert echo["requests"] == ours["requests"] == 5
    assert ours["cached_tokens_p50"] == 240            # the whole prefix, every time
    # After the warm-up every decision was made on the router's copy of the table.
    assert ours["routed_locally"] == 1.0 and m["routed_by"] == ["router_view"] * 10
    for timing, pulled in zip(m["timings"] + m["ttft_timings"], m["pulled"], strict=True):
        assert all(timing[p] >= 0 for p in TTFT_PARTS)
        assert sum(timing[p] for p in TTFT_PARTS) == pytest.approx(timing["ttft"], abs=0.01)
        assert timing["ttft"] + timing["respond"] == pytest.approx(timing["total"], abs=0.01)
        # No pull, no time in it. (On a loaded machine the router may send a request to the idle
        # replica, which pulls the prefix from its holder: then the part is that pull's time.)
        assert (timing["migrate"] > 0) == pulled
    for field in ("latency_ms_p50", "latency_ms_p99", "path_ms_p50", "ttft_ms_cached_p50", "suffix_forward_ms_p50",
                  "route_ms_p99", "decision_us_p99"):
        assert isinstance(ours[field], float), field   # measured, not left out (speed is the command's to report)
    assert ours["ttft_goal_ms"] == pytest.approx(ours["latency_ms_p50"] + 2 * ours["suffix_forward_ms_p50"])
    assert summary["latency_p50_ratio_vs_echo"] == pytest.approx(ours["latency_ms_p50"] / echo["latency_ms_p50"],
                                                                 abs=1e-3)
