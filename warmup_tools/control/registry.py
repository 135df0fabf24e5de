"""Changing the LoRA adapter set of a running ``lora_adapter`` model, on every instance, without a restart.

Each Triton instance of ``lora_adapter`` is its own OS process with its own copy of the base model and
adapters, so control cannot be a call into one of them, and it must not go through the public ensemble.
Instead all instances share a *control folder* on disk::

    <root>/desired.json            written by the operator CLI: one AdapterSpec per adapter + a generation
    <root>/status/<instance>.json  written by each instance: the AdapterStatus of every adapter it knows
    <root>/.lock                   flock'ed by writers of desired.json

Before serving a request an instance calls :meth:`Reconciler.maybe_reconcile`: one ``stat`` of
desired.json. Only when the file changed does it re-read it, :func:`plan_reconcile` the actions that move
its :class:`AdapterLifecycle` to the desired state (register, load, warm, go live, retire), apply them,
and :meth:`ControlRegistry.report` its statuses. The CLI then :meth:`ControlRegistry.wait_until` every
instance reports the adapter in the wanted state at the spec's current revision.

Every file is written to a temporary file in the same folder, fsync'ed and ``os.replace``'d, so a reader
sees either the old or the new complete file, never a half-written one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from warmup_tools.common.control_json import loads_bounded, read_json_bounded
from warmup_tools.common.files import stat_key, write_atomic
from warmup_tools.common.regular_file import FileTooLarge, NotARegularFile, read_regular
from warmup_tools.control.state import AdapterSpec, AdapterState, AdapterStatus, LifecycleError, validate_name

LOGGER = logging.getLogger(__name__)


DESIRED_FILE = "desired.json"


STATUS_DIR = "status"


LOCK_FILE = ".lock"


FORMAT_VERSION = 1


#: Bounds on what a reader takes from the control folder (desired.json holds every adapter's warm prompts).
MAX_DESIRED_BYTES = 16 * 1024 * 1024
#: The most JSON values desired.json may hold, counted on its bytes before it is parsed (control_json.json_values):
#: an adapter is 6 values and one per warm prompt, so this is e.g. 1,000 adapters of 59 prompts. Parsing is what
#: costs (16 MiB of ``[[],[],...]``, 5.6 million values, took every reader 5.7 s and 774 MiB); this many cost a
#: few milliseconds and megabytes, text of any length besides.
MAX_DESIRED_VALUES = 65_536
MAX_STATUS_BYTES = 1024 * 1024


class ControlRegistry:
    """The control folder: desired.json (an AdapterSpec per name, plus a global ``generation``) and
    status/<instance>.json.

    Safe to use from several threads and processes: writers of desired.json serialize on an flock and
    replace the file atomically; readers never lock.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.status_dir = self.root / STATUS_DIR
        self.status_dir.mkdir(parents=True, exist_ok=True)
        self.desired_path = self.root / DESIRED_FILE
        self._lock = threading.Lock()
        self._cache_key: tuple[int, int, int] | None = None
        self._cache: tuple[int, dict[str, AdapterSpec]] = (0, {})
        #: stat key of a desired.json that failed to parse, with its error (not re-read until it changes).
        self._bad: tuple[tuple[int, int, int] | None, LifecycleError | None] = (None, None)

    def desired(self) -> tuple[int, dict[str, AdapterSpec]]:
        """``(generation, specs)``; re-reads desired.json only when its stat changed. Missing file: ``(0, {})``.

        Raises LifecycleError when the file is not a valid control file (not re-read until it changes).
        """
        key = stat_key(self.desired_path)
        with self._lock:
            if key == self._cache_key:
                return self._cache[0], dict(self._cache[1])
            if key is not None and key == self._bad[0]:
                raise self._bad[1]
            generation, specs, key = self._read_desired()
            self._cache_key, self._cache = key, (generation, specs)
            return generation, dict(specs)

    def changed_since(self, generation: int) -> bool:
        """Whether desired.json may hold something other than ``generation``: one stat, no read.

        True whenever the file changed since this registry last read it (call :meth:`desired` to see what
        changed); False when it is unchanged since a read that failed (nothing new to act on yet).
        """
        key = stat_key(self.desired_path)
        with self._lock:
            if key == self._cache_key:
                return self._cache[0] != generation
            return not (key is not None and key == self._bad[0])

    def add(self, name: str, warm_prompts: Sequence[str] = (), *, live: bool = True,
            path: str | None = None) -> AdapterSpec:
        """Ask every instance to load (and warm, then serve) ``name``, or with ``live=False`` only to
        register it. Re-adding a live adapter bumps its revision, so instances reload and re-warm it."""
        validate_name(name)
        if isinstance(warm_prompts, str):
            raise LifecycleError(f"adapter {name!r}: warm_prompts must be a sequence of prompts, not one string")
        target = "live" if live else "registered"

        def change(old: AdapterSpec | None) -> AdapterSpec | None:
            if old is not None and target == "registered":
                if old.target == "live":
                    raise LifecycleError(f"adapter {name!r} is live; retire it before adding it again as registered")
                if old.target == "registered" and old.warm_prompts == tuple(warm_prompts) and old.path == path:
                    return None  # NOTE: nothing to redo; a bump would leave instances at an older revision.
            return AdapterSpec(name, target, tuple(warm_prompts), _next_revision(old), path)

        return self._update(name, change)

    def retire(self, name: str) -> AdapterSpec:
        """Ask every instance to stop serving ``name`` (and unload it). Retiring a retired adapter is a no-op."""
        validate_name(name)

        def change(old: AdapterSpec | None) -> AdapterSpec | None:
            if old is not None and old.target == "retired":
                return None
            prompts, path = (old.warm_prompts, old.path) if old is not None else ((), None)
            return AdapterSpec(name, "retired", prompts, _next_revision(old), path)

        return self._update(name, change)

    def report(self, instance: str, statuses: Mapping[str, AdapterStatus]) -> None:
        """Atomically replace status/<instance>.json with ``statuses``."""
        validate_name(instance, what="instance name")
        document = {
            "format": FORMAT_VERSION,
            "instance": instance,
            "reported_at": time.time(),
            "adapters": {name: _status_to_json(st) for name, st in sorted(statuses.items())},
        }
        write_atomic(self.status_dir / f"{instance}.json", _dump(document))

    def statuses(self) -> dict[str, dict[str, AdapterStatus]]:
        """``instance -> adapter name -> status`` of every readable status file; others are skipped."""
        found: dict[str, dict[str, AdapterStatus]] = {}
        for file in sorted(self.status_dir.glob("*.json")):
            if file.name.startswith("."):
                continue
            try:
                document = _expect(read_json_bounded(file, max_bytes=MAX_STATUS_BYTES), dict, "status file")
                raw_statuses = _expect(document["adapters"], dict, "adapters")
                found[file.stem] = {name: _status_from_json(raw) for name, raw in raw_statuses.items()}
            except (OSError, ValueError, KeyError, TypeError, LifecycleError) as exc:
                LOGGER.debug("skipping unreadable status file %s: %s", file, exc)
        return found

    def forget(self, instance: str) -> bool:
        """Remove an instance's status file (e.g. of an instance that is gone); True if there was one."""
        validate_name(instance, what="instance name")
        try:
            (self.status_dir / f"{instance}.json").unlink()
        except FileNotFoundError:
            return False
        return True

    def wait_until(self, name: str, state: AdapterState, *, instances: int | None = None,
                   timeout_s: float = 120.0, poll_s: float = 0.2) -> dict[str, AdapterStatus]:
        """Wait until instances report ``name`` in ``state`` at the spec's current revision.

        Waits for at least ``instances`` instances, or (None) for every instance that has a status file
        and at least one. Returns the matching instances' statuses. Raises LifecycleError as soon as an
        instance reports FAILED at the current revision, and on timeout with each instance's state.
        """
        validate_name(name)
        state = AdapterState(state)
        if instances is not None and instances < 1:
            raise LifecycleError(f"instances must be >= 1 or None, got {instances}")
        deadline = time.monotonic() + timeout_s
        while True:
            _, specs = self.desired()
            spec = specs.get(name)
            if spec is None:
                raise LifecycleError(f"adapter {name!r} is not in {self.desired_path}; add it first")
            reports = {inst: adapters.get(name) for inst, adapters in self.statuses().items()}
            for inst, st in reports.items():
                failed = st is not None and st.revision == spec.revision and st.state is AdapterState.FAILED
                if failed and state is not AdapterState.FAILED:
                    raise LifecycleError(f"adapter {name!r} failed on instance {inst}: {st.detail or 'no detail'}")
            ready = {inst: st for inst, st in reports.items()
                     if st is not None and st.state is state and st.revision == spec.revision}
            if instances is not None:
                done = len(ready) >= instances
            else:
                done = bool(reports) and len(ready) == len(reports)
            if done:
                return ready
            if time.monotonic() >= deadline:
                raise LifecycleError(
                    f"timed out after {timeout_s:g} s waiting for adapter {name!r} to be {state.value} at revision "
                    f"{spec.revision} on {instances if instances is not None else 'every'} instance(s); "
                    f"{_describe_reports(reports, time.time())}"
                )
            time.sleep(poll_s)

    # ------------------------------------------------------------------------------------- helpers
    def _update(self, name: str, change: Callable[[AdapterSpec | None], AdapterSpec | None]) -> AdapterSpec:
        """Read-modify-write desired.json under the flock; bumps the generation unless ``change`` is None."""
        with _flocked(self.root / LOCK_FILE):
            # NOTE: read the file itself, not the cache: another process may have written since.
            generation, specs, key = self._read_desired()
            old = specs.get(name)
            new = change(old)
            if new is None:  # an existing spec that needs no change: no write, no bump
                return old
            specs[name] = new
            document = {
                "format": FORMAT_VERSION,
                "generation": generation + 1,
                "adapters": {n: _spec_to_json(s) for n, s in sorted(specs.items())},
            }
            # NOTE: readers compare (inode, size, mtime_ns). Two writes in one clock tick could give an
            # equal size and mtime, and a reused inode, so each write moves mtime strictly forward.
            write_atomic(self.desired_path, _dump(document), min_mtime_ns=None if key is None else key[2] + 1000)
            return new

    def _read_desired(self) -> tuple[int, dict[str, AdapterSpec], tuple[int, int, int] | None]:
        """Read and validate desired.json; the stat key is taken from the open file, so it matches the bytes."""
        try:
            # NOTE: a regular file only, opened without blocking: a FIFO here would hang every reader for good.
            raw, st = read_regular(self.desired_path, MAX_DESIRED_BYTES, follow_symlinks=True)
        except FileNotFoundError:
            return 0, {}, None
        except (FileTooLarge, NotARegularFile) as exc:  # refused like any other bad file, below (once per change)
            cause = getattr(exc, "strerror", None) or exc
            st, raw, bad = os.stat(self.desired_path), b"", ValueError(f"{DESIRED_FILE}: {cause}")
        except OSError as exc:
            raise LifecycleError(f"cannot read {self.desired_path}: {exc.strerror or exc}") from exc
        else:
            bad = None
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        try:
            if bad is not None:
                raise bad
            # NOTE: bounded and iterative: a deeply nested file is a bad file, not a RecursionError.
            document = _expect(loads_bounded(raw, DESIRED_FILE, max_values=MAX_DESIRED_VALUES), dict, "desired.json")
            unknown = set(document) - {"format", "generation", "adapters"}
            if unknown:
                raise LifecycleError(f"unknown keys {sorted(unknown)}")
            if document.get("format") != FORMAT_VERSION:
                raise LifecycleError(f"format {document.get('format')!r} is not {FORMAT_VERSION}")
            generation = _expect(document["generation"], int, "generation")
            specs = {name: _spec_from_json(name, raw_spec)
                     for name, raw_spec in _expect(document["adapters"], dict, "adapters").items()}
        except (ValueError, KeyError, TypeError, LifecycleError) as exc:
            error = LifecycleError(
                f"{self.desired_path} is not a valid control file ({exc}); "
                "fix or remove it, then add the adapters again"
            )
            self._bad = (key, error)
            raise error from exc
        return generation, specs, key




# ------------------------------------------------------------------------------------- file helpers
def _next_revision(old: AdapterSpec | None) -> int:
    return 1 if old is None else old.revision + 1


@contextlib.contextmanager
def _flocked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _dump(document: Mapping[str, Any]) -> bytes:
    return (json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def _expect(value: Any, kind: type, what: str) -> Any:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise LifecycleError(f"{what} must be a {kind.__name__}, got a {type(value).__name__}")  # not the content
    return value


def _spec_to_json(spec: AdapterSpec) -> dict[str, Any]:
    return {
        "target": spec.target, "warm_prompts": list(spec.warm_prompts), "revision": spec.revision, "path": spec.path,
    }


def _spec_from_json(name: str, raw: Any) -> AdapterSpec:
    raw = _expect(raw, dict, f"adapter {name!r}")
    unknown = set(raw) - {"target", "warm_prompts", "revision", "path"}
    if unknown:
        raise LifecycleError(f"adapter {name!r} has unknown keys {sorted(unknown)}")
    return AdapterSpec(
        name=name,
        target=raw["target"],
        warm_prompts=tuple(_expect(raw.get("warm_prompts", []), list, f"adapter {name!r} warm_prompts")),
        revision=raw.get("revision", 0),
        path=raw.get("path"),
    )


def _status_to_json(st: AdapterStatus) -> dict[str, Any]:
    return {"state": st.state.value, "revision": st.revision, "detail": st.detail, "updated_at": st.updated_at}


def _status_from_json(raw: Any) -> AdapterStatus:
    raw = _expect(raw, dict, "adapter status")
    return AdapterStatus(
        state=AdapterState(raw["state"]),
        revision=_expect(raw["revision"], int, "revision"),
        detail=str(raw.get("detail", "")),
        updated_at=float(raw.get("updated_at", 0.0)),
    )


def _describe_reports(reports: Mapping[str, AdapterStatus | None], now: float) -> str:
    if not reports:
        return ("no instance has reported yet (is the lora_adapter model loaded, with the same control folder, "
                "and has it received a request since?)")
    parts = []
    for inst, st in sorted(reports.items()):
        if st is None:
            parts.append(f"{inst}: not reported")
        else:
            detail = f", {st.detail}" if st.detail else ""
            age = f"{now - st.updated_at:.0f} s ago"
            parts.append(f"{inst}: {st.state.value} at revision {st.revision} ({age}{detail})")
    return "; ".join(parts)
