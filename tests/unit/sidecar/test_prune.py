"""What replicas that are gone left in a fleet's shared folders is removed; a live replica's files, this replica's
own and anything the folders hold for something else never are (real files, ages set with os.utime, no clock
waited on)."""

from __future__ import annotations

import os
import time

import pytest

from tests.unit.kv.test_snapshot import ADAPTERS, BIG, IDENTITY, filled_cache
from warmup_tools.common.errors import ConfigError
from warmup_tools.control.plan_control import PLAN_STATUS_DIR, PlanStatus, PlanStatusBoard
from warmup_tools.kv.snapshot import write_snapshot
from warmup_tools.sidecar.app import Sidecar
from warmup_tools.sidecar.config import SidecarConfig
from warmup_tools.sidecar.prune import Pruned, prune_stale_writers

DAY = 86400.0
NOW = 1_000 * DAY
WEEK = 7 * DAY


def age(path, seconds, now=NOW):
    os.utime(path, (now - seconds, now - seconds))
    return path


def snapshot(folder, replica, seconds, instance="lora_adapter_0_0", now=NOW):
    """A real snapshot of ``instance`` of ``replica``, rewritten once (so a previous payload is kept), ``seconds``
    old at ``now``; its files."""
    blocks = filled_cache().snapshot_blocks(BIG)
    for count in (2, len(blocks)):
        write_snapshot(folder, f"{instance}_{replica}", IDENTITY, ADAPTERS, blocks[:count], created=float(count))
    files = sorted(folder.glob(f"{instance}_{replica}.*"))
    assert len(files) == 3  # the manifest, its payload, the previous payload
    return [age(p, seconds, now) for p in files]


def request_logs(folder, replica, seconds, files=("requests-lora_adapter_0_0.jsonl",
                                                   "requests-lora_adapter_0_0.jsonl.1"), now=NOW):
    (folder / replica).mkdir(parents=True)
    paths = []
    for name in files:
        (folder / replica / name).write_text('{"x": 1}\n')
        paths.append(age(folder / replica / name, seconds, now))
    age(folder / replica, seconds, now)
    return paths


def report(control, replica, seconds, instance="lora_adapter_0_0"):
    PlanStatusBoard(control).report(PlanStatus(instance, None, "samples", "none", {}, reported_at=NOW - seconds,
                                               host=replica))
    (path,) = [p for p in (control / PLAN_STATUS_DIR).glob(f"*.{instance}.json")
               if PlanStatus.from_json(p.read_bytes()).host == replica]
    return age(path, seconds)


def test_a_gone_replicas_snapshots_and_request_logs_are_removed_and_nobody_elses(tmp_path):
    snaps, logs = tmp_path / "snapshots", tmp_path / "logs"
    gone = snapshot(snaps, "old-pod-7", 9 * DAY) + snapshot(snaps, "old-pod-7", 9 * DAY, "lora_adapter_0_1")
    live = snapshot(snaps, "r2", 60)
    mine = snapshot(snaps, "r1", 30 * DAY)  # this replica's, however old
    gone_logs = request_logs(logs, "old-pod-7", 9 * DAY)
    live_logs = request_logs(logs, "r2", 9 * DAY)
    age(live_logs[0], 3600)  # a live replica: one recent file is enough
    age(logs / "r2", 9 * DAY)
    my_logs = request_logs(logs, "r1", 30 * DAY)

    pruned = prune_stale_writers("r1", WEEK, NOW, snapshot_dir=snaps, log_dir=logs)
    assert pruned == Pruned(snapshot_files=6, log_folders=1)
    assert not any(p.exists() for p in gone + gone_logs)
    assert all(p.exists() for p in live + mine + live_logs + my_logs)
    assert sorted(p.name for p in logs.iterdir()) == ["r1", "r2"]
    # Idempotent: a second pass, or another replica's sidecar, finds nothing more to remove.
    assert prune_stale_writers("r1", WEEK, NOW, snapshot_dir=snaps, log_dir=logs) == Pruned()
    assert prune_stale_writers("r2", WEEK, NOW, snapshot_dir=snaps, log_dir=logs) == Pruned(3, 1)  # r1's


def test_a_replica_that_reports_on_the_status_board_is_live_however_old_its_files(tmp_path):
    snaps, logs, control = tmp_path / "snapshots", tmp_path / "logs", tmp_path / "control"
    # NOTE: a replica with snapshot_interval_s 0 writes its snapshot only when it stops, one that serves no
    # request writes no log, but its instances report their plan status at every heartbeat.
    idle = snapshot(snaps, "r3", 30 * DAY) + request_logs(logs, "r3", 30 * DAY)
    fresh_report = report(control, "r3", 60)
    gone = snapshot(snaps, "old-pod-7", 9 * DAY) + request_logs(logs, "old-pod-7", 9 * DAY)
    gone_report = report(control, "old-pod-7", 9 * DAY)
    my_old_report = report(control, "r1", 30 * DAY, "lora_adapter_0_9")

    pruned = prune_stale_writers("r1", WEEK, NOW, snapshot_dir=snaps, log_dir=logs, control_dir=control)
    assert pruned == Pruned(snapshot_files=3, log_folders=1, status_files=1)
    assert all(p.exists() for p in idle + [fresh_report, my_old_report])
    assert not any(p.exists() for p in gone + [gone_report])
    assert PlanStatusBoard(control).hosts(since=0) == ["r1", "r3"]


def test_a_snapshot_is_judged_whole_and_removed_manifest_first(tmp_path, monkeypatch):
    manifest, *payloads = sorted(snapshot(tmp_path, "r2", 9 * DAY), key=lambda p: not p.name.endswith(".json"))
    age(payloads[0], 30 * DAY)
    age(manifest, 60)  # rewritten a minute ago: its older payloads are part of a live snapshot
    assert prune_stale_writers("r1", WEEK, NOW, snapshot_dir=tmp_path) == Pruned()
    assert all(p.exists() for p in [manifest, *payloads])

    age(manifest, 8 * DAY)
    removed = []
    real_unlink = os.unlink
    # NOTE: a spy on the real unlink (which still runs), to see the order.
    monkeypatch.setattr("warmup_tools.sidecar.prune.os.unlink",
                        lambda path: (removed.append(os.path.basename(path)), real_unlink(path)))
    assert prune_stale_writers("r1", WEEK, NOW, snapshot_dir=tmp_path) == Pruned(3)
    assert not any(p.exists() for p in [manifest, *payloads])
    assert removed[0] == manifest.name  # a reader that still sees the manifest finds its payload


def test_what_the_folders_hold_for_anything_else_stays(tmp_path):
    snaps, logs = tmp_path / "snapshots", tmp_path / "logs"
    snaps.mkdir()
    others = []
    for name in ("README.txt", "model.safetensors", ".lock", "x_old-pod-7.manifest.json.bak"):
        (snaps / name).write_text("x")
        others.append(age(snaps / name, 90 * DAY))
    (logs / "lost+found").mkdir(parents=True)  # an ext4 volume's root: no replica's name
    (logs / ".hidden").mkdir()
    for folder in ("lost+found", ".hidden"):
        age(logs / folder, 90 * DAY)
    kept_file = request_logs(logs, "old-pod-7", 9 * DAY, files=("requests-lora_adapter_0_0.jsonl", "notes.txt"))
    (logs / "elsewhere").mkdir()
    (logs / "old-pod-8").symlink_to(logs / "elsewhere")

    assert prune_stale_writers("r1", WEEK, NOW, snapshot_dir=snaps, log_dir=logs) == Pruned()
    assert all(p.exists() for p in others)
    assert sorted(p.name for p in logs.iterdir()) == [".hidden", "elsewhere", "lost+found", "old-pod-7", "old-pod-8"]
    assert [p.exists() for p in kept_file] == [False, True]  # its request logs went, the other file stayed


def test_missing_folders_are_nothing_to_prune(tmp_path):
    assert prune_stale_writers("r1", DAY, NOW, snapshot_dir=tmp_path / "none", log_dir=tmp_path / "no",
                               control_dir=tmp_path / "nothing") == Pruned()


def test_the_sidecar_prunes_its_replicas_folders_as_configured(tmp_path):
    snaps, logs, control = tmp_path / "snapshots", tmp_path / "logs", tmp_path / "control"
    now = time.time()  # the sidecar reads the real clock; a week is far more than this test takes
    gone = snapshot(snaps, "old-pod-7", 9 * DAY, now=now) + request_logs(logs, "old-pod-7", 9 * DAY, now=now)
    mine = snapshot(snaps, "r1", 30 * DAY, now=now) + request_logs(logs, "r1", 30 * DAY, now=now)
    config = SidecarConfig(port=0, fleet_log_dir=logs, coverage_threshold=0)
    sidecar = Sidecar(config, "http://127.0.0.1:9", "127.0.0.1:9", None, control_dir=control, replica_name="r1",
                      snapshot_dir=snaps)
    try:
        assert sidecar.pruner.run_once() == Pruned(snapshot_files=3, log_folders=1)
    finally:
        sidecar.stop()
    assert not any(p.exists() for p in gone) and all(p.exists() for p in mine)
    off = Sidecar(SidecarConfig(port=0, fleet_log_dir=logs, stale_writer_prune_s=0), "http://127.0.0.1:9",
                  "127.0.0.1:9", None, replica_name="r1", snapshot_dir=snaps)
    off.stop()
    assert off.pruner is None


@pytest.mark.parametrize("value", [1, 600, 3599])
def test_a_prune_age_a_live_replica_could_reach_between_two_writes_is_refused(value):
    with pytest.raises(ConfigError, match="stale_writer_prune_s"):
        SidecarConfig(stale_writer_prune_s=value)
    assert SidecarConfig(stale_writer_prune_s=0).stale_writer_prune_s == 0
    assert SidecarConfig(stale_writer_prune_s=3600).stale_writer_prune_s == 3600
