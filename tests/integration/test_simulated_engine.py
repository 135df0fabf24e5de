"""A replica whose lora_adapter runs the simulated engine (engine=simulated) behind a real tritonserver: the
ensemble serves, warm-up samples and the KV prefix cache work, and a repeated prompt is served from its cached
blocks with the same text."""

from __future__ import annotations

from pathlib import Path

import pytest

from warmup_tools.server.client import GenerateParams, StreamingClient
from warmup_tools.server.process import TritonServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2] / "model_repository"
#: A prompt no warm-up sample carries: its first run is cold.
PROMPT = ("Draft a migration checklist for moving the billing database to the new cluster: backups, a dry run, "
          "the cut-over window, rollback steps and who signs off each stage. ")
PARAMS = GenerateParams(max_tokens=12, adapter_id="legal", tenant_id="acme")


def test_a_simulated_replica_serves_the_ensemble_and_a_repeated_prompt_from_its_cache(served_assets, tmp_path):
    server = TritonServer(REPO, env={"WARMUP_ASSETS_DIR": str(served_assets), "WARMUP_CONTROL_DIR": "",
                                     "WARMUP_ENGINE": "simulated", "WARMUP_ENGINE_SPEEDUP": "4"},
                          work_dir=tmp_path / "work")
    server.start()
    try:
        server.wait_ready(timeout=600)
        with StreamingClient(server.grpc_url, timeout_s=120) as client:
            first = client.generate(PROMPT, PARAMS)
            second = client.generate(PROMPT, PARAMS)
        log = server.logs()
    finally:
        server.stop()
    assert "lora_adapter: modelled, profile cpu-demo-lm" in log, log[-3000:]
    assert first.cached_tokens == 0 and second.cached_tokens > 0
    assert second.text == first.text and first.output_tokens > 0
