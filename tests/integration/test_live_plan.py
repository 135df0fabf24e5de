"""Live plans against a real tritonserver: a plan applied through the control folder warms a new prefix
without a restart, and the sidecar's /ready follows the planned hot set's coverage (including a plan the
KV budget cannot hold, which it names)."""

from __future__ import annotations

import os
import socket
import urllib.request

import pytest

from tests.conftest import REPO_ROOT
from tests.integration.test_sidecar import get_json, wait_for
from warmup_tools.common.digests import tokenizer_fingerprint
from warmup_tools.common.plan import Plan
from warmup_tools.control.plan_history import write_live_plan
from warmup_tools.planning.live import apply_plan, wait_applied
from warmup_tools.planning.target import PlanTarget
from warmup_tools.server.client import GenerateParams, StreamingClient
from warmup_tools.server.process import RepositoryKey, TritonServer
from warmup_tools.sidecar.app import Sidecar
from warmup_tools.sidecar.config import SidecarConfig
from warmup_tools.sidecar.plan_id import discover_plan_id
from warmup_tools.sim.bench.support.servers import ready_status

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

INSTANCE = "lora_adapter_0_0"
#: 16 MiB of KV per instance: the demo stanzas (about 40 blocks of 96 KiB) fit, 200 more blocks do not.
KV_BYTES = 16 << 20
CLAIMS = ("You are the claims assistant of Example Mutual. You answer questions about filing a claim, the "
          "documents a claim needs, deadlines, deductibles and how long a decision takes. Always name the form "
          "number, never promise an outcome, and hand over to a human adjuster when a claim exceeds ten "
          "thousand euros or mentions an injury. ")
QUESTION = "User: I dented my car in a parking lot yesterday, what do I do first?\nAssistant:"


def make_plan(items, fingerprint):
    items = [{"kind": "kv_prefix", **item} for item in items]
    return Plan(plan_id=Plan.content_id(items, 16, fingerprint), created="2026-12-01T00:00:00+00:00",
                block_size=16, tokenizer_fingerprint=fingerprint, budgets={}, settings={}, summary={},
                items=items, embedding_items=[], tokenizer_templates=[], clusters=[])


@pytest.fixture()
def live_server(demo_assets, tmp_path):
    control = tmp_path / "control"
    env = {"WARMUP_ASSETS_DIR": str(demo_assets.root), "WARMUP_CONTROL_DIR": str(control),
           "WARMUP_REDIS_URL": "", "WARMUP_REQUEST_LOG_DIR": "", "WARMUP_KV_CACHE_BYTES": str(KV_BYTES)}
    server = TritonServer(REPO_ROOT / "model_repository", env=env, work_dir=tmp_path / "triton",
                          explicit_model_control=True, repository_key=RepositoryKey.generate())
    with server:
        server.wait_ready(timeout=600)
        server.control_dir = control
        server.target = PlanTarget.from_repository(REPO_ROOT / "model_repository", {**os.environ, **env})
        yield server


def test_a_live_plan_warms_a_new_prefix_without_a_restart_and_ready_follows_coverage(live_server):
    server, control = live_server, live_server.control_dir
    tokenizer = server.target.load_tokenizer()
    fingerprint = tokenizer_fingerprint(tokenizer)
    config = SidecarConfig(probe_interval_s=1.0, probe_timeout_s=10.0, port=0)
    with Sidecar(config, server.http_url, server.grpc_url, server.repository_key,
                 REPO_ROOT / "model_repository", control_dir=control) as sidecar:
        # At start the hot set is the model_warmup samples' plan: every system prompt resident.
        wait_for(lambda: ready_status(sidecar.url) == 200, "the sidecar to report ready", server)
        entry = sidecar.monitor.snapshot()["coverage"]["instances"][INSTANCE]  # plan ids: inside the sidecar only
        assert entry["plan_id"] == discover_plan_id(REPO_ROOT / "model_repository") and entry["source"] == "samples"
        assert {a: c["coverage"] for a, c in entry["adapters"].items()} == {"support": 1.0, "legal": 1.0, "sql": 1.0}

        # A new application appears: its prefix is planned and applied live, then served from the cache.
        prompt_ids = tokenizer.encode(CLAIMS + QUESTION, add_special_tokens=True)
        blocks = len(tokenizer.encode(CLAIMS, add_special_tokens=True)) // 16 - 1
        claims = make_plan([{"tenant": "acme", "adapter": "sql", "token_ids": prompt_ids[: blocks * 16]}], fingerprint)
        apply_plan(claims, control, target=server.target, tokenizer=tokenizer)
        applied = wait_applied(control, claims.plan_id, timeout_s=300)[f"{socket.gethostname()}/{INSTANCE}"]
        assert applied.adapters["sql"].resident == blocks
        assert "dropped" in applied.detail
        with StreamingClient(server.grpc_url, timeout_s=120) as client:
            warm = client.generate(CLAIMS + QUESTION, GenerateParams(max_tokens=2, adapter_id="sql", tenant_id="acme"))
            other = client.generate(CLAIMS + QUESTION, GenerateParams(max_tokens=2, adapter_id="sql",
                                                                       tenant_id="globex"))
        assert warm.cached_tokens >= blocks * 16, warm
        assert other.cached_tokens == 0, other  # planned for acme only
        wait_for(lambda: sidecar.monitor.snapshot()["coverage"]["instances"][INSTANCE]["plan_id"]
                 == claims.plan_id, "the sidecar to see the new plan", server)
        assert ready_status(sidecar.url) == 200
        with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
            metrics = response.read().decode()
        assert f'warmup_kv_plan_blocks{{adapter="sql",instance="{INSTANCE}",model="lora_adapter"}} {blocks}' in metrics

        # A plan the instance's warm-up budget cannot hold (written past apply-plan's budget check): the pod
        # goes unready and says why.
        huge = make_plan([{"tenant": "acme", "adapter": "", "token_ids": [100 + i % 3000 for i in range(1600)]},
                          {"tenant": "acme", "adapter": "", "token_ids": [7 + i % 2000 for i in range(1600)]}],
                         fingerprint)
        write_live_plan(control, huge, by=("test", ""))
        try:
            wait_for(lambda: ready_status(sidecar.url) == 503, "/ready to go 503 for a plan the budget cannot hold",
                     server, deadline_s=300)
        except pytest.fail.Exception as exc:  # say where the instance stood (warming, coverage, pins)
            entry = get_json(sidecar.url + "/status")["coverage"]["instances"].get(INSTANCE)
            pytest.fail(f"{exc}\ninstance status: {entry}")
        reason = get_json(sidecar.url + "/ready", allow_error=True)["reason"]
        assert "warm coverage" in reason and "do not fit the warm-up budget" in reason, reason
        base = get_json(sidecar.url + "/status")["coverage"]["instances"][INSTANCE]["adapters"]["base"]
        assert base["planned"] == 200 and base["resident"] < 190 and base["shortfall"], base
        with urllib.request.urlopen(sidecar.url + "/metrics", timeout=10) as response:
            assert f'warmup_sidecar_warm_coverage_shortfall{{adapter="base",instance="{INSTANCE}"}} 1.0' \
                in response.read().decode()

        # Back to a plan that fits: ready again, without a restart.
        apply_plan(claims, control, target=server.target, tokenizer=tokenizer)
        wait_for(lambda: ready_status(sidecar.url) == 200, "/ready to come back with a plan that fits", server,
                 deadline_s=300)


def test_plan_b_then_a_rollback_serves_plan_a_again(live_server, demo_assets, monkeypatch, capsys):
    """apply-plan A, then B, then `plan rollback`: the instance reports A applied, A's prefix is resident and
    served from the cache again, and the history says who did what."""
    from warmup_tools.control.plan_history import PlanHistory, plan_digest
    from warmup_tools.ops.cli import main

    server, control = live_server, live_server.control_dir
    tokenizer = server.target.load_tokenizer()
    fingerprint = tokenizer_fingerprint(tokenizer)
    blocks = len(tokenizer.encode(CLAIMS, add_special_tokens=True)) // 16 - 1
    prefix = tokenizer.encode(CLAIMS + QUESTION, add_special_tokens=True)[: blocks * 16]
    plan_a = make_plan([{"tenant": "acme", "adapter": "sql", "token_ids": prefix}], fingerprint)
    plan_b = make_plan([{"tenant": "globex", "adapter": "legal", "token_ids": prefix}], fingerprint)
    key = f"{socket.gethostname()}/{INSTANCE}"
    for plan in (plan_a, plan_b):
        apply_plan(plan, control, target=server.target, tokenizer=tokenizer)
        assert wait_applied(control, plan.plan_id, timeout_s=300)[key].plan_id == plan.plan_id
    # B dropped A's blocks (unpinned: evictable, no longer planned); A's scope is no longer in the plan (the
    # report still lists every live adapter, with nothing planned).
    assert wait_applied(control, plan_b.plan_id, timeout_s=10)[key].adapters["sql"].planned == 0

    # The CLI checks the plan against the repository the server runs (its assets and KV budget).
    monkeypatch.setenv("WARMUP_ASSETS_DIR", str(demo_assets.root))
    monkeypatch.setenv("WARMUP_KV_CACHE_BYTES", str(KV_BYTES))
    monkeypatch.setenv("WARMUP_PLAN_USER", "oncall")
    capsys.readouterr()
    assert main(["plan", "rollback", "--control-dir", str(control), "--model-repository",
                 str(REPO_ROOT / "model_repository"), "--wait", "300"]) == 0
    out = capsys.readouterr().out
    assert f"rolled back from plan {plan_digest(plan_b)} to {plan_digest(plan_a)}" in out
    assert f"applied plan {plan_a.plan_id}" in out

    status = wait_applied(control, plan_a.plan_id, timeout_s=10)[key]
    assert status.adapters["sql"].planned == blocks and status.adapters["sql"].resident == blocks, status
    with StreamingClient(server.grpc_url, timeout_s=120) as client:
        warm = client.generate(CLAIMS + QUESTION, GenerateParams(max_tokens=2, adapter_id="sql", tenant_id="acme"))
    assert warm.cached_tokens >= blocks * 16, warm
    history = PlanHistory(control).entries()
    assert [(e.id, e.by) for e in history] == [(plan_digest(plan_a), "rollback"), (plan_digest(plan_b), "apply-plan"),
                                              (plan_digest(plan_a), "apply-plan")]
    assert history[0].parent == plan_digest(plan_b) and history[0].user == "oncall"
