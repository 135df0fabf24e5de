"""A plan on trial on a whole replica of a fleet: two replicas (real tritonservers, sidecars and fronts) share the
control folder and the request log folder; a deliberately bad plan (another tenant mix's prefixes) goes to every
instance of ``r1``, whose sidecar judges it against ``r2``'s requests by difference of differences (each side
against its own requests before the trial), rolls it back with the reason in /status and /metrics, and ``r1``
serves the good plan again. The requests go to each replica's front in turn (the judge reads the request logs, so
which replica serves a request is the test's choice, not the router's). Every wait is on a condition."""

from __future__ import annotations

import json
import os

import httpx
import pytest

from tests.conftest import REPO_ROOT
from tests.integration.test_canary import APPS, get, items, system_prompt
from tests.integration.test_live_plan import make_plan
from tests.waiting import wait_for
from warmup_tools.common.digests import tokenizer_fingerprint
from warmup_tools.control.plan_control import PlanStatusBoard, read_canary
from warmup_tools.control.plan_history import PlanHistory, write_live_plan
from warmup_tools.planning.target import PlanTarget
from warmup_tools.sidecar.canary.trial import start_canary

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

CANARY, OTHER = "r1", "r2"
#: Requests each replica serves before the trial: its baseline (canary_min_requests is less).
BASELINE = 8


def test_a_bad_plan_on_a_whole_replica_is_rolled_back_against_the_other_replica(served_assets, tmp_path):
    from warmup_tools.fleet.fleet import Fleet
    from warmup_tools.fleet.settings import FleetSettings

    control, logs = tmp_path / "control", tmp_path / "logs"
    target = PlanTarget.from_repository(REPO_ROOT / "model_repository",
                                        {**os.environ, "WARMUP_ASSETS_DIR": str(served_assets)})
    tokenizer = target.load_tokenizer()
    fingerprint = tokenizer_fingerprint(tokenizer)
    good = make_plan(items(tokenizer, "acme"), fingerprint)
    bad = make_plan(items(tokenizer, "globex"), fingerprint)  # another tenant mix's prefixes
    write_live_plan(control, good, by=("test", ""))
    sidecar = tmp_path / "sidecar.json"
    # NOTE: a window no test outlasts: the verdict can only be the early, tested rollback.
    sidecar.write_text(json.dumps({"canary_window_s": 3600, "canary_min_requests": 6, "coverage_threshold": 0}),
                       encoding="utf-8")
    settings = FleetSettings(replicas=2, port=0, work_dir=tmp_path / "fleet", control_dir=control,
                             request_log_dir=logs, sidecar_config=sidecar, assets_dir=served_assets, lm_threads=1)
    with Fleet(settings) as fleet, httpx.Client(timeout=120) as client:
        replicas = fleet.replicas
        assert sorted(replicas) == [CANARY, OTHER]
        board = PlanStatusBoard(control)

        def plans(host: str) -> set[tuple[str, str]]:
            return {(s.plan_id, s.state) for s in board.read_all(host=host)[0].values()}

        for name in replicas:
            wait_for(lambda name=name: plans(name) == {(good.plan_id, "applied")}, f"{name} to apply the good plan")
        served = 0

        def ask(name: str) -> None:
            nonlocal served
            app = served // 2 % APPS
            body = {"model": "support", "prompt": system_prompt("acme", app) + f"User: where is my parcel {served}?"
                    "\nAssistant:", "max_tokens": 1, "user": "acme"}
            response = client.post(f"{replicas[name].url}/v1/completions", json=body)
            assert response.status_code == 200, response.text
            served += 1

        for _ in range(BASELINE):
            ask(CANARY)
            ask(OTHER)

        def canary_status() -> dict:
            return json.loads(get(replicas[CANARY].sidecar_url + "/status")[1])["canary"]

        def logged(name: str) -> int:
            return sum(len(path.read_text().splitlines()) for path in (logs / name).glob("requests-*.jsonl"))

        for name in replicas:  # each replica's baseline is in its request log before the trial starts
            wait_for(lambda name=name: logged(name) >= BASELINE, f"{name}'s baseline in its request log")
        start_canary(control, bad, host=CANARY, by=("test", ""))
        wait_for(lambda: (canary_status()["trial"] or {}).get("applied_at") is not None,
                 "every instance of the canary replica to apply the plan on trial",
                 detail=lambda: f": {canary_status()}")
        while not canary_status()["verdicts"]:
            ask(CANARY)
            ask(OTHER)
            if served > 2 * BASELINE + 200:
                pytest.fail(f"no verdict after {served} requests: {canary_status()}")
        verdict = canary_status()["verdicts"][0]
        assert verdict["verdict"] == "rolled_back", verdict
        assert verdict["replicas"] == [OTHER], verdict
        assert "of the canary replica" in verdict["reason"], verdict
        assert verdict["before"]["canary"]["requests"] >= 6 and verdict["before"]["rest"]["requests"] >= 6
        assert read_canary(control) is None
        assert PlanHistory(control).current().plan_id == good.plan_id  # the served plan never changed
        _, metrics = get(replicas[CANARY].sidecar_url + "/metrics")
        assert 'warmup_canary_verdicts_total{verdict="rolled_back"} 1.0' in metrics
        # The other replica's sidecar does not judge a trial on r1; r1 goes back to the good plan, warmed.
        assert json.loads(get(replicas[OTHER].sidecar_url + "/status")[1])["canary"]["verdicts"] == []
        wait_for(lambda: plans(CANARY) == {(good.plan_id, "applied")}, "the canary replica to serve the good plan")
        assert plans(OTHER) == {(good.plan_id, "applied")}
