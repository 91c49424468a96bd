"""The monitoring recipes in infra/ use only metrics the service exports, and are well formed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry

from rlens.service.common.metrics import GatewayMetrics, LearnerMetrics, StreamLabels, WorkerMetrics

INFRA = Path(__file__).parent.parent / "infra"
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"), "gauge": ("",)}


def exported() -> set[str]:
    """Every sample name a worker's, learner's or gateway's /metrics can hold."""
    registry = CollectorRegistry()
    WorkerMetrics(registry, StreamLabels(1))
    LearnerMetrics(registry, StreamLabels(1))
    GatewayMetrics(registry)
    return {family.name + suffix for family in registry.collect() for suffix in SUFFIXES[family.type]}


def metrics_in(expression: str) -> set[str]:
    return set(re.findall(r"\brlens_[a-z0-9_]+", expression))


def test_every_alert_rule_uses_exported_metrics():
    rules = yaml.safe_load((INFRA / "prometheus" / "rlens-alerts.yaml").read_text())["groups"][0]["rules"]
    names = exported()
    assert len(rules) >= 8 and all({"alert", "expr", "annotations"} <= set(rule) for rule in rules)
    for rule in rules:
        used = metrics_in(rule["expr"])
        assert used and used <= names, (rule["alert"], used - names)


def test_every_dashboard_panel_uses_exported_metrics():
    dashboard = json.loads((INFRA / "grafana" / "rlens-dashboard.json").read_text())
    names = exported()
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    assert len(dashboard["panels"]) >= 10 and len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for expression in expressions:
        used = metrics_in(expression)
        assert used and used <= names, (expression, used - names)


def test_the_check_catches_a_metric_the_service_does_not_export():
    assert metrics_in("rate(rlens_worker_answer_total[5m])") - exported() == {"rlens_worker_answer_total"}
