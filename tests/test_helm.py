"""The Helm chart (infra/helm/rlens): `helm template` renders the default values and the two sets in ci/, every
rendered Kubernetes object validates against the Kubernetes schemas (kubernetes-validate, strict) and every custom
resource against its operator's own CRD schema (the Prometheus Operator's and KEDA's, from their Go modules; unknown
fields refused), every pod meets Pod Security "restricted", every process is scraped exactly once on the port that
serves its /metrics, no more workers than partitions, the rendered rlens.toml passes `rlens config check`, the values
schema refuses a wrong value, the production render passes kube-score's checks, and the PrometheusRule carries the
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
# the operators' CRDs (not in Kubernetes' schemas), from their Go modules: .ci/run downloads them (`go mod download`)
GOMODCACHE = Path(
    subprocess.run(["go", "env", "GOMODCACHE"], capture_output=True, text=True).stdout.strip()
    if shutil.which("go")
    else Path.home() / "go" / "pkg" / "mod"
)
CRD_FILES = {
    "github.com/prometheus-operator/prometheus-operator@v0.85.0/example/prometheus-operator-crd": (
        "monitoring.coreos.com_podmonitors.yaml",
        "monitoring.coreos.com_prometheusrules.yaml",
    ),
    "github.com/kedacore/keda/v2@v2.21.0/config/crd/bases": ("keda.sh_scaledobjects.yaml",),
}
CRD_KINDS = {"PodMonitor", "PrometheusRule", "ScaledObject"}


class CrdLoader(yaml.SafeLoader):
    """YAML 1.1 reads a lone ``=`` (an enum value in the operators' schemas) as its "value" tag: a string here."""


CrdLoader.add_constructor("tag:yaml.org,2002:value", lambda loader, node: loader.construct_scalar(node))


def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> the openAPIV3Schema of every CRD version the modules define."""
    schemas = {}
    for folder, files in CRD_FILES.items():
        directory = GOMODCACHE / folder
        if not directory.is_dir():
            module = folder.split("/config/")[0].split("/example/")[0]
            pytest.skip(f"{module} is not downloaded: go mod download {module} (.ci/run does)")
        for name in files:
            for crd in yaml.load_all((directory / name).read_text(), Loader=CrdLoader):
                if crd and crd.get("kind") == "CustomResourceDefinition":
                    for version in crd["spec"]["versions"]:
                        api = f"{crd['spec']['group']}/{version['name']}"
                        schemas[(api, crd["spec"]["names"]["kind"])] = version["schema"]["openAPIV3Schema"]
    return schemas


def strict(schema: dict) -> dict:
    """An OpenAPI schema that refuses unknown fields, as the API server's strict field validation does (where the
    schema does not keep unknown fields itself)."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema:
            if not schema.get("x-kubernetes-preserve-unknown-fields"):
                schema["additionalProperties"] = False
    elif isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


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

    import jsonschema

    objects = render(*(["-f", str(CHART / "ci" / values)] if values else []))
    schemas = crd_schemas()
    for obj in objects:
        if obj["kind"] in CRD_KINDS:
            # not jsonschema.validate: the schemas hold Go regular expressions, which Python's metaschema refuses
            jsonschema.Draft7Validator(strict(schemas[(obj["apiVersion"], obj["kind"])])).validate(obj)
            continue
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)
    (config,) = [o for o in objects if o["kind"] == "ConfigMap"]
    path = tmp_path / "rlens.toml"
    path.write_text(config["data"]["rlens.toml"])
    monkeypatch.setenv("RLENS_CONFIG", "")
    checked = CliRunner().invoke(app, ["config", "check", str(path)])
    assert checked.exit_code == 0 and "a pool of 3 models" in checked.output, checked.output
    found = kinds(objects)
    # the learner (and in production, its shards) and the gateway; the workers
    assert found["StatefulSet"] == (3 if values == "production-values.yaml" else 2) and found["Deployment"] == 1
    if values == "minimal-values.yaml":
        assert not {"HorizontalPodAutoscaler", "PodDisruptionBudget", "NetworkPolicy"} & set(found)
        (workers,) = [o for o in objects if o["kind"] == "Deployment"]
        assert workers["spec"]["replicas"] == 2
    else:
        shards = values == "production-values.yaml"  # their own disruption budget
        assert found["HorizontalPodAutoscaler"] + found["ScaledObject"] == 1
        assert found["PodDisruptionBudget"] == 2 + shards
        assert found["NetworkPolicy"] == (3 if values == "production-values.yaml" else 2)
    if values == "production-values.yaml":
        assert found["PodMonitor"] == 1 and found["PrometheusRule"] == 1
        assert found["ScaledObject"] == 1 and found["Ingress"] == 1 and "HorizontalPodAutoscaler" not in found
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


def pod_templates(objects: list[dict]) -> dict[str, dict]:
    return {
        o["metadata"]["name"].removeprefix("t-rlens-"): o["spec"]["template"]
        for o in objects
        if o["kind"] in ("Deployment", "StatefulSet")
    }


RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


@pytest.mark.parametrize("values", [None, "minimal-values.yaml", "production-values.yaml"])
def test_every_pod_meets_pod_security_restricted_with_a_read_only_root_and_no_api_token(values):
    """The "restricted" profile's rules (kubernetes.io/docs/concepts/security/pod-security-standards), each checked;
    and beyond it: a read-only root, only /tmp (an emptyDir) and the learner's checkpoints writable, no API token, a
    startupProbe."""
    for role, template in pod_templates(render(*(["-f", str(CHART / "ci" / values)] if values else []))).items():
        pod = template["spec"]
        context = pod.get("securityContext", {})
        assert pod["automountServiceAccountToken"] is False, role
        assert not {"hostNetwork", "hostPID", "hostIPC"} & {k for k, v in pod.items() if v}, role
        assert {next(iter(set(v) - {"name"})) for v in pod["volumes"]} <= RESTRICTED_VOLUMES, role
        for container in pod["containers"]:
            own = container["securityContext"]
            assert own["allowPrivilegeEscalation"] is False and not own.get("privileged"), role
            assert own["capabilities"]["drop"] == ["ALL"] and not own["capabilities"].get("add"), role
            assert (own.get("runAsNonRoot") or context.get("runAsNonRoot")) is True, role
            assert own.get("runAsUser", context.get("runAsUser")) not in (0, None), role
            seccomp = own.get("seccompProfile", context.get("seccompProfile", {}))
            assert seccomp.get("type") in ("RuntimeDefault", "Localhost"), role
            assert not [p for p in container.get("ports", []) if p.get("hostPort")], role
            assert own["readOnlyRootFilesystem"] is True, role
            writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
            learner = role in ("learner", "learner-shard")
            assert writable == ({"/tmp", "/var/lib/rlens"} if learner else {"/tmp"}), (role, writable)
            assert container["startupProbe"]["httpGet"]["path"] == "/healthz", role


def test_the_pod_monitor_scrapes_every_process_once_on_the_port_serving_its_metrics():
    """As the Prometheus Operator makes targets of a PodMonitor: each endpoint keeps the selected pods that have a
    container port of its name. Every process is one target, on the port where it serves /metrics; none is dead."""
    objects = render("--set", "monitoring.podMonitor.enabled=true")
    (monitor,) = [o for o in objects if o["kind"] == "PodMonitor"]
    assert not [o for o in objects if o["kind"] == "ServiceMonitor"]
    wanted = monitor["spec"]["selector"]["matchLabels"]
    targets: Counter = Counter()
    for role, template in pod_templates(objects).items():
        if wanted.items() <= template["metadata"]["labels"].items():
            ports = {p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
            for endpoint in monitor["spec"]["podMetricsEndpoints"]:
                if endpoint["port"] in ports:
                    targets[(role, ports[endpoint["port"]], endpoint["path"])] += 1
    assert targets == Counter(
        {("worker", 9400, "/metrics"): 1, ("learner", 9400, "/metrics"): 1, ("gateway", 8000, "/metrics"): 1}
    )


def test_learner_shards_one_per_pod_index_beside_the_trainer_and_no_more_than_partitions():
    objects = render("--set", "learner.shards=3")
    workloads = {o["metadata"]["name"].removeprefix("t-rlens-"): o for o in objects if o["kind"] == "StatefulSet"}
    shards, trainer = workloads["learner-shard"]["spec"], workloads["learner"]["spec"]
    assert shards["replicas"] == 3 and shards["volumeClaimTemplates"][0]["metadata"]["name"] == "checkpoints"
    (container,) = shards["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") or e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]}
    assert env["RLENS_LEARNER_ROLE"] == "shard" and env["RLENS_LEARNER_SHARDS"] == "3"
    assert env["RLENS_LEARNER_SHARD"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    (container,) = trainer["template"]["spec"]["containers"]
    assert {"name": "RLENS_LEARNER_ROLE", "value": "trainer"} in container["env"]
    (one,) = [o for o in render() if o["kind"] == "StatefulSet" and "learner" in o["metadata"]["name"]]
    assert "RLENS_LEARNER_ROLE" not in {e["name"] for e in one["spec"]["template"]["spec"]["containers"][0]["env"]}
    refused = template("--set", "learner.shards=5")
    assert refused.returncode != 0 and "learner.shards 5 exceeds the 4 partitions" in refused.stderr, refused.stderr


def test_no_more_workers_than_partitions():
    refused = template("--set", "worker.autoscaling.maxReplicas=8")
    assert refused.returncode != 0 and "exceeds the 4 partitions" in refused.stderr, refused.stderr
    refused = template("--set", "worker.autoscaling.enabled=false", "--set", "worker.replicas=5")
    assert refused.returncode != 0 and "worker.replicas 5 exceeds" in refused.stderr, refused.stderr
    allowed = render("--set", "worker.autoscaling.maxReplicas=8", "--set", "config.kafka.partitions=8")
    (hpa,) = [o for o in allowed if o["kind"] == "HorizontalPodAutoscaler"]
    assert hpa["spec"]["maxReplicas"] == 8


KUBE_SCORE = shutil.which("kube-score") or next(
    (str(p) for p in [Path(os.environ.get("GOPATH", Path.home() / "go")) / "bin" / "kube-score"] if p.is_file()), None
)
# what the chart does on purpose: no CPU limit (throttling costs latency; requests reserve the CPU), and a pinned
# image tag pulled IfNotPresent
KUBE_SCORE_WAIVED = ["--ignore-container-cpu-limit", "--ignore-test", "container-image-pull-policy"]


@pytest.mark.skipif(
    KUBE_SCORE is None, reason="go install github.com/zegl/kube-score/cmd/kube-score@v1.20.0 (.ci/run does)"
)
def test_kube_score_finds_nothing_in_the_production_render(tmp_path):
    """kube-score (a chart linter: probes, resources, network policies, disruption budgets, anti-affinity, security
    contexts, ...) on the production values: no critical finding, no warning."""
    rendered = template("-f", str(CHART / "ci" / "production-values.yaml"))
    assert rendered.returncode == 0, rendered.stderr
    (tmp_path / "chart.yaml").write_text(rendered.stdout)
    scored = subprocess.run(
        [str(KUBE_SCORE), "score", str(tmp_path / "chart.yaml"), "--output-format", "ci", *KUBE_SCORE_WAIVED],
        capture_output=True,
        text=True,
        timeout=120,
    )
    findings = [line for line in scored.stdout.splitlines() if line.startswith(("[CRITICAL]", "[WARNING]"))]
    assert scored.returncode == 0 and not findings, scored.stdout + scored.stderr
    assert "[OK]" in scored.stdout  # it did score the objects
