"""Plans for a running server: apply-plan through the control folder, and the rolling re-plan."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.unit.planning.test_plan_stanzas import REPO
from warmup_tools.common.jsonl import write_json_lines
from warmup_tools.common.plan import Plan, PlanError
from warmup_tools.common.records import RequestRecord
from warmup_tools.control.plan_control import CanaryError, LivePlan
from warmup_tools.control.plan_history import PlanHistory
from warmup_tools.planning.live import RollingPlanner, served_plan
from warmup_tools.planning.plan_stanzas import check_repository
from warmup_tools.sidecar.replan import Replanner

NOW = 1_700_000_000.0
OLD = "I want you to act as a travel guide for a small coastal town, suggesting walks and museums.\n"
NEW = "I want you to act as a patient maths tutor who explains every step of a proof with an example.\n"


def records(prompt, start, n, tenant="acme"):
    return [RequestRecord(ts=start + i, tenant=tenant, prompt=prompt + f"Question number {i} please.").to_json()
            for i in range(n)]


@pytest.fixture()
def env(demo_assets, monkeypatch):
    monkeypatch.setenv("WARMUP_ASSETS_DIR", str(demo_assets.root))
    return {**os.environ}


def test_the_rolling_re_plan_applies_the_difference_and_writes_the_stanzas(tmp_path, env, caplog):
    repo, control, logs = tmp_path / "repo", tmp_path / "control", tmp_path / "logs"
    shutil.copytree(REPO, repo)
    logs.mkdir()
    write_json_lines(logs / "requests.jsonl.1", records(OLD, NOW - 8 * 3600, 20))
    clock = [NOW - 7 * 3600]
    planner = RollingPlanner(repo, control, logs, since_s=6 * 3600, environ=env, now=lambda: clock[0])

    first = planner.run_once()
    assert first.applied and first.previous is None and first.added == 1
    served = served_plan(control)
    assert served.plan_id == first.plan_id and "travel guide" in served.items[0]["text"]
    assert LivePlan.parse((control / "plan.json").read_bytes()).plan_id == first.plan_id
    assert first.plan_id[:8] in (repo / "lora_adapter" / "config.pbtxt").read_text()
    assert check_repository(repo) == []
    entry = PlanHistory(control).current()
    assert (entry.plan_id, entry.parent, entry.by) == (first.plan_id, None, "sidecar re-plan")
    assert entry.inputs["records"] == 20 and entry.inputs["window"] == [NOW - 13 * 3600, NOW - 7 * 3600]
    assert entry.inputs["settings"]["min_block_requests"] == 2 and entry.inputs["budgets"]["kv_bytes_total"] > 0

    # Eight hours on, only the new application is in the window: it is added, the old one dropped.
    write_json_lines(logs / "requests.jsonl", records(NEW, NOW, 20))
    clock[0] = NOW + 3600
    caplog.set_level("INFO")
    second = planner.run_once()
    assert (second.previous, second.added, second.kept, second.dropped) == (first.plan_id, 1, 0, 1)
    assert "tutor" in served_plan(control).items[0]["text"]
    assert any("1 items added, 0 kept, 1 dropped" in r.getMessage() for r in caplog.records)
    assert any("dropped: tenant acme" in r.getMessage() for r in caplog.records)
    # Nothing new: the same plan again, nothing applied.
    assert not planner.run_once().applied


def test_apply_plan_refuses_a_plan_the_repository_cannot_serve(tmp_path, env):
    from tests.unit.planning.test_plan_stanzas import make_plan
    from warmup_tools.ops.cli import main

    bad = make_plan("another-tokenizer")
    bad.save(tmp_path / "plan.json")
    with pytest.raises(PlanError, match="tokenizer"):
        from warmup_tools.planning.live import apply_plan

        apply_plan(Plan.load(tmp_path / "plan.json"), tmp_path / "control", REPO)
    assert not (tmp_path / "control" / "plan.json").exists()
    assert main(["apply-plan", str(tmp_path / "plan.json"), "--control-dir", str(tmp_path / "control"),
                 "--wait", "0"]) == 2  # the CLI's status for a WarmupToolsError


def test_the_replanner_keeps_its_last_result_and_error():
    calls = []

    def run_once():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("embedder gone")
        from warmup_tools.planning.live import ReplanResult

        return ReplanResult("p2", "p1", 10, 1, 2, 3, True, 0.5, 0.0)

    replanner = Replanner(run_once, interval_s=3600)
    replanner.run_once()
    assert replanner.status()["last"]["plan_id"] == "p2" and replanner.status()["error"] == ""
    replanner.run_once()
    status = replanner.status()
    assert status["runs"] == 2 and "embedder gone" in status["error"] and status["last"]["plan_id"] == "p2"


@pytest.fixture()
def replanning(tmp_path, env):
    """A real rolling planner that has applied one plan, behind the sidecar's Replanner."""
    repo, control, logs = tmp_path / "repo", tmp_path / "control", tmp_path / "logs"
    shutil.copytree(REPO, repo)
    logs.mkdir()
    write_json_lines(logs / "requests.jsonl.1", records(OLD, NOW - 8 * 3600, 20))
    clock = [NOW - 7 * 3600]
    planner = RollingPlanner(repo, control, logs, since_s=6 * 3600, environ=env, now=lambda: clock[0])
    replanner = Replanner(planner.run_once, interval_s=3600)
    replanner.run_once()
    served = served_plan(control)
    assert served is not None and replanner.status()["error"] == ""
    clock[0] = NOW + 3600
    return replanner, served, repo, control, logs


def served_state(repo, control):
    return (control / "plan.json").read_bytes(), (repo / "lora_adapter" / "config.pbtxt").read_text()


def test_a_re_plan_that_cannot_read_its_logs_keeps_the_served_plan(replanning):
    replanner, served, repo, control, logs = replanning
    before = served_state(repo, control)
    shutil.rmtree(logs)  # the log volume is gone
    replanner.run_once()
    status = replanner.status()
    assert status["error"] == f"FileFormatError: {logs}: cannot read (No such file or directory)"
    assert status["runs"] == 2 and status["last"]["plan_id"] == served.plan_id
    assert served_state(repo, control) == before


def test_a_re_plan_over_logs_with_no_usable_record_keeps_the_served_plan(replanning):
    replanner, served, repo, control, logs = replanning
    before = served_state(repo, control)
    # Only bad lines in the window (the old log is outside it): no evidence that the traffic stopped.
    (logs / "requests.jsonl").write_text('not json\n{"ts": "never"}\n')
    replanner.run_once()
    status = replanner.status()
    assert status["error"] == (f"PlanError: no request record of the last 6 h in the logs under {logs} (2 bad "
                               "lines skipped): nothing to plan from; the plan served now stays")
    assert served_state(repo, control) == before and served_plan(control).items == served.items


def test_in_a_fleet_one_replica_re_plans_from_every_replica_s_logs_and_a_trial_started_meanwhile_wins(tmp_path, env):
    repo, control, logs = tmp_path / "repo", tmp_path / "control", tmp_path / "requests"
    shutil.copytree(REPO, repo)
    (logs / "r1").mkdir(parents=True)
    write_json_lines(logs / "r1" / "requests-lm_0_0.jsonl", records(OLD, NOW - 100, 20))
    clock = [NOW]
    elsewhere = RollingPlanner(repo, control, logs, environ=env, now=lambda: clock[0], defer=lambda: "r1")
    deferred = elsewhere.run_once()
    assert deferred.trial == "replica r1" and not deferred.applied and served_plan(control) is None
    first = RollingPlanner(repo, control, logs, environ=env, now=lambda: clock[0]).run_once()
    assert first.applied and first.records == 20  # the replica's subfolder of the fleet's log folder

    def taken(plan):
        raise CanaryError("plan x is on trial already")

    (logs / "r2").mkdir()
    write_json_lines(logs / "r2" / "requests-lm_0_0.jsonl", records(NEW, NOW - 50, 20))
    racing = RollingPlanner(repo, control, logs, environ=env, now=lambda: clock[0], propose=taken)
    result = racing.run_once()
    assert result.trial == "waiting" and not result.applied and result.records == 40
    assert served_plan(control).plan_id == first.plan_id
