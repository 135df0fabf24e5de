"""The plan history: content-addressed plans, their parents, the bound, and bad input changing nothing."""

from __future__ import annotations

import json

import pytest

from tests.unit.control.test_plan_control import make_plan
from warmup_tools.common.errors import ConfigError
from warmup_tools.common.plan import Plan
from warmup_tools.control.plan_history import (
    HISTORY_DIR,
    HISTORY_FILE,
    PlanHistory,
    PlanHistoryError,
    PlanHistorySettings,
    applied_by,
    diff_plans,
    plan_digest,
    write_live_plan,
)
from warmup_tools.ops.cli import main
from warmup_tools.planning.live import rollback

BY = ("test", "alice")


def plan_of(*starts, tenant="acme"):
    """A plan with one 32-token item per start (two 16-token blocks each)."""
    plan = make_plan([{"tenant": tenant, "adapter": "sql", "token_ids": list(range(s, s + 32)), "kv_bytes": 32 * 100,
                       "text": f"prefix {s}"} for s in starts])
    plan.settings = {"kv_bytes_per_token": 100}
    plan.plan_id = Plan.content_id(plan.items, plan.block_size, plan.tokenizer_fingerprint)
    return plan


def snapshot(root):
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".lock"}


def test_the_digest_is_stable_and_names_the_content():
    a, again = plan_of(0, 100), plan_of(0, 100)
    assert plan_digest(a) == plan_digest(again) and len(plan_digest(a)) == 16
    # The same items with another creation time: the same plan_id (what is warmed) but another file.
    later = plan_of(0, 100)
    later.created = "2026-12-02T00:00:00Z"
    assert later.plan_id == a.plan_id and plan_digest(later) != plan_digest(a)
    assert plan_digest(plan_of(0, 101)) != plan_digest(a)


def test_each_application_records_its_parent_and_who(tmp_path):
    a, b = plan_of(0), plan_of(0, 100)
    first = write_live_plan(tmp_path, a, by=BY, inputs={"plan_file": "a.json"})
    second = write_live_plan(tmp_path, b, by=applied_by("apply-plan", {"WARMUP_PLAN_USER": "bob\x1b[31m"}))
    assert (first.parent, second.parent) == (None, plan_digest(a))
    assert second.by == "apply-plan" and second.user == "bob?[31m"
    history = PlanHistory(tmp_path)
    assert [e.id for e in history.entries()] == [plan_digest(b), plan_digest(a)]  # newest first
    assert history.current().id == plan_digest(b) and history.entries()[1].inputs["plan_file"] == "a.json"
    assert (second.items, second.kv_bytes) == (2, 6400)
    # Stored byte for byte as served, and loaded back checked.
    assert (tmp_path / HISTORY_DIR / f"{first.id}.json").read_bytes() == (a.to_json() + "\n").encode()
    assert history.load(first.id[:6]).to_json() == a.to_json()
    assert history.load(a.plan_id).to_json() == a.to_json()  # a plan_id names it too


def test_a_plan_json_written_before_the_history_becomes_the_parent(tmp_path):
    old = plan_of(7)
    (tmp_path / "plan.json").write_text(old.to_json() + "\n")
    entry = write_live_plan(tmp_path, plan_of(8), by=BY)
    found = PlanHistory(tmp_path).entries()[1]
    assert entry.parent == found.id == plan_digest(old) and found.by == "found"


def test_rollback_serves_the_parent_again_as_a_new_entry(tmp_path):
    a, b = plan_of(0), plan_of(0, 100)
    write_live_plan(tmp_path, a, by=BY)
    write_live_plan(tmp_path, b, by=BY)
    plan, entry = rollback(tmp_path)
    assert plan.to_json() == a.to_json() and (tmp_path / "plan.json").read_text() == a.to_json() + "\n"
    assert (entry.id, entry.parent, entry.by) == (plan_digest(a), plan_digest(b), "rollback")
    assert [e.id for e in PlanHistory(tmp_path).entries()] == [plan_digest(a), plan_digest(b), plan_digest(a)]

    # The served plan applied again is recorded, and keeps its parent (a rollback still goes somewhere).
    assert write_live_plan(tmp_path, a, by=BY).parent == plan_digest(b)
    # Rolling back again goes to b (the parent of what is served now); naming the served plan is refused.
    assert rollback(tmp_path)[1].id == plan_digest(b)
    with pytest.raises(PlanHistoryError, match="served now"):
        rollback(tmp_path, plan_digest(b))


def test_the_bound_keeps_the_newest_and_never_the_served_plan_or_its_parent(tmp_path):
    settings = PlanHistorySettings(plan_history_keep=3)
    plans = [plan_of(i) for i in range(6)]
    for plan in plans:
        write_live_plan(tmp_path, plan, by=BY, settings=settings)
    history = PlanHistory(tmp_path, settings)
    assert [e.id for e in history.entries()] == [plan_digest(p) for p in reversed(plans[-3:])]
    stored = {p.stem for p in (tmp_path / HISTORY_DIR).glob("*.json")} - {"history"}
    assert stored == {plan_digest(p) for p in plans[-3:]}
    # Going back to an old plan and on: the served plan's parent outlives the entry that applied it.
    write_live_plan(tmp_path, plans[3], by=BY, settings=settings)
    write_live_plan(tmp_path, plans[0], by=BY, settings=settings)
    write_live_plan(tmp_path, plans[1], by=BY, settings=settings)
    write_live_plan(tmp_path, plans[2], by=BY, settings=settings)
    assert history.current().parent == plan_digest(plans[1])
    assert history.load(plan_digest(plans[1])).plan_id == plans[1].plan_id
    assert not (tmp_path / HISTORY_DIR / f"{plan_digest(plans[5])}.json").exists()
    with pytest.raises(ConfigError, match="plan_history_keep"):
        PlanHistorySettings(plan_history_keep=1)


@pytest.mark.parametrize("corrupt", [b"{", b"[]", b'{"format": 2, "entries": []}',
                                     b'{"format": 1, "entries": [{"id": "../../etc"}]}',
                                     b"[" * 100_000 + b"]" * 100_000])
def test_a_corrupt_history_is_an_error_and_nothing_changes(tmp_path, corrupt):
    write_live_plan(tmp_path, plan_of(0), by=BY)
    (tmp_path / HISTORY_DIR / HISTORY_FILE).write_bytes(corrupt)
    before = snapshot(tmp_path)
    with pytest.raises(PlanHistoryError, match="plan history"):
        write_live_plan(tmp_path, plan_of(1), by=BY)
    with pytest.raises(PlanHistoryError):
        rollback(tmp_path)
    with pytest.raises(PlanHistoryError):
        PlanHistory(tmp_path).entries()
    assert snapshot(tmp_path) == before


def test_bad_ids_and_edited_plans_are_errors_and_change_nothing(tmp_path):
    a, b = plan_of(0), plan_of(1)
    write_live_plan(tmp_path, a, by=BY)
    write_live_plan(tmp_path, b, by=BY)
    before = snapshot(tmp_path)
    for ref, error in (("../plan", "not a plan id"), ("", "not a plan id"), ("ffff", "no plan ffff"),
                       ("0" * 64, "no plan")):
        with pytest.raises(PlanHistoryError, match=error):
            rollback(tmp_path, ref)
    stored = tmp_path / HISTORY_DIR / f"{plan_digest(a)}.json"
    data = json.loads(stored.read_text())
    data["created"] = "edited"
    stored.write_text(json.dumps(data))
    with pytest.raises(PlanHistoryError, match="does not hash to its name"):
        rollback(tmp_path)
    stored.write_text("{")
    with pytest.raises(PlanHistoryError, match="corrupt"):
        rollback(tmp_path)
    assert snapshot(tmp_path) == before | {stored.relative_to(tmp_path): b"{"}


def test_diff_counts_items_and_distinct_blocks(tmp_path):
    a, b = plan_of(0, 100), plan_of(100, 200)
    diff = diff_plans(a, b)
    assert [i["text"] for i in diff.added] == ["prefix 200"] and [i["text"] for i in diff.dropped] == ["prefix 0"]
    assert [i["text"] for i in diff.kept] == ["prefix 100"]
    block = 16 * 100
    assert (diff.added_bytes, diff.kept_bytes, diff.dropped_bytes) == (2 * block, 2 * block, 2 * block)


def test_the_commands_print_history_and_diff(tmp_path, capsys):
    a, b = plan_of(0, 100), plan_of(100, 200)
    write_live_plan(tmp_path, a, by=("apply-plan", "alice"))
    write_live_plan(tmp_path, b, by=("sidecar re-plan", ""))
    capsys.readouterr()
    assert main(["plan", "history", "--control-dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("*") and plan_digest(b) in lines[1] and "sidecar re-plan" in lines[1]
    assert plan_digest(a) in lines[2] and "apply-plan (alice)" in lines[2] and "6,400" in lines[2]
    assert main(["plan", "diff", plan_digest(a)[:8], plan_digest(b), "--control-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "1 items added (0.0 MiB of new blocks), 1 kept" in out and "+ acme / sql: 32 tokens 'prefix 200'" in out
    assert main(["plan", "diff", "nope", plan_digest(b), "--control-dir", str(tmp_path)]) == 2
    assert "not a plan id" in capsys.readouterr().err
