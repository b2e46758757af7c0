"""Offline checks of the Grafana dashboard and its ConfigMap against the metrics
the app defines: every series the dashboard queries must be one Ray exports
(``ray_`` prefix, ``_total`` on counters, ``_bucket``/``_sum``/``_count`` on
histograms) for a metric that serve_app/metrics.py creates. Each check returns
a list of problems, like ``tests.k8s.validation``.
"""

from __future__ import annotations

import ast
import re

METRIC_CLASSES = ("Counter", "Gauge", "Histogram")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
RAY_PREFIX = "ray_"
# a metric selector: a name right before its label matchers (``name{...}``)
_SELECTOR = re.compile(r"(?<![\w:])([a-zA-Z_:][\w:]*)\{[^{}]*\}")
_LABEL_VALUES = re.compile(r"label_values\(\s*([a-zA-Z_:][\w:]*)\s*,")


def defined_metrics(source: str) -> dict[str, str]:
    """name -> class of every ``ray.util.metrics`` Counter/Gauge/Histogram the module creates
    (the first argument or ``name=``, a string literal)."""
    found: dict[str, str] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        cls = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if cls not in METRIC_CLASSES:
            continue
        name = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "name"), None)
        if isinstance(name, ast.Constant) and isinstance(name.value, str):
            found[name.value] = cls
    return found


def exported_series(metrics: dict[str, str]) -> dict[str, str]:
    """Prometheus series name -> the metric it belongs to, as Ray exports them: ``ray_`` prefix;
    counters end in ``_total`` (added when the name lacks it); histograms as
    ``_bucket``/``_sum``/``_count``. (Ray also exports a counter without ``_total`` as a
    deprecated gauge of the bare name; a dashboard must not use that.)"""
    out: dict[str, str] = {}
    for name, cls in metrics.items():
        if cls == "Histogram":
            for suffix in HISTOGRAM_SUFFIXES:
                out[f"{RAY_PREFIX}{name}{suffix}"] = name
        elif cls == "Counter":
            out[f"{RAY_PREFIX}{name}" + ("" if name.endswith("_total") else "_total")] = name
        else:
            out[f"{RAY_PREFIX}{name}"] = name
    return out


def dashboard_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target (rows' nested panels too) and query variable."""
    out = []

    def panels(items, where):
        for panel in items or []:
            here = f"{where}panel {panel.get('id')} {panel.get('title')!r}"
            for target in panel.get("targets") or []:
                out.append((f"{here} target {target.get('refId')}", target.get("expr", "")))
            panels(panel.get("panels"), f"{here} > ")
    panels(dashboard.get("panels"), "")
    for var in (dashboard.get("templating") or {}).get("list") or []:
        if var.get("type") == "query":
            query = var.get("query")
            out.append((f"variable {var.get('name')}", query.get("query", "") if isinstance(query, dict) else query))
    return out


def dashboard_series(dashboard: dict) -> tuple[set[str], list[str]]:
    """(series names the dashboard queries, problems): every metric must be written as a
    selector ``name{...}`` (or be the metric of ``label_values(name, label)``), so that none
    is missed; a query naming a prefix_cache metric any other way is a problem."""
    series: set[str] = set()
    errors: list[str] = []
    for where, expr in dashboard_queries(dashboard):
        if not expr:
            errors.append(f"{where}: empty query")
            continue
        names = _SELECTOR.findall(expr) + _LABEL_VALUES.findall(expr)
        series.update(names)
        rest = _LABEL_VALUES.sub("", _SELECTOR.sub("", expr))
        if "prefix_cache" in rest:
            errors.append(f"{where}: a prefix_cache metric not written as a selector name{{...}}: {expr}")
    return series, errors


def dashboard_errors(dashboard: dict, metrics: dict[str, str]) -> list[str]:
    """What would make the dashboard show nothing, or break in Grafana: a series Ray does not
    export from ``metrics`` (name -> class), a histogram quantile without ``_bucket``, panels
    without a Prometheus data source or with clashing ids."""
    errors: list[str] = []
    exported = exported_series(metrics)
    series, errors = dashboard_series(dashboard)
    for name in sorted(series - set(exported)):
        base = name.removeprefix(RAY_PREFIX)
        hint = ""
        if not name.startswith(RAY_PREFIX):
            hint = " (Ray exports every metric with the ray_ prefix)"
        elif metrics.get(base) == "Histogram":
            hint = f" (a histogram: query {name}_bucket, _sum or _count)"
        errors.append(f"{name} is not a series the app exports{hint}")
    for where, expr in dashboard_queries(dashboard):
        for match in re.finditer(r"histogram_quantile\([^,]+,(.*)", expr):
            if "_bucket{" not in match[1]:
                errors.append(f"{where}: histogram_quantile over something other than a _bucket series")
    if not dashboard.get("uid") or not dashboard.get("title"):
        errors.append("the dashboard needs a uid and a title")
    ids: list = []

    def walk(items):
        for panel in items or []:
            ids.append(panel.get("id"))
            if panel.get("targets"):
                source = panel.get("datasource") or {}
                if source.get("type") != "prometheus" or source.get("uid") != "${datasource}":
                    errors.append(f"panel {panel.get('id')} {panel.get('title')!r}: datasource must be the "
                                  f"$datasource Prometheus variable, got {source}")
            walk(panel.get("panels"))
    walk(dashboard.get("panels"))
    if len(ids) != len(set(ids)) or None in ids:
        errors.append(f"panel ids must be unique: {ids}")
    if "datasource" not in [v.get("name") for v in (dashboard.get("templating") or {}).get("list") or []]:
        errors.append("no datasource template variable")
    return errors


def dashboard_configmap_errors(configmap: dict, dashboard_text: str) -> list[str]:
    """The ConfigMap Grafana's sidecar loads: labelled grafana_dashboard=1, holding the file."""
    errors = []
    labels = (configmap.get("metadata") or {}).get("labels") or {}
    if labels.get("grafana_dashboard") != "1":
        errors.append(f"the dashboard ConfigMap lacks the label grafana_dashboard=\"1\" (has {labels})")
    data = configmap.get("data") or {}
    if list(data) != ["prefix-cache.json"]:
        errors.append(f"the dashboard ConfigMap must hold prefix-cache.json only, holds {sorted(data)}")
    elif data["prefix-cache.json"] != dashboard_text:
        errors.append("the dashboard ConfigMap does not hold k8s/base/grafana-dashboard.json as it is")
    return errors
