"""The fleet's variant on smg's gRPC worker protocol: docker-compose.grpc.yml over docker-compose.yml, and the
kustomize overlay deploy/k8s-grpc/ over deploy/k8s/, checked offline (no Docker engine or cluster runs here).

What they must hold: the router and the replicas' fronts run the gRPC flags (open mode: smg passes no tenant
identity to a gRPC worker), each join registers the listeners at the address the router reaches, the listener
ports (which carry no credential and no TLS) are reachable by the router alone: an internal compose network only
the router and the replicas join, a NetworkPolicy admitting the port range from the router's pods only; and the
router's worker API stays behind the deployment's router_control.key, which the router and every join read from
the deployment's secrets (open mode is the replicas' alone)."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from warmup_tools.common.deployment import MOUNT, DeploymentSecrets
from warmup_tools.fleet.router import smg_argv
from warmup_tools.ops.cli import _parser, fleet_settings
from warmup_tools.ops.cli.fleet import served_model

ROOT = Path(__file__).resolve().parents[2]
BASE, OVERLAY = ROOT / "deploy" / "k8s", ROOT / "deploy" / "k8s-grpc"
TRUST_FILES = ("WARMUP_DEPLOYMENT_SECRET_FILE", "WARMUP_TENANT_KEYS_FILE", "WARMUP_PROBE_TENANT_KEY_FILE")
#: Strategic merge keys of the lists the overlay's patches touch (Kubernetes' own, for these fields).
MERGE_KEYS = {"containers": "name", "env": "name", "ports": "containerPort", "volumeMounts": "mountPath",
              "volumes": "name"}
#: The router's control-plane key where both variants mount the deployment's secrets.
ROUTER_KEY = DeploymentSecrets(MOUNT).router_key


def _load(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _merge(base: Any, patch: Any, key: str = "") -> Any:
    """A strategic merge patch as Kubernetes applies it to the fields used here: mappings merged, lists of
    objects merged by their merge key, every other value replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for name, value in patch.items():
            merged[name] = _merge(base[name], value, name) if name in base else copy.deepcopy(value)
        return merged
    if isinstance(base, list) and isinstance(patch, list) and key in MERGE_KEYS:
        by = MERGE_KEYS[key]
        merged = [copy.deepcopy(item) for item in base]
        for item in patch:
            at = next((i for i, old in enumerate(merged) if old.get(by) == item.get(by)), None)
            if at is None:
                merged.append(copy.deepcopy(item))
            else:
                merged[at] = _merge(merged[at], item, "")
        return merged
    return copy.deepcopy(patch)


def overlay_docs() -> list[dict[str, Any]]:
    """deploy/k8s-grpc as `kubectl apply -k` renders it: the base's manifests, its patches applied, its own."""
    kustomization = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text())
    docs: list[dict[str, Any]] = []
    for resource in kustomization["resources"]:
        path = (OVERLAY / resource).resolve()
        if path.is_dir():
            listed = yaml.safe_load((path / "kustomization.yaml").read_text())["resources"]
            docs += [d for name in listed for d in _load(path / name)]
        else:
            docs += _load(path)
    for patch in kustomization["patches"]:
        for change in _load(OVERLAY / patch["path"]):
            at = next(i for i, d in enumerate(docs) if d["kind"] == change["kind"]
                      and d["metadata"]["name"] == change["metadata"]["name"])
            docs[at] = _merge(docs[at], change)
    return docs


def _doc(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def _container(docs: list[dict[str, Any]], kind: str, name: str, container: str) -> dict[str, Any]:
    pod = _doc(docs, kind, name)["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == container)


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_the_base_kustomization_lists_every_manifest_and_the_overlay_is_built_on_it():
    listed = yaml.safe_load((BASE / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml")
    kustomization = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text())
    assert "../k8s" in kustomization["resources"]
    for item in [*kustomization["resources"], *(p["path"] for p in kustomization["patches"])]:
        assert (OVERLAY / item).exists(), item


@pytest.mark.parametrize("doc", overlay_docs(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_every_manifest_of_the_grpc_overlay_validates_against_the_kubernetes_schemas(doc):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kubernetes_validate.validate(doc, "1.30.0", strict=True)


def test_the_overlays_router_routes_cache_aware_on_the_replicas_kv_events_in_open_mode():
    docs = overlay_docs()
    command = _container(docs, "Deployment", "warmup-router", "smg")["command"]
    assert command[:4] == ["python3", "-m", "warmup_tools", "router"]
    settings = fleet_settings(_parser().parse_args(command[3:]))
    assert settings.grpc and settings.secrets_dir is None and settings.routed_policy == "cache_aware"
    assert settings.model_repository == Path("/models")  # the image's repository: its LM is smg's tokenizer
    # (this checkout's repository in place of the image's: the LM folder is read from it)
    local = dataclasses.replace(settings, model_repository=None)
    argv = smg_argv(local, port=30000, prometheus_port=29000, served=served_model(local))
    assert argv[argv.index("--kv-index") + 1] == "positional" and "--model-path" in argv


def test_the_overlays_replicas_listen_where_only_the_router_may_connect():
    docs = overlay_docs()
    triton = _container(docs, "StatefulSet", "triton-warmup", "triton")
    env = _env(triton)
    assert all(env[name] == "" for name in TRUST_FILES)  # open mode, set empty on purpose
    first, count = int(env["WARMUP_FRONT_GRPC_WORKER_PORT"]), int(env["WARMUP_FRONT_GRPC_WORKER_MODELS"])
    assert {"name": "grpc-workers", "containerPort": first} in triton["ports"]
    # The listeners' range is admitted by one policy, from the router's pods alone.
    admitting = []
    for policy in (d for d in docs if d["kind"] == "NetworkPolicy"
                   and d["spec"]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "triton-warmup"}):
        for rule in policy["spec"]["ingress"]:
            for port in rule.get("ports", []):
                last = port.get("endPort", port["port"])
                if port["port"] <= first + count - 1 and last >= first:
                    admitting.append((rule, port))
    assert len(admitting) == 1, admitting
    rule, port = admitting[0]
    assert (port["port"], port["endPort"]) == (first, first + count - 1)
    assert rule["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "warmup-router"}}}]
    # The front takes the variables as meant (FrontSettings: WARMUP_FRONT_<FIELD>).
    from warmup_tools.common.settings import environ_overrides, load_settings
    from warmup_tools.front.settings import FrontSettings

    with environ_overrides({k: v for k, v in env.items() if k.startswith("WARMUP_FRONT_GRPC_")}):
        front = load_settings(FrontSettings)
    assert (front.grpc_worker_port, front.grpc_worker_models) == (first, count)


def test_the_overlays_join_registers_the_listeners_at_the_pods_ip():
    docs = overlay_docs()
    join = _container(docs, "StatefulSet", "triton-warmup", "join")
    args = _parser().parse_args(join["command"][3:])
    assert args.worker_protocol == "grpc" and args.secrets_dir is None
    assert args.worker_host == "$(POD_IP)" and _env(join)["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert args.model_repository == Path("/models")  # the repository's KV block size


def _compose() -> dict[str, Any]:
    """docker-compose.yml with docker-compose.grpc.yml over it, merged as compose merges these keys (mappings
    merged, ``command`` replaced)."""
    base = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    override = yaml.safe_load((ROOT / "docker-compose.grpc.yml").read_text())
    merged = copy.deepcopy(base)
    for name, service in override["services"].items():
        assert name in base["services"], f"the override names {name}, which docker-compose.yml does not run"
        target = merged["services"][name]
        for key, value in service.items():
            if isinstance(value, dict):
                target[key] = {**(target.get(key) or {}), **value}
            else:
                assert key != "ports", "the override publishes no port"
                target[key] = value
    merged["networks"] = {**base.get("networks", {}), **override["networks"]}
    return merged


def test_compose_grpc_runs_the_router_and_the_replicas_on_the_grpc_flags_in_open_mode():
    compose = _compose()["services"]
    router = fleet_settings(_parser().parse_args(compose["router"]["command"][3:]))
    assert router.grpc and router.secrets_dir is None and router.model_repository == Path("/models")
    for replica in ("triton", "triton-2"):
        env = compose[replica]["environment"]
        assert all(env[name] == "" for name in TRUST_FILES)
        assert int(env["WARMUP_FRONT_GRPC_WORKER_PORT"]) >= 1 and int(env["WARMUP_FRONT_GRPC_WORKER_MODELS"]) >= 1


def test_compose_grpc_listeners_are_on_an_internal_network_only_the_router_and_the_replicas_join():
    merged = _compose()
    compose, network = merged["services"], merged["networks"]["grpc-workers"]
    assert network["internal"] is True
    on_it = {name for name, service in compose.items() if "grpc-workers" in (service.get("networks") or {})}
    assert on_it == {"router", "triton", "triton-2"}
    joins = {"triton": "join-1", "triton-2": "join-2"}
    for replica, join in joins.items():
        address = compose[replica]["networks"]["grpc-workers"]["ipv4_address"]
        # The front binds that address alone (not the compose network's), and its join registers it there.
        assert compose[replica]["environment"]["WARMUP_FRONT_GRPC_WORKER_HOST"] == address
        args = _parser().parse_args(compose[join]["command"][3:])
        assert args.worker_protocol == "grpc" and args.worker_host == address
        assert args.replica == f"http://{replica}:9000" and args.secrets_dir is None
    # The base file stays the product: trust mode on HTTP workers.
    base = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    assert "--worker-protocol" not in base["router"]["command"] and "--secrets-dir" in base["router"]["command"]


def _mounted_secret_items(pod: dict[str, Any], container: dict[str, Any], path: Path) -> tuple[str, list[Any]]:
    """The Secret mounted at ``path`` in ``container`` and the items it projects there (None: all of them)."""
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(path))
    assert mount.get("readOnly") is True
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    return volume["secret"]["secretName"], volume["secret"].get("items")


def test_both_grpc_variants_put_the_routers_worker_api_behind_the_deployments_control_key():
    """The replicas run open mode; the router's worker API does not: the router and every join read
    router_control.key (deploy-secrets: compose's one-shot secrets service, the Kubernetes Secret) from its file,
    and only that item is mounted where only it is needed."""
    only_the_key = [{"key": ROUTER_KEY.name, "path": ROUTER_KEY.name}]
    # Kubernetes: the router's and each pod's join command, and the one item of the trust Secret they mount.
    docs = overlay_docs()
    router_pod = _doc(docs, "Deployment", "warmup-router")["spec"]["template"]["spec"]
    replica_pod = _doc(docs, "StatefulSet", "triton-warmup")["spec"]["template"]["spec"]
    for pod, container in ((router_pod, _container(docs, "Deployment", "warmup-router", "smg")),
                           (replica_pod, _container(docs, "StatefulSet", "triton-warmup", "join"))):
        settings = fleet_settings(_parser().parse_args(container["command"][3:]))
        assert settings.grpc and settings.secrets_dir is None and settings.router_key_file == ROUTER_KEY
        assert _mounted_secret_items(pod, container, MOUNT) == ("triton-warmup-trust", only_the_key)
    # The router's launcher reads the file (the key is on no command line).
    router = fleet_settings(_parser().parse_args(
        _container(docs, "Deployment", "warmup-router", "smg")["command"][3:]))
    local = dataclasses.replace(router, model_repository=None)
    argv = smg_argv(local, port=30000, prometheus_port=29000, served=served_model(local))
    assert argv[3:5] == ["--control-key-file", str(ROUTER_KEY)]
    # compose: the router and both joins read it from the volume the secrets service fills.
    compose = _compose()["services"]
    secrets = compose["secrets"]
    command = secrets["command"]
    assert command[3] == "deploy-secrets" and command[command.index("--dir") + 1] == str(MOUNT)
    assert f"warmup-secrets:{MOUNT}" in secrets["volumes"]
    for name in ("router", "join-1", "join-2"):
        settings = fleet_settings(_parser().parse_args(compose[name]["command"][3:]))
        assert settings.grpc and settings.secrets_dir is None and settings.router_key_file == ROUTER_KEY, name
        assert f"warmup-secrets:{MOUNT}:ro" in compose[name]["volumes"], name
    assert compose["router"]["depends_on"]["secrets"] == {"condition": "service_completed_successfully"}
    assert all("router" in compose[join]["depends_on"] for join in ("join-1", "join-2"))
