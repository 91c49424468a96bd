"""The Helm chart (infra/helm/rlens): `helm template` renders the default values and the two sets in ci/, every
rendered Kubernetes object validates against the Kubernetes schemas (kubernetes-validate, strict), the rendered
rlens.toml passes `rlens config check`, the values schema refuses a wrong value, and the PrometheusRule carries the
alert rules of infra/prometheus/rlens-alerts.yaml."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from rlens.cli import app

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "infra" / "helm" / "rlens"
KUBERNETES = "1.31.0"  # the cluster version the chart is rendered and validated for
HELM = shutil.which("helm") or next(
    (str(p) for p in [Path(os.environ.get("GOPATH", Path.home() / "go")) / "bin" / "helm"] if p.is_file()), None
)
pytestmark = pytest.mark.skipif(
    HELM is None, reason="helm is not installed: go install helm.sh/helm/v3/cmd/helm@v3.22.0 (.ci/run does)"
)
OPERATOR_KINDS = {"ServiceMonitor", "PrometheusRule"}  # the Prometheus Operator's CRDs: not in Kubernetes' schemas


def template(*args: str) -> subprocess.CompletedProcess:
    """``helm template`` of the chart with ``args``."""
    command = [str(HELM), "template", "t", str(CHART), "--kube-version", KUBERNETES, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def render(*args: str) -> list[dict]:
    result = template(*args)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def kinds(objects: list[dict]) -> Counter:
    return Counter(o["kind"] for o in objects)


@pytest.mark.parametrize("values", [None, "minimal-values.yaml", "production-values.yaml"])
def test_the_chart_renders_objects_the_kubernetes_schemas_accept(values, tmp_path, monkeypatch):
    import kubernetes_validate

    objects = render(*(["-f", str(CHART / "ci" / values)] if values else []))
    for obj in objects:
        if obj["kind"] in OPERATOR_KINDS:
            assert obj["apiVersion"] == "monitoring.coreos.com/v1" and obj["spec"], obj
            continue
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)
    (config,) = [o for o in objects if o["kind"] == "ConfigMap"]
    path = tmp_path / "rlens.toml"
    path.write_text(config["data"]["rlens.toml"])
    monkeypatch.setenv("RLENS_CONFIG", "")
    checked = CliRunner().invoke(app, ["config", "check", str(path)])
    assert checked.exit_code == 0 and "a pool of 3 models" in checked.output, checked.output
    found = kinds(objects)
    assert found["StatefulSet"] == 2 and found["Deployment"] == 1  # learner and gateway; workers
    if values == "minimal-values.yaml":
        assert not {"HorizontalPodAutoscaler", "PodDisruptionBudget", "NetworkPolicy"} & set(found)
        (workers,) = [o for o in objects if o["kind"] == "Deployment"]
        assert workers["spec"]["replicas"] == 2
    else:
        assert found["HorizontalPodAutoscaler"] == 1 and found["PodDisruptionBudget"] == 2
        assert found["NetworkPolicy"] == 2
    if values == "production-values.yaml":
        assert found["ServiceMonitor"] == 1 and found["PrometheusRule"] == 1
        (rule,) = [o for o in objects if o["kind"] == "PrometheusRule"]
        alerts = yaml.safe_load((ROOT / "infra" / "prometheus" / "rlens-alerts.yaml").read_text())
        assert rule["spec"]["groups"] == alerts["groups"]


def test_every_process_reads_its_role_secret_and_the_configuration():
    objects = render()
    workloads = {
        o["metadata"]["name"].removeprefix("t-rlens-"): o for o in objects if o["kind"] in ("Deployment", "StatefulSet")
    }
    assert set(workloads) == {"worker", "learner", "gateway"}
    for role, obj in workloads.items():
        (container,) = obj["spec"]["template"]["spec"]["containers"]
        assert container["args"] == [role]
        secrets = [s["secretRef"]["name"] for s in container["envFrom"]]
        assert f"rlens-{role}-secrets" in secrets and not [s for s in secrets if "secrets" in s and role not in s]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["RLENS_CONFIG"] == "/etc/rlens/rlens.toml"
        assert {"livenessProbe", "readinessProbe"} <= set(container)
    learner = workloads["learner"]["spec"]
    assert learner["replicas"] == 1 and learner["volumeClaimTemplates"][0]["metadata"]["name"] == "checkpoints"


def test_the_values_schema_refuses_a_wrong_value():
    result = template("--set", "worker.replicas=0")
    assert result.returncode != 0 and "/worker/replicas" in result.stderr, result.stderr
    result = template("--set", "config.kafak.bootstrap=x")
    assert result.returncode != 0 and "kafak" in result.stderr, result.stderr


def test_the_charts_alert_rules_are_the_infra_ones():
    assert (CHART / "files" / "rlens-alerts.yaml").read_text() == (
        ROOT / "infra" / "prometheus" / "rlens-alerts.yaml"
    ).read_text()
