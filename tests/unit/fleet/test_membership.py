"""A replica's membership in the router against a fake smg worker API and a fake front (in-process HTTP
servers): workers follow the models the front serves, come back after a router restart, are never added while
/health fails, and are all removed at stop.

The fakes answer as the real parts do in both modes: in trust mode the front lists its models only to a tenant key
(401 in OpenAI's error body otherwise, /health stays open) and the router's worker API only to its control-plane
key (401 otherwise). tests/unit/fleet/test_router.py checks the real smg's answers, and
tests/integration/test_fleet_trust.py the whole fleet as shipped."""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator

import pytest

from warmup_tools.common.errors import ServerError
from warmup_tools.fleet.membership import Membership
from warmup_tools.fleet.router import RouterClient


class FakeRouter:
    """smg 1.13's worker API as the membership uses it: POST /workers (ready at once), GET /workers, DELETE
    /workers/{id} (draining, then gone on the next listing); :meth:`restart` forgets every worker."""

    def __init__(self, control_key: str | None = None) -> None:
        self.workers: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()
        self.control_key = control_key

    def restart(self) -> None:
        with self.lock:
            self.workers.clear()

    def urls(self, status: str = "ready") -> set[str]:
        with self.lock:
            return {w["url"] for w in self.workers.values() if w["status"] == status}

    def handle(self, method: str, path: str, body: dict[str, Any] | None,
               authorization: str | None = None) -> tuple[int, dict[str, Any]]:
        locked = self.control_key is not None and authorization != f"Bearer {self.control_key}"
        if path.startswith("/workers") and locked:
            return 401, {"error": "Unauthorized"}  # smg 1.13 with --control-plane-api-keys
        with self.lock:
            if method == "GET" and path == "/workers":
                listed = [dict(w) for w in self.workers.values()]
                for worker_id in [i for i, w in self.workers.items() if w["status"] == "draining"]:
                    del self.workers[worker_id]
                return 200, {"workers": listed}
            if method == "POST" and path == "/workers":
                assert body is not None and body["models"][0]["id"] and body["url"].endswith(body["models"][0]["id"])
                worker_id = uuid.uuid4().hex
                self.workers[worker_id] = {"id": worker_id, "url": body["url"], "status": "ready"}
                return 202, {"worker_id": worker_id}
            if method == "DELETE" and path.startswith("/workers/"):
                worker = self.workers.get(path.rsplit("/", 1)[1])
                if worker is None:
                    return 404, {"error": "no such worker"}
                worker["status"] = "draining"
                return 202, {}
        return 404, {}


class FakeFront:
    """A replica's front: /health says ``status`` (to anyone, as the real one does), /v1/models lists ``models``;
    with ``tenant_key`` (trust mode) only to that bearer key, 401 otherwise. ``health_looks`` counts /health calls."""

    def __init__(self, tenant_key: str | None = None) -> None:
        self.status = 200
        self.models = ["base", "support"]
        self.tenant_key = tenant_key
        self.health_looks = 0

    def handle(self, method: str, path: str, body: dict[str, Any] | None,
               authorization: str | None = None) -> tuple[int, dict[str, Any]]:
        if path.startswith("/m/"):  # a worker's URL: the front serves every path under /m/<model> too
            path = "/" + path.split("/", 3)[3] if path.count("/") >= 3 else "/"
        if path == "/health":
            self.health_looks += 1
            return self.status, {}
        if path == "/v1/models":
            if self.tenant_key is not None and authorization != f"Bearer {self.tenant_key}":
                return 401, {"error": {"message": "a valid API key is required", "type": "invalid_request_error",
                                       "param": None, "code": "invalid_api_key"}}
            return 200, {"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]}
        return 404, {}


def _serve(app: Callable[..., tuple[int, dict[str, Any]]]) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            status, answer = app(self.command, self.path, body, self.headers.get("Authorization"))
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_DELETE = _answer

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    return server


ROUTER_KEY, TENANT_KEY = "router-control-key", "probe-tenant-key"


@pytest.fixture(params=["open", "trust"])
def parts(request) -> Iterator[tuple[FakeRouter, FakeFront, Membership]]:
    """The fakes and a membership of the mode the test is parametrised with (every test runs in both)."""
    trust = request.param == "trust"
    router, front = FakeRouter(ROUTER_KEY if trust else None), FakeFront(TENANT_KEY if trust else None)
    router_server, front_server = _serve(router.handle), _serve(front.handle)
    replica = f"http://127.0.0.1:{front_server.server_port}"
    client = RouterClient(f"http://127.0.0.1:{router_server.server_port}", 1, control_key=router.control_key)
    membership = Membership(replica, client, 0.05, replica_key=front.tenant_key)
    try:
        yield router, front, membership
    finally:
        membership.stop()
        for server in (router_server, front_server):
            server.shutdown()
            server.server_close()


@pytest.fixture()
def trust_parts() -> Iterator[tuple[FakeRouter, FakeFront, str, str]]:
    """A trust-mode router and front, and their URLs, for memberships a test builds itself."""
    router, front = FakeRouter(ROUTER_KEY), FakeFront(TENANT_KEY)
    router_server, front_server = _serve(router.handle), _serve(front.handle)
    try:
        yield (router, front, f"http://127.0.0.1:{router_server.server_port}",
               f"http://127.0.0.1:{front_server.server_port}")
    finally:
        for server in (router_server, front_server):
            server.shutdown()
            server.server_close()


def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _urls(membership: Membership, *models: str) -> set[str]:
    return {membership.worker_url(m) for m in models}


def test_a_warm_replica_gets_one_worker_per_model_it_serves(parts):
    router, _, membership = parts
    membership.sync()
    assert router.urls() == _urls(membership, "base", "support")
    assert set(membership.workers) == {"base", "support"}
    membership.sync()  # nothing changed: nothing added twice
    assert len(router.workers) == 2


def test_no_worker_is_added_while_health_is_not_200(parts):
    router, front, membership = parts
    front.status = 503
    membership.start()
    _until(lambda: front.health_looks >= 5, "several looks at a replica that is not warm")
    assert router.workers == {} and membership.workers == {}
    front.status = 200  # warm now: it joins
    _until(lambda: router.urls() == _urls(membership, "base", "support"), "joined once warm")


def test_a_replica_that_stops_being_warm_keeps_its_workers_for_the_routers_health_checks(parts):
    router, front, membership = parts
    membership.sync()
    front.status = 503
    front.models = ["base", "support", "sql"]  # an adapter went live meanwhile: not added while not warm
    membership.sync()
    assert router.urls() == _urls(membership, "base", "support")
    front.status = 200
    membership.sync()
    assert router.urls() == _urls(membership, "base", "support", "sql")


def test_an_adapter_made_live_later_is_added_and_a_retired_one_removed(parts):
    router, front, membership = parts
    membership.start()
    _until(lambda: router.urls() == _urls(membership, "base", "support"), "joined")
    front.models = ["base", "support", "legal"]
    _until(lambda: router.urls() == _urls(membership, "base", "support", "legal"), "the new adapter's worker")
    front.models = ["base", "legal"]
    # NOTE: the loop forgets a worker just after the router took it out: wait for both, not for the first.
    _until(lambda: router.urls() == _urls(membership, "base", "legal") and set(membership.workers) == {"base", "legal"},
           "the retired adapter's worker removed")


def test_workers_come_back_after_a_router_restart(parts):
    router, _, membership = parts
    membership.start()
    _until(lambda: len(membership.workers) == 2, "joined")  # both registrations answered
    before = set(membership.workers.values())
    router.restart()
    _until(lambda: router.urls() == _urls(membership, "base", "support"), "added again")
    assert not before & set(membership.workers.values())  # new registrations, not the lost ids


def test_listed_means_every_model_served_has_a_worker_at_the_router(parts):
    router, front, membership = parts
    assert not membership.listed()  # nothing registered yet
    membership.sync()
    assert membership.listed()
    router.restart()
    assert not membership.listed()
    membership.sync()
    front.models = ["base", "support", "legal"]  # one of three still missing is not listed
    assert not membership.listed()
    membership.sync()
    assert membership.listed()


def test_a_loop_that_restarted_adopts_the_workers_it_registered_before(parts):
    router, front, membership = parts
    membership.sync()
    again = Membership(membership.replica_url, membership.router, 0.05, replica_key=membership.replica_key)
    again.sync()
    assert again.workers == membership.workers and len(router.workers) == 2


def test_stop_removes_every_worker_and_waits_until_they_drain(parts):
    router, _, membership = parts
    membership.start()
    _until(lambda: len(router.urls()) == 2, "joined")
    membership.stop()  # returns once the router lists them draining or gone
    assert router.urls() == set() and membership.workers == {}
    assert not membership._thread.is_alive()


def test_stop_without_a_loop_leaves_too(parts):
    router, _, membership = parts
    membership.sync()
    membership.stop()
    assert router.urls() == set()


def test_a_router_that_does_not_answer_is_tried_again(parts):
    router, front, membership = parts
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, then closes without an answer
    calls = []

    def hang_up() -> None:
        while True:
            try:
                connection, _ = silent.accept()
            except OSError:
                return
            calls.append(1)
            connection.close()

    threading.Thread(target=hang_up, daemon=True).start()
    try:
        gone = Membership(membership.replica_url, RouterClient(f"http://127.0.0.1:{silent.getsockname()[1]}", 1), 0.05,
                          replica_key=membership.replica_key)
        gone.start()
        _until(lambda: len(calls) >= 3, "three looks at a router that hangs up")  # each failing look is logged
        assert gone._thread.is_alive()
        gone.stop()
    finally:
        silent.close()
    assert not gone._thread.is_alive() and router.workers == {}


def test_in_trust_mode_a_membership_without_the_keys_adds_nothing_and_says_why(trust_parts, caplog):
    router, front, router_url, replica_url = trust_parts
    no_tenant_key = Membership(replica_url, RouterClient(router_url, 1, control_key=ROUTER_KEY), 0.05)
    with pytest.raises(ServerError, match="401.*trust mode.*--secrets-dir"):
        no_tenant_key.sync()
    no_router_key = Membership(replica_url, RouterClient(router_url, 1), 0.05, replica_key=TENANT_KEY)
    with pytest.raises(ServerError, match="401"):
        no_router_key.sync()
    wrong_keys = Membership(replica_url, RouterClient(router_url, 1, control_key="wrong"), 0.05, replica_key="wrong")
    with pytest.raises(ServerError, match="401"):
        wrong_keys.sync()
    assert router.workers == {}
    with_keys = Membership(replica_url, RouterClient(router_url, 1, control_key=ROUTER_KEY), 0.05,
                           replica_key=TENANT_KEY)
    with_keys.sync()
    assert router.urls() == {with_keys.worker_url(m) for m in ("base", "support")}


def test_the_join_command_keeps_the_membership_until_sigterm_then_leaves(parts, tmp_path):
    import signal
    import subprocess
    import sys

    from warmup_tools.common.deployment import DeploymentSecrets
    from warmup_tools.server.config import REPO_ROOT

    router, front, membership = parts
    command = [sys.executable, "-m", "warmup_tools", "join", "--router", membership.router.url,
               "--replica", membership.replica_url, "--interval-s", "0.05"]
    if router.control_key is not None:  # trust mode: the keys from the deployment's secrets folder
        secrets = DeploymentSecrets(tmp_path)
        secrets.router_key.write_text(router.control_key + "\n")
        secrets.probe_key.write_text(f"{front.tenant_key}\n")
        command += ["--secrets-dir", str(tmp_path)]
    process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _until(lambda: router.urls() == _urls(membership, "base", "support"), "the join process registered")
        front.models = ["base", "support", "sql"]
        _until(lambda: router.urls() == _urls(membership, "base", "support", "sql"), "the new adapter added")
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 0, output
    assert router.urls() == set() and "left" in output
