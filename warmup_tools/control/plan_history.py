"""Every plan the control folder served: the one writer of ``plan.json``, and the history it keeps.

:func:`write_live_plan` is the only function that makes a plan the one every instance serves (``apply-plan``,
the sidecar's rolling re-plan and ``plan rollback`` all come through it). Before it replaces ``plan.json``
it keeps the plan in the control folder, content-addressed, with what it replaced and who applied it::

    <root>/plans/<id>.json     a plan file, byte for byte what plan.json held; <id> is its digest
    <root>/plans/history.json  the applications, oldest first: id, parent, when, by whom, inputs, size
    <root>/plans/.lock         serialises writers (the CLI and a sidecar may share the folder)

A plan's history id is the SHA-256 of its canonical JSON (:meth:`Plan.to_json`), cut to 16 hex digits: the
same plan file has the same id wherever and whenever it is written. (The plan's ``plan_id``, what instances
report, hashes only what is warmed; two plans with the same items but other budgets share it.)

The history is bounded (:class:`PlanHistorySettings`): past ``plan_history_keep`` applications the oldest
entries go, and with them every stored plan no remaining entry names, except the plan served now and its
parent. Everything read back is checked: a history file that is not what this module writes, a stored plan
whose content does not hash to its name, an id that names no plan, each raise :class:`PlanHistoryError`
before anything is written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import Any, Iterator, Mapping

from warmup_tools.common.control_json import read_json_bounded
from warmup_tools.common.errors import FileFormatError
from warmup_tools.common.files import stat_key, write_atomic
from warmup_tools.common.plan import Plan, PlanError
from warmup_tools.common.settings import check_settings, setting
from warmup_tools.control.plan_control import HISTORY_DIR, PLAN_FILE, read_canary

HISTORY_FILE = "history.json"
HISTORY_FORMAT = 1
MAX_HISTORY_BYTES = 8 * 1024 * 1024
#: Environment variable naming who applies a plan (recorded as given; USER when unset).
USER_ENV = "WARMUP_PLAN_USER"
_ID = re.compile(r"[0-9a-f]{4,16}")
_TEXT = re.compile(r"[^\x20-\x7e]")


class PlanHistoryError(PlanError):
    """The plan history is unreadable, or an id names no stored plan (or several)."""


@dataclasses.dataclass(frozen=True, slots=True)
class PlanHistorySettings:
    """How much plan history the control folder keeps (``WARMUP_PLAN_HISTORY_KEEP``, or the commands' flags)."""

    plan_history_keep: int = setting(20, "Plan applications the control folder's history keeps (plans/); the "
                                         "oldest beyond it are deleted with every stored plan no kept entry names, "
                                         "never the plan served now or its parent.", ge=2, le=10_000,
                                  flag="history-keep")

    def __post_init__(self) -> None:
        check_settings(self)


@dataclasses.dataclass(frozen=True, slots=True)
class HistoryEntry:
    """One application of a plan to the control folder."""

    #: Digest of the plan file's canonical JSON (:func:`plan_digest`).
    id: str
    #: The plan's ``plan_id`` (what instances report in plan_status/).
    plan_id: str
    #: The history id of the plan it replaced (None: the folder served none, or one that was not a plan).
    parent: str | None
    #: Epoch seconds it was written.
    at: float
    #: What applied it: ``apply-plan``, ``sidecar re-plan``, ``rollback``, ``found`` (a plan.json written
    #: before the history existed).
    by: str
    #: Who, from the environment (``WARMUP_PLAN_USER``, else ``USER``), "" when unknown.
    user: str
    items: int
    kv_bytes: int
    #: What the plan was made from, when known: the log window, the planner's settings and budgets.
    inputs: Mapping[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"inputs": dict(self.inputs)}

    @classmethod
    def from_dict(cls, raw: Any, where: str) -> HistoryEntry:
        if not isinstance(raw, dict) or set(raw) != {f.name for f in dataclasses.fields(cls)}:
            raise PlanHistoryError(f"{where}: not a history entry")
        ok = (_is_id(raw["id"]) and isinstance(raw["plan_id"], str) and (raw["parent"] is None or _is_id(raw["parent"]))
              and isinstance(raw["at"], (int, float)) and not isinstance(raw["at"], bool)
              and isinstance(raw["by"], str) and isinstance(raw["user"], str) and isinstance(raw["inputs"], dict)
              and all(type(raw[k]) is int and raw[k] >= 0 for k in ("items", "kv_bytes")))
        if not ok:
            raise PlanHistoryError(f"{where}: a field has the wrong type")
        return cls(**raw)


def plan_digest(plan: Plan) -> str:
    """A plan file's history id: the SHA-256 of its canonical JSON, 16 hex digits."""
    return hashlib.sha256(plan.to_json().encode("utf-8")).hexdigest()[:16]


def applied_by(via: str, environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """``(via, user)``: the user from ``WARMUP_PLAN_USER`` (else ``USER``), printable and at most 64 characters."""
    environ = os.environ if environ is None else environ
    user = environ.get(USER_ENV) or environ.get("USER") or ""
    return via, _TEXT.sub("?", user)[:64]


class PlanHistory:
    """The plans a control folder served; :func:`write_live_plan` adds to it, the CLI reads it."""

    def __init__(self, control_dir: Path, settings: PlanHistorySettings | None = None) -> None:
        self.control_dir = Path(control_dir)
        self.folder = self.control_dir / HISTORY_DIR
        self.settings = settings or PlanHistorySettings()

    def entries(self) -> list[HistoryEntry]:
        """Every kept application, newest first; :class:`PlanHistoryError` if the history file is corrupt."""
        return list(reversed(self._read()))

    def resolve(self, ref: str) -> str:
        """The stored plan ``ref`` names: a history id, a unique prefix of one (4 digits at least), or a plan_id."""
        if not isinstance(ref, str) or not re.fullmatch(r"[0-9a-f]{4,64}", ref):
            raise PlanHistoryError(f"{ref!r} is not a plan id (4 to 16 hex digits: see `plan history`)")
        entries = self._read()
        ids = {e.id for e in entries} | {e.parent for e in entries if e.parent}
        matches = sorted(i for i in ids if i.startswith(ref)) or sorted({e.id for e in entries if e.plan_id == ref})
        if not matches:
            raise PlanHistoryError(f"no plan {ref} in the history of {self.control_dir} (see `plan history`)")
        if len(matches) > 1:
            raise PlanHistoryError(f"{ref} names {len(matches)} plans ({', '.join(matches)}); give more digits")
        return matches[0]

    def load(self, ref: str) -> Plan:
        """The stored plan ``ref`` names, validated (its format, its plan_id, and its digest against its name)."""
        return self.load_stored(self.resolve(ref))

    def load_stored(self, plan_id: str) -> Plan:
        """The stored plan of history id ``plan_id`` (in the history or not: a plan on trial), validated."""
        if not _is_id(plan_id):
            raise PlanHistoryError(f"{plan_id!r} is not a plan history id (16 hex digits)")
        path = self.folder / f"{plan_id}.json"
        if not path.exists():
            raise PlanHistoryError(f"the file of plan {plan_id} ({path}) is gone (deleted by the "
                                   "history bound, or by hand)")
        try:
            plan = Plan.load(path)
        except PlanError as exc:
            raise PlanHistoryError(f"stored plan {plan_id} is corrupt: {exc}") from None
        if plan_digest(plan) != plan_id:
            raise PlanHistoryError(f"stored plan {path} does not hash to its name {plan_id}: it was edited")
        return plan

    def current(self) -> HistoryEntry | None:
        """The newest entry, if it is what ``plan.json`` holds now."""
        entries = self._read()
        return entries[-1] if entries and self._served_id() == entries[-1].id else None

    # ---------------------------------------------------------------------------------- internals
    def _read(self) -> list[HistoryEntry]:
        path = self.folder / HISTORY_FILE
        if not path.exists():
            return []
        try:
            data = read_json_bounded(path, max_bytes=MAX_HISTORY_BYTES)
        except FileFormatError as exc:
            raise PlanHistoryError(f"plan history {exc}; move it aside to start a new history") from None
        if (not isinstance(data, dict) or data.get("format") != HISTORY_FORMAT
                or not isinstance(data.get("entries"), list)):
            raise PlanHistoryError(f"plan history {path} is not a history of format {HISTORY_FORMAT}; move it aside "
                                   "to start a new history")
        return [HistoryEntry.from_dict(raw, f"plan history {path}, entry {i}") for i, raw in enumerate(data["entries"])]

    def _served_id(self) -> str | None:
        """The history id of the plan in ``plan.json`` (None: no file, or not a valid plan)."""
        try:
            return plan_digest(Plan.load(self.control_dir / PLAN_FILE))
        except PlanError:
            return None

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / ".lock", "a+b") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def _store(self, plan: Plan) -> str:
        plan_id = plan_digest(plan)
        path = self.folder / f"{plan_id}.json"
        if not path.exists():
            write_atomic(path, plan.to_json() + "\n")
        return plan_id

    def _drop_unused(self, plan_id: str) -> None:
        """Remove stored plan ``plan_id`` unless the history names it (a plan rolled back from its trial); the caller
        holds the lock. A history that cannot be read keeps the file."""
        try:
            wanted = _wanted(self._read())
        except PlanHistoryError:
            return
        if plan_id not in wanted and _is_id(plan_id):
            (self.folder / f"{plan_id}.json").unlink(missing_ok=True)

    def _write(self, entries: list[HistoryEntry]) -> None:
        keep = self.settings.plan_history_keep
        entries = entries[-keep:]
        wanted = _wanted(entries)
        try:  # NOTE: the plan on trial is stored here too, and no entry names it until it is promoted
            canary = read_canary(self.control_dir)
        except PlanError:
            canary = None
        if canary is not None:
            wanted.add(canary.plan)
        document = {"format": HISTORY_FORMAT, "entries": [e.to_dict() for e in entries]}
        write_atomic(self.folder / HISTORY_FILE, json.dumps(document, sort_keys=True, separators=(",", ":")) + "\n")
        for path in self.folder.glob("*.json"):
            if path.name != HISTORY_FILE and path.stem not in wanted and _is_id(path.stem):
                path.unlink(missing_ok=True)


def write_live_plan(control_dir: Path, plan: Plan, *, by: tuple[str, str], inputs: Mapping[str, Any] | None = None,
                    settings: PlanHistorySettings | None = None) -> HistoryEntry:
    """Make ``plan`` the plan every instance serves (``plan.json``, atomic, its mtime always moving forward)
    and record it in the history; ``by`` is :func:`applied_by`'s ``(what, who)``.

    The history is read first: a corrupt one raises :class:`PlanHistoryError` and nothing is written.
    """
    history = PlanHistory(control_dir, settings)
    with history._locked():
        entries = history._read()
        parent = None
        served = history.control_dir / PLAN_FILE
        try:
            before = Plan.load(served) if served.exists() else None
        except PlanError:
            before = None  # not a plan: an instance refuses it too; nothing to go back to
        if before is not None:
            parent = history._store(before)
            if not entries or entries[-1].id != parent:  # written before the history existed, or by hand
                entries.append(_entry(before, parent, None, ("found", ""), {}))
        plan_id = history._store(plan)
        if parent == plan_id:  # the served plan applied again: what it replaced stays its parent
            parent = entries[-1].parent if entries and entries[-1].id == plan_id else None
        old = stat_key(served)
        write_atomic(served, plan.to_json() + "\n", min_mtime_ns=None if old is None else old[2] + 1000)
        entry = _entry(plan, plan_id, parent, by, inputs or {})
        history._write([*entries, entry])
    return entry


@dataclasses.dataclass(frozen=True, slots=True)
class PlanDiff:
    """What serving ``new`` instead of ``old`` changes: items (scope and token ids) and KV bytes (blocks)."""

    added: list[dict[str, Any]]
    kept: list[dict[str, Any]]
    dropped: list[dict[str, Any]]
    added_bytes: int
    kept_bytes: int
    dropped_bytes: int


def diff_plans(old: Plan, new: Plan) -> PlanDiff:
    """Items added, kept and dropped from ``old`` to ``new``; bytes count each distinct KV block once (a
    block two items share is one block), at the plans' block size and KV bytes per token."""
    def items(plan: Plan) -> dict[tuple[str, str, tuple[int, ...]], dict[str, Any]]:
        return {(i["tenant"], i["adapter"], tuple(i["token_ids"])): i for i in plan.items}

    def blocks(plan: Plan) -> set[tuple[str, str, tuple[int, ...]]]:
        bs = plan.block_size
        return {(t, a, ids[:end]) for t, a, ids in items(plan) for end in range(bs, len(ids) + 1, bs)}

    def block_bytes(plan: Plan) -> int:
        return plan.block_size * int(plan.settings.get("kv_bytes_per_token", 0) or 0)

    before, after = items(old), items(new)
    old_blocks, new_blocks = blocks(old), blocks(new)
    return PlanDiff([after[k] for k in after if k not in before], [after[k] for k in after if k in before],
                    [before[k] for k in before if k not in after], len(new_blocks - old_blocks) * block_bytes(new),
                    len(new_blocks & old_blocks) * block_bytes(new), len(old_blocks - new_blocks) * block_bytes(old))


def _entry(plan: Plan, plan_id: str, parent: str | None, by: tuple[str, str],
           inputs: Mapping[str, Any]) -> HistoryEntry:
    inputs = {"settings": plan.settings, "budgets": plan.budgets, "as_of": plan.summary.get("as_of"), **inputs}
    return HistoryEntry(plan_id, plan.plan_id, parent, round(time.time(), 3), by[0], by[1], len(plan.items),
                        sum(int(item.get("kv_bytes", 0)) for item in plan.items), inputs)


def _is_id(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 16 and bool(_ID.fullmatch(value))


def _wanted(entries: list[HistoryEntry]) -> set[str]:
    """The stored plans ``entries`` still need: each entry's plan, and the newest one's parent."""
    return {e.id for e in entries} | {e.parent for e in entries[-1:] if e.parent}
