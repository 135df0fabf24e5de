"""The monitor's rounds and the HTTP endpoints, with a fake probe function and a fake repository."""

from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.request

import pytest

from tests.waiting import HANG_S
from warmup_tools.common.errors import ConfigError, ServerError
from warmup_tools.sidecar.config import SidecarConfig
from warmup_tools.sidecar.endpoints import SidecarHttpServer
from warmup_tools.sidecar.health import ProbeResult
from warmup_tools.sidecar.monitor import Monitor

STUB_DEAD = "Stub process 'lora_adapter_0_0' is not healthy."


class FakeTriton:
    """Models that answer until ``kill()``; ``reload`` brings a model back (or fails while ``refuse``)."""

    def __init__(self) -> None:
        self.dead: set[str] = set()
        self.calls: list[tuple[str, str]] = []
        self.refuse = False
        self.server_up = True

    def probe(self, model: str) -> ProbeResult:
        if "lora_adapter" in self.dead and model in ("lora_adapter", "ensemble"):
            return ProbeResult(False, 0.001, 0.0, STUB_DEAD)
        return ProbeResult(model not in self.dead, 0.001, 0.0, "" if model not in self.dead else "timed out")

    def server_ready(self) -> tuple[bool, str]:
        return self.server_up, "" if self.server_up else "connection refused"

    def reload(self, model: str, timeout_s: float | None = None) -> None:
        self.calls.append(("reload", model))
        if self.refuse:
            raise ServerError("repository API models/lora_adapter/unload: HTTP 403")
        self.dead.discard(model)

    def ensure_loaded(self, model: str, timeout_s: float | None = None) -> bool:
        self.calls.append(("ensure_loaded", model))
        return False


def monitor_for(triton: FakeTriton, **config: object) -> Monitor:
    now = iter(range(0, 10_000, 2))
    return Monitor(SidecarConfig(**config), triton.probe, triton.server_ready, triton,
                   plan_id="default-0001", clock=lambda: float(next(now)))


def test_a_dead_stub_is_reloaded_and_readiness_follows():
    triton = FakeTriton()
    monitor = monitor_for(triton)
    monitor.run_once()
    assert monitor.readiness().ready
    triton.dead.add("lora_adapter")
    monitor.run_once()  # probe fails with the stub error -> reload in the same round
    assert triton.calls == [("reload", "lora_adapter"), ("ensure_loaded", "ensemble")]
    assert not monitor.readiness().ready  # reloaded, but no probe has passed since
    monitor.run_once()
    assert monitor.readiness().ready
    status = monitor.snapshot()
    assert status["last_recovery"]["model"] == "lora_adapter" and status["last_recovery"]["ok"]
    assert status["models"]["lora_adapter"]["recoveries"] == 1
    assert status["plan_id"] == "default-0001"


def test_a_model_that_keeps_failing_is_reloaded_after_n_rounds():
    triton = FakeTriton()
    monitor = monitor_for(triton, failures_to_recover=2)
    monitor.run_once()
    triton.dead.add("embedding_cache")
    monitor.run_once()
    assert triton.calls == [] and not monitor.readiness().ready
    monitor.run_once()
    assert triton.calls[0] == ("reload", "embedding_cache")


def test_a_refused_reload_is_reported_and_the_server_being_down_skips_probes():
    triton = FakeTriton()
    triton.refuse = True
    monitor = monitor_for(triton)
    monitor.run_once()
    triton.dead.add("lora_adapter")
    monitor.run_once()
    readiness = monitor.readiness()
    assert not readiness.ready and "reload failed" in readiness.reason and "403" in readiness.reason
    triton.server_up = False
    monitor.run_once()
    assert monitor.readiness().reason == "connection refused"


def test_endpoints_answer_from_the_last_round():
    triton = FakeTriton()
    monitor = monitor_for(triton)
    server = SidecarHttpServer(monitor, port=0)
    server.start()
    try:
        status, body = get(server.url + "/ready")
        assert status == 503 and body["ready"] is False and "not probed yet" in body["reason"]
        assert get(server.url + "/live") == (200, {"live": True})
        monitor.run_once()
        assert get(server.url + "/ready") == (200, {"ready": True, "temperature": "warm", "adapters": {}})
        monitor.run_once()
        monitor.run_once()  # three hot rounds in a row (temperature_confirm_rounds): hot
        assert get(server.url + "/ready")[1]["temperature"] == "hot"
        with urllib.request.urlopen(server.url + "/metrics", timeout=10) as response:
            assert 'warmup_temperature{adapter="",scope="replica"} 2.0' in response.read().decode()
        status, body = get(server.url + "/status")
        assert status == 200 and body["models"]["ensemble"]["state"] == "healthy"
        assert body["models"]["ensemble"]["last_probe"]["ok"] is True
        assert get(server.url + "/nope")[0] == 404
    finally:
        server.stop()


def test_no_public_endpoint_names_a_plan_id():
    """A plan id is what a warm-up sample carries: /status, /metrics and /ready never show one (the
    monitor keeps it, and its log names it)."""
    from warmup_tools.sidecar.coverage import evaluate

    monitor = monitor_for(FakeTriton())
    monitor.sections["coverage_example"] = lambda: evaluate({}, threshold=0.9, now=0, stale_s=30).status
    monitor.sections["replan"] = lambda: {"last": {"plan_id": "live-0002", "previous": "default-0001"}}
    server = SidecarHttpServer(monitor, port=0)
    server.start()
    try:
        monitor.run_once()
        assert monitor.snapshot()["plan_id"] == "default-0001"  # kept inside the sidecar
        bodies = [json.dumps(get(server.url + path)[1]) for path in ("/status", "/ready")]
        with urllib.request.urlopen(server.url + "/metrics", timeout=10) as response:
            bodies.append(response.read().decode())
        for body in bodies:
            assert "default-0001" not in body and "live-0002" not in body and "plan_id" not in body
        from warmup_tools.sidecar.endpoints import public_status

        assert public_status({"a": [{"plan_id": "x", "b": 1}], "plan_id": "y"}) == {"a": [{"b": 1}]}
        # Nor inside a text: a canary verdict's reason, an error quoting a plan or a stored plan's history id.
        snapshot = {"canary": {"verdicts": [{"plan_id": "live-0003", "reason": "did not apply plan live-0003 in 9 s"}],
                               "error": "plan 0123456789abcdef is on trial already"}}
        assert public_status(snapshot) == {"canary": {"verdicts": [{"reason": "did not apply plan <plan> in 9 s"}],
                                                      "error": "plan <plan> is on trial already"}}
    finally:
        server.stop()


def test_config_is_validated():
    with pytest.raises(ConfigError, match="probe_interval_s"):
        SidecarConfig(probe_interval_s=0)
    with pytest.raises(ConfigError, match="failures_to_recover"):
        SidecarConfig(failures_to_recover=0)


def get(url: str, timeout_s: float = 10) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


def test_half_sent_requests_hold_no_more_threads_than_the_pool_and_are_dropped_at_their_deadline():
    monitor = monitor_for(FakeTriton())
    # NOTE: the short deadline only bounds how long the test runs; nothing below is asserted on time.
    server = SidecarHttpServer(monitor, port=0, workers=4, timeout_s=0.2)
    server.start()
    host, port = server.url.removeprefix("http://").split(":")
    half_sent = []
    try:
        threads = threading.active_count()
        for _ in range(40):
            conn = socket.create_connection((host, int(port)), timeout=30)
            conn.sendall(b"GET /live HTTP/1.1\r\nHost: x\r\n")  # never finished
            half_sent.append(conn)
        # Answered after the 40 (the accept loop takes connections in order), with no thread more: once every
        # one of them reached its deadline, however long this machine takes to get there.
        assert get(server.url + "/live", timeout_s=HANG_S) == (200, {"live": True})
        assert threading.active_count() == threads
        for conn in half_sent:
            assert conn.recv(1024) == b""  # closed by the server at its deadline, without an answer
        assert get(server.url + "/live") == (200, {"live": True})
    finally:
        for conn in half_sent:
            conn.close()
        server.stop()
