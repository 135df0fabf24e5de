"""The router's control-plane key apart from trust mode (``control_key_file``): over gRPC the replicas run open mode
(smg passes no tenant identity to a gRPC worker), but the router's worker API stays behind a key, which the router's
launcher and every join read from a file (never from a command line), and which ``warmup_tools fleet`` over gRPC
makes once per run. The real smg router refuses an anonymous worker API call with it. tests/integration/
test_fleet_grpc.py checks the same on the gRPC fleet of real replicas; test_deploy_grpc.py the shipped variants."""

from __future__ import annotations

import dataclasses
import stat
from pathlib import Path
from typing import Iterator

import pytest

from tests.unit.fleet.test_router import _call, assert_on_no_command_line
from warmup_tools.common.deployment import DeploymentSecrets
from warmup_tools.common.errors import ConfigError, ServerError
from warmup_tools.fleet.fleet import Fleet
from warmup_tools.fleet.router import Router, RouterClient, control_key, smg_argv
from warmup_tools.fleet.settings import FleetSettings
from warmup_tools.ops.cli import _parser, fleet_settings
from warmup_tools.ops.cli.fleet import served_model
from warmup_tools.ops.deploy_secrets import make_deployment_secrets

GRPC = FleetSettings(worker_protocol="grpc")


def _key_file(folder: Path) -> tuple[Path, str]:
    secrets = make_deployment_secrets(folder)
    return secrets.router_key, secrets.read_key(secrets.router_key)


def test_the_control_key_is_given_without_trust_mode_and_trust_mode_stays_refused_over_grpc(tmp_path):
    key_file = tmp_path / "router_control.key"
    keyed = FleetSettings(worker_protocol="grpc", control_key_file=key_file)
    assert keyed.router_key_file == key_file and keyed.secrets_dir is None  # the replicas stay open mode
    assert FleetSettings(secrets_dir=tmp_path).router_key_file == DeploymentSecrets(tmp_path).router_key
    assert FleetSettings().router_key_file is None and GRPC.router_key_file is None
    with pytest.raises(ConfigError, match="passes no tenant identity"):
        FleetSettings(worker_protocol="grpc", secrets_dir=tmp_path)
    with pytest.raises(ConfigError, match="not both"):  # one source of the router's key
        FleetSettings(secrets_dir=tmp_path, control_key_file=key_file)


def test_the_router_and_join_commands_read_the_key_from_its_file_and_no_command_line_carries_it(tmp_path):
    key_file, key = _key_file(tmp_path / "secrets")
    for command in (["router", "--worker-protocol", "grpc", "--control-key-file", str(key_file)],
                    ["join", "--router", "http://router:30000", "--replica", "http://triton:9000",
                     "--worker-protocol", "grpc", "--control-key-file", str(key_file)]):
        settings = fleet_settings(_parser().parse_args(command))
        assert settings.grpc and settings.secrets_dir is None and settings.control_key_file == key_file
        assert control_key(settings) == key  # what join's RouterClient sends and the router's launcher reads
    argv = smg_argv(settings, port=30000, prometheus_port=29000, served=served_model(settings))
    assert argv[3:5] == ["--control-key-file", str(key_file)]
    assert not any(key in arg for arg in argv)
    with pytest.raises(ConfigError, match="router_control.key"):  # a missing file: named, before smg starts
        control_key(dataclasses.replace(settings, control_key_file=tmp_path / "none" / "router_control.key"))


def test_a_grpc_fleet_makes_its_routers_key_once_per_run_owner_only(tmp_path):
    served = served_model(GRPC)
    settings = dataclasses.replace(GRPC, work_dir=tmp_path / "fleet")
    keys = []
    for _ in range(2):  # the same work folder, a new key
        fleet = Fleet(settings, served)
        key_file = fleet.settings.control_key_file
        assert key_file is not None and key_file.parent == tmp_path / "fleet"
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        key = key_file.read_text().strip()
        assert fleet.router._control_key == key  # its memberships register with it
        assert fleet.router.process.argv[3:5] == ["--control-key-file", str(key_file)]
        assert not any(key in arg for arg in fleet.router.process.argv)
        keys.append(key)
    assert keys[0] != keys[1]
    given, key = _key_file(tmp_path / "secrets")
    fleet = Fleet(dataclasses.replace(settings, control_key_file=given), served)
    assert fleet.settings.control_key_file == given and fleet.router._control_key == key
    assert Fleet(dataclasses.replace(settings, worker_protocol="http")).router._control_key is None  # as before


@pytest.fixture(scope="module")
def grpc_router(tmp_path_factory) -> Iterator[tuple[Router, str]]:
    key_file, key = _key_file(tmp_path_factory.mktemp("secrets"))
    settings = FleetSettings(worker_protocol="grpc", port=0, control_key_file=key_file, health_check_interval_s=1)
    router = Router(settings, tmp_path_factory.mktemp("router"), served_model(settings))
    router.start()
    try:
        yield router, key
    finally:
        router.stop()


def test_over_grpc_the_routers_worker_api_refuses_a_caller_without_the_control_key(grpc_router):
    router, key = grpc_router
    attacker = {"url": "grpc://127.0.0.1:9", "runtime": "vllm", "connection_mode": "grpc", "kv_block_size": 16}
    for wrong in (None, "not-the-key", key[:-1]):
        assert _call(f"{router.url}/workers", "POST", attacker, key=wrong) == 401
        assert _call(f"{router.url}/workers", "GET", key=wrong) == 401
        assert _call(f"{router.url}/workers/any-id", "DELETE", key=wrong) == 401
    assert router.workers() == []  # the key is taken, and nothing was added
    with pytest.raises(ServerError, match="401"):
        RouterClient(router.url, 1).workers()
    # The key was read from its file: it is on no process's command line.
    assert_on_no_command_line(key)
