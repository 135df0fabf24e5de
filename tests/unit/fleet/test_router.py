"""The real smg router as the fleet launches it (fleet/router.py): in trust mode its worker API answers only the
deployment's control-plane key, and ``/v1/*`` is unchanged; in open mode (a local fleet on the loopback) it is
open. Also: one command line for every deployment (``smg_argv``)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from tests.unit.fleet.test_membership import TENANT_KEY, FakeFront, _serve
from warmup_tools.common.errors import ConfigError, ServerError
from warmup_tools.fleet.router import Router, RouterClient, smg_argv
from warmup_tools.fleet.settings import TEXT_ROUTER_POLICIES, FleetSettings
from warmup_tools.front.settings import FrontSettings
from warmup_tools.ops.deploy_secrets import make_deployment_secrets


def _call(url: str, method: str, body: dict | None = None, key: str | None = None) -> int:
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None,
                                     method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


@pytest.fixture(scope="module")
def trust_router(tmp_path_factory) -> Iterator[tuple[Router, str]]:
    secrets = make_deployment_secrets(tmp_path_factory.mktemp("secrets"))
    router = Router(FleetSettings(port=0, secrets_dir=secrets.folder, health_check_interval_s=1),
                    tmp_path_factory.mktemp("router"))
    router.start()
    try:
        yield router, secrets.read_key(secrets.router_key)
    finally:
        router.stop()


def test_in_trust_mode_the_worker_api_refuses_a_caller_without_the_control_key(trust_router):
    router, key = trust_router
    attacker = {"url": "http://127.0.0.1:9/m/support", "runtime_type": "generic", "models": [{"id": "support"}]}
    for wrong in (None, "not-the-key", key[:-1]):
        assert _call(f"{router.url}/workers", "POST", attacker, key=wrong) == 401
        assert _call(f"{router.url}/workers", "GET", key=wrong) == 401
        assert _call(f"{router.url}/workers/any-id", "DELETE", key=wrong) == 401
    assert router.workers() == []  # nothing was added
    with pytest.raises(ServerError, match="401"):
        RouterClient(router.url, 1).workers()


def test_in_trust_mode_the_control_key_adds_a_worker_the_router_health_checks_and_routes_to(trust_router):
    router, _ = trust_router
    front = FakeFront(tenant_key=TENANT_KEY)  # answers as a trust-mode front: /health to anyone, models to a key
    server = _serve(front.handle)
    try:
        url = f"http://127.0.0.1:{server.server_port}/m/support"
        worker_id = router.add(url, "support", timeout_s=60)
        assert [w["url"] for w in router.workers() if w["id"] == worker_id] == [url]
        router.remove(worker_id, timeout_s=60)
    finally:
        server.shutdown()
        server.server_close()
    # The OpenAI API needs no control key (a tenant's own key goes to the replica).
    assert _call(f"{router.url}/v1/models", "GET") == 200


def test_every_deployment_launches_the_router_with_one_command_line(tmp_path):
    settings = FleetSettings(host="0.0.0.0", policy="cache_aware")
    open_mode = smg_argv(settings, port=30000, prometheus_port=29000)
    trust = smg_argv(dataclasses.replace(settings, secrets_dir=tmp_path), port=30000, prometheus_port=29000)
    assert open_mode[1:3] == ["-m", "warmup_tools.fleet.smg_launch"] and "--control-key-file" not in open_mode
    # the launcher reads the deployment's router_control.key from the file
    assert trust[3:5] == ["--control-key-file", str(tmp_path / "router_control.key")]
    flags = dict(zip(open_mode[3::2], open_mode[4::2]))
    assert flags["--policy"] == "cache_aware" and flags["--health-check-endpoint"] == "/health"
    assert flags["--port"] == "30000" and flags["--prometheus-port"] == "29000"


def test_the_router_keeps_no_history_and_refuses_a_body_the_front_would():
    flags = dict(zip(*[iter(smg_argv(FleetSettings(), port=1, prometheus_port=2)[3:])] * 2))
    assert flags["--history-backend"] == "none"  # no conversation or response store for anyone to fill
    assert flags["--max-payload-size"] == str(FrontSettings().max_body_bytes)


def test_the_routers_warm_up_slice_is_off_unless_asked():
    """Replicas join warm: smg's warm-up slice (a share of the fleet's cache misses to a new worker) is off by
    default and the setting's value when given."""
    flags = dict(zip(*[iter(smg_argv(FleetSettings(), port=1, prometheus_port=2)[3:])] * 2))
    assert flags["--worker-warmup-secs"] == "0"
    asked = dict(zip(*[iter(smg_argv(FleetSettings(warmup_slice_s=60), port=1, prometheus_port=2)[3:])] * 2))
    assert asked["--worker-warmup-secs"] == "60"


def test_in_trust_mode_the_router_never_routes_on_the_requests_text(tmp_path):
    """cache_aware keeps one tree of what every tenant sent, prefix_hash hashes the prompt: in trust mode the router
    runs trust_policy instead, which keeps no state built from any request's text."""
    for policy in TEXT_ROUTER_POLICIES:
        trust = FleetSettings(policy=policy, secrets_dir=tmp_path)
        flags = dict(zip(*[iter(smg_argv(trust, port=1, prometheus_port=2)[5:])] * 2))
        assert flags["--policy"] == trust.trust_policy == "least_load"
        assert FleetSettings(policy=policy).routed_policy == policy  # open mode: as asked
    assert FleetSettings(policy="round_robin", secrets_dir=tmp_path).routed_policy == "round_robin"
    with pytest.raises(ConfigError):
        FleetSettings(trust_policy="cache_aware")


def assert_on_no_command_line(key: str) -> None:
    """No process of the machine carries ``key`` in its command line (/proc/*/cmdline)."""
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            assert key.encode() not in cmdline, f"the control key is on the command line of process {proc.name}"


def test_the_routers_control_key_is_on_no_command_line(trust_router):
    """smg 1.13 takes the key on its command line only; the launcher reads it from the secrets folder instead."""
    router, key = trust_router
    assert not any(key in arg for arg in router.process.argv)
    # NOTE: smg renames its process once started (setproctitle), which hid an argv key from a later `ps` but not
    # from one during its start, nor from exec auditing: the key must not be in the argv at all.
    assert isinstance(router.workers(), list)  # up, and the key read from the folder works
    assert_on_no_command_line(key)


def test_the_launcher_without_the_key_file_exits_with_one_line_naming_it(tmp_path):
    done = subprocess.run([sys.executable, "-m", "warmup_tools.fleet.smg_launch", "--control-key-file",
                           str(tmp_path / "router_control.key"), "--port", "1"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "router_control.key" in done.stderr and "Traceback" not in done.stderr
