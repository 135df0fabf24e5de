"""What writers that are gone left in a fleet's shared folders is removed; a live writer's and this replica's own
files never are (ages set with os.utime, no clock waited on)."""

import os

from warmup_tools.common.prune import Pruned, prune_stale_writers

DAY = 86400.0
NOW = 1_000 * DAY


def _file(path, age_s):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("x")
    os.utime(path, (NOW - age_s, NOW - age_s))
    return path


def test_a_gone_writers_snapshot_files_and_log_folder_are_removed_and_nobody_elses(tmp_path):
    snaps, logs = tmp_path / "snapshots", tmp_path / "logs"
    gone = [_file(snaps / "lora_adapter_0_0_old-pod-7.manifest.json", 9 * DAY),
            _file(snaps / "lora_adapter_0_0_old-pod-7.ab12.safetensors", 9 * DAY)]
    live = [_file(snaps / "lora_adapter_0_0_r2.manifest.json", 60),
            _file(snaps / "lora_adapter_0_0_r2.cd34.safetensors", 60)]
    mine = [_file(snaps / "lora_adapter_0_0_r1.manifest.json", 30 * DAY),  # this replica's, however old
            _file(snaps / "lora_adapter_0_0_r1.ef56.safetensors", 30 * DAY)]
    _file(logs / "old-pod-7" / "requests-lora_adapter_0_0.jsonl", 9 * DAY)
    os.utime(logs / "old-pod-7", (NOW - 9 * DAY, NOW - 9 * DAY))
    _file(logs / "r2" / "requests-lora_adapter_0_0.jsonl.1", 9 * DAY)
    _file(logs / "r2" / "requests-lora_adapter_0_0.jsonl", 3600)  # a live replica: one recent file is enough
    _file(logs / "r1" / "requests-lora_adapter_0_0.jsonl", 30 * DAY)
    for folder in ("r1", "r2"):
        os.utime(logs / folder, (NOW - 30 * DAY, NOW - 30 * DAY))
    pruned = prune_stale_writers("r1", 7 * DAY, NOW, snapshot_dir=snaps, log_dir=logs)
    assert pruned == Pruned(snapshot_files=2, log_folders=1)
    assert not any(p.exists() for p in gone) and all(p.exists() for p in live + mine)
    assert sorted(p.name for p in logs.iterdir()) == ["r1", "r2"]
    # Idempotent: a second pass, or another replica's sidecar, finds nothing more to remove.
    assert prune_stale_writers("r1", 7 * DAY, NOW, snapshot_dir=snaps, log_dir=logs) == Pruned()
    assert prune_stale_writers("r2", 7 * DAY, NOW, snapshot_dir=snaps, log_dir=logs) == Pruned(2, 1)


def test_missing_folders_are_nothing_to_prune(tmp_path):
    assert prune_stale_writers("r1", DAY, NOW, snapshot_dir=tmp_path / "none", log_dir=None) == Pruned()
