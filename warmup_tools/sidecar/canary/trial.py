"""A plan on trial: start it on a share of the instances, then promote it or roll it back.

``canary.json`` (:class:`~warmup_tools.control.plan_control.CanaryAssignment`) names the plan on trial (stored
in the plan history, ``plans/<id>.json``) and the instances that serve it instead of ``plan.json``: one
instance of a replica, or every instance of one or more replicas. The other instances keep serving ``plan.json``.
The verdict is the controller's (:mod:`warmup_tools.sidecar.canary.controller`); these functions only change the files:

- :func:`start_canary` stores the plan and writes ``canary.json`` (one trial at a time);
- :func:`end_canary` with ``promote=True`` makes the plan the one every instance serves
  (:func:`~warmup_tools.control.plan_history.write_live_plan`, recorded in the history), then removes
  ``canary.json``; with ``promote=False`` it removes ``canary.json`` and the stored plan (unless the history names
  it), and the canary instances go back to ``plan.json`` (the plan they were tried against), re-pinning and
  re-warming it like any plan change.

Both check that ``canary.json`` still names the trial the caller judged, so a verdict on one trial never
ends another.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from warmup_tools.common.files import write_atomic
from warmup_tools.common.plan import Plan, PlanError
from warmup_tools.control.plan_control import CANARY_FILE, PLAN_FILE, CanaryAssignment, CanaryError, read_canary
from warmup_tools.control.plan_history import (
    HistoryEntry,
    PlanHistory,
    PlanHistorySettings,
    write_live_plan,
)
from warmup_tools.control.state import LifecycleError, validate_name


def start_canary(control_dir: Path, plan: Plan, *, host: str, instances: Sequence[str] = (),
                 by: tuple[str, str], settings: PlanHistorySettings | None = None,
                 now: float | None = None, replicas: Sequence[str] = ()) -> CanaryAssignment:
    """Put ``plan`` on trial on ``instances`` of replica ``host`` (none named: all of them, and every instance of
    each of ``replicas`` too)."""
    history = PlanHistory(control_dir, settings)
    try:
        names = tuple(validate_name(i, what="instance name") for i in instances)
        for name in (host, *replicas):
            validate_name(name, what="replica (host) name")
    except LifecycleError as exc:
        raise CanaryError(str(exc)) from None
    with history._locked():
        running = read_canary(history.control_dir)
        if running is not None:
            raise CanaryError(f"plan {running.plan} is on trial already (since {_when(running.started_at)} on "
                              f"{_scope(running)}); wait for its verdict or end it (`plan canary --abort`)")
        served = history.control_dir / PLAN_FILE
        try:
            before = Plan.load(served) if served.exists() else None
        except PlanError:
            before = None
        if before is not None and before.plan_id == plan.plan_id:
            raise CanaryError(f"plan {plan.plan_id} is the plan served now: nothing to try")
        stored = history._store(plan)
        canary = CanaryAssignment(stored, plan.plan_id, host, names, round(time.time() if now is None else now, 3),
                                  *by, replicas=tuple(replicas))
        CanaryAssignment.parse(canary.to_json())  # the same checks an instance makes
        write_atomic(history.control_dir / CANARY_FILE, canary.to_json())
    return canary


def end_canary(control_dir: Path, canary: CanaryAssignment, *, promote: bool, by: tuple[str, str],
               inputs: Mapping[str, Any] | None = None,
               settings: PlanHistorySettings | None = None) -> HistoryEntry | None:
    """End the trial ``canary`` (as read when it was judged): promote its plan (the history entry written) or
    roll it back (None). :class:`CanaryError` if ``canary.json`` names another trial or none."""
    history = PlanHistory(control_dir, settings)
    entry = None
    if promote:
        _check_running(history, canary)
        plan = history.load_stored(canary.plan)
        entry = write_live_plan(control_dir, plan, by=by, settings=settings,
                                inputs={"canary": {"host": canary.host, "instances": list(canary.instances),
                                                   "replicas": list(canary.replicas),
                                                   "started_at": canary.started_at}, **dict(inputs or {})})
    with history._locked():
        _check_running(history, canary)
        (history.control_dir / CANARY_FILE).unlink()
        if not promote:  # NOTE: else the trials rolled back would pile up in plans/ until the next promotion
            history._drop_unused(canary.plan)
    return entry


def _check_running(history: PlanHistory, canary: CanaryAssignment) -> None:
    running = read_canary(history.control_dir)
    if running != canary:
        raise CanaryError(f"the trial of plan {canary.plan} is not running any more"
                          + (f" (plan {running.plan} is on trial now)" if running is not None else ""))


def _scope(canary: CanaryAssignment) -> str:
    return f"{', '.join(canary.instances) or 'every instance'} of {', '.join(canary.hosts) or 'this host'}"


def _when(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(at)) + " UTC"
