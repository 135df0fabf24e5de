"""Operators add, warm, make live and retire adapters while the server serves, without a restart."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest

from tests.waiting import HANG_S, wait_for
from warmup_tools.control.registry import ControlRegistry
from warmup_tools.control.state import AdapterState, LifecycleError
from warmup_tools.demo.prompts import SYSTEM_PROMPTS, demo_prompt
from warmup_tools.server.client import GenerateError, GenerateParams, StreamingClient, metric_sum, scrape_metrics

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def test_adapter_added_while_traffic_flows_goes_live_without_restart(triton, grpc_client):
    registry = ControlRegistry(triton.control_dir)
    shutil.copytree(triton.assets_dir / "adapters" / "legal", triton.assets_dir / "adapters" / "legal-v2")
    prompt = demo_prompt("legal", "Clause 9: who pays the audit costs?")
    with pytest.raises(GenerateError, match="unknown adapter 'legal-v2'"):
        grpc_client.generate(prompt, GenerateParams(max_tokens=4, adapter_id="legal-v2"))

    # Live traffic on another adapter keeps flowing while the new one loads and warms.
    stop = threading.Event()
    outcomes: list[object] = []

    def traffic():
        with StreamingClient(triton.grpc_url, timeout_s=120) as client:
            while not stop.is_set():
                try:
                    outcomes.append(client.generate(demo_prompt("support", "Status?"),
                                                    GenerateParams(max_tokens=4, adapter_id="support")))
                except Exception as exc:  # noqa: BLE001 - collected and asserted below
                    outcomes.append(exc)

    worker = threading.Thread(target=traffic)
    worker.start()
    try:
        wait_for(lambda: outcomes, "the live traffic's first answer")  # flowing before the new adapter loads
        registry.add("legal-v2", [SYSTEM_PROMPTS["legal"]])
        reached = registry.wait_until("legal-v2", AdapterState.LIVE, timeout_s=HANG_S)
    finally:
        stop.set()
        worker.join(timeout=HANG_S)
    assert reached and all("warmed 1 prompts" in s.detail for s in reached.values())
    assert outcomes and not [o for o in outcomes if isinstance(o, Exception)], outcomes

    new = grpc_client.generate(prompt, GenerateParams(max_tokens=8, adapter_id="legal-v2"))
    same_weights = grpc_client.generate(prompt, GenerateParams(max_tokens=8, adapter_id="legal"))
    assert new.text == same_weights.text
    assert new.cached_tokens > 0  # its system prompt was warmed before it went live

    registry.retire("legal-v2")
    registry.wait_until("legal-v2", AdapterState.RETIRED, timeout_s=HANG_S)
    with pytest.raises(GenerateError, match="retired"):
        grpc_client.generate(prompt, GenerateParams(max_tokens=4, adapter_id="legal-v2"))
    states = scrape_metrics(triton.metrics_url)
    assert metric_sum(states, "warmup_adapter_state", adapter="legal-v2", state="retired") >= 1
    assert grpc_client.generate(prompt, GenerateParams(max_tokens=2, adapter_id="legal")).output_tokens >= 1


def test_registered_adapter_is_refused_with_its_state(triton, grpc_client):
    registry = ControlRegistry(triton.control_dir)
    shutil.copytree(triton.assets_dir / "adapters" / "sql", triton.assets_dir / "adapters" / "sql-next")
    registry.add("sql-next", live=False)
    registry.wait_until("sql-next", AdapterState.REGISTERED, timeout_s=HANG_S)
    with pytest.raises(GenerateError, match="sql-next.*registered"):
        grpc_client.generate("hello", GenerateParams(max_tokens=2, adapter_id="sql-next"))


def test_adapter_whose_folder_is_missing_fails_with_a_clear_status(triton):
    registry = ControlRegistry(triton.control_dir)
    registry.add("ghost")
    # The instance reports the adapter FAILED with the reason (not a timeout, whose message names it too).
    with pytest.raises(LifecycleError, match=r"^adapter 'ghost' failed on instance lora_adapter_0_0: load failed: "
                                             r"AssetError: adapter 'ghost': .* has no adapter_config\.json$"):
        registry.wait_until("ghost", AdapterState.LIVE, timeout_s=HANG_S)


def test_every_instance_of_a_multi_instance_model_ends_in_the_same_state(served_assets, tmp_path):
    """Instances are separate processes: each reconciles the control folder and reports its own state."""
    from warmup_tools.server.config import set_instance_count
    from warmup_tools.server.process import TritonServer

    repo = tmp_path / "repo"
    shutil.copytree(Path(__file__).resolve().parents[2] / "model_repository", repo)
    set_instance_count(repo / "lora_adapter", 2)
    control = tmp_path / "control"
    adapters = served_assets / "adapters"
    shutil.copytree(adapters / "support", adapters / "support-two", dirs_exist_ok=True)
    server = TritonServer(repo, env={"WARMUP_ASSETS_DIR": str(served_assets), "WARMUP_CONTROL_DIR": str(control)},
                          work_dir=tmp_path / "work")
    with server:
        server.wait_ready(timeout=600)
        registry = ControlRegistry(control)
        registry.add("support-two", [SYSTEM_PROMPTS["support"]])
        reached = registry.wait_until("support-two", AdapterState.LIVE, instances=2, timeout_s=HANG_S)
        assert sorted(reached) == ["lora_adapter_0_0", "lora_adapter_0_1"]
        with StreamingClient(server.grpc_url) as client:
            for _ in range(4):  # requests land on either instance; each serves the adapter warm
                result = client.generate(demo_prompt("support", "Refund?"),
                                         GenerateParams(max_tokens=2, adapter_id="support-two"))
                assert result.cached_tokens > 0
        registry.retire("support-two")
        assert len(registry.wait_until("support-two", AdapterState.RETIRED, instances=2, timeout_s=HANG_S)) == 2
