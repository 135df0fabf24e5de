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
import dataclasses
import enum
import fcntl
import json
import logging
import os
import re
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from warmup_tools.common.errors import AdapterUnavailableError, ConfigError, UnknownAdapterError

LOGGER = logging.getLogger(__name__)


class AdapterState(str, enum.Enum):
    REGISTERED = "registered"
    LOADING = "loading"
    WARMING = "warming"
    LIVE = "live"
    FAILED = "failed"
    RETIRED = "retired"


_S = AdapterState

#: Allowed transitions. registered->retired retires an adapter that was never loaded, and
#: retired->registered re-adds one as registered only; both are needed to reach every AdapterSpec target.
TRANSITIONS: Mapping[AdapterState, frozenset[AdapterState]] = {
    _S.REGISTERED: frozenset({_S.LOADING, _S.RETIRED}),
    _S.LOADING: frozenset({_S.WARMING, _S.LIVE, _S.FAILED}),
    _S.WARMING: frozenset({_S.LIVE, _S.FAILED}),
    # live->warming re-warms after a plan change; live->loading reloads changed weights.
    _S.LIVE: frozenset({_S.RETIRED, _S.WARMING, _S.LOADING}),
    _S.FAILED: frozenset({_S.LOADING, _S.RETIRED}),
    _S.RETIRED: frozenset({_S.LOADING, _S.REGISTERED}),
}

#: What an operator can ask for: the state every instance should bring the adapter to.
TARGETS = frozenset({"live", "registered", "retired"})

#: Adapter and instance names become file and folder names: no separators, no leading dot.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")

DESIRED_FILE = "desired.json"
STATUS_DIR = "status"
LOCK_FILE = ".lock"
FORMAT_VERSION = 1


class LifecycleError(ConfigError):
    """An illegal adapter state transition, a bad adapter name, or an unreadable control file."""


@dataclasses.dataclass(frozen=True, slots=True)
class AdapterSpec:
    """The desired state of one adapter, written by the operator."""

    name: str
    #: "live", "registered" (known, not loaded) or "retired".
    target: str
    #: Prompt texts to pre-fill into the instance's KV cache before the adapter goes live.
    warm_prompts: tuple[str, ...] = ()
    #: Bumped by every change of this spec; instances redo their work when it changes.
    revision: int = 0
    #: Folder name under the adapter root; None means ``name``.
    path: str | None = None

    def __post_init__(self) -> None:
        validate_name(self.name)
        if self.target not in TARGETS:
            targets = ", ".join(sorted(TARGETS))
            raise LifecycleError(f"adapter {self.name!r}: target {self.target!r} is not one of {targets}")
        prompts = tuple(self.warm_prompts)
        if not all(isinstance(p, str) and p for p in prompts):
            raise LifecycleError(f"adapter {self.name!r}: every warm prompt must be a non-empty string")
        object.__setattr__(self, "warm_prompts", prompts)
        if not isinstance(self.revision, int) or isinstance(self.revision, bool) or self.revision < 0:
            raise LifecycleError(f"adapter {self.name!r}: revision must be an int >= 0, got {self.revision!r}")
        if self.path is not None:
            validate_name(self.path, what="adapter path")

    @property
    def folder(self) -> str:
        """The folder name under the adapter root."""
        return self.path or self.name


@dataclasses.dataclass(frozen=True, slots=True)
class AdapterStatus:
    """What one instance reports for one adapter."""

    state: AdapterState
    revision: int
    #: The failure message, or what was done, e.g. "warmed 3 prompts (512 tokens)".
    detail: str = ""
    #: ``time.time()`` of the last change.
    updated_at: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class Action:
    """One step an instance takes towards the desired state."""

    kind: str  # "register" | "load" | "warm" | "go_live" | "retire"
    name: str
    spec: AdapterSpec


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
        key = _stat_key(self.desired_path)
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
        key = _stat_key(self.desired_path)
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
        _write_atomic(self.status_dir / f"{instance}.json", _dump(document))

    def statuses(self) -> dict[str, dict[str, AdapterStatus]]:
        """``instance -> adapter name -> status`` of every readable status file; others are skipped."""
        found: dict[str, dict[str, AdapterStatus]] = {}
        for file in sorted(self.status_dir.glob("*.json")):
            if file.name.startswith("."):
                continue
            try:
                document = _expect(json.loads(file.read_text(encoding="utf-8")), dict, "status file")
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
                if st is not None and st.revision == spec.revision and st.state is _S.FAILED and state is not _S.FAILED:
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
            _write_atomic(self.desired_path, _dump(document), min_mtime_ns=None if key is None else key[2] + 1000)
            return new

    def _read_desired(self) -> tuple[int, dict[str, AdapterSpec], tuple[int, int, int] | None]:
        """Read and validate desired.json; the stat key is taken from the open file, so it matches the bytes."""
        try:
            with open(self.desired_path, "rb") as file:
                st = os.fstat(file.fileno())
                raw = file.read()
        except FileNotFoundError:
            return 0, {}, None
        except OSError as exc:
            raise LifecycleError(f"cannot read {self.desired_path}: {exc}") from exc
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        try:
            document = _expect(json.loads(raw.decode("utf-8")), dict, "desired.json")
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


def plan_reconcile(desired: Mapping[str, AdapterSpec], current: Mapping[str, AdapterStatus]) -> list[Action]:
    """The ordered actions one instance must take to move ``current`` to ``desired`` (a pure function).

    - target live: an adapter that is unknown, registered, retired, failed at an older revision, or live
      at an older revision gets (register if unknown) -> load -> (warm if it has warm prompts) -> go_live.
      Live at the current revision: nothing. Failed at the current revision: nothing (a new revision retries).
    - target registered: register if unknown, retired, or registered at an older revision.
    - target retired: retire unless retired (an unknown adapter is registered, then retired, so that every
      instance reports it).
    - loading or warming: nothing; the reconcile in flight finishes or fails it.
    - adapters in ``current`` but absent from ``desired`` are left alone (they come from the static config).

    Retirements come first, so memory is freed before new adapters load.
    """
    retires: list[Action] = []
    others: list[Action] = []
    for name, spec in desired.items():
        steps = _PLANNERS[spec.target](spec, current.get(name))
        actions = [Action(kind, name, spec) for kind in steps]
        (retires if spec.target == "retired" else others).extend(actions)
    return retires + others


class AdapterLifecycle:
    """One instance's adapter states, thread-safe. The base model (name None) is always live."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._states: dict[str, AdapterStatus] = {}

    def register(self, name: str, revision: int = 0) -> None:
        """Make ``name`` REGISTERED at ``revision``: a new name, a retired one, or a registered one (re-stamped)."""
        with self._lock:
            old = self._states.get(name)
            if old is not None and old.state is not _S.REGISTERED:
                self._check(name, old.state, _S.REGISTERED)
            self._states[name] = AdapterStatus(_S.REGISTERED, revision, "", self._clock())

    def transition(self, name: str, state: AdapterState, *, revision: int | None = None,
                   detail: str = "") -> AdapterStatus:
        """Move ``name`` to ``state`` (keeping its revision unless given); raises LifecycleError if illegal."""
        state = AdapterState(state)
        with self._lock:
            old = self._states.get(name)
            if old is None:
                raise LifecycleError(f"adapter {name!r} is not registered on this instance; register it first")
            self._check(name, old.state, state)
            new = AdapterStatus(state, old.revision if revision is None else revision, detail, self._clock())
            self._states[name] = new
            return new

    def status(self, name: str) -> AdapterStatus | None:
        with self._lock:
            return self._states.get(name)

    def snapshot(self) -> dict[str, AdapterStatus]:
        with self._lock:
            return dict(self._states)

    def check_servable(self, name: str | None, *, serve_cold: bool = False) -> bool:
        """True if a request for ``name`` may be served now, else a RequestError that says why.

        With ``serve_cold`` a warming adapter is served before its prefixes are warm.
        """
        if name is None:
            return True
        with self._lock:
            st = self._states.get(name)
            if st is None:
                live = ", ".join(sorted(n for n, s in self._states.items() if s.state is _S.LIVE)) or "none"
                raise UnknownAdapterError(
                    f"unknown adapter '{name}'; live adapters: {live} (or empty for the base model)"
                )
        if st.state is _S.LIVE or (st.state is _S.WARMING and serve_cold):
            return True
        raise AdapterUnavailableError(_UNAVAILABLE[st.state].format(name=name, detail=st.detail or "no detail"))

    # ------------------------------------------------------------------------------------- helpers
    @staticmethod
    def _check(name: str, old: AdapterState, new: AdapterState) -> None:
        if new not in TRANSITIONS[old]:
            allowed = ", ".join(sorted(s.value for s in TRANSITIONS[old]))
            raise LifecycleError(
                f"adapter {name!r}: illegal transition {old.value} -> {new.value} (from {old.value}: {allowed})"
            )


class Reconciler:
    """Applies the control folder's desired state to one instance.

    Call :meth:`maybe_reconcile` before serving each request (one stat when nothing changed). ``load``
    loads (or reloads) an adapter's weights, ``warm`` pre-fills its warm prompts and returns a detail such
    as "warmed 3 prompts (512 tokens)", ``unload`` frees it. An exception from one of them marks that
    adapter FAILED with the message and leaves the other adapters alone.
    """

    def __init__(self, registry: ControlRegistry, lifecycle: AdapterLifecycle, instance: str, *,
                 load: Callable[[str, AdapterSpec], None], warm: Callable[[str, AdapterSpec], str],
                 unload: Callable[[str], None] | None = None) -> None:
        validate_name(instance, what="instance name")
        self.registry = registry
        self.lifecycle = lifecycle
        self.instance = instance
        self._load = load
        self._warm = warm
        self._unload = unload
        #: Serializes reconciles; hold it to keep adapters from changing under a request.
        self.lock = threading.RLock()
        self._generation = -1  # NOTE: -1, so the first call always reports, even with no desired.json.
        self._warmed: dict[str, str] = {}

    def maybe_reconcile(self) -> bool:
        """Reconcile and report if desired.json changed since the last reconcile; True if it did."""
        if not self.registry.changed_since(self._generation):
            return False
        with self.lock:
            try:
                generation, specs = self.registry.desired()
            except LifecycleError as exc:
                LOGGER.error("instance %s keeps its adapters as they are: %s", self.instance, exc)
                return False
            if generation == self._generation:
                return False
            for action in plan_reconcile(specs, self.lifecycle.snapshot()):
                self._apply(action)
            try:
                self.registry.report(self.instance, self.lifecycle.snapshot())
            except OSError as exc:
                # NOTE: the generation is not recorded, so the next request reconciles (a no-op) and reports again.
                LOGGER.error("instance %s cannot write its status to %s: %s",
                             self.instance, self.registry.status_dir, exc)
                return True
            self._generation = generation
            return True

    def report(self) -> None:
        """Write this instance's statuses now (e.g. after registering the statically configured adapters)."""
        self.registry.report(self.instance, self.lifecycle.snapshot())

    # ------------------------------------------------------------------------------------- helpers
    def _apply(self, action: Action) -> None:
        name, spec = action.name, action.spec
        current = self.lifecycle.status(name)
        if action.kind in ("warm", "go_live") and current is not None and current.state is _S.FAILED:
            return  # the load of this plan failed
        try:
            _APPLY[action.kind](self, name, spec)
        except Exception as exc:  # noqa: BLE001 - NOTE: any load/warm error fails this adapter, not the instance
            LOGGER.exception("instance %s: %s of adapter %s failed", self.instance, action.kind, name)
            self._warmed.pop(name, None)
            with contextlib.suppress(LifecycleError):  # an illegal transition is logged above; nothing to mark
                self.lifecycle.transition(name, _S.FAILED, revision=spec.revision,
                                          detail=f"{action.kind} failed: {type(exc).__name__}: {exc}")

    def _do_register(self, name: str, spec: AdapterSpec) -> None:
        self.lifecycle.register(name, spec.revision)

    def _do_load(self, name: str, spec: AdapterSpec) -> None:
        self.lifecycle.transition(name, _S.LOADING, revision=spec.revision, detail=f"loading {spec.folder}")
        self._load(name, spec)

    def _do_warm(self, name: str, spec: AdapterSpec) -> None:
        self.lifecycle.transition(name, _S.WARMING, revision=spec.revision,
                                  detail=f"warming {len(spec.warm_prompts)} prompts")
        self._warmed[name] = self._warm(name, spec)

    def _do_go_live(self, name: str, spec: AdapterSpec) -> None:
        detail = self._warmed.pop(name, None) or f"loaded {spec.folder}"
        self.lifecycle.transition(name, _S.LIVE, revision=spec.revision, detail=detail)

    def _do_retire(self, name: str, spec: AdapterSpec) -> None:
        detail = "retired"
        if self._unload is not None:
            try:
                self._unload(name)
            except Exception as exc:  # noqa: BLE001 - NOTE: retired means "not served"; freeing memory is best effort
                LOGGER.exception("instance %s: unloading adapter %s failed", self.instance, name)
                detail = f"retired; unloading failed: {type(exc).__name__}: {exc}"
        self.lifecycle.transition(name, _S.RETIRED, revision=spec.revision, detail=detail)


_APPLY: Mapping[str, Callable[[Reconciler, str, AdapterSpec], None]] = {
    "register": Reconciler._do_register,
    "load": Reconciler._do_load,
    "warm": Reconciler._do_warm,
    "go_live": Reconciler._do_go_live,
    "retire": Reconciler._do_retire,
}


def validate_name(name: object, *, what: str = "adapter name") -> str:
    """``name`` if it is safe as a file or folder name, else LifecycleError."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name) or name in (".", ".."):
        raise LifecycleError(
            f"{what} {name!r} is not allowed: use 1 to 64 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit (no '/' or '..')"
        )
    return name


# ----------------------------------------------------------------------------------- planning helpers
def _plan_live(spec: AdapterSpec, st: AdapterStatus | None) -> list[str]:
    bring_up = ["load", *(["warm"] if spec.warm_prompts else []), "go_live"]
    if st is None:
        return ["register", *bring_up]
    if st.state in (_S.LOADING, _S.WARMING):
        return []
    if st.state in (_S.LIVE, _S.FAILED) and st.revision == spec.revision:
        return []
    return bring_up


def _plan_registered(spec: AdapterSpec, st: AdapterStatus | None) -> list[str]:
    if st is None or st.state is _S.RETIRED or (st.state is _S.REGISTERED and st.revision != spec.revision):
        return ["register"]
    return []


def _plan_retired(spec: AdapterSpec, st: AdapterStatus | None) -> list[str]:
    if st is None:
        return ["register", "retire"]
    if st.state in (_S.RETIRED, _S.LOADING, _S.WARMING):
        return []
    return ["retire"]


_PLANNERS: Mapping[str, Callable[[AdapterSpec, AdapterStatus | None], list[str]]] = {
    "live": _plan_live,
    "registered": _plan_registered,
    "retired": _plan_retired,
}

_UNAVAILABLE: Mapping[AdapterState, str] = {
    _S.REGISTERED: "adapter '{name}' is registered but not loaded; an operator must make it live before it is served",
    _S.LOADING: "adapter '{name}' is loading, not live yet; retry shortly",
    _S.WARMING: "adapter '{name}' is warming, not live yet; retry shortly",
    _S.FAILED: "adapter '{name}' failed to load: {detail}",
    _S.RETIRED: "adapter '{name}' is retired",
}


# ------------------------------------------------------------------------------------- file helpers
def _next_revision(old: AdapterSpec | None) -> int:
    return 1 if old is None else old.revision + 1


def _stat_key(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


@contextlib.contextmanager
def _flocked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _write_atomic(path: Path, data: bytes, *, min_mtime_ns: int | None = None) -> None:
    """Write ``data`` to a temporary file next to ``path``, fsync it and rename it over ``path``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            # NOTE: mkstemp makes the file 0600; the CLI and tritonserver may run as different users.
            os.fchmod(file.fileno(), 0o644)
            os.fsync(file.fileno())
        if min_mtime_ns is not None and os.stat(tmp).st_mtime_ns < min_mtime_ns:
            os.utime(tmp, ns=(min_mtime_ns, min_mtime_ns))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable; not possible on every filesystem
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _dump(document: Mapping[str, Any]) -> bytes:
    return (json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def _expect(value: Any, kind: type, what: str) -> Any:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise LifecycleError(f"{what} must be a {kind.__name__}, got {value!r}")
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
