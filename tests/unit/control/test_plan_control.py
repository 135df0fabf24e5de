"""plan.json and plan_status/ in the control folder: bounded, schema-checked, a bad file never replaces a plan."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from warmup_tools.common.control_json import json_containers
from warmup_tools.common.files import write_atomic
from warmup_tools.common.plan import MAX_PLAN_FILE_CONTAINERS, Plan, PlanError
from warmup_tools.control.plan_control import (
    MAX_PLAN_CONTAINERS,
    MAX_PLAN_ITEMS,
    AdapterCoverage,
    LivePlan,
    PinReport,
    PlanFileWatcher,
    PlanStatus,
    PlanStatusBoard,
    read_canary,
)
from warmup_tools.control.plan_history import write_live_plan

BS = 16


def make_plan(items, block_size=BS, fingerprint="tok-1"):
    """A plan file as the planner writes it (only what the live channel reads matters here)."""
    items = [{"kind": "kv_prefix", "reason": "test", **item} for item in items]
    return Plan(plan_id=Plan.content_id(items, block_size, fingerprint), created="2026-12-01T00:00:00Z",
                block_size=block_size, tokenizer_fingerprint=fingerprint, budgets={}, settings={}, summary={},
                items=items, embedding_items=[], tokenizer_templates=[], clusters=[])


def test_a_planner_plan_parses_into_its_items():
    plan = make_plan([{"tenant": "acme", "adapter": "sql", "token_ids": list(range(32))},
                      {"tenant": "", "adapter": "", "token_ids": list(range(16))}])
    live = LivePlan.parse(plan.to_json().encode())
    assert live.plan_id == plan.plan_id and live.block_size == BS
    assert [(i.tenant, i.adapter, len(i.token_ids)) for i in live.items] == [("acme", "sql", 32), ("default", "", 16)]


@pytest.mark.parametrize("mutate, error", [
    (lambda d: d.update(format=2), "format"),
    (lambda d: d["items"][0].update(token_ids=list(range(20))), "multiple of block_size"),
    (lambda d: d["items"][0].update(token_ids=[1.5] * 16), "integers"),
    (lambda d: d["items"][0].update(tenant="../etc"), "tenant"),
    (lambda d: d["items"][0].update(adapter="a/b"), "adapter"),
    (lambda d: d["items"].append({"kind": "kv_prefix", "token_ids": list(range(16))}), "hash"),
    (lambda d: d.update(block_size=0), "block_size"),
])
def test_an_invalid_plan_is_refused(mutate, error):
    data = json.loads(make_plan([{"tenant": "acme", "adapter": "sql", "token_ids": list(range(32))}]).to_json())
    mutate(data)
    with pytest.raises(PlanError, match=error):
        LivePlan.parse(json.dumps(data).encode())
    with pytest.raises(PlanError, match="JSON"):
        LivePlan.parse(b"\xff{")


def test_an_items_retention_is_read_and_an_item_without_one_takes_the_instances():
    plan = make_plan([{"tenant": "acme", "adapter": "sql", "token_ids": list(range(32)), "retention_s": 600},
                      {"tenant": "acme", "adapter": "", "token_ids": list(range(16)), "retention_s": None},
                      {"tenant": "acme", "adapter": "", "token_ids": list(range(16, 32))}])
    live = LivePlan.parse(plan.to_json().encode())
    assert [i.retention_s for i in live.items] == [600.0, None, None]
    assert isinstance(live.items[0].retention_s, float)


@pytest.mark.parametrize("retention", [0, -1, 1e-50, 30 * 86400 + 1, 1e309, "600", True, [600], {"s": 1}])
def test_an_item_whose_retention_is_not_seconds_in_its_bound_is_refused(retention):
    data = json.loads(make_plan([{"tenant": "acme", "adapter": "sql", "token_ids": list(range(32))}]).to_json())
    data["items"][0]["retention_s"] = retention
    with pytest.raises(PlanError, match=r"item 0: retention_s must be a number of seconds above 0 and at most "
                                        r"2592000 \(30 days\)"):
        LivePlan.parse(json.dumps(data).encode())


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity"])
def test_a_retention_of_nan_or_infinity_is_refused(literal):
    data = json.loads(make_plan([{"tenant": "acme", "adapter": "sql", "token_ids": list(range(32))}]).to_json())
    data["items"][0]["retention_s"] = "__R__"
    raw = json.dumps(data).encode().replace(b'"__R__"', literal)
    with pytest.raises(PlanError, match="retention_s must be|JSON"):
        LivePlan.parse(raw)


def test_bad_and_oversized_files_are_refused_once_and_the_instance_keeps_its_plan(tmp_path, caplog):
    good = make_plan([{"tenant": "acme", "adapter": "sql", "token_ids": list(range(32))}])
    watcher = PlanFileWatcher(tmp_path, max_bytes=4096, who="inst_0")
    assert watcher.poll() is None  # no file yet
    write_live_plan(tmp_path, good, by=("test", ""))
    assert watcher.poll().plan_id == good.plan_id
    assert watcher.poll() is None  # unchanged: not read again

    caplog.set_level(logging.ERROR)
    for bad in (b"{not json", b" " * 5000, json.dumps({"format": 1}).encode()):
        caplog.clear()
        write_atomic(tmp_path / "plan.json", bad, min_mtime_ns=(tmp_path / "plan.json").stat().st_mtime_ns + 1000)
        assert watcher.poll() is None and watcher.poll() is None
        assert len(caplog.records) == 1 and "keeping the plan served now" in caplog.records[0].getMessage()
        assert "refused" in watcher.error
    # A plan nested 50,000 deep (past the parser's recursion limit, under the containers bound, checked first) is
    # one more bad file, with an error that says which and why.
    caplog.clear()
    write_atomic(tmp_path / "plan.json", b"[" * 50_000 + b"]" * 50_000,
                 min_mtime_ns=(tmp_path / "plan.json").stat().st_mtime_ns + 1000)
    deep = PlanFileWatcher(tmp_path, who="inst_0")
    assert deep.poll() is None and deep.poll() is None
    assert "plan.json refused: plan.json: nested deeper than the parser" in deep.error
    assert len(caplog.records) == 1
    many = make_plan([{"tenant": "acme", "token_ids": [i] * BS} for i in range(5)])
    write_live_plan(tmp_path, many, by=("test", ""))
    assert PlanFileWatcher(tmp_path, max_items=4).poll() is None
    assert PlanFileWatcher(tmp_path).poll().plan_id == many.plan_id


def test_a_plan_of_more_arrays_and_objects_than_allowed_is_refused_before_parsing_and_the_instance_keeps_its_plan(
        tmp_path, caplog, monkeypatch):
    good = make_plan([{"tenant": "acme", "adapter": "sql", "token_ids": list(range(32))}])
    write_live_plan(tmp_path, good, by=("test", ""))
    watcher = PlanFileWatcher(tmp_path, who="inst_0")
    assert watcher.poll().plan_id == good.plan_id
    # A plan's shape with a list of empty lists for items: 16 MiB of these took every instance seconds and hundreds
    # of MiB to parse before the format check refused them. Over the bound by one here: refused unparsed.
    hostile = b'{"format": 1, "items": [' + b"[]," * (MAX_PLAN_CONTAINERS - 2) + b"[]]}"
    assert json_containers(hostile) == MAX_PLAN_CONTAINERS + 1
    caplog.set_level(logging.ERROR)
    monkeypatch.setattr(json, "loads", lambda *_a, **_k: pytest.fail("parsed"))
    write_atomic(tmp_path / "plan.json", hostile, min_mtime_ns=(tmp_path / "plan.json").stat().st_mtime_ns + 1000)
    assert watcher.poll() is None and watcher.poll() is None
    assert watcher.error == (f"{tmp_path / 'plan.json'} refused: plan.json: {MAX_PLAN_CONTAINERS + 1} JSON arrays and "
                             f"objects by its brackets, more than the {MAX_PLAN_CONTAINERS} allowed (refused before "
                             f"parsing)")
    assert [r.getMessage() for r in caplog.records] == [
        f"instance inst_0: {watcher.error}; keeping the plan served now"]
    # The sidecar's loader of plan.json (Plan.load, 64 MiB) refuses the same shape at its own bound, four times it.
    assert MAX_PLAN_FILE_CONTAINERS == 4 * MAX_PLAN_CONTAINERS
    larger = b'{"format": 1, "items": [' + b"[]," * (MAX_PLAN_FILE_CONTAINERS - 2) + b"[]]}"
    write_atomic(tmp_path / "plan.json", larger, min_mtime_ns=(tmp_path / "plan.json").stat().st_mtime_ns + 1000)
    with pytest.raises(PlanError, match=rf"^plan file {tmp_path / 'plan.json'}: {MAX_PLAN_FILE_CONTAINERS + 1} "
                                        rf"JSON arrays and objects by its brackets, more than the "
                                        rf"{MAX_PLAN_FILE_CONTAINERS} allowed \(refused before parsing\); rebuild it"):
        Plan.load(tmp_path / "plan.json")


def test_a_plan_at_the_item_cap_with_everything_a_planner_writes_per_item_is_within_the_containers_bound():
    # Per item: the item, its token_ids and clusters; a tokenizer template, an embedding item, a dropped item of a
    # rolling plan's summary, its cluster and that cluster's centroid; and as many clusters again that no item warms.
    n = MAX_PLAN_ITEMS
    items = [{"tenant": "acme", "adapter": "sql", "token_ids": [i % 50_000] * BS, "clusters": [i]} for i in range(n)]
    plan = make_plan(items)
    plan.tokenizer_templates = [{"text": "t", "tenant": "acme", "adapter": "sql", "tokens": BS}] * n
    plan.embedding_items = [{"text": "t", "cluster": i, "tenant": "acme", "adapter": "sql"} for i in range(n)]
    plan.summary = {"changes": {"dropped_items": [{"tenant": "acme", "tokens": BS}] * n}, "arbitration": {}}
    plan.clusters = [{"cluster": i, "centroid": [0.5, 0.25]} for i in range(2 * n)]
    raw = plan.to_json().encode()
    assert json_containers(raw) == 10 * n + 11 <= MAX_PLAN_CONTAINERS
    assert len(LivePlan.parse(raw).items) == n


def test_statuses_round_trip_and_unreadable_ones_are_skipped(tmp_path):
    board = PlanStatusBoard(tmp_path, max_bytes=2048)
    status = PlanStatus("lora_adapter_0_0", "p1", "control", "applied",
                        {"sql": AdapterCoverage(10, 9, True, "1 of 10 planned blocks do not fit the warm-up budget")},
                        reported_at=12.5)
    board.report(status)
    (board.folder / "junk.json").write_text("{}")
    (board.folder / "big.json").write_text(json.dumps({"pad": "x" * 4000}))
    found, skipped = board.read_all()
    assert found == {"lora_adapter_0_0": status}
    assert found["lora_adapter_0_0"].adapters["sql"].coverage == 0.9
    assert len(skipped) == 2 and any("larger than" in s for s in skipped)
    assert board.wait_for("p1", timeout_s=5, poll_s=0.01) == {"lora_adapter_0_0": status}
    with pytest.raises(PlanError, match="lora_adapter_0_0: applied plan p1"):
        board.wait_for("p2", timeout_s=0.05, poll_s=0.01)
    # Replicas share the folder and name their instances alike: reports are kept apart by host.
    for host in ("pod-a", "pod-b"):
        board.report(dataclasses.replace(status, host=host, plan_id=host))
    found, _ = board.read_all()
    assert set(found) == {"lora_adapter_0_0", "pod-a/lora_adapter_0_0", "pod-b/lora_adapter_0_0"}
    assert board.read_all(host="pod-b")[0]["lora_adapter_0_0"].plan_id == "pod-b"
    bad = json.loads(status.to_json())
    bad["adapters"]["sql"]["resident"] = 11
    with pytest.raises(ValueError, match="resident"):
        PlanStatus.from_json(json.dumps(bad).encode())


#: A pin report as PrefixCache.pin_report writes it.
PINS = {"plan_id": "p1", "state": "released", "window_s": 60.0, "pinned_blocks": 0, "window_pin_hits": 0,
        "window_shadow_hits": 1, "pin_hits": 2, "shadow_hits": 31, "expired_blocks": 1, "released_blocks": 9,
        "releases": 1, "reason": "over 61 s the pinned blocks gave 2 block hits and the blocks evicted for them "
        "would have given 31", "adapters": {"sql": {"pinned_blocks": 0, "pin_hits": 2, "shadow_hits": 31,
                                                    "expired_blocks": 1, "released_blocks": 9}}}


def test_a_status_carries_the_caches_pin_report_and_reads_it_back():
    status = PlanStatus("lora_adapter_0_0", "p1", "control", "applied", {"sql": AdapterCoverage(10, 10)},
                        reported_at=12.5, pins=PinReport.from_dict(PINS))
    back = PlanStatus.from_json(status.to_json())
    assert back == status and back.pins.to_dict() == PINS
    assert back.pins.adapters["sql"].released_blocks == 9
    # A report from before the live check (no "pins") and one of an instance without a KV cache read back as None.
    old = json.loads(status.to_json())
    del old["pins"]
    assert PlanStatus.from_json(json.dumps(old).encode()).pins is None
    assert PlanStatus.from_json(dataclasses.replace(status, pins=None).to_json()).pins is None


@pytest.mark.parametrize("change, error", [
    ({"state": "gone"}, "pins.state must be one of none, pinned, expired, released"),
    ({"pin_hits": -1}, "pins.pin_hits must be a non-negative integer"),
    ({"shadow_hits": 1.5}, "pins.shadow_hits must be a non-negative integer"),
    ({"releases": True}, "pins.releases must be a non-negative integer"),
    ({"window_s": float("inf")}, "pins.window_s"),
    ({"adapters": {"../x": {}}}, "adapter"),
    ({"adapters": {"sql": []}}, "pins.adapters entries must be objects"),
    ({"adapters": {f"a{i}": {} for i in range(257)}}, "at most 256 adapters"),
    ({"plan_id": "p" * 65}, "plan_id"),
])
def test_a_status_with_a_malformed_pin_report_is_not_read(change, error):
    raw = json.loads(PlanStatus("lora_adapter_0_0", "p1", "control", "applied", {}, reported_at=1.0,
                                pins=PinReport.from_dict(PINS)).to_json())
    raw["pins"].update(change)
    with pytest.raises(ValueError, match=error):
        PlanStatus.from_json(json.dumps(raw).encode())


def test_a_pin_reports_reason_is_printable_text_of_bounded_length():
    pins = PinReport.from_dict({**PINS, "reason": "\x1b[31m" + "y" * 2000})
    assert pins.reason.startswith("?[31m") and len(pins.reason) == 500


def test_a_fifo_in_place_of_plan_json_canary_json_or_a_status_file_is_refused_without_blocking(tmp_path, caplog):
    # A plain open() of a FIFO waits for a writer that never comes: the instance's plan watcher, or the sidecar
    # reading the status board, hung for good.
    import os

    os.mkfifo(tmp_path / "plan.json")
    watcher = PlanFileWatcher(tmp_path)
    with caplog.at_level(logging.ERROR):
        assert watcher.poll() is None
    assert "not a regular file (a FIFO)" in watcher.error and "keeping the plan served now" in caplog.text
    os.mkfifo(tmp_path / "canary.json")
    with pytest.raises(PlanError, match=r"canary\.json: .*not a regular file \(a FIFO\)"):
        read_canary(tmp_path)
    board = PlanStatusBoard(tmp_path)
    board.folder.mkdir(parents=True, exist_ok=True)
    os.mkfifo(board.folder / "lora_adapter_0_9.json")
    found, skipped = board.read_all()
    assert found == {} and len(skipped) == 1 and "not a regular file (a FIFO)" in skipped[0]
