"""Warm coverage: is every live adapter's planned hot set resident on every ``lora_adapter`` instance?

Each instance writes ``plan_status/<instance>.json`` into the control folder
(:mod:`warmup_tools.control.plan_control`, :mod:`warmup_tools.lora_adapter.live_plan`); the monitor reads
them once per round (:class:`CoverageReader`) and :func:`evaluate` turns them into a verdict. Pure apart
from the read, so unit tests feed statuses directly.

- A report older than ``stale_s`` is ignored (an instance that is gone, or a stub that died: the probes
  see the latter), and shown as stale.
- Ready needs at least one fresh report, no instance still warming a plan, and every live adapter's
  resident share of its planned blocks at ``threshold`` or above on every instance.
- A live plan change must not take a serving pod out of rotation (every pod re-plans at once): an
  instance that met the threshold before (``covered``; the monitor forgets it when it reloads the model)
  stays ready while it warms a new plan; once applied, the new plan's coverage counts.
- An adapter that cannot get there because the warm-up budget cannot hold its plan says so in the reason
  (the instance's ``shortfall``), so a pod that stays unready is never silent about why.
- Each instance's ``pins`` (the cache's live check: pinned blocks, their hits against the hits of the blocks
  evicted for them, and whether the pins expired or were released) is shown per plan and adapter. It is never
  a reason to be unready: a released or expired pin still counts as covered (``PrefixCache.covered``).
"""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path
from typing import Any, Callable, Collection, Mapping, Sequence

from warmup_tools.control.plan_control import PlanStatus, PlanStatusBoard


@dataclasses.dataclass(frozen=True, slots=True)
class CoverageVerdict:
    ready: bool
    reason: str
    #: ``/status``'s ``coverage`` entry (JSON-ready).
    status: dict[str, Any]
    #: Instances at or above the threshold on an applied plan in this round.
    covered: frozenset[str] = frozenset()


#: What the monitor holds before the first read, and when coverage is not checked.
NOT_CHECKED = CoverageVerdict(True, "", {"checked": False})


def evaluate(statuses: Mapping[str, PlanStatus], *, threshold: float, now: float, stale_s: float,
             covered: Collection[str] = (), skipped: Sequence[str] = ()) -> CoverageVerdict:
    """The verdict over the instances' plan statuses (see the module docstring)."""
    reasons: list[str] = []
    instances: dict[str, Any] = {}
    fresh = 0
    now_covered: set[str] = set()
    for name, status in sorted(statuses.items()):
        stale = now - status.reported_at > stale_s
        entry: dict[str, Any] = {"plan_id": status.plan_id, "source": status.source, "state": status.state,
                                 "detail": status.detail, "error": status.error, "reported_at": status.reported_at,
                                 "stale": stale, "adapters": {}}
        instances[name] = entry
        for adapter, cov in sorted(status.adapters.items()):
            entry["adapters"][adapter] = {"coverage": round(cov.coverage, 4), "planned": cov.planned,
                                          "resident": cov.resident, "live": cov.live, "shortfall": cov.shortfall}
        # The live check of the plan's pins (shown, never a reason to be unready: coverage counts blocks whose
        # pins ended by design).
        entry["pins"] = status.pins.to_dict() if status.pins is not None else None
        if stale:
            continue
        fresh += 1
        if status.state == "warming":
            if name not in covered:
                reasons.append(f"{name}: warming its plan")
            continue
        short = [f"{name}/{adapter}: warm coverage {cov.coverage:.1%} of its plan "
                 f"({cov.resident}/{cov.planned} blocks) is below {threshold:.0%}"
                 + (f"; {cov.shortfall}" if cov.shortfall else "")
                 for adapter, cov in sorted(status.adapters.items()) if cov.live and cov.coverage < threshold]
        reasons += short
        if not short:
            now_covered.add(name)
    if not fresh:
        reasons.append("no lora_adapter instance has reported its warm coverage yet" if not instances else
                       f"every lora_adapter coverage report is older than {stale_s:g} s")
    status = {"checked": True, "threshold": threshold, "instances": instances, "skipped_files": list(skipped)}
    return CoverageVerdict(not reasons, "; ".join(reasons), status, frozenset(now_covered))


class CoverageReader:
    """Reads the control folder's plan statuses and evaluates them (one call per probe round)."""

    def __init__(self, control_dir: Path, threshold: float, stale_s: float, clock: Callable[[], float],
                 host: str | None = None) -> None:
        """``host``: whose reports count (default this host: the sidecar runs in the pod of its server)."""
        self._board = PlanStatusBoard(control_dir)
        self.host = host if host is not None else socket.gethostname()
        self.threshold = threshold
        self.stale_s = stale_s
        self._clock = clock

    def __call__(self, covered: Collection[str] = ()) -> CoverageVerdict:
        statuses, skipped = self._board.read_all(host=self.host)
        return evaluate(statuses, threshold=self.threshold, now=self._clock(), stale_s=self.stale_s,
                        covered=covered, skipped=skipped)
