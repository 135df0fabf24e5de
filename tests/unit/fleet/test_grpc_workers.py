"""The fleet on smg's gRPC worker protocol (``worker_protocol`` grpc): its settings (refused with trust mode), the
router's command line (smg's own parser takes it), each replica's listener ports, and a replica's membership
registering one gRPC worker per listener its front lists on ``GET /grpc-workers``, against the fake worker API and
front of test_membership.py. tests/integration/test_fleet_grpc.py runs the real smg against real replicas."""

from __future__ import annotations

import socket
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.unit.fleet.test_membership import FakeFront, FakeRouter, _serve
from warmup_tools.common.errors import ConfigError, ServerError
from warmup_tools.fleet.fleet import Fleet
from warmup_tools.fleet.membership import Membership, grpc_workers
from warmup_tools.fleet.replica import Replica
from warmup_tools.fleet.router import RouterClient, smg_argv
from warmup_tools.fleet.settings import FleetSettings
from warmup_tools.ops.cli import _parser
from warmup_tools.ops.cli.fleet import served_model
from warmup_tools.server.process import free_port_block


def _flags(argv: list[str]) -> dict[str, str]:
    return dict(zip(argv[3::2], argv[4::2]))


def test_http_is_the_default_and_grpc_is_refused_with_trust_mode_citing_the_missing_tenant_identity(tmp_path):
    assert FleetSettings().worker_protocol == "http" and not FleetSettings().grpc
    assert FleetSettings(worker_protocol="grpc").grpc
    with pytest.raises(ConfigError, match="passes no tenant identity to a gRPC worker") as refused:
        FleetSettings(worker_protocol="grpc", secrets_dir=tmp_path)
    assert "docs/fleet.md" in str(refused.value)
    with pytest.raises(ConfigError):
        FleetSettings(worker_protocol="h2")
    FleetSettings(worker_protocol="http", secrets_dir=tmp_path)  # trust mode stays on HTTP


def test_over_grpc_the_router_routes_cache_aware_on_its_event_index_and_tokenizes_from_the_repositorys_lm():
    settings = FleetSettings(worker_protocol="grpc")
    served = served_model(settings)
    assert served is not None and served_model(FleetSettings()) is None  # HTTP: smg needs no model
    grpc = smg_argv(settings, port=30000, prometheus_port=29000, served=served)
    flags = _flags(grpc)
    assert flags["--policy"] == "cache_aware" and flags["--kv-index"] == "positional"
    lm, block_size = served.tokenizer_dir, served.block_size
    assert flags["--model-path"] == str(lm) and (lm / "tokenizer_config.json").is_file()
    assert flags["--block-size"] == str(block_size) == "16"  # the repository's kv_block_size: smg hashes by it
    # Without worker URLs at its start smg 1.13 builds the HTTP router alone (a gRPC worker's model: 404).
    assert "--enable-igw" in grpc
    http = smg_argv(FleetSettings(), port=30000, prometheus_port=29000)
    assert not {"--kv-index", "--model-path", "--enable-igw", "--block-size"} & set(http)  # HTTP: as before
    # A policy without a tree has no index to feed.
    assert "--kv-index" not in smg_argv(FleetSettings(worker_protocol="grpc", policy="round_robin"), port=1,
                                        prometheus_port=2, served=served)
    # The fleet reads no model config (tests/unit/test_layout.py): over gRPC its caller names the model.
    with pytest.raises(ValueError, match="served model"):
        smg_argv(settings, port=1, prometheus_port=2)
    with pytest.raises(ValueError, match="served model"):
        Fleet(settings)
    # smg's own parser (what smg_launch runs) takes every flag, and reads them as meant.
    from smg.launch_router import parse_router_args

    args = parse_router_args(grpc[3:])
    assert args.policy == "cache_aware" and args.kv_index == "positional" and args.model_path == str(lm)
    assert args.enable_igw and args.block_size == block_size


def test_the_router_and_join_commands_take_the_protocol():
    router = _parser().parse_args(["router", "--worker-protocol", "grpc", "--model-repository", "/models"])
    assert router.worker_protocol == "grpc" and router.model_repository == Path("/models")
    join = _parser().parse_args(["join", "--router", "http://r:30000", "--replica", "http://localhost:9000",
                                 "--worker-protocol", "grpc", "--worker-host", "triton-warmup-0.triton-warmup-pods"])
    assert join.worker_protocol == "grpc" and join.worker_host == "triton-warmup-0.triton-warmup-pods"


def test_a_grpc_replica_gets_a_block_of_free_listener_ports_for_its_front(tmp_path):
    settings = FleetSettings(worker_protocol="grpc", grpc_ports_per_replica=4)
    replica = Replica("r1", settings, tmp_path, tmp_path / "control", None)
    env = replica.process.env
    first = int(env["WARMUP_FRONT_GRPC_WORKER_PORT"])
    assert first == replica.grpc_worker_port and env["WARMUP_FRONT_GRPC_WORKER_HOST"] == settings.host
    assert env["WARMUP_FRONT_GRPC_WORKER_MODELS"] == "4"  # the front listens on none beyond the block
    http = Replica("r2", FleetSettings(), tmp_path, tmp_path / "control", None)
    assert http.grpc_worker_port is None and "WARMUP_FRONT_GRPC_WORKER_PORT" not in http.process.env
    block = free_port_block("127.0.0.1", 3)
    for port in range(block, block + 3):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # each free


class FakeGrpcRouter(FakeRouter):
    """The worker API taking smg 1.13's registration of a gRPC worker (no model card: smg asks the worker)."""

    def __init__(self) -> None:
        super().__init__()
        self.bodies: list[dict[str, Any]] = []

    def handle(self, method: str, path: str, body: dict[str, Any] | None,
               authorization: str | None = None) -> tuple[int, dict[str, Any]]:
        if method == "POST" and path == "/workers" and body is not None and body["url"].startswith("grpc://"):
            with self.lock:
                self.bodies.append(body)
                worker_id = uuid.uuid4().hex
                self.workers[worker_id] = {"id": worker_id, "url": body["url"], "status": "ready"}
            return 202, {"worker_id": worker_id}
        return super().handle(method, path, body, authorization)


class GrpcFront(FakeFront):
    """A front with smg engine listeners: ``GET /grpc-workers`` lists ``ports`` (model -> port)."""

    def __init__(self) -> None:
        super().__init__()
        self.ports = {"base": 41000, "support": 41001}

    def handle(self, method: str, path: str, body: dict[str, Any] | None,
               authorization: str | None = None) -> tuple[int, dict[str, Any]]:
        if path == "/grpc-workers":
            return 200, {"workers": [{"model": m, "port": p} for m, p in self.ports.items()]}
        return super().handle(method, path, body, authorization)


@pytest.fixture()
def grpc_parts() -> Iterator[tuple[FakeGrpcRouter, GrpcFront, Membership]]:
    router, front = FakeGrpcRouter(), GrpcFront()
    router_server, front_server = _serve(router.handle), _serve(front.handle)
    client = RouterClient(f"http://127.0.0.1:{router_server.server_port}", 1)
    membership = Membership(f"http://127.0.0.1:{front_server.server_port}", client, 0.05, protocol="grpc",
                            kv_block_size=16)
    try:
        yield router, front, membership
    finally:
        membership.stop()
        for server in (router_server, front_server):
            server.shutdown()
            server.server_close()


def test_a_warm_replica_gets_one_grpc_worker_per_listener_registered_as_smg_takes_it(grpc_parts):
    router, front, membership = grpc_parts
    front.status = 503
    membership.sync()
    assert membership.workers == {} and router.workers == {}  # nothing while /health is not 200
    front.status = 200
    membership.sync()
    assert router.urls() == {"grpc://127.0.0.1:41000", "grpc://127.0.0.1:41001"}
    assert sorted(membership.workers) == ["base", "support"]
    for body in router.bodies:
        assert {k: body[k] for k in ("runtime", "connection_mode", "kv_block_size")} == {
            "runtime": "vllm", "connection_mode": "grpc", "kv_block_size": 16}
        assert "models" not in body  # smg reads the model from the listener (GetModelInfo)
    assert membership.listed()


def test_a_retired_model_loses_its_worker_a_moved_listener_is_registered_again_and_stop_leaves(grpc_parts):
    router, front, membership = grpc_parts
    membership.sync()
    del front.ports["support"]
    membership.sync()
    assert router.urls() == {"grpc://127.0.0.1:41000"} and list(membership.workers) == ["base"]
    front.ports["base"] = 41005  # the front restarted on other ports
    membership.sync()
    assert router.urls() == {"grpc://127.0.0.1:41005"}
    router.restart()
    membership.sync()
    assert router.urls() == {"grpc://127.0.0.1:41005"}  # back after a router restart
    membership.stop()
    assert router.urls() == set()


def test_the_worker_host_is_where_the_router_reaches_the_replica(grpc_parts):
    router, _, membership = grpc_parts
    pod = Membership(membership.replica_url, membership.router, 0.05, protocol="grpc", kv_block_size=16,
                     worker_host="triton-warmup-0.triton-warmup-pods")
    pod.sync()
    assert router.urls() == {"grpc://triton-warmup-0.triton-warmup-pods:41000",
                             "grpc://triton-warmup-0.triton-warmup-pods:41001"}
    pod.stop()
    # Over HTTP too: the front's URL at that host (a pod's join reads the front on localhost).
    port = membership.replica_url.rsplit(":", 1)[1]
    http = Membership(membership.replica_url.replace("127.0.0.1", "localhost"), membership.router, 0.05,
                      worker_host="10.1.2.3")
    assert http.worker_url("base") == f"http://10.1.2.3:{port}/m/base"
    assert Membership("http://localhost:9000", membership.router, 1, worker_host="fd00::7").worker_url("sql") == \
        "http://[fd00::7]:9000/m/sql"
    assert Membership("http://localhost:9000", membership.router, 1).worker_url("sql") == \
        "http://localhost:9000/m/sql"


@pytest.mark.parametrize("listing", [{"workers": [{"model": "base", "port": "41000"}]},
                                     {"workers": [{"model": "", "port": 41000}]},
                                     {"workers": [{"model": "base", "port": 70000}]},
                                     {"workers": [{"model": "base", "port": True}]},
                                     {"models": []}])
def test_a_listing_that_is_not_models_and_ports_registers_nothing(grpc_parts, listing, caplog):
    router, front, membership = grpc_parts
    front.handle = lambda method, path, body, authorization=None: (  # type: ignore[method-assign]
        (200, listing) if path == "/grpc-workers" else GrpcFront.handle(front, method, path, body, authorization))
    front_server = _serve(front.handle)
    try:
        mine = Membership(f"http://127.0.0.1:{front_server.server_port}", membership.router, 0.05, protocol="grpc",
                          kv_block_size=16)
        with pytest.raises(ServerError, match="/grpc-workers"):
            mine.sync()
        assert router.workers == {}
    finally:
        front_server.shutdown()
        front_server.server_close()


def test_a_grpc_membership_or_registration_without_the_block_size_is_refused():
    client = RouterClient("http://127.0.0.1:9", 1)
    with pytest.raises(ValueError, match="kv_block_size"):
        Membership("http://127.0.0.1:9", client, 1, protocol="grpc")
    with pytest.raises(ValueError, match="kv_block_size"):
        client.add("grpc://127.0.0.1:9", "base")
    with pytest.raises(ValueError, match="protocol"):
        Membership("http://127.0.0.1:9", client, 1, protocol="grpcs")


def test_grpc_workers_reads_the_fronts_listing(grpc_parts):
    _, front, membership = grpc_parts
    assert grpc_workers(membership.replica_url) == front.ports
