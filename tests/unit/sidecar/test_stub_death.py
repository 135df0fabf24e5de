"""When a stub dies: reload its model, or restart tritonserver (a decoupled model's stub that held requests).

The rule (:func:`decide`), the monitor acting on it with a fake server, and the facts read from Triton's
HTTP endpoints (served here by a small HTTP server; tests/integration/test_sidecar.py runs the real one).
"""

from __future__ import annotations

import http.server
import inspect
import json
import threading

import pytest

from warmup_tools.common.errors import ConfigError, ServerError
from warmup_tools.sidecar.config import SidecarConfig
from warmup_tools.sidecar.monitor import Monitor
from warmup_tools.sidecar.stub_death import (
    RELOAD,
    RESTART,
    RUNNING_SEQUENCES,
    WAITING_SEQUENCES,
    StubDeathFacts,
    decide,
)
from warmup_tools.sidecar.stubs import StubFault
from warmup_tools.triton import metrics

from .test_monitor import FakeTriton

DEAD = StubFault(7, "lora_adapter_0_0", "exited")


@pytest.mark.parametrize(("mode", "decoupled", "in_flight", "action"), [
    ("restart", True, 1, RESTART),
    ("restart", True, None, RESTART),  # the gauges unreadable
    ("restart", True, 0, RESTART),  # the gauges lag a request's first step: 0 proves nothing
    ("restart", None, None, RESTART),  # the model's configuration unreadable: it may be decoupled
    ("restart", False, 5, RELOAD),  # not decoupled: Triton answers its requests with the stub error
    ("reload", True, 5, RELOAD),
    ("reload", None, None, RELOAD),
])
def test_decide_restarts_for_a_dead_decoupled_stub_and_reloads_otherwise(mode, decoupled, in_flight, action):
    decision = decide(mode, "lora_adapter", decoupled, in_flight)
    assert decision.action == action
    assert decision.reason
    if action == RESTART:
        assert ("unknown" if in_flight is None else str(in_flight)) in decision.reason


class FakeFacts:
    def __init__(self, decoupled: bool | None, in_flight: int | None) -> None:
        self._decoupled, self._in_flight = decoupled, in_flight
        self.asked: list[tuple[str, str]] = []

    def decoupled(self, model: str) -> bool | None:
        return self._decoupled

    def in_flight(self, model: str, instance: str) -> int | None:
        self.asked.append((model, instance))
        return self._in_flight


class Restarter:
    """Counts restarts; sees what the monitor publishes while one is under way."""

    def __init__(self, monitor_ref: list[Monitor], fail: bool = False) -> None:
        self.monitor_ref = monitor_ref
        self.fail = fail
        self.during: list[tuple[bool, str]] = []

    def __call__(self) -> None:
        readiness = self.monitor_ref[0].readiness()
        self.during.append((readiness.ready, readiness.reason))
        if self.fail:
            raise ServerError("tritonserver exited with code 1 before it was ready")


def monitor_with(facts: FakeFacts, *, fail: bool = False, **config: object):
    triton = FakeTriton()
    faults: dict[str, StubFault] = {}
    ref: list[Monitor] = []
    restarter = Restarter(ref, fail=fail)
    monitor = Monitor(SidecarConfig(**config), triton.probe, triton.server_ready, triton,
                      stub_faults=lambda: dict(faults), restart_server=restarter, stub_death=facts)
    ref.append(monitor)
    monitor.run_once()
    assert monitor.readiness().ready
    return monitor, triton, faults, restarter


def test_a_dead_decoupled_stub_that_held_a_stream_restarts_the_server_and_ready_waits_for_probes():
    facts = FakeFacts(decoupled=True, in_flight=1)
    monitor, triton, faults, restarter = monitor_with(facts)
    faults["lora_adapter"] = DEAD
    monitor.run_once()
    assert facts.asked == [("lora_adapter", "lora_adapter_0_0")]
    assert len(restarter.during) == 1 and triton.calls == []  # restarted, not reloaded
    ready, reason = restarter.during[0]
    assert not ready and reason.startswith("restarting tritonserver: lora_adapter: its Python backend stub (pid 7)")
    assert not monitor.readiness().ready  # until a probe round passes on the new server
    status = monitor.snapshot()
    assert status["restarts"] == 1 and status["failed_restarts"] == 0
    assert status["last_recovery"]["model"] == "tritonserver" and status["last_recovery"]["ok"]
    assert all(m["state"] == "unknown" for m in status["models"].values())
    faults.clear()
    monitor.run_once()
    assert monitor.readiness().ready and triton.calls == []  # the new server's stubs need no reload


@pytest.mark.parametrize(("facts", "config"), [
    (FakeFacts(decoupled=False, in_flight=None), {}),
    (FakeFacts(decoupled=True, in_flight=2), {"on_stub_death": "reload"}),
])
def test_otherwise_the_model_is_reloaded_as_before(facts, config):
    monitor, triton, faults, restarter = monitor_with(facts, **config)
    faults["lora_adapter"] = DEAD
    monitor.run_once()
    assert restarter.during == []
    assert triton.calls[0] == ("reload", "lora_adapter")


def test_without_a_server_to_restart_the_model_is_reloaded():
    triton = FakeTriton()
    faults: dict[str, StubFault] = {}
    monitor = Monitor(SidecarConfig(), triton.probe, triton.server_ready, triton, stub_faults=lambda: dict(faults),
                      stub_death=FakeFacts(decoupled=True, in_flight=1))
    monitor.run_once()
    faults["lora_adapter"] = DEAD
    monitor.run_once()
    assert triton.calls[0] == ("reload", "lora_adapter")


def test_a_failed_restart_is_reported_and_keeps_the_sidecar_unready():
    monitor, triton, faults, _ = monitor_with(FakeFacts(decoupled=True, in_flight=1), fail=True)
    faults["lora_adapter"] = DEAD
    monitor.run_once()
    status = monitor.snapshot()
    assert status["restarts"] == 0 and status["failed_restarts"] == 1
    assert not status["ready"] and "restarting tritonserver failed" in status["reason"]
    assert not status["last_recovery"]["ok"] and "exited with code 1" in status["last_recovery"]["error"]


def test_on_stub_death_and_the_grace_are_validated():
    assert SidecarConfig().on_stub_death == "restart"
    with pytest.raises(ConfigError, match="on_stub_death must be one of restart, reload"):
        SidecarConfig(on_stub_death="ignore")
    with pytest.raises(ConfigError, match="restart_grace_s"):
        SidecarConfig(restart_grace_s=0)


METRICS = """# HELP warmup_scheduler_running_sequences Sequences in the running batch of an instance
# TYPE warmup_scheduler_running_sequences gauge
warmup_scheduler_running_sequences{instance="lora_adapter_0_0",model="lora_adapter"} 2
warmup_scheduler_running_sequences{instance="lora_adapter_0_1",model="lora_adapter"} 0
# HELP warmup_scheduler_waiting_sequences Sequences waiting for a running slot on an instance
# TYPE warmup_scheduler_waiting_sequences gauge
warmup_scheduler_waiting_sequences{instance="lora_adapter_0_0",model="lora_adapter"} 1
warmup_scheduler_waiting_sequences{instance="lora_adapter_0_1",model="lora_adapter"} 0
"""


@pytest.fixture
def triton_http():
    """Triton's model configuration and /metrics endpoints, as 2.51 answers them."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            bodies = {
                "/metrics": METRICS.encode(),
                "/v2/models/lora_adapter/config": json.dumps(
                    {"name": "lora_adapter", "model_transaction_policy": {"decoupled": True}}).encode(),
                "/v2/models/tokenizer_cache/config": json.dumps({"name": "tokenizer_cache"}).encode(),
                "/v2/models/garbled/config": b"{not json",
            }
            body = bodies.get(self.path)
            self.send_response(200 if body is not None else 400)
            self.end_headers()
            self.wfile.write(body or b'{"error": "unknown model"}')

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


def test_the_facts_come_from_the_model_configuration_and_the_scheduler_gauges(triton_http):
    facts = StubDeathFacts(triton_http, f"http://{triton_http}/metrics")
    try:
        assert facts.decoupled("lora_adapter") is True
        assert facts.decoupled("tokenizer_cache") is False
        assert facts.decoupled("unknown") is None and facts.decoupled("garbled") is None
        assert facts.in_flight("lora_adapter", "lora_adapter_0_0") == 3  # running plus waiting
        assert facts.in_flight("lora_adapter", "lora_adapter_0_1") == 0
        assert facts.in_flight("lora_adapter", "lora_adapter_0_9") is None  # never reported
        assert facts.in_flight("lora_adapter", "") is None
    finally:
        facts.close()


def test_the_gauges_read_are_the_ones_the_scheduler_exports():
    source = inspect.getsource(metrics.SchedulerMetrics)
    assert f'name="{RUNNING_SEQUENCES}"' in source and f'name="{WAITING_SEQUENCES}"' in source
    assert 'labels = {"model": model, "instance": instance}' in source


def test_facts_that_cannot_be_read_are_unknown():
    facts = StubDeathFacts("127.0.0.1:9", "http://127.0.0.1:9/metrics", timeout_s=0.5)  # port 9: nothing there
    try:
        assert facts.decoupled("lora_adapter") is None
        assert facts.in_flight("lora_adapter", "lora_adapter_0_0") is None
    finally:
        facts.close()
    assert StubDeathFacts("127.0.0.1:9", None).in_flight("lora_adapter", "lora_adapter_0_0") is None
