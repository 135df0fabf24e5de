"""Removing what writers that are gone left in a fleet's shared folders.

Every replica writes its KV snapshots into one shared folder (``<instance>_<replica>.manifest.json`` and its
payloads) and its request logs into its own subfolder of one shared log folder (``<replica>/``). A replica that
left for good (scaled in, renamed) never comes back for them, so nothing else would ever remove them. A live
writer rewrites its snapshot every snapshot interval (minutes) and appends to its logs while it serves, so what
no one touched for ``max_age_s`` (days: see the sidecar's ``stale_writer_prune_s``) belongs to a writer that is
gone. A replica never removes its own files, and removing is idempotent: every sidecar of a fleet may run it.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

LOGGER = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Pruned:
    """What one pass removed."""

    snapshot_files: int = 0
    log_folders: int = 0


def prune_stale_writers(me: str, max_age_s: float, now: float, *, snapshot_dir: Path | None = None,
                        log_dir: Path | None = None) -> Pruned:
    """Remove from ``snapshot_dir`` the files of other writers untouched for ``max_age_s`` (at ``now``), and from
    ``log_dir`` the subfolders of other replicas in which nothing changed for as long; ``me`` (this replica's name,
    checked by :func:`warmup_tools.common.names.replica_name`) is never touched."""
    files = folders = 0
    cutoff = now - max_age_s
    if snapshot_dir is not None and Path(snapshot_dir).is_dir():
        for path in Path(snapshot_dir).iterdir():
            # NOTE: a snapshot file is <instance>_<replica>.<...>: this replica's contain "_<me>." (a name is
            # one path component of letters, digits, '.', '_' and '-', which the snapshot name keeps as it is).
            if not path.is_file() or f"_{me}." in path.name or _mtime(path) > cutoff:
                continue
            path.unlink(missing_ok=True)
            files += 1
    if log_dir is not None and Path(log_dir).is_dir():
        for folder in Path(log_dir).iterdir():
            if folder.name == me or not folder.is_dir() or folder.is_symlink() or _newest(folder) > cutoff:
                continue
            shutil.rmtree(folder, ignore_errors=True)
            folders += 1
    if files or folders:
        LOGGER.info("removed what writers gone for %.0f s left: %d snapshot files, %d request-log folders",
                    max_age_s, files, folders)
    return Pruned(files, folders)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return float("inf")  # gone meanwhile, or unreadable: not ours to judge


def _newest(folder: Path) -> float:
    newest = _mtime(folder)
    for root, dirs, names in os.walk(folder):
        for name in [*dirs, *names]:
            newest = max(newest, _mtime(Path(root) / name))
    return newest
