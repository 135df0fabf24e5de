"""Service temperature against a real tritonserver: the replica goes cold -> warm -> hot after start, and an
adapter registered later goes warm, then hot; /ready, /status and /metrics say so."""

from __future__ import annotations

import logging
import shutil
import urllib.request

import pytest

from tests.conftest import REPO_ROOT
from tests.integration.test_sidecar import get_json, wait_for
from warmup_tools.control.registry import ControlRegistry
from warmup_tools.control.state import AdapterState
from warmup_tools.demo.prompts import SYSTEM_PROMPTS
from warmup_tools.server.process import RepositoryKey, TritonServer
from warmup_tools.sidecar.app import Sidecar
from warmup_tools.sidecar.config import SidecarConfig

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

NEW = "temperature-claims"


def test_a_replica_warms_then_turns_hot_and_so_does_an_adapter_added_later(served_assets, tmp_path, caplog):
    control = tmp_path / "control"
    env = {"WARMUP_ASSETS_DIR": str(served_assets), "WARMUP_CONTROL_DIR": str(control), "WARMUP_REDIS_URL": "",
           "WARMUP_REQUEST_LOG_DIR": ""}
    server = TritonServer(REPO_ROOT / "model_repository", env=env, work_dir=tmp_path / "triton",
                          explicit_model_control=True, repository_key=RepositoryKey.generate())
    # NOTE: a probe TTFT bound no probe reaches (above the probe deadline): hot depends on coverage and the
    # confirming rounds only, never on this machine's speed.
    config = SidecarConfig(probe_interval_s=0.5, probe_timeout_s=10.0, port=0, hot_probe_ttft_s=60.0,
                           temperature_confirm_rounds=2)
    caplog.set_level(logging.INFO, logger="warmup_tools.sidecar.monitor")
    with server, Sidecar(config, server.http_url, server.grpc_url, server.repository_key,
                         REPO_ROOT / "model_repository", control_dir=control) as sidecar:
        status = sidecar.monitor.snapshot()
        assert status["temperature"]["replica"]["state"] == "cold"  # not probed yet: not serving
        server.wait_ready(timeout=600)
        wait_for(lambda: sidecar.monitor.temperature()[0] == "hot", "the replica to turn hot", server)
        ready = get_json(sidecar.url + "/ready")
        assert ready["ready"] and ready["temperature"] == "hot"
        # NOTE: the served assets are shared with other tests, which may have added adapters of their own.
        assert {"legal", "sql", "support"} <= ready["adapters"].keys(), ready
        assert set(ready["adapters"].values()) == {"hot"}, ready
        assert "temperature of replica: cold -> warm" in caplog.text
        assert "temperature of replica: warm -> hot" in caplog.text

        shutil.copytree(served_assets / "adapters" / "legal", served_assets / "adapters" / NEW)
        registry = ControlRegistry(control)
        try:
            registry.add(NEW, [SYSTEM_PROMPTS["legal"]])
            registry.wait_until(NEW, AdapterState.LIVE, timeout_s=300)
            wait_for(lambda: sidecar.monitor.temperature()[1].get(NEW) == "hot", f"{NEW} to turn hot", server)
            lines = [r.getMessage() for r in caplog.records if f"adapter {NEW}:" in r.getMessage()]
            # Whatever it read while it loaded (cold, or not reported yet), it served warm before it was hot.
            assert [line.split(" (", 1)[0] for line in lines[-2:]] == [
                f"temperature of adapter {NEW}: cold -> warm", f"temperature of adapter {NEW}: warm -> hot"], lines
            assert sidecar.monitor.temperature()[0] == "hot"  # the replica stayed hot meanwhile
            with urllib.request.urlopen(sidecar.url + "/metrics", timeout=10) as response:
                metrics = response.read().decode()
            assert 'warmup_temperature{adapter="",scope="replica"} 2.0' in metrics
            assert f'warmup_temperature{{adapter="{NEW}",scope="adapter"}} 2.0' in metrics
            assert 'warmup_temperature_transitions_total{from="cold",scope="replica",to="warm"} 1.0' in metrics
            assert 'warmup_temperature_transitions_total{from="warm",scope="adapter",to="hot"}' in metrics
            assert get_json(sidecar.url + "/status")["temperature"]["adapters"][NEW]["state"] == "hot"
        finally:
            registry.retire(NEW)
            registry.wait_until(NEW, AdapterState.RETIRED, timeout_s=120)
            shutil.rmtree(served_assets / "adapters" / NEW, ignore_errors=True)
