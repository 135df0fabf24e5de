"""Saturation is not failure: a probe answered busy proves the model alive, and a model still generating tokens is
never reloaded because its probes time out (issue 41: one tenant's burst made every replica unready and reloaded
lora_adapter on both). The tracker and the monitor are fed by hand; the token counter is read from a /metrics page
as Triton serves it."""

from __future__ import annotations

import http.server
import inspect
import threading

import pytest

from warmup_tools.sidecar.config import SidecarConfig
from warmup_tools.sidecar.health import HealthTracker, ModelState, ProbeResult
from warmup_tools.sidecar.monitor import Monitor
from warmup_tools.sidecar.stub_death import OUTPUT_TOKENS, StubDeathFacts
from warmup_tools.triton import metrics

MODELS = ("tokenizer_cache", "embedding_cache", "lora_adapter", "ensemble")
BUSY = ("in ensemble 'ensemble', [busy] server busy: this instance already holds 72 requests (8 running at most, "
        "max_queue 64 waiting); retry later")
TIMED_OUT = "no response from lora_adapter within 5s"
STUB_DEAD = "Stub process 'lora_adapter_0_0' is not healthy."


def ok() -> ProbeResult:
    return ProbeResult(True, 0.01, 0.0)


def busy() -> ProbeResult:
    return ProbeResult(False, 0.01, 0.0, BUSY, busy=True)


def timed_out() -> ProbeResult:
    return ProbeResult(False, 5.0, 0.0, TIMED_OUT)


def ready_tracker() -> HealthTracker:
    tracker = HealthTracker(MODELS, failures_to_recover=3)
    tracker.record_server(True)
    for model in MODELS:
        tracker.record(model, ok())
    return tracker


def test_a_busy_answer_is_alive_however_many_in_a_row():
    tracker = ready_tracker()
    for _ in range(20):
        tracker.record("lora_adapter", busy())
        tracker.record("ensemble", busy())
    assert tracker.readiness().ready and tracker.to_recover(1e9) == []
    assert tracker.health["lora_adapter"].state is ModelState.HEALTHY
    status = tracker.snapshot()["models"]["lora_adapter"]
    assert status["busy_probes"] == 20 and status["consecutive_failures"] == 0
    # A model never probed before is ready on a busy answer too: it answered.
    fresh = HealthTracker(MODELS)
    fresh.record_server(True)
    for model in MODELS:
        fresh.record(model, busy() if model == "lora_adapter" else ok())
    assert fresh.readiness().ready


def test_a_model_generating_tokens_is_never_reloaded_for_probes_that_time_out():
    tracker = ready_tracker()
    for _ in range(20):
        tracker.record("lora_adapter", timed_out(), progressed=True)
    assert tracker.readiness().ready and tracker.to_recover(1e9) == []
    assert tracker.snapshot()["models"]["lora_adapter"]["stalled_probes"] == 20
    # Once the tokens stop, the timeouts count again: reloaded after failures_to_recover of them.
    for _ in range(2):
        tracker.record("lora_adapter", timed_out(), progressed=False)
    assert not tracker.readiness().ready and tracker.to_recover(1e9) == []
    tracker.record("lora_adapter", timed_out(), progressed=False)
    assert tracker.to_recover(1e9) == ["lora_adapter"]


def test_a_dead_stub_or_a_refused_probe_is_no_sign_of_life_whatever_the_tokens():
    tracker = ready_tracker()
    tracker.record("lora_adapter", ProbeResult(False, 0.01, 0.0, STUB_DEAD), progressed=True)
    assert tracker.to_recover(1e9) == ["lora_adapter"]
    tracker.record("lora_adapter", busy())  # another instance answering does not cancel the reload
    assert tracker.to_recover(1e9) == ["lora_adapter"]
    refused = HealthTracker(MODELS)
    refused.record_server(True)
    refused.record("lora_adapter", ProbeResult(False, 0.01, 0.0, "[invalid] bad probe", rejected=True), progressed=True)
    assert refused.health["lora_adapter"].state is ModelState.FAILING


class FloodedTriton:
    """lora_adapter and the ensemble saturated: their probes time out (or answer busy) while the token counter
    rises by ``rate`` each round; the composing models answer."""

    def __init__(self, answer: ProbeResult) -> None:
        self.answer = answer
        self.tokens = 0.0
        self.rate = 50.0
        self.calls: list[tuple[str, str]] = []

    def probe(self, model: str) -> ProbeResult:
        return self.answer if model in ("lora_adapter", "ensemble") else ok()

    def server_ready(self) -> tuple[bool, str]:
        return True, ""

    def output_tokens(self) -> dict[str, float]:
        self.tokens += self.rate
        return {"lora_adapter": self.tokens}

    def reload(self, model: str, timeout_s: float | None = None) -> None:
        self.calls.append(("reload", model))

    def ensure_loaded(self, model: str, timeout_s: float | None = None) -> bool:
        return False


def flooded_monitor(triton: FloodedTriton) -> Monitor:
    return Monitor(SidecarConfig(failures_to_recover=3, coverage_threshold=0), triton.probe, triton.server_ready,
                   triton, progress=triton.output_tokens)


@pytest.mark.parametrize("answer", [timed_out(), busy()], ids=["timing-out", "busy"])
def test_a_flooded_replica_stays_ready_and_nothing_is_reloaded_while_tokens_flow(answer):
    triton = FloodedTriton(answer)
    monitor = flooded_monitor(triton)
    monitor.run_once()  # the first round has no baseline for the tokens: one failure at most (a timeout)
    for _ in range(20):
        monitor.run_once()
        assert monitor.readiness().ready, monitor.readiness().reason
    assert triton.calls == []
    assert monitor.snapshot()["models"]["lora_adapter"]["recoveries"] == 0


def test_a_replica_whose_tokens_stopped_is_reloaded_as_before():
    triton = FloodedTriton(timed_out())
    monitor = flooded_monitor(triton)
    for _ in range(3):
        monitor.run_once()
    triton.rate = 0.0  # wedged: no token any more
    for _ in range(3):
        monitor.run_once()
    assert ("reload", "lora_adapter") in triton.calls


def test_unreadable_tokens_are_no_evidence_and_never_fail_a_round():
    triton = FloodedTriton(timed_out())

    def broken() -> dict[str, float]:
        raise OSError("metrics port closed")

    monitor = Monitor(SidecarConfig(failures_to_recover=3, coverage_threshold=0), triton.probe, triton.server_ready,
                      triton, progress=broken)
    for _ in range(3):
        monitor.run_once()
    assert ("reload", "lora_adapter") in triton.calls


METRICS = """# HELP warmup_output_tokens_total Generated tokens by adapter
# TYPE warmup_output_tokens_total counter
warmup_output_tokens_total{adapter="base",model="lora_adapter"} 12
warmup_output_tokens_total{adapter="support",model="lora_adapter"} 30
# HELP warmup_scheduler_running_sequences Sequences in the running batch of an instance
# TYPE warmup_scheduler_running_sequences gauge
warmup_scheduler_running_sequences{instance="lora_adapter_0_0",model="lora_adapter"} 2
"""


@pytest.fixture
def metrics_url():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(METRICS.encode())

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()
    server.server_close()
    thread.join()


def test_the_tokens_are_read_from_the_counter_the_scheduler_exports(metrics_url):
    facts = StubDeathFacts("127.0.0.1:9", metrics_url)
    try:
        assert facts.output_tokens() == {"lora_adapter": 42.0}
    finally:
        facts.close()
    assert f'name="{OUTPUT_TOKENS}"' in inspect.getsource(metrics.SchedulerMetrics)
    assert StubDeathFacts("127.0.0.1:9", "http://127.0.0.1:9/metrics", timeout_s=0.5).output_tokens() is None


def test_a_probe_answered_busy_through_the_ensemble_is_marked_busy(monkeypatch):
    from tritonclient.utils import InferenceServerException

    from warmup_tools.sidecar.probes import TritonProbes

    probes = TritonProbes("127.0.0.1:9", timeout_s=0.5)  # nothing listens: the stream below stands in for it
    try:
        for message, expected in ((BUSY, True), ("[rate_limited] too many concurrent requests", True),
                                  (TIMED_OUT, False), (STUB_DEAD, False)):
            def refuse(model, inputs, message=message):
                raise InferenceServerException(message)

            monkeypatch.setattr(probes, "_stream_once", refuse)
            result = probes.probe("ensemble")
            assert not result.ok and result.busy is expected and result.error == message
    finally:
        probes.close()


def test_a_probe_answered_with_an_error_ends_its_stream_instead_of_cancelling_it(monkeypatch):
    """An error is a refused request's final response: its stream is ended as an answered one's (a call cancelled
    just after its final response keeps a decoupled model loaded on tritonserver 2.51), a timed-out one is
    cancelled."""
    from tritonclient.utils import InferenceServerException

    from warmup_tools.sidecar import probes as probes_module
    from warmup_tools.sidecar.probes import TritonProbes

    ended: list[str] = []
    monkeypatch.setattr(probes_module, "end_stream", lambda client, timeout_s: ended.append("end"))
    monkeypatch.setattr(probes_module, "cancel_stream", lambda client: ended.append("cancel"))

    class Client:
        """tritonclient's stream calls, answering each request with ``answer`` (None: never)."""

        def __init__(self, answer):
            self.answer, self.callback = answer, None

        def start_stream(self, callback):
            self.callback = callback

        def async_stream_infer(self, model, inputs, **kwargs):
            if self.answer is not None:
                self.callback(None, self.answer)

        def close(self):
            pass

    probes = TritonProbes("127.0.0.1:9", timeout_s=0.5)  # nothing listens: the client below stands in for it
    try:
        probes._client = Client(InferenceServerException("[busy] server busy: try again"))
        result = probes.probe("lora_adapter")
        assert not result.ok and result.busy and ended == ["end"]
        probes._client = Client(None)
        assert not probes.probe("lora_adapter").ok and ended == ["end", "cancel"]
    finally:
        probes._client = Client(None)
        probes.close()
