"""The sidecar against a real tritonserver: a killed lora_adapter stub is noticed, reloaded, and warm again."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from tests.conftest import REPO_ROOT
from tests.waiting import HANG_S
from warmup_tools.demo.prompts import USER_QUESTIONS, demo_prompt
from warmup_tools.server.client import GenerateError, GenerateParams, StreamingClient
from warmup_tools.server.process import RepositoryKey, TritonServer
from warmup_tools.sidecar.app import Sidecar
from warmup_tools.sidecar.config import SidecarConfig
from warmup_tools.sim.bench.recovery import CLIENT_TIMEOUT_MESSAGE, InFlightRequest, OutageClient
from warmup_tools.sim.bench.support.servers import ready_status

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

CLIENT_TIMEOUT_S = 60.0


@pytest.fixture()
def explicit_server(demo_assets, tmp_path):
    server = TritonServer(
        REPO_ROOT / "model_repository",
        env={"WARMUP_ASSETS_DIR": str(demo_assets.root), "WARMUP_CONTROL_DIR": str(tmp_path / "control"),
             "WARMUP_REDIS_URL": "", "WARMUP_REQUEST_LOG_DIR": ""},
        work_dir=tmp_path / "triton",
        explicit_model_control=True,
        repository_key=RepositoryKey.generate(),
    )
    with server:
        server.wait_ready(timeout=600)
        yield server


def test_a_killed_lora_adapter_stub_is_reloaded_and_serves_warm_again(explicit_server, monkeypatch):
    server = explicit_server
    config = SidecarConfig(probe_interval_s=1.0, probe_timeout_s=10.0, port=0)
    with Sidecar(config, server.http_url, server.grpc_url, server.repository_key,
                 REPO_ROOT / "model_repository") as sidecar:
        # NOTE: the test holds the outage open itself: the sidecar's reload (the real one) starts only once the test
        # saw /ready answer 503, a state that would otherwise last only as long as a reload.
        not_ready_seen = threading.Event()
        reload = sidecar.monitor._repository.reload

        def reload_once_seen(model, timeout_s=None):
            not_ready_seen.wait(HANG_S)
            return reload(model, timeout_s=timeout_s)

        monkeypatch.setattr(sidecar.monitor._repository, "reload", reload_once_seen)
        wait_for(lambda: ready_status(sidecar.url) == 200, "the sidecar to report ready", server)
        status = get_json(sidecar.url + "/status")
        assert "plan_id" not in json.dumps(status), status  # the sidecar's public endpoints name no plan
        # Open mode: the probes prove the probe tenant with the sidecar's per-start secret; a client
        # naming it is refused, so it cannot drop out of the request log and the heat statistics.
        from tests.integration.test_errors import _stream_direct
        from warmup_tools.common.records import PROBE_TENANT

        error = _stream_direct(server, "lora_adapter", {"input_ids": np.arange(5, 40, dtype=np.int32),
                                                        "max_tokens": np.array([1], np.int32),
                                                        "tenant_id": np.array([PROBE_TENANT.encode()], dtype=object)})
        assert error is not None and "reserved for the sidecar's readiness probes" in str(error), error
        with pytest.raises(GenerateError, match="reserved for the sidecar's readiness probes"):
            with StreamingClient(server.grpc_url) as probe_client:
                probe_client.generate("Hello", GenerateParams(max_tokens=1, tenant_id=PROBE_TENANT))
        assert all(m["state"] == "healthy" for m in status["models"].values()), status

        # Nobody but the sidecar may reload models: the repository API wants the per-run key.
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(
                f"http://{server.http_url}/v2/repository/models/lora_adapter/unload", data=b"{}", method="POST"),
                timeout=10)
        assert refused.value.code == 403

        stubs = server.stub_pids("lora_adapter")
        assert len(stubs) == 1, f"expected one lora_adapter stub under tritonserver {server.pid}: {stubs}"
        os.kill(stubs[0], signal.SIGKILL)
        killed_at = time.monotonic()

        # A request right after the kill, before any reload, fails with Triton's error instead of hanging.
        with StreamingClient(server.grpc_url, timeout_s=CLIENT_TIMEOUT_S) as client:
            start = time.perf_counter()
            with pytest.raises(GenerateError) as outage_error:
                client.generate("Hello", GenerateParams(max_tokens=4, adapter_id="support"))
            first_failure_s = time.perf_counter() - start
        assert CLIENT_TIMEOUT_MESSAGE not in str(outage_error.value)

        outage = OutageClient(server.grpc_url)
        outage.start(killed_at)
        try:
            try:
                wait_for(lambda: ready_status(sidecar.url) == 503, "/ready to go 503 after the kill", server)
                not_ready_s = time.monotonic() - killed_at
                body = get_json(sidecar.url + "/ready", allow_error=True)
            finally:
                not_ready_seen.set()
            assert "lora_adapter" in body["reason"], body
            wait_for(lambda: ready_status(sidecar.url) == 200, "/ready to come back after the reload", server)
            ready_again_s = time.monotonic() - killed_at
        finally:
            outage.stop()

        status = get_json(sidecar.url + "/status")
        assert status["last_recovery"]["model"] == "lora_adapter" and status["last_recovery"]["ok"], status
        assert status["models"]["lora_adapter"]["recoveries"] == 1, status
        # Requests during the outage got an error from the server, none waited for the client's deadline.
        assert outage.attempts and not outage.hung(), outage.summary()

        # The reload re-ran the model_warmup samples: the support system prompt is in the KV cache again.
        with StreamingClient(server.grpc_url, timeout_s=CLIENT_TIMEOUT_S) as client:
            result = client.generate(demo_prompt("support", USER_QUESTIONS["support"][0]),
                                     GenerateParams(max_tokens=4, adapter_id="support"))
        assert result.cached_tokens > 0, result

    print(f"\nsidecar recovery: first request after the kill failed in {first_failure_s * 1000:.1f} ms; "
          f"/ready false after {not_ready_s:.1f} s, true again after {ready_again_s:.1f} s; "
          f"reload {status['last_recovery']['duration_s']:.1f} s; after recovery cached_tokens "
          f"{result.cached_tokens}/{result.prompt_tokens}; requests during the outage "
          f"({len(outage.attempts)}, one every 0.5 s), min / median / max:")
    for line in outage.summary():
        print(f"    {line}")


def test_a_stream_in_flight_on_a_killed_lora_adapter_stub_ends_with_an_error_instead_of_waiting_for_its_deadline(
        explicit_server):
    """Triton never answers a decoupled request whose stub died; the sidecar restarts tritonserver (the
    default ``on_stub_death``), which drops the stream's connection, so its client gets an error at once."""
    server = explicit_server
    config = SidecarConfig(probe_interval_s=1.0, probe_timeout_s=10.0, port=0)
    assert config.on_stub_death == "restart"
    old_pid = server.pid
    with Sidecar(config, server.http_url, server.grpc_url, server.repository_key,
                 REPO_ROOT / "model_repository", server=server) as sidecar:
        wait_for(lambda: ready_status(sidecar.url) == 200, "the sidecar to report ready", server)
        stubs = server.stub_pids("lora_adapter")
        assert len(stubs) == 1, f"expected one lora_adapter stub under tritonserver {server.pid}: {stubs}"
        # NOTE: a deadline between responses far beyond the test's waits: the stream may end only by an error
        # the server side causes, not by its client giving up. Nothing holds the generation open but its length:
        # the longest a request may ask for, its stub killed at its first token with 511 steps still to run.
        inflight = InFlightRequest(server.grpc_url, timeout_s=2 * HANG_S)
        assert inflight.start(), "the long generation did not start streaming"
        os.kill(stubs[0], signal.SIGKILL)
        killed_at = time.monotonic()
        inflight.join()
        assert inflight.ended_at is not None, "the stream on the dead stub never ended"
        ended_after_s = inflight.ended_at - killed_at
        assert inflight.error, "the stream on the dead stub ended without an error"
        assert CLIENT_TIMEOUT_MESSAGE not in inflight.error, inflight.error  # not its client's deadline

        # NOTE: the stream may end before the sidecar's next probe saw the dead stub, with /ready still 200 from
        # before the kill: wait for the restart to be recorded (it stays), then for /ready.
        wait_for(lambda: get_json(sidecar.url + "/status")["last_recovery"] is not None,
                 "the sidecar to record its restart of tritonserver", server)
        wait_for(lambda: ready_status(sidecar.url) == 200, "/ready to come back after the restart", server)
        status = get_json(sidecar.url + "/status")
        assert status["last_recovery"]["model"] == "tritonserver" and status["last_recovery"]["ok"], status
        assert status["restarts"] == 1 and status["models"]["lora_adapter"]["recoveries"] == 0, status
        assert server.pid != old_pid and server.is_alive()

        # The restarted server ran its model_warmup samples again: it serves, warm.
        with StreamingClient(server.grpc_url, timeout_s=CLIENT_TIMEOUT_S) as client:
            result = client.generate(demo_prompt("support", USER_QUESTIONS["support"][0]),
                                     GenerateParams(max_tokens=4, adapter_id="support"))
        assert result.cached_tokens > 0, result
    print(f"\nin-flight stream on a killed stub: {inflight.error[:120]!r} {ended_after_s:.1f} s after the kill")


def get_json(url: str, allow_error: bool = False) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        with exc:
            if not allow_error:
                raise
            return json.loads(exc.read())


def wait_for(condition, what: str, server: TritonServer, deadline_s: float = HANG_S) -> None:
    deadline = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {deadline_s:.0f}s waiting for {what}; server log:\n{server.log_tail(40)}")
        time.sleep(0.1)
