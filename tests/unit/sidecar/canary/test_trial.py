"""A plan on trial: canary.json, which instances serve it, and how a trial starts and ends."""

from __future__ import annotations

import json

import pytest

from tests.unit.control.test_plan_history import BY, plan_of
from warmup_tools.common.plan import PlanError
from warmup_tools.control.plan_control import (
    CANARY_FILE,
    HISTORY_DIR,
    PLAN_FILE,
    CanaryAssignment,
    CanaryError,
    PlanFileWatcher,
    read_canary,
)
from warmup_tools.control.plan_history import PlanHistory, PlanHistorySettings, plan_digest, write_live_plan
from warmup_tools.sidecar.canary.trial import end_canary, start_canary


def test_a_trial_serves_its_plan_on_the_named_instances_only(tmp_path):
    a, b = plan_of(0), plan_of(0, 100)
    write_live_plan(tmp_path, a, by=BY)
    canary_watch = PlanFileWatcher(tmp_path, who="lm_0_1", host="r1")
    other_watch = PlanFileWatcher(tmp_path, who="lm_0_0", host="r1")
    other_host = PlanFileWatcher(tmp_path, who="lm_0_1", host="r2")
    assert [w.poll().plan_id for w in (canary_watch, other_watch, other_host)] == [a.plan_id] * 3

    trial = start_canary(tmp_path, b, host="r1", instances=["lm_0_1"], by=BY, now=100.0)
    assert (trial.plan, trial.plan_id, trial.started_at) == (plan_digest(b), b.plan_id, 100.0)
    assert read_canary(tmp_path) == trial
    assert canary_watch.poll().plan_id == b.plan_id and canary_watch.canary == trial
    assert other_watch.poll() is None and other_host.poll() is None  # they keep plan.json's plan

    end_canary(tmp_path, trial, promote=False, by=BY)  # rolled back: back to plan.json
    assert read_canary(tmp_path) is None
    assert canary_watch.poll().plan_id == a.plan_id and canary_watch.canary is None
    assert PlanHistory(tmp_path).current().id == plan_digest(a)  # a rollback changes no served plan


def test_a_promoted_trial_becomes_the_served_plan_with_its_history(tmp_path):
    a, b = plan_of(0), plan_of(0, 100)
    write_live_plan(tmp_path, a, by=BY)
    trial = start_canary(tmp_path, b, host="r1", instances=["lm_0_1"], by=BY)
    canary_watch, other_watch = PlanFileWatcher(tmp_path, who="lm_0_1", host="r1"), PlanFileWatcher(
        tmp_path, who="lm_0_0", host="r1")
    canary_watch.poll(), other_watch.poll()
    entry = end_canary(tmp_path, trial, promote=True, by=("canary promote", ""), inputs={"verdict": "no worse"})
    assert entry.id == plan_digest(b) and entry.parent == plan_digest(a) and entry.by == "canary promote"
    assert entry.inputs["canary"]["instances"] == ["lm_0_1"] and entry.inputs["verdict"] == "no worse"
    assert read_canary(tmp_path) is None and PlanHistory(tmp_path).current().id == plan_digest(b)
    assert other_watch.poll().plan_id == b.plan_id
    assert canary_watch.poll().plan_id == b.plan_id  # the same plan, now from plan.json: the keeper skips it


def test_one_trial_at_a_time_and_never_the_served_plan(tmp_path):
    a, b, c = plan_of(0), plan_of(0, 100), plan_of(0, 200)
    write_live_plan(tmp_path, a, by=BY)
    with pytest.raises(CanaryError, match="the plan served now"):
        start_canary(tmp_path, a, host="r1", by=BY)
    trial = start_canary(tmp_path, b, host="r1", by=BY)
    with pytest.raises(CanaryError, match="on trial already"):
        start_canary(tmp_path, c, host="r1", by=BY)
    with pytest.raises(PlanError):
        start_canary(tmp_path, c, host="r1", instances=["../x"], by=BY)
    end_canary(tmp_path, trial, promote=False, by=BY)
    with pytest.raises(CanaryError, match="not running any more"):
        end_canary(tmp_path, trial, promote=True, by=BY)
    second = start_canary(tmp_path, c, host="r1", by=BY)
    with pytest.raises(CanaryError, match="is on trial now"):  # a verdict on one trial never ends another
        end_canary(tmp_path, trial, promote=False, by=BY)
    assert read_canary(tmp_path) == second


def test_the_history_bound_keeps_the_plan_on_trial(tmp_path):
    settings = PlanHistorySettings(plan_history_keep=2)
    write_live_plan(tmp_path, plan_of(0), by=BY, settings=settings)
    trial = start_canary(tmp_path, plan_of(5), host="r1", by=BY, settings=settings)
    for start in (10, 20, 30):
        write_live_plan(tmp_path, plan_of(start), by=BY, settings=settings)
    assert (tmp_path / HISTORY_DIR / f"{trial.plan}.json").exists()


def test_trials_rolled_back_leave_no_plan_file_behind(tmp_path):
    settings = PlanHistorySettings(plan_history_keep=2)
    served = plan_of(0)
    write_live_plan(tmp_path, served, by=BY, settings=settings)
    for start in range(1, 101):
        trial = start_canary(tmp_path, plan_of(start), host="r1", by=BY, settings=settings)
        assert (tmp_path / HISTORY_DIR / f"{trial.plan}.json").exists()
        end_canary(tmp_path, trial, promote=False, by=BY, settings=settings)
    stored = {p.stem for p in (tmp_path / HISTORY_DIR).glob("*.json")} - {"history"}
    assert stored == {plan_digest(served)}  # the served plan only; 100 rolled-back trials left nothing
    assert PlanHistory(tmp_path, settings).load_stored(plan_digest(served)) == served
    # A trial of a plan the history still names (served before) keeps its file when rolled back.
    write_live_plan(tmp_path, plan_of(200), by=BY, settings=settings)
    trial = start_canary(tmp_path, served, host="r1", by=BY, settings=settings)
    end_canary(tmp_path, trial, promote=False, by=BY, settings=settings)
    assert PlanHistory(tmp_path, settings).load_stored(plan_digest(served)) == served


def test_a_rollback_with_an_unreadable_history_ends_the_trial_and_keeps_the_plan_file(tmp_path):
    write_live_plan(tmp_path, plan_of(0), by=BY)
    trial = start_canary(tmp_path, plan_of(1), host="r1", by=BY)
    (tmp_path / HISTORY_DIR / "history.json").write_text("{")  # which plans it names cannot be known
    assert end_canary(tmp_path, trial, promote=False, by=BY) is None
    assert read_canary(tmp_path) is None
    assert (tmp_path / HISTORY_DIR / f"{trial.plan}.json").exists()


@pytest.mark.parametrize("change", [
    {"format": 2}, {"plan": "../../etc/passwd"}, {"plan_id": ""}, {"instances": "lm_0_1"},
    {"instances": ["a b"]}, {"host": "r/1"}, {"started_at": "now"}, {"started_at": float("nan")}, {"extra": 1},
])
def test_a_bad_canary_file_is_refused_and_every_instance_serves_plan_json(tmp_path, change):
    a, b = plan_of(0), plan_of(0, 100)
    write_live_plan(tmp_path, a, by=BY)
    trial = start_canary(tmp_path, b, host="r1", instances=["lm_0_1"], by=BY)
    document = {**json.loads(trial.to_json()), **change}
    (tmp_path / CANARY_FILE).write_text(json.dumps(document))
    with pytest.raises(PlanError):
        read_canary(tmp_path)
    assert PlanFileWatcher(tmp_path, who="lm_0_1", host="r1").poll().plan_id == a.plan_id


def test_a_canary_whose_stored_plan_was_edited_is_refused(tmp_path):
    a, b = plan_of(0), plan_of(0, 100)
    write_live_plan(tmp_path, a, by=BY)
    trial = start_canary(tmp_path, b, host="r1", instances=["lm_0_1"], by=BY)
    stored = tmp_path / HISTORY_DIR / f"{trial.plan}.json"
    stored.write_text((tmp_path / PLAN_FILE).read_text())  # another plan under the trial's name
    watcher = PlanFileWatcher(tmp_path, who="lm_0_1", host="r1")
    assert watcher.poll() is None and "the plan on trial is" in watcher.error


def test_targets():
    every = CanaryAssignment("0" * 16, "p", "r1", (), 0.0)
    one = CanaryAssignment("0" * 16, "p", "r1", ("lm_0_1",), 0.0)
    assert every.targets("r1", "lm_0_0") and not every.targets("r2", "lm_0_0")
    assert one.targets("r1", "lm_0_1") and not one.targets("r1", "lm_0_0")


def test_the_cli_shows_and_aborts_a_trial_and_refuses_a_plan_that_does_not_fit(tmp_path, capsys):
    from warmup_tools.ops.cli import main

    a, b = plan_of(0), plan_of(0, 100)
    write_live_plan(tmp_path, a, by=BY)
    assert main(["plan", "canary", "--abort", "--control-dir", str(tmp_path)]) == 1
    trial = start_canary(tmp_path, b, host="r1", instances=["lm_0_1"], by=BY)
    assert main(["plan", "history", "--control-dir", str(tmp_path)]) == 0
    assert f"on trial: {trial.plan} (plan_id {b.plan_id}) on lm_0_1 of r1" in capsys.readouterr().out
    assert main(["plan", "canary", "--abort", "--control-dir", str(tmp_path)]) == 0
    assert read_canary(tmp_path) is None and "ended the trial" in capsys.readouterr().out
    # A plan for another tokenizer and block layout than the repository's is refused before anything is written.
    b.save(tmp_path / "b.json")
    assert main(["plan", "canary", str(tmp_path / "b.json"), "--replica", "r1", "--instance", "lm_0_1",
                 "--control-dir", str(tmp_path)]) == 2
    assert read_canary(tmp_path) is None


def test_the_cli_puts_a_plan_on_a_whole_replica_when_named_without_instances(tmp_path, capsys, monkeypatch):
    import time

    from warmup_tools.control.plan_control import AdapterCoverage, PlanStatus, PlanStatusBoard
    from warmup_tools.ops.cli import main

    monkeypatch.setattr("warmup_tools.planning.live.check_plan", lambda plan, repository: None)
    a, b = plan_of(0), plan_of(0, 100)
    write_live_plan(tmp_path, a, by=BY)
    b.save(tmp_path / "b.json")
    board = PlanStatusBoard(tmp_path)

    def report(host):
        for instance in ("lm_0_0", "lm_0_1"):
            board.report(PlanStatus(instance, a.plan_id, "control", "applied", {"base": AdapterCoverage(1, 1)},
                                    reported_at=time.time(), host=host))

    args = ["plan", "canary", str(tmp_path / "b.json"), "--replica", "r1", "--control-dir", str(tmp_path)]
    report("r1")
    assert main(args) == 2 and read_canary(tmp_path) is None
    assert "another one to compare with" in capsys.readouterr().err
    report("r2")
    assert main(args) == 0
    assert read_canary(tmp_path).instances == () and read_canary(tmp_path).host == "r1"
    assert "on trial on every instance of r1" in capsys.readouterr().out
