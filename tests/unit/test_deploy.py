"""The deployment files: Kubernetes manifests validated offline against the API schemas, and the compose
file, Prometheus and Grafana configs checked against the code (no Docker engine or cluster runs here)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import yaml

from warmup_tools.ops.cli import _parser

ROOT = Path(__file__).resolve().parents[2]
K8S = sorted((ROOT / "deploy" / "k8s").glob("*.yaml"))
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def k8s_docs():
    return [(path.name, doc) for path in K8S for doc in yaml.safe_load_all(path.read_text()) if doc]


@pytest.mark.parametrize("name,doc", k8s_docs(), ids=lambda v: v if isinstance(v, str) else v["kind"])
def test_every_manifest_validates_against_the_kubernetes_schemas(name, doc):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kubernetes_validate.validate(doc, "1.30.0", strict=True)


def test_the_validator_does_catch_a_broken_manifest():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    deployment = next(doc for _, doc in k8s_docs() if doc["kind"] == "Deployment")
    broken = copy.deepcopy(deployment)
    broken["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "eight thousand"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, "1.30.0", strict=True)


def _sidecar_args(command):
    assert command[:4] == ["python3", "-m", "warmup_tools", "sidecar"]
    return _parser().parse_args(command[3:])  # every flag is one the CLI knows


def test_the_pod_probes_the_sidecar_and_its_ports_match_the_command():
    deployment = next(doc for _, doc in k8s_docs() if doc["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    args = _sidecar_args(container["command"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": args.http_port, "grpc": args.grpc_port, "metrics": args.metrics_port,
                     "sidecar": args.sidecar_port}
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "sidecar"}
    assert container["startupProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"] == {"path": "/live", "port": "sidecar"}
    mounted = {m["name"] for m in container["volumeMounts"]}
    assert mounted <= {v["name"] for v in pod["volumes"]} and {"control", "logs", "snapshots"} <= mounted
    env = {e["name"]: e.get("value") for e in container["env"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert env["WARMUP_SNAPSHOT_DIR"] == mounts["snapshots"]  # lora_adapter's snapshot_dir is the shared volume
    assert "persistentVolumeClaim" in next(v for v in pod["volumes"] if v["name"] == "snapshots")
    claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    assert claims <= {doc["metadata"]["name"] for _, doc in k8s_docs() if doc["kind"] == "PersistentVolumeClaim"}
    selector = deployment["spec"]["selector"]["matchLabels"]
    for kind in ("Service", "PodDisruptionBudget"):
        doc = next(d for _, d in k8s_docs() if d["kind"] == kind)
        assert (doc["spec"]["selector"].get("matchLabels") or doc["spec"]["selector"]) == selector


def test_compose_runs_the_sidecar_with_a_password_protected_redis():
    services = COMPOSE["services"]
    assert set(services) == {"triton", "redis", "prometheus", "grafana", "locust"}
    triton = services["triton"]
    args = _sidecar_args(triton["command"])
    assert f"{args.sidecar_port}:{args.sidecar_port}" in triton["ports"]
    assert f"localhost:{args.sidecar_port}/ready" in " ".join(triton["healthcheck"]["test"])
    snapshot_dir = triton["environment"]["WARMUP_SNAPSHOT_DIR"]
    assert any(v.endswith(f":{snapshot_dir}") for v in triton["volumes"])
    redis_password = re.search(r"redis://:([^@]+)@redis:", triton["environment"]["WARMUP_REDIS_URL"]).group(1)
    assert services["redis"]["command"][services["redis"]["command"].index("--requirepass") + 1] == redis_password
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"compose mounts {source}, which does not exist"


def test_prometheus_scrapes_triton_and_the_sidecar_where_compose_serves_them():
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    targets = {job["job_name"]: job["static_configs"][0]["targets"][0] for job in config["scrape_configs"]}
    args = _sidecar_args(COMPOSE["services"]["triton"]["command"])
    assert targets == {"triton": f"triton:{args.metrics_port}", "warmup-sidecar": f"triton:{args.sidecar_port}"}


def test_the_dashboard_queries_only_metrics_the_code_exports():
    source = "".join((ROOT / "warmup_tools" / p).read_text() for p in ("triton/metrics.py", "sidecar/endpoints.py"))
    exported = set(re.findall(r'(?:name=|Gauge\()"(warmup_[a-z_]+)"', source))
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "warmup.json").read_text())
    used = {re.sub(r"_(bucket|sum|count)$", "", m) for panel in dashboard["panels"] for t in panel["targets"]
            for m in re.findall(r"warmup_[a-z_]+", t["expr"])}
    assert used and used <= exported, sorted(used - exported)
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("ttft", "cold share", "hit ratio", "adapter states", "recoveries"):
        assert topic in titles
