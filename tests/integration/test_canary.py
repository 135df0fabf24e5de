"""A plan on trial against a real tritonserver: a deliberately bad plan (another tenant mix's prefixes) goes to
one of two lora_adapter instances, the sidecar compares that instance's requests with the other's from the
request logs, rolls the plan back with its reason in /status, /metrics and the log, and the canary instance
serves the good plan again."""

from __future__ import annotations

import json
import os
import shutil
import socket
import urllib.request

import pytest

from tests.conftest import REPO_ROOT
from tests.integration.test_live_plan import make_plan
from tests.integration.test_sidecar import wait_for
from warmup_tools.common.digests import tokenizer_fingerprint
from warmup_tools.control.plan_control import PlanStatusBoard, read_canary
from warmup_tools.control.plan_history import PlanHistory, write_live_plan
from warmup_tools.planning.target import PlanTarget
from warmup_tools.server.client import GenerateParams, StreamingClient
from warmup_tools.server.config import set_instance_count
from warmup_tools.server.process import RepositoryKey, TritonServer
from warmup_tools.sidecar.app import Sidecar
from warmup_tools.sidecar.canary.trial import start_canary
from warmup_tools.sidecar.config import SidecarConfig

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

CANARY, OTHER = "lora_adapter_0_1", "lora_adapter_0_0"
APPS = 8


def system_prompt(tenant: str, index: int) -> str:
    return (f"You are assistant {index} of {tenant}. Answer questions about order {index * 7919} and its "
            f"invoices, returns and deliveries; cite policy section {index}.{index + 3} and never guess. ") * 2


def items(tokenizer, tenant: str) -> list[dict]:
    out = []
    for index in range(APPS):
        ids = tokenizer.encode(system_prompt(tenant, index), add_special_tokens=True)
        out.append({"tenant": tenant, "adapter": "support", "token_ids": ids[: len(ids) // 16 * 16]})
    return out


def get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, response.read().decode()


def test_a_bad_plan_on_trial_is_rolled_back_and_the_canary_serves_the_good_plan_again(demo_assets, tmp_path, caplog):
    repo, control, logs = tmp_path / "repo", tmp_path / "control", tmp_path / "logs"
    shutil.copytree(REPO_ROOT / "model_repository", repo)
    set_instance_count(repo / "lora_adapter", 2)
    env = {"WARMUP_ASSETS_DIR": str(demo_assets.root), "WARMUP_CONTROL_DIR": str(control), "WARMUP_REDIS_URL": "",
           "WARMUP_REQUEST_LOG_DIR": str(logs)}
    target = PlanTarget.from_repository(repo, {**os.environ, **env})
    tokenizer = target.load_tokenizer()
    fingerprint = tokenizer_fingerprint(tokenizer)
    good = make_plan(items(tokenizer, "acme"), fingerprint)
    bad = make_plan(items(tokenizer, "globex"), fingerprint)  # another tenant mix's prefixes
    host = socket.gethostname()
    # The trial first, then the good plan: the canary instance never warms the good plan's prefixes.
    start_canary(control, bad, host=host, instances=[CANARY], by=("test", ""))
    write_live_plan(control, good, by=("test", ""))
    config = SidecarConfig(probe_interval_s=0.5, probe_timeout_s=10.0, port=0, replan_log_dir=logs,
                           canary_window_s=3600, canary_min_requests=APPS - 2, coverage_threshold=0)
    server = TritonServer(repo, env=env, work_dir=tmp_path / "triton", explicit_model_control=True,
                          repository_key=RepositoryKey.generate())
    with server:
        server.wait_ready(timeout=600)
        with Sidecar(config, server.http_url, server.grpc_url, server.repository_key, repo,
                     control_dir=control) as sidecar:
            def status() -> dict:
                return json.loads(get(sidecar.url + "/status")[1])["canary"]

            wait_for(lambda: (status()["trial"] or {}).get("applied_at") is not None,
                     "the canary instance to apply the plan on trial", server)
            with StreamingClient(server.grpc_url) as client:
                served = 0
                # Each application twice (Triton takes the instances in turn): until the sidecar decides.
                while not status()["verdicts"]:
                    app = served // 2 % APPS
                    question = f"User: where is my parcel {served}?\nAssistant:"
                    client.generate(system_prompt("acme", app) + question,
                                    GenerateParams(max_tokens=1, adapter_id="support", tenant_id="acme"))
                    served += 1
                    if served > 400:
                        pytest.fail(f"no verdict after {served} requests: {status()}")
            verdict = status()["verdicts"][0]
            assert verdict["verdict"] == "rolled_back", verdict
            # NOTE: which measure crosses its test first (cold share, cached or planned tokens) depends on how the
            # requests fell to the instances; each says the canary served less from its cache.
            assert verdict["reason"].startswith("worse than the plan served now")
            assert verdict["canary"]["cached_share"] < verdict["rest"]["cached_share"]
            assert read_canary(control) is None
            assert PlanHistory(control).current().plan_id == good.plan_id  # the served plan never changed
            _, metrics = get(sidecar.url + "/metrics")
            assert 'warmup_canary_verdicts_total{verdict="rolled_back"} 1.0' in metrics
            # The canary instance goes back to plan.json: the good plan, warmed.
            wait_for(lambda: {name: (s.plan_id, s.state) for name, s in
                              PlanStatusBoard(control).read_all(host=host)[0].items()}
                     == {CANARY: (good.plan_id, "applied"), OTHER: (good.plan_id, "applied")},
                     "both instances to serve the good plan", server)
    assert any("canary: plan" in r.getMessage() and "rolled back" in r.getMessage() for r in caplog.records)
