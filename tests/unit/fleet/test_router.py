"""The real smg router as the fleet launches it (fleet/router.py): in trust mode its worker API answers only the
deployment's control-plane key, and ``/v1/*`` is unchanged; in open mode (a local fleet on the loopback) it is
open. Also: one command line for every deployment (``smg_argv``)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Iterator

import pytest

from tests.unit.fleet.test_membership import TENANT_KEY, FakeFront, _serve
from warmup_tools.common.errors import ServerError
from warmup_tools.fleet.router import Router, RouterClient, smg_argv
from warmup_tools.fleet.settings import FleetSettings
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


def test_every_deployment_launches_the_router_with_one_command_line():
    settings = FleetSettings(host="0.0.0.0", policy="cache_aware")
    open_mode = smg_argv(settings, port=30000, prometheus_port=29000, control_key=None)
    trust = smg_argv(settings, port=30000, prometheus_port=29000, control_key="k" * 64)
    assert trust[:len(open_mode)] == open_mode and "--control-plane-api-keys" not in open_mode
    spec = trust[trust.index("--control-plane-api-keys") + 1]
    assert spec.endswith(":admin:" + "k" * 64)  # smg's id:name:role:key
    flags = dict(zip(open_mode[2::2], open_mode[3::2]))
    assert flags["--policy"] == "cache_aware" and flags["--health-check-endpoint"] == "/health"
    assert flags["--port"] == "30000" and flags["--prometheus-port"] == "29000"
