"""The Grafana dashboard (k8s/base/grafana-dashboard.json) against the metrics
serve_app/metrics.py defines, under the series names Ray exports, and the
ConfigMap that ships it; broken copies must be rejected with a message that
names the problem."""

from __future__ import annotations

import json
from typing import Callable

import pytest

from tests.k8s import dashboards as dv
from tests.k8s import validation as v
from tests.k8s.builds import by_kind

DASHBOARD_FILE = v.K8S / "base" / "grafana-dashboard.json"
METRICS_SOURCE = (v.REPO / "serve_app" / "metrics.py").read_text()


# Every metric family the dashboard plots. The last five are the reliability counters (issue 11);
# the dashboard test fails, naming them, while serve_app/metrics.py does not define them.
DASHBOARD_METRICS = {
    "prefix_cache_ttft_seconds": "Histogram",
    "prefix_cache_inter_token_seconds": "Histogram",
    "prefix_cache_requests_total": "Counter",
    "prefix_cache_cached_tokens_total": "Counter",
    "prefix_cache_prompt_tokens_total": "Counter",
    "prefix_cache_migrations_total": "Counter",
    "prefix_cache_migrated_bytes_total": "Counter",
    "prefix_cache_tier_moves_total": "Counter",
    "prefix_cache_tier_used_tokens": "Gauge",
    "prefix_cache_router_decisions_total": "Counter",
    "prefix_cache_responses_5xx_total": "Counter",
    "prefix_cache_cut_streams_total": "Counter",
    "prefix_cache_resumed_requests_total": "Counter",
    "prefix_cache_watchdog_trips_total": "Counter",
    "prefix_cache_migration_timeouts_total": "Counter",
    "prefix_cache_preemptions_total": "Counter",
    "prefix_cache_preempted_tokens_total": "Counter",
    "prefix_cache_swap_in_bytes_total": "Counter",
}


def dashboard() -> dict:
    return json.loads(DASHBOARD_FILE.read_text())


def test_dashboard_plots_only_metrics_the_app_exports():
    """Every series the dashboard queries is one Ray exports for a metric serve_app/metrics.py
    defines (read from its source: the names given to Counter, Gauge, Histogram)."""
    defined = dv.defined_metrics(METRICS_SOURCE)
    missing = sorted(set(DASHBOARD_METRICS) - set(defined))
    assert missing == [], f"serve_app/metrics.py does not define {missing}"
    assert dv.dashboard_errors(dashboard(), defined) == []


def test_dashboard_plots_these_metrics():
    """TTFT, cached tokens by tier, migrations and bytes, errors and status, tier usage and the
    reliability counters: each family plotted, under the series name Ray exports."""
    series, errors = dv.dashboard_series(dashboard())
    assert errors == []
    assert {dv.exported_series(DASHBOARD_METRICS)[s] for s in series} == set(DASHBOARD_METRICS)
    assert series == set(dv.exported_series(DASHBOARD_METRICS)) - {
        "ray_prefix_cache_inter_token_seconds_sum", "ray_prefix_cache_inter_token_seconds_count"}
    exprs = [e for _, e in dv.dashboard_queries(dashboard())]
    for q in ("0.5", "0.9", "0.99"):
        assert (f'histogram_quantile({q}, sum by (le) (rate(ray_prefix_cache_ttft_seconds_bucket'
                f'{{ray_io_cluster=~"$cluster"}}[$__rate_interval])))') in exprs
    assert ('sum by (tier) (rate(ray_prefix_cache_cached_tokens_total{ray_io_cluster=~"$cluster"}'
            '[$__rate_interval]))') in exprs
    assert ('sum by (endpoint) (rate(ray_prefix_cache_responses_5xx_total{ray_io_cluster=~"$cluster"}'
            '[$__rate_interval]))') in exprs
    assert ('sum by (worker) (increase(ray_prefix_cache_watchdog_trips_total{ray_io_cluster=~"$cluster"}'
            '[$__rate_interval]))') in exprs


def test_dashboard_configmap():
    configmap = by_kind()["ConfigMap"]
    assert configmap["metadata"]["name"] == "prefix-cache-grafana-dashboard"
    assert dv.dashboard_configmap_errors(configmap, DASHBOARD_FILE.read_text()) == []


def test_defined_metrics_parser():
    source = """
from ray.util import metrics
from ray.util.metrics import Counter, Gauge, Histogram
a = Counter("a_total", "doc", tag_keys=("x",))
b = metrics.Histogram(name="b_seconds", boundaries=[1.0])
c = Gauge("c_tokens")
d = Counter("d_bytes")
e = Counter(NAME)          # not a literal: not read
f = dict("not_a_metric")
"""
    defined = dv.defined_metrics(source)
    assert defined == {"a_total": "Counter", "b_seconds": "Histogram", "c_tokens": "Gauge", "d_bytes": "Counter"}
    assert dv.exported_series(defined) == {
        "ray_a_total": "a_total", "ray_b_seconds_bucket": "b_seconds", "ray_b_seconds_sum": "b_seconds",
        "ray_b_seconds_count": "b_seconds", "ray_c_tokens": "c_tokens", "ray_d_bytes_total": "d_bytes"}


def _first_target(d: dict) -> dict:
    return next(p for p in d["panels"] if p.get("targets"))["targets"][0]


def _replace_expr(old: str, new: str) -> Callable[[dict], None]:
    def mutate(d: dict) -> None:
        hits = 0
        for panel in d["panels"]:
            for target in panel.get("targets") or []:
                if old in target["expr"]:
                    target["expr"] = target["expr"].replace(old, new)
                    hits += 1
        assert hits, old
    return mutate


@pytest.mark.parametrize("mutate,message", [
    (_replace_expr("ray_prefix_cache_migrations_total{", "ray_prefix_cache_migration_total{"),
     "ray_prefix_cache_migration_total is not a series the app exports"),
    (_replace_expr("ray_prefix_cache_ttft_seconds_bucket{", "ray_prefix_cache_ttft_seconds{"),
     "ray_prefix_cache_ttft_seconds is not a series the app exports (a histogram: query "
     "ray_prefix_cache_ttft_seconds_bucket, _sum or _count)"),
    (_replace_expr("ray_prefix_cache_tier_used_tokens{", "prefix_cache_tier_used_tokens{"),
     "prefix_cache_tier_used_tokens is not a series the app exports (Ray exports every metric with the ray_ prefix)"),
    (_replace_expr("ray_prefix_cache_cut_streams_total{", "ray_prefix_cache_cut_streams_total_total{"),
     "ray_prefix_cache_cut_streams_total_total is not a series the app exports"),
    (_replace_expr('ray_prefix_cache_resumed_requests_total{ray_io_cluster=~"$cluster"}',
                   "ray_prefix_cache_resumed_requests_total"),
     "a prefix_cache metric not written as a selector"),
    (lambda d: _first_target(d).update(expr=""), "empty query"),
    (lambda d: d["panels"][2].update(id=d["panels"][1]["id"]), "panel ids must be unique"),
    (lambda d: next(p for p in d["panels"] if p.get("targets")).update(datasource={"type": "loki", "uid": "x"}),
     "datasource must be the $datasource Prometheus variable"),
], ids=["misspelled", "histogram-without-bucket", "no-ray-prefix", "double-total", "bare-name", "empty",
        "duplicate-id", "datasource"])
def test_broken_dashboard_rejected(mutate, message):
    d = dashboard()
    mutate(d)
    errors = dv.dashboard_errors(d, DASHBOARD_METRICS)
    assert any(message in e for e in errors), errors


def test_dashboard_missing_metric_named():
    """A metric the dashboard plots that metrics.py does not define is named (as the reliability
    counters were before serve_app/metrics.py had them)."""
    defined = dict(DASHBOARD_METRICS)
    del defined["prefix_cache_watchdog_trips_total"]
    assert dv.dashboard_errors(dashboard(), defined) == [
        "ray_prefix_cache_watchdog_trips_total is not a series the app exports"]


@pytest.mark.parametrize("mutate,message", [
    (lambda c: c["metadata"]["labels"].pop("grafana_dashboard"), "lacks the label grafana_dashboard"),
    (lambda c: c["data"].update({"prefix-cache.json": "{}"}), "does not hold k8s/base/grafana-dashboard.json"),
    (lambda c: c["data"].update({"other.json": "{}"}), "must hold prefix-cache.json only"),
], ids=["no-label", "stale", "extra-key"])
def test_broken_dashboard_configmap_rejected(mutate, message):
    configmap = by_kind()["ConfigMap"]
    mutate(configmap)
    assert any(message in e for e in dv.dashboard_configmap_errors(configmap, DASHBOARD_FILE.read_text()))
