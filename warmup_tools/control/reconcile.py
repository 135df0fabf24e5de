"""Moving one instance's adapters to the desired state: the pure plan of actions, and the reconciler that applies it."""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Callable, Mapping

from warmup_tools.control.registry import ControlRegistry
from warmup_tools.control.state import (
    Action,
    AdapterLifecycle,
    AdapterSpec,
    AdapterState,
    AdapterStatus,
    LifecycleError,
    validate_name,
)

LOGGER = logging.getLogger(__name__)


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
        if action.kind in ("warm", "go_live") and current is not None and current.state is AdapterState.FAILED:
            return  # the load of this plan failed
        try:
            _APPLY[action.kind](self, name, spec)
        except Exception as exc:
            LOGGER.exception("instance %s: %s of adapter %s failed", self.instance, action.kind, name)
            self._warmed.pop(name, None)
            with contextlib.suppress(LifecycleError):  # an illegal transition is logged above; nothing to mark
                self.lifecycle.transition(name, AdapterState.FAILED, revision=spec.revision,
                                          detail=f"{action.kind} failed: {type(exc).__name__}: {exc}")

    def _do_register(self, name: str, spec: AdapterSpec) -> None:
        self.lifecycle.register(name, spec.revision)

    def _do_load(self, name: str, spec: AdapterSpec) -> None:
        self.lifecycle.transition(name, AdapterState.LOADING, revision=spec.revision, detail=f"loading {spec.folder}")
        self._load(name, spec)

    def _do_warm(self, name: str, spec: AdapterSpec) -> None:
        self.lifecycle.transition(name, AdapterState.WARMING, revision=spec.revision,
                                  detail=f"warming {len(spec.warm_prompts)} prompts")
        self._warmed[name] = self._warm(name, spec)

    def _do_go_live(self, name: str, spec: AdapterSpec) -> None:
        detail = self._warmed.pop(name, None) or f"loaded {spec.folder}"
        self.lifecycle.transition(name, AdapterState.LIVE, revision=spec.revision, detail=detail)

    def _do_retire(self, name: str, spec: AdapterSpec) -> None:
        detail = "retired"
        if self._unload is not None:
            try:
                self._unload(name)
            except Exception as exc:
                LOGGER.exception("instance %s: unloading adapter %s failed", self.instance, name)
                detail = f"retired; unloading failed: {type(exc).__name__}: {exc}"
        self.lifecycle.transition(name, AdapterState.RETIRED, revision=spec.revision, detail=detail)


# ----------------------------------------------------------------------------------- planning helpers
def _plan_live(spec: AdapterSpec, st: AdapterStatus | None) -> list[str]:
    bring_up = ["load", *(["warm"] if spec.warm_prompts else []), "go_live"]
    if st is None:
        return ["register", *bring_up]
    if st.state in (AdapterState.LOADING, AdapterState.WARMING):
        return []
    if st.state in (AdapterState.LIVE, AdapterState.FAILED) and st.revision == spec.revision:
        return []
    return bring_up


def _plan_registered(spec: AdapterSpec, st: AdapterStatus | None) -> list[str]:
    stale = st is not None and st.state is AdapterState.REGISTERED and st.revision != spec.revision
    if st is None or st.state is AdapterState.RETIRED or stale:
        return ["register"]
    return []


def _plan_retired(spec: AdapterSpec, st: AdapterStatus | None) -> list[str]:
    if st is None:
        return ["register", "retire"]
    if st.state in (AdapterState.RETIRED, AdapterState.LOADING, AdapterState.WARMING):
        return []
    return ["retire"]


_PLANNERS: Mapping[str, Callable[[AdapterSpec, AdapterStatus | None], list[str]]] = {
    "live": _plan_live,
    "registered": _plan_registered,
    "retired": _plan_retired,
}


_APPLY: Mapping[str, Callable[[Reconciler, str, AdapterSpec], None]] = {
    "register": Reconciler._do_register,
    "load": Reconciler._do_load,
    "warm": Reconciler._do_warm,
    "go_live": Reconciler._do_go_live,
    "retire": Reconciler._do_retire,
}
