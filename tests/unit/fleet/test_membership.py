"""A replica's membership in the router against a fake smg worker API and a fake front (in-process HTTP
servers): workers follow the models the front serves, come back after a router restart, are never added while
/health fails, and are all removed at stop."""

from __future__ import annotations

import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator

import pytest

from warmup_tools.fleet.membership import Membership
from warmup_tools.fleet.router import RouterClient


class FakeRouter:
    """smg 1.13's worker API as the membership uses it: POST /workers (ready at once), GET /workers, DELETE
    /workers/{id} (draining, then gone on the next listing); :meth:`restart` forgets every worker."""

    def __init__(self) -> None:
        self.workers: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()

    def restart(self) -> None:
        with self.lock:
            self.workers.clear()

    def urls(self, status: str = "ready") -> set[str]:
        with self.lock:
            return {w["url"] for w in self.workers.values() if w["status"] == status}

    def handle(self, method: str, path: str, body: dict[str, Any] | None) -> tuple[int, dict[str, Any]]:
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
    """A replica's front: /health says ``status``, /v1/models lists ``models``."""

    def __init__(self) -> None:
        self.status = 200
        self.models = ["base", "support"]

    def handle(self, method: str, path: str, body: dict[str, Any] | None) -> tuple[int, dict[str, Any]]:
        if path == "/health":
            return self.status, {}
        if path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]}
        return 404, {}


def _serve(app: Callable[[str, str, dict[str, Any] | None], tuple[int, dict[str, Any]]]) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            status, answer = app(self.command, self.path, body)
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


@pytest.fixture()
def parts() -> Iterator[tuple[FakeRouter, FakeFront, Membership]]:
    router, front = FakeRouter(), FakeFront()
    router_server, front_server = _serve(router.handle), _serve(front.handle)
    replica = f"http://127.0.0.1:{front_server.server_port}"
    membership = Membership(replica, RouterClient(f"http://127.0.0.1:{router_server.server_port}", 1), 0.05)
    try:
        yield router, front, membership
    finally:
        membership.stop()
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
    time.sleep(0.3)  # several looks
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
    _until(lambda: router.urls() == _urls(membership, "base", "legal"), "the retired adapter's worker removed")
    assert set(membership.workers) == {"base", "legal"}


def test_workers_come_back_after_a_router_restart(parts):
    router, _, membership = parts
    membership.start()
    _until(lambda: len(membership.workers) == 2, "joined")  # both registrations answered
    before = set(membership.workers.values())
    router.restart()
    _until(lambda: router.urls() == _urls(membership, "base", "support"), "added again")
    assert not before & set(membership.workers.values())  # new registrations, not the lost ids


def test_a_loop_that_restarted_adopts_the_workers_it_registered_before(parts):
    router, front, membership = parts
    membership.sync()
    again = Membership(membership.replica_url, membership.router, 0.05)
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
    router, _, membership = parts
    gone = Membership(membership.replica_url, RouterClient("http://127.0.0.1:9", 1), 0.05)
    gone.start()
    time.sleep(0.2)  # failing looks are logged, the loop goes on
    assert gone._thread.is_alive()
    gone.stop()
    assert not gone._thread.is_alive() and router.workers == {}


def test_the_join_command_keeps_the_membership_until_sigterm_then_leaves(parts):
    import signal
    import subprocess
    import sys

    from warmup_tools.server.config import REPO_ROOT

    router, front, membership = parts
    command = [sys.executable, "-m", "warmup_tools", "join", "--router", membership.router.url,
               "--replica", membership.replica_url, "--interval-s", "0.05"]
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
