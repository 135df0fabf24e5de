"""A repository generated from a plan loads in the real server; planned prefixes are warm at once."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from warmup_tools.planning.plan_stanzas import check_repository, write_plan_stanzas
from warmup_tools.server.client import GenerateParams, StreamingClient
from warmup_tools.server.process import TritonServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2] / "model_repository"


def test_plan_from_day1_warms_day2_first_requests(demo_assets, served_assets, tmp_path):
    from warmup_tools.common.plan import Budgets
    from warmup_tools.embedding_cache.embedder import OnnxEmbedder
    from warmup_tools.planning.select import build_plan
    from warmup_tools.planning.target import PlanTarget
    from warmup_tools.sim.traffic import TrafficConfig, generate

    config = TrafficConfig(seed=3, requests_per_day=400)
    records = list(generate(config))
    day2 = config.start + 86400
    day1 = [r for r in records if r["ts"] < day2]
    repo = tmp_path / "repo"
    shutil.copytree(REPO, repo)
    target = PlanTarget.from_repository(repo, {**os.environ, "WARMUP_ASSETS_DIR": str(demo_assets.root)})
    plan = build_plan(day1, target.load_tokenizer(), OnnxEmbedder(target.embedder),
                      Budgets(kv_bytes_total=64 << 20, kv_bytes_per_adapter=32 << 20), now=day2,
                      block_size=target.block_size, kv_bytes_per_token=target.kv_bytes_per_token, progress=False)
    planned_scopes = {(i["tenant"], i["adapter"]) for i in plan.items}
    assert planned_scopes

    write_plan_stanzas(plan, repo, target=target)
    assert check_repository(repo) == []

    firsts = {}
    for record in records:
        scope = (record["tenant"], record["adapter"])
        if record["ts"] >= day2 and record["template"] and scope in planned_scopes and scope not in firsts:
            firsts[scope] = record
    server = TritonServer(repo, env={"WARMUP_ASSETS_DIR": str(served_assets), "WARMUP_CONTROL_DIR": ""},
                          work_dir=tmp_path / "work")
    with server:
        server.wait_ready(timeout=900)
        with StreamingClient(server.grpc_url) as client:
            for (tenant, adapter), record in firsts.items():
                result = client.generate(record["prompt"], GenerateParams(
                    max_tokens=1, adapter_id=adapter or None, tenant_id=tenant))
                assert result.cached_tokens > 0, (tenant, adapter)
