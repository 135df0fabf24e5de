"""Adapter states on one instance: the state machine, the operator's spec, an instance's status."""

from __future__ import annotations

import dataclasses
import enum
import re
import threading
import time
from typing import Callable, Mapping

from warmup_tools.common.errors import UNKNOWN_ADAPTER_HINT, AdapterUnavailableError, ConfigError, UnknownAdapterError


class AdapterState(str, enum.Enum):
    REGISTERED = "registered"
    LOADING = "loading"
    WARMING = "warming"
    LIVE = "live"
    FAILED = "failed"
    RETIRED = "retired"


#: Allowed transitions. registered->retired retires an adapter that was never loaded, and
#: retired->registered re-adds one as registered only; both are needed to reach every AdapterSpec target.
TRANSITIONS: Mapping[AdapterState, frozenset[AdapterState]] = {
    AdapterState.REGISTERED: frozenset({AdapterState.LOADING, AdapterState.RETIRED}),
    AdapterState.LOADING: frozenset({AdapterState.WARMING, AdapterState.LIVE, AdapterState.FAILED}),
    AdapterState.WARMING: frozenset({AdapterState.LIVE, AdapterState.FAILED}),
    # live->warming re-warms after a plan change; live->loading reloads changed weights.
    AdapterState.LIVE: frozenset({AdapterState.RETIRED, AdapterState.WARMING, AdapterState.LOADING}),
    AdapterState.FAILED: frozenset({AdapterState.LOADING, AdapterState.RETIRED}),
    AdapterState.RETIRED: frozenset({AdapterState.LOADING, AdapterState.REGISTERED}),
}


#: What an operator can ask for: the state every instance should bring the adapter to.
TARGETS = frozenset({"live", "registered", "retired"})


#: Adapter and instance names become file and folder names: no separators, no leading dot.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


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
            if old is not None and old.state is not AdapterState.REGISTERED:
                self._check(name, old.state, AdapterState.REGISTERED)
            self._states[name] = AdapterStatus(AdapterState.REGISTERED, revision, "", self._clock())

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
                raise UnknownAdapterError(f"unknown adapter '{name}': {UNKNOWN_ADAPTER_HINT}")
        if st.state is AdapterState.LIVE or (st.state is AdapterState.WARMING and serve_cold):
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


def validate_name(name: object, *, what: str = "adapter name") -> str:
    """``name`` if it is safe as a file or folder name, else LifecycleError."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name) or name in (".", ".."):
        raise LifecycleError(
            f"{what} {name!r} is not allowed: use 1 to 64 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit (no '/' or '..')"
        )
    return name


_UNAVAILABLE: Mapping[AdapterState, str] = {
    AdapterState.REGISTERED: ("adapter '{name}' is registered but not loaded; an operator must make it live "
                              "before it is served"),
    AdapterState.LOADING: "adapter '{name}' is loading, not live yet; retry shortly",
    AdapterState.WARMING: "adapter '{name}' is warming, not live yet; retry shortly",
    AdapterState.FAILED: "adapter '{name}' failed to load: {detail}",
    AdapterState.RETIRED: "adapter '{name}' is retired",
}

