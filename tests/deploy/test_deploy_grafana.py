"""deploy/grafana and deploy/prometheus: the dashboard and the alert rules query metrics that
really exist; the alert rules pass promtool's own checks and unit tests.

Router metric names come from the router itself (a :class:`RouterMetrics` on a fresh registry, with
the sample suffixes Prometheus exposes: ``_total``, ``_bucket``, ...). Our connector's
``disagg_push_*`` names are read from disagg_router/connector/stats.py (building its metrics needs a
running vLLM engine's config). vLLM metric names are looked up in the installed vLLM's source (found
without importing vLLM, which takes seconds).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from disagg_router.router.observability.metrics import RouterMetrics
from tests.deploy.deploy_support import DASHBOARD, DEPLOY, REPO, require_tool

ALERTS = DEPLOY / "prometheus" / "alerts.yaml"

# PromQL pieces that are not metric names: label matchers, ranges, `by (...)` groupings and
# `on (...)` matchings.
_NOT_NAMES = re.compile(r"\{[^}]*\}|\[[^\]]*\]|\b(?:by|without|on|ignoring)\s*\([^)]*\)")
# An identifier not followed by "(" (that would be a function call).
_IDENT = re.compile(r"(?<![\w:.])([a-zA-Z_:][\w:]*)\b(?!\s*\()")
_PROMQL_WORDS = {"by", "without", "and", "or", "unless", "on", "ignoring", "offset"}
_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
_SAMPLE_SUFFIX = re.compile(r"_(total|bucket|sum|count)$")


def _dashboard() -> dict[str, Any]:
    data = json.loads(DASHBOARD.read_text())
    assert isinstance(data, dict)
    return data


def _exprs() -> list[str]:
    return [t["expr"] for p in _dashboard()["panels"] for t in p.get("targets", [])]


def _metric_names(expr: str) -> set[str]:
    return {m for m in _IDENT.findall(_NOT_NAMES.sub(" ", expr)) if m not in _PROMQL_WORDS}


def _alert_exprs() -> list[str]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


def _router_sample_names() -> set[str]:
    """Every sample name the router's /metrics can expose."""
    registry = CollectorRegistry()
    RouterMetrics(registry)
    return {f.name + s for f in registry.collect() for s in _SUFFIXES[f.type]}


def _connector_family_names() -> set[str]:
    """The ``disagg_push_*`` metric names our connector defines (string literals of stats.py)."""
    tree = ast.parse((REPO / "disagg_router" / "connector" / "stats.py").read_text())
    literals = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)}
    return {s for s in literals if isinstance(s, str) and s.startswith("disagg_push_")}


def _vllm_source_names() -> set[str]:
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed (pip install -e '.[cpu]')")
    names: set[str] = set()
    for path in Path(spec.origin).parent.rglob("*.py"):
        names.update(re.findall(r"[\"'](vllm:[a-z_]+)[\"']", path.read_text(errors="replace")))
    return names


def test_dashboard_is_a_grafana_dashboard() -> None:
    dash = _dashboard()
    assert dash["uid"] and dash["title"]
    panels = dash["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        if panel["type"] != "row":
            assert panel["targets"], f"panel {panel['title']!r} has no query"
            assert panel["datasource"]["uid"] == "${datasource}"
    assert dash["templating"]["list"][0]["name"] == "datasource"


def test_parser_finds_metric_names() -> None:
    """Control for the checks below: names are extracted, functions and labels are not."""
    expr = 'histogram_quantile(0.95, sum by (le, backend) (rate(a_b_bucket{outcome!="ok"}[5m])))'
    assert _metric_names(expr) == {"a_b_bucket"}
    assert _metric_names("sum by (role) (x:y)") == {"x:y"}


def test_router_metrics_exist_in_the_router() -> None:
    exported = _router_sample_names()
    used = {
        n
        for e in _exprs()
        for n in _metric_names(e)
        if n.startswith(("disagg_router_", "process_"))
    }
    assert used, "the dashboard shows router metrics"
    assert used <= exported, (
        f"not exported by disagg_router/router/observability/metrics.py: {sorted(used - exported)}"
    )
    # Every router metric family is on the dashboard.
    exported = {n for n in exported if n.startswith("disagg_router_")}
    families = {n.removesuffix(s) for n in exported for s in ("_total", "_bucket") if n.endswith(s)}
    families |= {n for n in exported if not n.endswith(("_sum", "_count", "_total", "_bucket"))}
    shown = {n.removesuffix("_total").removesuffix("_bucket").removesuffix("_count") for n in used}
    assert families <= shown, f"router metrics missing from the dashboard: {families - shown}"


def test_vllm_metrics_exist_in_vllm() -> None:
    known = _vllm_source_names()
    used = {n for e in _exprs() for n in _metric_names(e) if n.startswith("vllm:")}
    assert {"vllm:time_to_first_token_seconds_bucket", "vllm:num_requests_running"} <= used
    base = {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in used}
    assert base <= known, f"not defined in vLLM: {sorted(base - known)}"


def test_connector_metrics_exist_in_the_connector() -> None:
    defined = _connector_family_names()
    assert {"disagg_push_transfers_total", "disagg_push_write_seconds"} <= defined
    used = {n for e in _exprs() for n in _metric_names(e) if n.startswith("disagg_push_")}
    # Counters are defined with their _total; histograms are queried by their _bucket.
    families = {n if n.endswith("_total") else _SAMPLE_SUFFIX.sub("", n) for n in used}
    assert families <= defined, (
        f"not defined in disagg_router/connector/stats.py: {sorted(families - defined)}"
    )
    assert defined <= families, f"missing from the dashboard: {defined - families}"


def test_every_query_names_a_known_prefix() -> None:
    for expr in _exprs() + _alert_exprs():
        names = _metric_names(expr)
        assert names, f"no metric in {expr!r}"
        known = ("disagg_router_", "disagg_push_", "vllm:", "process_")
        assert all(n.startswith(known) for n in names), expr


def test_alert_rules_query_metrics_that_exist() -> None:
    used = {n for e in _alert_exprs() for n in _metric_names(e)}
    router = {n for n in used if n.startswith("disagg_router_")}
    assert router and router <= _router_sample_names(), sorted(router - _router_sample_names())
    ours = {n if n.endswith("_total") else _SAMPLE_SUFFIX.sub("", n) for n in used} - router
    assert ours and ours <= _connector_family_names(), sorted(ours - _connector_family_names())


def test_alert_rules_pass_promtool_check_and_unit_tests() -> None:
    promtool = require_tool("promtool")
    for args in (["check", "rules", ALERTS.name], ["test", "rules", "alerts.test.yaml"]):
        done = subprocess.run(
            [promtool, *args], cwd=ALERTS.parent, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stdout + done.stderr
