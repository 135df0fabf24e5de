"""The deployment files: Kubernetes manifests validated offline against the API schemas, and the compose
file, Prometheus and Grafana configs checked against the code (no Docker engine or cluster runs here)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import yaml

from warmup_tools.common.flags import options_from_args
from warmup_tools.ops.cli import _parser
from warmup_tools.ops.cli.options import BesideOptions

ROOT = Path(__file__).resolve().parents[2]
#: The manifests (kustomization.yaml lists them for `kubectl apply -k`: tests/unit/test_deploy_grpc.py).
K8S = sorted(p for p in (ROOT / "deploy" / "k8s").glob("*.yaml") if p.name != "kustomization.yaml")
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def k8s_docs():
    return [(path.name, doc) for path in K8S for doc in yaml.safe_load_all(path.read_text()) if doc]


def _doc(kind: str, name: str = "triton-warmup"):
    """The manifest of ``kind`` named ``name`` (the replicas' by default, a StatefulSet; the router's are
    warmup-router)."""
    return next(doc for _, doc in k8s_docs() if doc["kind"] == kind and doc["metadata"]["name"] == name)


@pytest.mark.parametrize("name,doc", k8s_docs(), ids=lambda v: v if isinstance(v, str) else v["kind"])
def test_every_manifest_validates_against_the_kubernetes_schemas(name, doc):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kubernetes_validate.validate(doc, "1.30.0", strict=True)


def test_the_validator_does_catch_a_broken_manifest():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    deployment = _doc("StatefulSet")
    broken = copy.deepcopy(deployment)
    broken["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "eight thousand"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, "1.30.0", strict=True)


def _sidecar_args(command):
    assert command[:4] == ["python3", "-m", "warmup_tools", "sidecar"]
    return _parser().parse_args(command[3:])  # every flag is one the CLI knows


def test_the_pod_probes_the_sidecar_and_its_ports_match_the_command():
    deployment = _doc("StatefulSet")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    args = _sidecar_args(container["command"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    # tritonserver's HTTP and gRPC listen on the pod's loopback: no container port names them.
    assert ports == {"metrics": args.metrics_port, "sidecar": args.sidecar_port, "openai": args.front_port}
    assert args.host == "127.0.0.1" and args.metrics_host == "0.0.0.0"
    # the sidecar starts the OpenAI front beside tritonserver
    assert options_from_args(BesideOptions, args).front and args.front_host == "0.0.0.0"
    # Every pod logs into its own folder of the shared (ReadWriteMany) log volume.
    logs = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "logs")
    assert str(args.fleet_log_dir) == logs
    # Ready = the front's /health: warm (the sidecar's /ready) and not draining.
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "openai"}
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
        doc = _doc(kind)
        assert (doc["spec"]["selector"].get("matchLabels") or doc["spec"]["selector"]) == selector


def test_compose_runs_the_sidecar_in_trust_mode_with_generated_secrets():
    services = COMPOSE["services"]
    assert set(services) == {"secrets", "triton", "triton-2", "router", "gateway", "join-1", "join-2", "redis",
                             "prometheus", "grafana", "locust"}
    triton = services["triton"]
    args = _sidecar_args(triton["command"])
    assert f"127.0.0.1:{args.sidecar_port}:{args.sidecar_port}" in triton["ports"]
    assert f"localhost:{args.sidecar_port}/ready" in " ".join(triton["healthcheck"]["test"])
    assert any(v.endswith(f":{args.fleet_log_dir}") for v in triton["volumes"])  # one folder per replica
    snapshot_dir = triton["environment"]["WARMUP_SNAPSHOT_DIR"]
    assert any(v.endswith(f":{snapshot_dir}") for v in triton["volumes"])
    # Trust mode: every file the models and the sidecar read comes from the volume the secrets service fills.
    init = services["secrets"]
    init_args = _parser().parse_args(init["command"][3:])
    assert init["command"][:4] == ["python3", "-m", "warmup_tools", "deploy-secrets"]
    volume = next(v.split(":")[0] for v in init["volumes"] if v.split(":")[1] == str(init_args.dir))
    mount = next(v.split(":")[1] for v in triton["volumes"] if v.split(":")[0] == volume)
    assert next(v for v in triton["volumes"] if v.startswith(f"{volume}:")).endswith(":ro")
    env = triton["environment"]
    assert "WARMUP_REDIS_URL" not in env  # the URL, with its password, is a file of that volume
    for name in ("WARMUP_DEPLOYMENT_SECRET_FILE", "WARMUP_TENANT_KEYS_FILE", "WARMUP_PROBE_TENANT_KEY_FILE",
                 "WARMUP_REDIS_URL_FILE"):
        assert env[name].startswith(f"{mount}/"), name
    assert triton["depends_on"]["secrets"] == {"condition": "service_completed_successfully"}
    # Redis reads the config with the generated password that the secrets service writes.
    redis = services["redis"]
    conf_volume = next(v.split(":")[0] for v in init["volumes"] if v.split(":")[1] == str(init_args.redis_conf_dir))
    conf_mount = next(v.split(":")[1] for v in redis["volumes"] if v.split(":")[0] == conf_volume)
    assert redis["command"] == ["redis-server", f"{conf_mount}/redis.conf"]
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"compose mounts {source}, which does not exist"


def test_no_default_password_anywhere_in_the_shipped_files():
    shipped = [ROOT / "docker-compose.yml", ROOT / "docker" / "Dockerfile", *K8S]
    for path in shipped:
        text = path.read_text()
        assert "change-me" not in text and "requirepass" not in text, path
        assert not re.search(r"PASSWORD:-|redis://:[^@$]+@", text), path
    grafana = COMPOSE["services"]["grafana"]["environment"]
    assert grafana["GF_AUTH_DISABLE_LOGIN_FORM"] == "true" and grafana["GF_AUTH_BASIC_ENABLED"] == "false"


def test_compose_publishes_only_the_inference_ports_beyond_the_loopback_and_restarts_what_exits():
    public = set()
    for name, service in COMPOSE["services"].items():
        for port in service.get("ports", []):
            if not port.startswith("127.0.0.1:"):
                public.add(port)
        one_shot = name == "secrets"
        assert service["restart"] in ({"on-failure"} if one_shot else {"unless-stopped", "always"}), name
        if not one_shot and "ports" in service:  # a join service has no port: a failure of it is an exit
            assert service["healthcheck"]["test"], name
    assert public == {"9000:9000", "30000:30000"}  # tritonserver's own ports are the replica's only
    # 30000 is the gateway's, which passes the OpenAI API only; the router (and its worker API) is not published.
    assert "30000:30000" in COMPOSE["services"]["gateway"]["ports"] and "ports" not in COMPOSE["services"]["router"]
    args = _sidecar_args(COMPOSE["services"]["triton"]["command"])
    assert options_from_args(BesideOptions, args).front and f"{args.front_port}:{args.front_port}" in public
    assert "ports" not in COMPOSE["services"]["redis"]


def test_the_pod_runs_trust_mode_from_a_secret_and_the_service_exposes_inference_only():
    deployment = _doc("StatefulSet")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    secret_volume = next(v for v in pod["volumes"] if "secret" in v)
    assert secret_volume["secret"]["defaultMode"] == 0o400 and not secret_volume["secret"].get("optional")
    mount = next(m for m in container["volumeMounts"] if m["name"] == secret_volume["name"])
    assert mount["readOnly"] is True
    for name in ("WARMUP_DEPLOYMENT_SECRET_FILE", "WARMUP_TENANT_KEYS_FILE", "WARMUP_PROBE_TENANT_KEY_FILE"):
        assert env[name]["value"].startswith(mount["mountPath"] + "/"), name
    assert "value" not in env["WARMUP_REDIS_URL"]  # from a Secret, never a literal
    service = _doc("Service")
    assert {p["name"] for p in service["spec"]["ports"]} == {"openai"}
    policy = _doc("NetworkPolicy")
    assert policy["spec"]["podSelector"] == deployment["spec"]["selector"]
    by_port = {p["port"]: rule for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert "from" not in by_port[9000] and not {8000, 8001} & set(by_port)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for name in ("metrics", "sidecar"):
        assert by_port[ports[name]]["from"], name  # only the monitoring may connect


def test_deploy_secrets_makes_owner_only_files_once_and_every_deployment_its_own(tmp_path):
    import stat

    from warmup_tools.common.records import PROBE_TENANT
    from warmup_tools.ops.deploy_secrets import make_deployment_secrets
    from warmup_tools.triton.trust import TenantTrust

    files = make_deployment_secrets(tmp_path / "a", redis_conf_dir=tmp_path / "conf")
    made = sorted(p.name for p in files.folder.iterdir())
    assert made == ["deployment.secret", "load_tenant.key", "probe_tenant.key", "redis.password", "redis.url",
                    "router_control.key", "tenant_keys.json"]
    assert stat.S_IMODE(files.folder.stat().st_mode) == 0o700
    assert {stat.S_IMODE(p.stat().st_mode) for p in [*files.folder.iterdir(), tmp_path / "conf" / "redis.conf"]} == {
        0o600}
    trust = TenantTrust.from_files(files.deployment_secret, files.tenant_keys)
    trust.verify_key(PROBE_TENANT, files.probe_key.read_text().strip())
    trust.verify_key("default", files.load_key.read_text().strip())
    password = files.redis_password.read_text().strip()
    assert len(password) >= 32 and f"redis://:{password}@redis:6379/0" == files.redis_url.read_text().strip()
    assert f"requirepass {password}\n" in (tmp_path / "conf" / "redis.conf").read_text()
    before = {p.name: p.read_bytes() for p in files.folder.iterdir()}
    make_deployment_secrets(tmp_path / "a")  # a restart keeps every key
    assert {p.name: p.read_bytes() for p in files.folder.iterdir()} == before
    other = make_deployment_secrets(tmp_path / "b")
    assert other.redis_password.read_bytes() != files.redis_password.read_bytes()
    assert other.deployment_secret.read_bytes() != files.deployment_secret.read_bytes()
    assert other.router_key.read_bytes() != files.router_key.read_bytes()
    assert len(files.read_key(files.router_key)) >= 64


def test_prometheus_scrapes_triton_and_the_sidecar_where_compose_serves_them():
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    targets = {job["job_name"]: job["static_configs"][0]["targets"][0] for job in config["scrape_configs"]}
    args = _sidecar_args(COMPOSE["services"]["triton"]["command"])
    assert targets == {"triton": f"triton:{args.metrics_port}", "warmup-sidecar": f"triton:{args.sidecar_port}",
                       "openai-front": f"triton:{args.front_port}"}


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


def test_the_image_defaults_to_trust_mode():
    text = (ROOT / "docker" / "Dockerfile").read_text()
    for name in ("WARMUP_DEPLOYMENT_SECRET_FILE", "WARMUP_TENANT_KEYS_FILE", "WARMUP_PROBE_TENANT_KEY_FILE"):
        assert re.search(rf"\b{name}=/run/warmup/\S+", text), name
    assert "HEALTHCHECK" in text


def _flag(command, name):
    return command[command.index(name) + 1]


def _router_argv(command):
    """What a deployment's router command runs: ``warmup_tools router``'s smg command line."""
    from warmup_tools.fleet.router import smg_argv
    from warmup_tools.ops.cli import fleet_settings

    assert command[:4] == ["python3", "-m", "warmup_tools", "router"]
    args = _parser().parse_args(command[3:])
    settings = fleet_settings(args)
    assert str(settings.secrets_dir) == "/run/warmup"  # trust mode: the worker API behind the control-plane key
    return smg_argv(settings, port=settings.port, prometheus_port=settings.prometheus_port)


def test_each_replica_pod_keeps_its_own_membership_in_the_router():
    router = _doc("Deployment", "warmup-router")["spec"]["template"]["spec"]
    command = _router_argv(router["containers"][0]["command"])
    assert not any(f.startswith("--service-discovery") for f in command)
    assert _flag(command, "--health-check-endpoint") == "/health"
    assert _flag(command, "--prometheus-port") != _flag(command, "--port")
    # No service discovery: the router needs no access to the Kubernetes API.
    assert router.get("automountServiceAccountToken") is False and "serviceAccountName" not in router
    assert not [doc for _, doc in k8s_docs() if doc["kind"] in ("Role", "RoleBinding", "ServiceAccount")]
    # Each replica pod runs `join` beside the replica: its own front on localhost, the router by its Service.
    pod = _doc("StatefulSet")["spec"]["template"]["spec"]
    triton, join = pod["containers"][0], next(c for c in pod["containers"] if c["name"] == "join")
    assert join["command"][:4] == ["python3", "-m", "warmup_tools", "join"]
    args = _parser().parse_args(join["command"][3:])
    assert not args.once  # runs until the pod's SIGTERM, then removes its workers
    front = {p["name"]: p["containerPort"] for p in triton["ports"]}["openai"]
    assert args.replica == f"http://localhost:{front}"
    # ... and registers it at the pod's IP: the router, in its own pod, cannot reach the replica's localhost.
    pod_ip = next(e for e in join["env"] if e["name"] == "POD_IP")
    assert args.worker_host == "$(POD_IP)" and pod_ip["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    service = _doc("Service", "warmup-router")
    port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "openai")
    assert args.router == f"http://{service['metadata']['name']}:{port}" and port == int(_flag(command, "--port"))
    assert join["securityContext"]["runAsNonRoot"] is True and "ports" not in join


def _secret_files(pod, container, mount_path):
    """The files of the trust Secret a container sees under ``mount_path``."""
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == mount_path)
    secret = next(v for v in pod["volumes"] if v["name"] == mount["name"])["secret"]
    assert secret["secretName"] == "triton-warmup-trust" and mount["readOnly"] is True
    return {item["path"] for item in secret["items"]} if "items" in secret else None


def test_the_shipped_fleets_run_trust_mode_from_one_definition_of_the_secrets():
    """compose, Kubernetes and ``warmup_tools fleet`` name the same files, mounted at the same place, set the same
    variables on the replicas, and give the router and ``join`` the keys they read."""
    from warmup_tools.common.deployment import MOUNT, DeploymentSecrets

    secrets = DeploymentSecrets(MOUNT)
    pod = _doc("StatefulSet")["spec"]["template"]["spec"]
    triton, join = pod["containers"][0], next(c for c in pod["containers"] if c["name"] == "join")
    k8s_env = {e["name"]: e.get("value") for e in triton["env"]}
    compose = COMPOSE["services"]
    for name in ("triton", "triton-2"):
        env = compose[name]["environment"]
        assert {k: v for k, v in env.items() if k in secrets.replica_environment()} == secrets.replica_environment()
    # Kubernetes takes the Redis URL from its own Secret (WARMUP_REDIS_URL), the rest from the trust files.
    expected = secrets.replica_environment(redis=False)
    assert {k: v for k, v in k8s_env.items() if k in expected} == expected
    assert _secret_files(pod, triton, str(MOUNT)) is None  # the whole Secret
    assert _secret_files(pod, join, str(MOUNT)) == {secrets.router_key.name, secrets.probe_key.name}
    router_pod = _doc("Deployment", "warmup-router")["spec"]["template"]["spec"]
    assert _secret_files(router_pod, router_pod["containers"][0], str(MOUNT)) == {secrets.router_key.name}
    for pod_spec in (pod, router_pod):  # users other than root read the keys through the pod's group
        assert pod_spec["securityContext"]["fsGroup"] == 1000
    # The operator's `kubectl create secret` line names every file deploy-secrets makes for the cluster.
    instructions = (ROOT / "deploy" / "k8s" / "statefulset.yaml").read_text()
    for path in (secrets.deployment_secret, secrets.tenant_keys, secrets.probe_key, secrets.router_key):
        assert f"--from-file=./trust/{path.name}" in instructions
    # compose: the router and each join read the secrets volume where deploy-secrets wrote it.
    volume = next(v.split(":")[0] for v in compose["secrets"]["volumes"] if v.split(":")[1] == str(MOUNT))
    for name in ("router", "join-1", "join-2", "triton", "triton-2"):
        assert f"{volume}:{MOUNT}:ro" in compose[name]["volumes"], name
    for name in ("join-1", "join-2"):
        assert _parser().parse_args(compose[name]["command"][3:]).secrets_dir == MOUNT
    assert _parser().parse_args(join["command"][3:]).secrets_dir == MOUNT


def test_the_replicas_of_compose_and_kubernetes_run_one_sidecar_command_under_stable_names():
    compose = COMPOSE["services"]
    pod = _doc("StatefulSet")["spec"]["template"]["spec"]
    assert compose["triton"]["command"] == compose["triton-2"]["command"] == pod["containers"][0]["command"]
    # A replica's name is its host name: fixed in compose, the StatefulSet's pod name in Kubernetes.
    assert {compose["triton"]["hostname"], compose["triton-2"]["hostname"]} == {"triton-1", "triton-2"}
    statefulset = _doc("StatefulSet")
    headless = _doc("Service", statefulset["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"] == statefulset["spec"]["selector"]["matchLabels"]
    assert _doc("HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]["kind"] == "StatefulSet"


#: The routes the product serves (warmup_tools/front/routers/): generation through the router, the model list.
SERVED_ROUTES = {"/v1/chat/completions": "router", "/v1/completions": "router", "/v1/models": "fronts",
                 "/v1/models/": "fronts"}


def _gateway_routes(conf: str) -> dict[str, str]:
    """Each nginx location that proxies, and the upstream it proxies to."""
    return {path.split()[-1]: upstream for path, upstream in
            re.findall(r"location\s+([^{]+?)\s*\{[^}]*proxy_pass\s+http://(\w+);", conf)}


def test_the_gateway_and_the_ingress_pass_exactly_the_served_routes():
    """Not smg's worker API, nor its conversations and responses; /v1/models from a front (it asks a tenant key in
    trust mode, smg's own list answers anyone); no response names a replica's internal URL."""
    from warmup_tools.front.routers import chat, completions, models
    from warmup_tools.front.settings import FrontSettings

    served = {route.path for r in (chat, completions, models) for route in r.router.routes}
    assert served == {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/{model:path}"}
    conf = (ROOT / "deploy" / "gateway" / "nginx.conf").read_text()
    routes = _gateway_routes(conf)
    assert routes == SERVED_ROUTES and conf.count("proxy_pass") == len(SERVED_ROUTES)
    assert re.search(r"location = /v1/models \{", conf) and re.search(r"location \^~ /v1/models/ \{", conf)
    assert all(re.search(rf"location = {p} \{{", conf) for p, u in SERVED_ROUTES.items() if u == "router")
    assert "server router:30000;" in conf
    assert re.findall(r"server (triton(?:-2)?):9000;", conf) == ["triton", "triton-2"]
    assert "proxy_hide_header x-smg-routed-worker-id;" in conf
    assert re.search(r"client_max_body_size (\d+)m;", conf).group(1) == str(FrontSettings().max_body_bytes >> 20)
    assert "./deploy/gateway/nginx.conf:/etc/nginx/nginx.conf:ro" in COMPOSE["services"]["gateway"]["volumes"]
    ingress = _doc("Ingress", "warmup-router")
    paths = [p for rule in ingress["spec"]["rules"] for p in rule["http"]["paths"]]
    assert [(p["path"], p["pathType"], p["backend"]["service"]["name"]) for p in paths] == [
        ("/v1/chat/completions", "Exact", "warmup-router"), ("/v1/completions", "Exact", "warmup-router"),
        ("/v1/models", "Prefix", "triton-warmup")]
    assert all(p["backend"]["service"]["port"] == {"name": "openai"} for p in paths)
    assert _doc("Service", "triton-warmup")["spec"]["ports"][-1]["name"] == "openai"
    annotations = ingress["metadata"]["annotations"]
    snippet = annotations["nginx.ingress.kubernetes.io/configuration-snippet"]
    assert "proxy_hide_header x-smg-routed-worker-id;" in snippet
    assert annotations["nginx.ingress.kubernetes.io/proxy-body-size"] == f"{FrontSettings().max_body_bytes >> 20}m"


def test_the_routers_worker_api_is_not_reachable_from_outside():
    """compose publishes the gateway, which proxies the served routes only; Kubernetes exposes them through its
    Ingress and admits the router's port from the ingress controller and the replica pods only."""
    conf = (ROOT / "deploy" / "gateway" / "nginx.conf").read_text()
    assert not any(p.startswith("/workers") or p == "/" for p in _gateway_routes(conf))
    assert _doc("Service", "warmup-router")["spec"].get("type", "ClusterIP") == "ClusterIP"
    policy = _doc("NetworkPolicy", "warmup-router")
    assert policy["spec"]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "warmup-router"}
    by_port = {p["port"]: rule["from"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert set(by_port) == {30000, 29000} and all(by_port.values())  # every port names who may connect
    sources = by_port[30000]
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}} in sources
    assert {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "triton-warmup"}}} in sources


def test_the_grace_period_covers_the_drain_and_the_hpa_scales_the_replicas_on_warm_queue_depth():
    from warmup_tools.server.config import ServeConfig

    pod = _doc("StatefulSet")["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    drain = float(env["WARMUP_FRONT_DRAIN_GRACE_S"]) + float(env["WARMUP_FRONT_DRAIN_TIMEOUT_S"])
    assert pod["terminationGracePeriodSeconds"] >= drain + ServeConfig().exit_timeout_s
    router = _router_argv(_doc("Deployment", "warmup-router")["spec"]["template"]["spec"]["containers"][0]["command"])
    # the replicas fail /health for longer than the router takes to notice
    assert float(env["WARMUP_FRONT_DRAIN_GRACE_S"]) > float(_flag(router, "--health-check-interval-secs"))
    hpa = _doc("HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "triton-warmup"
    metric = hpa["spec"]["metrics"][0]["external"]["metric"]["name"]
    rules = yaml.safe_load(_doc("ConfigMap", "warmup-prometheus-adapter-rules")["data"]["rules.yaml"])
    rule = next(r for r in rules["externalRules"] if r["name"]["as"] == metric)
    assert "vllm:num_requests_waiting" in rule["metricsQuery"]  # a series the front exports (docs/metrics.md)
    assert 'kube_pod_status_ready{condition="true"' in rule["metricsQuery"]  # warming replicas are not Ready


def test_compose_runs_two_replicas_behind_the_router_and_keeps_each_ones_membership():
    services = COMPOSE["services"]
    first, second = _sidecar_args(services["triton"]["command"]), _sidecar_args(services["triton-2"]["command"])
    assert first.front_port == second.front_port
    assert services["triton-2"]["volumes"] == services["triton"]["volumes"]  # one control and snapshot folder
    assert services["triton"]["stop_grace_period"] == services["triton-2"]["stop_grace_period"]
    router = _router_argv(services["router"]["command"])
    assert _flag(router, "--health-check-endpoint") == "/health"
    joined = set()
    for name in ("join-1", "join-2"):
        args = _parser().parse_args(services[name]["command"][3:])
        assert args.router == f"http://router:{_flag(router, '--port')}"
        assert not args.once and services[name]["restart"] == "unless-stopped"  # it runs until stopped
        joined.add(args.replica)
    assert joined == {f"http://triton:{first.front_port}", f"http://triton-2:{second.front_port}"}


def test_the_routers_of_compose_and_kubernetes_run_the_local_fleets_command_line():
    """Both run ``warmup_tools router``, whose smg command line is the one ``warmup_tools fleet`` runs: the same
    settings give the same flags, and neither deployment restates a router flag."""
    from warmup_tools.fleet.router import smg_argv
    from warmup_tools.fleet.settings import FleetSettings

    compose = COMPOSE["services"]["router"]["command"]
    k8s = _doc("Deployment", "warmup-router")["spec"]["template"]["spec"]["containers"][0]["command"]
    assert compose == k8s
    local = smg_argv(FleetSettings(host="0.0.0.0", secrets_dir=Path("/run/warmup")), port=30000, prometheus_port=29000)
    assert _router_argv(compose) == local
    assert not {"--policy", "--cache-threshold", "--balance-abs-threshold", "--health-check-interval-secs"} & set(k8s)
