"""tritonserver in the shipped deployment: a release with the August 2025 CVEs fixed, its HTTP and gRPC reachable
from inside the replica only, and the opt-in direct-access proxy passing inference and health only (the files'
structure; tests/integration/test_triton_surface.py runs the replica and the proxy)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from warmup_tools.ops.cli import _parser

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
DIRECT_CONF = ROOT / "deploy" / "gateway" / "triton-direct.conf"
DIRECT_COMPOSE = yaml.safe_load((ROOT / "deploy" / "gateway" / "triton-direct.compose.yml").read_text())
TRITON_PORTS = {8000, 8001}
#: The first Triton release with CVE-2025-23310/23311 and CVE-2025-23319/23320/23334 fixed.
FIXED_RELEASE = (25, 7)


def _k8s(kind: str, name: str = "triton-warmup") -> dict:
    docs = [d for path in (ROOT / "deploy" / "k8s").glob("*.yaml") for d in yaml.safe_load_all(path.read_text()) if d]
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def _sidecar(command: list[str]):
    assert command[:4] == ["python3", "-m", "warmup_tools", "sidecar"]
    return _parser().parse_args(command[3:])


def test_the_image_is_built_on_a_triton_release_with_the_august_2025_fixes():
    text = (ROOT / "docker" / "Dockerfile").read_text()
    release = re.search(r"ARG TRITON_IMAGE=nvcr\.io/nvidia/tritonserver:(\d\d)\.(\d\d)-py3\n", text)
    assert release and (int(release[1]), int(release[2])) >= FIXED_RELEASE, release
    assert "FROM ${TRITON_IMAGE}" in text
    assert "PIP_BREAK_SYSTEM_PACKAGES=1" in text  # Ubuntu 24.04's Python 3.12 is externally managed
    assert not re.search(r"^RUN .*--upgrade pip", text, re.M)  # Ubuntu's pip cannot be uninstalled by pip
    exposed = {int(p) for line in re.findall(r"^EXPOSE (.+)$", text, re.M) for p in line.split()}
    assert not exposed & TRITON_PORTS
    cmd = yaml.safe_load(re.search(r"^CMD (\[.*?\])$", text, re.M | re.S)[1].replace("\\\n", ""))
    args = _sidecar(cmd)
    assert args.host == "127.0.0.1" and args.metrics_host == "0.0.0.0"


def test_compose_publishes_no_triton_port_and_binds_them_to_the_replicas_loopback():
    for name, service in COMPOSE["services"].items():
        published = {int(str(p).rsplit(":", 1)[-1]) for p in service.get("ports", [])}
        assert not published & TRITON_PORTS, name
    for name in ("triton", "triton-2"):
        args = _sidecar(COMPOSE["services"][name]["command"])
        assert args.host == "127.0.0.1" and (args.http_port, args.grpc_port) == (8000, 8001), name
        assert args.metrics_host == "0.0.0.0"  # Prometheus scrapes triton:8002 over the compose network


def test_compose_load_generator_reaches_the_replica_through_its_openai_front():
    command = COMPOSE["services"]["locust"]["command"]
    front = _sidecar(COMPOSE["services"]["triton"]["command"]).front_port
    assert command[command.index("--host") + 1] == f"http://triton:{front}"
    assert command[command.index("--transport") + 1] == "openai"
    # NOTE: not imported: importing locust monkey-patches this whole process for gevent.
    source = (ROOT / "warmup_tools" / "sim" / "load" / "locustfile.py").read_text()
    assert re.search(r'^CLIENTS = \{.*"openai": OpenAIStreamingClient', source, re.M)


def test_kubernetes_opens_no_triton_port():
    service = _k8s("Service")
    assert not {p["port"] for p in service["spec"]["ports"]} & TRITON_PORTS
    policy = _k8s("NetworkPolicy")
    assert not {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]} & TRITON_PORTS
    container = _k8s("StatefulSet")["spec"]["template"]["spec"]["containers"][0]
    assert not {p["containerPort"] for p in container["ports"]} & TRITON_PORTS
    args = _sidecar(container["command"])
    assert args.host == "127.0.0.1" and args.metrics_host == "0.0.0.0"


def _locations(conf: str, directive: str) -> list[str]:
    """The location patterns whose block (up to the next location) passes requests on with ``directive``
    (proxy_pass, grpc_pass)."""
    starts = list(re.finditer(r"location\s+(?:[=~]\s+)?(\"[^\"]+\"|\S+)\s*\{", conf))
    ends = [m.start() for m in starts[1:]] + [len(conf)]
    return [m[1] for m, end in zip(starts, ends) if directive in conf[m.end():end]]


def test_the_direct_access_proxy_passes_only_inference_and_health():
    conf = DIRECT_CONF.read_text()
    http = [p.strip('"') for p in _locations(conf, "proxy_pass")]
    assert len(http) == 3 and conf.count("proxy_pass") == 3
    allowed = ["/v2/models/ensemble/infer", "/v2/models/lora_adapter/versions/1/infer", "/v2/models/ensemble/generate",
               "/v2/models/ensemble/generate_stream", "/v2/models/ensemble", "/v2/models/ensemble/ready",
               "/v2/models/ensemble/versions/1/ready", "/v2/health/live", "/v2/health/ready"]
    refused = ["/v2/repository/index", "/v2/repository/models/ensemble/load", "/v2/repository/models/x/unload",
               "/v2/systemsharedmemory/region/x/register", "/v2/systemsharedmemory/status",
               "/v2/cudasharedmemory/status", "/v2/logging", "/v2/trace/setting", "/v2/models/ensemble/trace/setting",
               "/v2/models/stats", "/v2/models/ensemble/stats", "/v2/models/ensemble/config", "/v2", "/metrics",
               "/v2/models/ensemble/infer/x", "/v2/health/stats"]
    for path in allowed:
        assert any(re.fullmatch(p.strip("^$"), path) for p in http), path
    for path in refused:
        assert not any(re.fullmatch(p.strip("^$"), path) for p in http), path
    grpc = _locations(conf, "grpc_pass")
    assert sorted(grpc) == sorted(f"/inference.GRPCInferenceService/{m}" for m in (
        "ModelInfer", "ModelStreamInfer", "ServerLive", "ServerReady", "ModelReady", "ModelMetadata"))
    assert conf.count("grpc_pass") == len(grpc)
    # A body cap, and the whole body read before it goes on (a chunked one re-framed with a Content-Length).
    assert re.search(r"client_max_body_size \d+m;", conf) and "proxy_request_buffering on;" in conf
    assert "proxy_request_buffering off" not in conf and "$uri;" in conf  # the matched path alone is passed on


def test_the_direct_access_proxy_is_an_opt_in_in_the_replicas_network_namespace():
    services = DIRECT_COMPOSE["services"]
    proxy = services["triton-direct"]
    assert proxy["network_mode"] == "service:triton"
    assert f"./{DIRECT_CONF.relative_to(ROOT)}:/etc/nginx/nginx.conf:ro" in proxy["volumes"]
    published = {int(p.rsplit(":", 1)[-1]) for p in services["triton"]["ports"]}
    conf = DIRECT_CONF.read_text()
    assert published == {int(p) for p in re.findall(r"listen (\d+)", conf)} and not published & TRITON_PORTS
    assert "127.0.0.1:8000" in conf and "127.0.0.1:8001" in conf  # tritonserver on the replica's loopback
    assert "triton-direct" not in COMPOSE["services"]  # not part of the default stack


@pytest.mark.skipif(shutil.which("nginx") is None and not Path("/usr/sbin/nginx").exists(),
                    reason="nginx is not installed")
def test_nginx_accepts_the_direct_access_proxys_configuration(tmp_path):
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    (tmp_path / "logs").mkdir()
    done = subprocess.run([nginx, "-t", "-p", str(tmp_path), "-c", str(DIRECT_CONF), "-e", "stderr", "-g",
                           f"pid {tmp_path / 'nginx.pid'};"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
