"""Removing what replicas that are gone left in a fleet's shared folders.

Every replica writes its KV snapshots into one shared folder (``<instance>_<replica>.manifest.json`` and its
payloads: :mod:`warmup_tools.kv.snapshot_files`), its request logs into its own subfolder of the fleet's log
folder (``<replica>/requests-<instance>.jsonl*``) and its instances' plan status into the control folder
(``plan_status/``). A replica that left for good (scaled in; a pod renamed at its restart) never comes back for
them, so nothing else would remove them, and a reader that looks at a bounded number of files (the newest
snapshots, the first statuses) starts missing live ones.

A writer is live when it wrote any of its files within ``max_age_s`` (days: the sidecar's
``stale_writer_prune_s``; a live instance rewrites its snapshot every ``snapshot_interval_s`` and its status at
each heartbeat) or one of its instances reported on the plan status board within as long. Only files of writers
that are neither live nor this replica are removed, and only files named as those writers name them: a file the
folders hold for anything else stays. Every sidecar of a fleet may run :func:`prune_stale_writers`: a pass is
idempotent (a file another sidecar removed first is simply gone).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Collection

from warmup_tools.common.control_json import read_capped
from warmup_tools.common.names import is_replica_name
from warmup_tools.control.plan_control import MAX_STATUS_BYTES, PLAN_STATUS_DIR, PlanStatus, PlanStatusBoard
from warmup_tools.kv.snapshot_files import MANIFEST_SUFFIX, snapshot_of

LOGGER = logging.getLogger(__name__)

#: A request-log file (:class:`~warmup_tools.lora_adapter.request_log.RequestLogWriter`, rotated or compressed).
_REQUEST_LOG = re.compile(r"requests-[A-Za-z0-9._-]+\.jsonl(?:\.\d+)?(?:\.gz)?")


@dataclass(frozen=True, slots=True)
class Pruned:
    """What one pass removed."""

    snapshot_files: int = 0
    log_folders: int = 0
    status_files: int = 0


def prune_stale_writers(me: str, max_age_s: float, now: float, *, snapshot_dir: Path | None = None,
                        log_dir: Path | None = None, control_dir: Path | None = None) -> Pruned:
    """Remove, at ``now``, what replicas other than ``me`` (this replica's name, as
    :func:`warmup_tools.common.names.replica_name` returned it) that are not live left: their snapshot files in
    ``snapshot_dir``, their request-log subfolders of ``log_dir`` and their plan status files in ``control_dir``
    (whose board also says which replicas are live)."""
    cutoff = now - max_age_s
    keep = {me}
    if control_dir is not None:
        keep.update(PlanStatusBoard(control_dir).hosts(since=cutoff))
    pruned = Pruned(_prune_snapshots(Path(snapshot_dir), keep, cutoff) if snapshot_dir is not None else 0,
                    _prune_logs(Path(log_dir), keep, cutoff) if log_dir is not None else 0,
                    _prune_statuses(Path(control_dir) / PLAN_STATUS_DIR, keep, cutoff)
                    if control_dir is not None else 0)
    if pruned != Pruned():
        LOGGER.info("removed what replicas gone for %.0f s left: %d snapshot files, %d request-log folders, %d plan "
                    "status files", max_age_s, pruned.snapshot_files, pruned.log_folders, pruned.status_files)
    return pruned


class StaleWriterPruner:
    """:func:`prune_stale_writers` for one sidecar: a pass at :meth:`start`, then every ``every_s``, on a thread of
    its own until :meth:`stop`; a pass that fails is logged and tried again at the next."""

    def __init__(self, me: str, max_age_s: float, every_s: float, *, snapshot_dir: Path | None = None,
                 log_dir: Path | None = None, control_dir: Path | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.me, self.max_age_s, self.every_s = me, max_age_s, every_s
        self.snapshot_dir, self.log_dir, self.control_dir = snapshot_dir, log_dir, control_dir
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def run_once(self) -> Pruned:
        return prune_stale_writers(self.me, self.max_age_s, self._clock(), snapshot_dir=self.snapshot_dir,
                                   log_dir=self.log_dir, control_dir=self.control_dir)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="sidecar-prune", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_once()
            except Exception:  # NOTE: a pass that fails (a folder unreadable for a while) is tried again later
                LOGGER.exception("removing what replicas that are gone left failed")
            self._stop.wait(self.every_s)


# ------------------------------------------------------------------------------------------ helpers
def _prune_snapshots(folder: Path, keep: Collection[str], cutoff: float) -> int:
    """Each snapshot (its manifest, payloads and temporary files) as a whole: kept if any of its files is newer
    than ``cutoff`` or its name ends with a kept replica's name, else removed, manifest first (a reader that still
    sees the manifest finds its payload)."""
    snapshots: dict[str, list[Path]] = {}
    for path in _entries(folder):
        name = snapshot_of(path.name)
        if name is not None and not path.is_symlink() and path.is_file():
            snapshots.setdefault(name, []).append(path)
    removed = 0
    for name, files in snapshots.items():
        # NOTE: a snapshot is named <instance>_<replica> (snapshot_name), and a replica name ends with a letter or
        # a digit, so the name ends with "_<replica>"; one that also ends so for another replica is kept (safe).
        if any(name == r or name.endswith(f"_{r}") for r in keep) or max(map(_mtime, files)) > cutoff:
            continue
        files.sort(key=lambda p: not p.name.endswith(MANIFEST_SUFFIX))
        removed += sum(_unlink_if_old(path, cutoff) for path in files)
    return removed


def _prune_logs(folder: Path, keep: Collection[str], cutoff: float) -> int:
    """Each replica's subfolder: its request-log files removed, then the folder when that left it empty."""
    removed = 0
    for sub in _entries(folder):
        if (sub.name in keep or not is_replica_name(sub.name) or sub.is_symlink() or not sub.is_dir()
                or _newest(sub) > cutoff):
            continue
        for path in _entries(sub):
            if _REQUEST_LOG.fullmatch(path.name) and not path.is_symlink() and path.is_file():
                _unlink_if_old(path, cutoff)
        try:
            sub.rmdir()
            removed += 1
        except FileNotFoundError:
            pass  # another sidecar removed it first
        except OSError:
            LOGGER.warning("request-log folder %s of a replica that is gone holds other files: left in place", sub)
    return removed


def _prune_statuses(folder: Path, keep: Collection[str], cutoff: float) -> int:
    """The plan status files of instances of other replicas that reported last before ``cutoff``."""
    removed = 0
    for path in _entries(folder):
        if path.name.startswith(".") or not path.name.endswith(".json") or path.is_symlink():
            continue
        try:
            with open(path, "rb") as file:
                status = PlanStatus.from_json(read_capped(file, MAX_STATUS_BYTES, path.name))
        except (OSError, ValueError):
            continue  # not one the board reads: not ours to judge
        if status.host and status.host not in keep and status.reported_at <= cutoff:
            removed += _unlink_if_old(path, cutoff)
    return removed


def _entries(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except OSError:  # no such folder (yet), or not readable
        return []


def _unlink_if_old(path: Path, cutoff: float) -> bool:
    """Remove ``path`` if it was not written since ``cutoff``, looked at once more right before (a writer that came
    back under its old name keeps what it wrote)."""
    if _mtime(path) > cutoff:
        return False
    try:
        os.unlink(path)
    except OSError:  # gone meanwhile (another sidecar), or not ours to remove
        return False
    return True


def _mtime(path: Path) -> float:
    try:
        return path.lstat().st_mtime
    except OSError:
        return float("inf")  # gone meanwhile, or unreadable: not judged


def _newest(folder: Path) -> float:
    newest = _mtime(folder)
    for root, dirs, names in os.walk(folder):
        for name in (*dirs, *names):
            newest = max(newest, _mtime(Path(root) / name))
    return newest
