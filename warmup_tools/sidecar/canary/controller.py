"""The canary controller: starts a trial, reads both sides' request logs, judges each tick, acts on a verdict.

The package docstring (:mod:`warmup_tools.sidecar.canary`) says what is compared with what."""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from pathlib import Path
from typing import Any, Callable

from warmup_tools.common.plan import Plan, PlanError
from warmup_tools.control.plan_control import CanaryAssignment, PlanStatusBoard, read_canary
from warmup_tools.control.plan_history import PlanHistorySettings, applied_by
from warmup_tools.sidecar.background import BackgroundThread
from warmup_tools.sidecar.canary.judge import (
    Comparison,
    Verdict,
    WindowStats,
    carried,
    evidence,
    judge,
    judge_replica,
    replica_evidence,
)
from warmup_tools.sidecar.canary.log_tail import RequestLogTail
from warmup_tools.sidecar.canary.trial import end_canary, start_canary
from warmup_tools.sidecar.config import SidecarConfig

LOGGER = logging.getLogger(__name__)

#: Verdicts kept for ``/status``.
KEEP_VERDICTS = 10
#: A trial on whole replicas takes replicas until, in the window before it, they served this many times
#: ``canary_min_requests``. NOTE: a comparison counts each tenant for the smaller of its requests in the baseline and
#: in the trial, so what it counts is well below either side's requests when tenants come and go (on the real-text
#: replay at eight replicas, twice was 14 requests before a trial, 22 during it and 4 counted in 30 minutes).
TRAFFIC_MARGIN = 4


class CanaryController:
    """Starts trials (:meth:`propose`) and judges the running one (:meth:`tick`, every ``interval_s`` on a thread
    of its own once :meth:`start` is called).

    ``log_dir``: this replica's request logs; ``fleet_log_dir``: a fleet's, one subfolder per replica (``log_dir``
    is the one named ``host``), which a trial on a whole replica needs to compare with the other replicas."""

    def __init__(self, control_dir: Path, log_dir: Path, settings: SidecarConfig, *, host: str,
                 history: PlanHistorySettings | None = None, stale_s: float = 30.0,
                 on_promote: Callable[[Plan], None] | None = None,
                 clock: Callable[[], float] = time.time, fleet_log_dir: Path | None = None) -> None:
        self.control_dir = Path(control_dir)
        self.settings = settings
        self.host = host
        self.history = history
        self.stale_s = stale_s
        self.on_promote = on_promote
        self.fleet_log_dir = Path(fleet_log_dir) if fleet_log_dir is not None else None
        self._clock = clock
        self._log_dir = Path(log_dir)
        self._tails = {host: RequestLogTail(log_dir)}
        self._board = PlanStatusBoard(self.control_dir)
        self._lock = threading.Lock()
        self._trial: CanaryAssignment | None = None
        self._applied_at: float | None = None
        self._sides = (WindowStats(), WindowStats())
        #: A trial on a whole replica: each side's window before the trial, and the replicas compared with.
        self._before: tuple[WindowStats, WindowStats] | None = None
        self._others: tuple[str, ...] = ()
        self._verdicts: list[dict[str, Any]] = []
        self._counts = {"promoted": 0, "rolled_back": 0}
        self._last = Verdict("wait", "no trial")
        self._error = ""
        self._worker = BackgroundThread("sidecar-canary")

    # -------------------------------------------------------------------------------- starting a trial
    def instances(self) -> list[str]:
        """This replica's lora_adapter instances that reported lately, by name."""
        statuses, _ = self._board.read_all(host=self.host)
        now = self._clock()
        return sorted(name for name, status in statuses.items() if now - status.reported_at <= self.stale_s)

    def replicas(self) -> list[str]:
        """The fleet's replicas that reported lately, by name (none without ``fleet_log_dir``)."""
        if self.fleet_log_dir is None:
            return []
        return self._board.hosts(since=self._clock() - self.stale_s)

    def proposer(self) -> str:
        """The replica whose sidecar re-plans for the fleet: the first by name of those that reported lately (this
        one when it is alone or not in a fleet). NOTE: every sidecar reads the same board, so they agree; one that
        disagrees for a moment (a replica joining) is stopped by the history's lock on ``canary.json``."""
        return min(self.replicas(), default=self.host)

    def propose(self, plan: Plan, by: str) -> CanaryAssignment | None:
        """Put ``plan`` on trial: on whole replicas when two or more replicas of the fleet report (this one and as
        many more as :meth:`canary_replicas` takes, judged against the others), else on this replica's last
        instance; None when there is nothing to compare with (the caller applies the plan everywhere).
        :class:`CanaryError` when a trial is running already."""
        if self.settings.canary_window_s <= 0:
            return None
        replicas = self.replicas()
        if len(replicas) >= 2 and self.host in replicas:
            serving = self.canary_replicas(replicas)
            canary = start_canary(self.control_dir, plan, host=self.host, replicas=serving[1:], by=applied_by(by),
                                  settings=self.history, now=self._clock())
            LOGGER.info("canary: plan %s on trial on every instance of replica(s) %s (the plan served now stays on "
                        "%s)", plan.plan_id, ", ".join(serving), ", ".join(r for r in replicas if r not in serving))
            return canary
        instances = self.instances()
        if len(instances) < 2:
            return None
        canary = start_canary(self.control_dir, plan, host=self.host, instances=instances[-1:],
                              by=applied_by(by), settings=self.history, now=self._clock())
        LOGGER.info("canary: plan %s on trial on instance %s of %s (the plan served now stays on %s)",
                    plan.plan_id, instances[-1], self.host, ", ".join(instances[:-1]))
        return canary

    def canary_replicas(self, replicas: list[str]) -> tuple[str, ...]:
        """The replicas a trial on whole replicas runs on: this one, then the busiest others of the last
        ``canary_window_s`` (by requests served, then by name) that keep the canary side within half of the
        fleet's requests in that window, until it served :data:`TRAFFIC_MARGIN` times ``canary_min_requests``
        (or half), at most ``canary_fleet_share`` of the fleet and never all of it. One replica of a large fleet
        sees too few requests to be judged within the trial's time limit; a share of the fleet sees enough at
        any size."""
        others = [r for r in replicas if r != self.host]
        most = max(1, min(len(replicas) - 1, math.floor(self.settings.canary_fleet_share * len(replicas))))
        if most == 1 or self.fleet_log_dir is None:
            return (self.host,)
        now = self._clock()
        since = now - self.settings.canary_window_s
        served = {r: len(RequestLogTail(self.fleet_log_dir / r).recent(since, now)) for r in replicas}
        half = sum(served.values()) / 2
        # NOTE: never past half the fleet's traffic: the other side needs as many requests to be judged against.
        target = min(TRAFFIC_MARGIN * self.settings.canary_min_requests, half)
        chosen, counted = [self.host], served[self.host]
        for replica in sorted(others, key=lambda r: (-served[r], r)):
            if len(chosen) >= most or counted >= target:
                break
            if counted + served[replica] <= half:
                chosen.append(replica)
                counted += served[replica]
        return tuple(chosen)

    # -------------------------------------------------------------------------------- judging it
    def tick(self) -> Verdict:
        """Read the logs, judge the running trial, and end it when the verdict says so."""
        try:
            return self._tick()
        except (OSError, PlanError) as exc:
            with self._lock:
                self._error = f"{type(exc).__name__}: {exc}"
            LOGGER.warning("canary: %s", exc)
            return Verdict("wait", self._error)

    def _tick(self) -> Verdict:
        canary = read_canary(self.control_dir)
        now = self._clock()
        if canary is None or canary.host != self.host:
            with self._lock:
                self._trial, self._applied_at, self._error = None, None, ""
                self._last = Verdict("wait", "no trial" if canary is None else f"the trial runs on {canary.host}")
            return self._last
        if canary != self._trial:
            with self._lock:
                self._trial, self._applied_at, self._sides = canary, None, (self._side(), self._side())
                self._before, self._others = None, ()
                self._tails = {self.host: self._tails[self.host]}
        whole = not canary.instances
        if self._applied_at is None:
            if whole and self.fleet_log_dir is None:
                return self._act(canary, Verdict("rollback", "a trial on every instance of a replica is judged "
                                                             "against the other replicas' request logs, and this "
                                                             "sidecar has no fleet_log_dir"), now)
            if not self._canary_applied(canary):
                verdict = Verdict("wait", "the canary instance is warming the plan")
                if now - canary.started_at >= 3 * max(self.settings.canary_window_s, 1.0):
                    # NOTE: no plan id in a reason: reasons are in the public /status (the log line names it)
                    verdict = Verdict("rollback", "the canary instance did not apply the plan on trial within "
                                                  f"{now - canary.started_at:.0f} s")
                return self._act(canary, verdict, now)
            if whole:
                verdict = self._compare_with_the_fleet(canary)
                if verdict is not None:
                    return self._act(canary, verdict, now)
            for tail in self._tails.values():
                tail.skip_to_end()  # NOTE: only requests served once the plan on trial is warm are compared
            with self._lock:
                self._applied_at = now
        assert self._applied_at is not None
        canary_side, rest = self._sides
        for replica, tail in self._tails.items():
            for instance, record in tail.read():
                if record.ts < self._applied_at:
                    continue
                if whole:
                    (canary_side if replica in canary.hosts else rest).add(record)
                elif replica == self.host:
                    (canary_side if canary.targets(self.host, instance) else rest).add(record)
        elapsed = now - self._applied_at
        if whole and self._before is not None:
            return self._act(canary, judge_replica(canary_side, rest, self._before, elapsed, self.settings), now)
        return self._act(canary, judge(canary_side, rest, elapsed, self.settings), now)

    def _compare_with_the_fleet(self, canary: CanaryAssignment) -> Verdict | None:
        """At the start of a trial on whole replicas: the replicas to compare with (those reporting now whose
        logs are in ``fleet_log_dir`` and that do not serve the trial: a replica that left is not read, one that
        joins later has no baseline and is not either) and each side's baseline, the ``canary_window_s`` before
        the trial started. A rollback verdict when there is no other replica or no baseline to judge against."""
        assert self.fleet_log_dir is not None
        others = tuple(r for r in self.replicas() if r not in canary.hosts and (self.fleet_log_dir / r).is_dir())
        if not others:
            return Verdict("rollback", "no other replica reports with request logs under "
                                       f"{self.fleet_log_dir}: nothing to compare a whole replica with")
        tails = {self.host: self._tails[self.host]}
        tails.update({r: RequestLogTail(self.fleet_log_dir / r) for r in (*canary.replicas, *others)})
        since = canary.started_at - self.settings.canary_window_s
        before = (self._side(), self._side())
        for replica, tail in tails.items():
            for record in tail.recent(since, canary.started_at):
                before[replica not in canary.hosts].add(record)
        sides = (self._side(), self._side())
        need = self.settings.canary_min_requests
        if min(before[0].requests, before[1].requests) < need:
            return Verdict("rollback", f"no baseline to judge a whole replica against: {before[0].requests} requests "
                                       f"on {', '.join(canary.hosts)} and {before[1].requests} on {', '.join(others)} "
                                       f"in the {self.settings.canary_window_s:g} s before the trial ({need} each "
                                       "needed)")
        with self._lock:
            self._tails, self._before, self._others, self._sides = tails, before, others, sides
        return None

    def _side(self) -> WindowStats:
        return WindowStats(tenant_cap=self.settings.canary_tenant_cap)

    def _comparisons(self) -> tuple[Comparison, ...]:
        """What the verdict compares: the canary with the rest; on a whole replica, each side with its baseline."""
        canary_side, rest = self._sides
        if self._before is None:
            return (Comparison.of(canary_side, rest, self.settings),)
        return (Comparison.of(canary_side, self._before[0], self.settings),
                Comparison.of(rest, self._before[1], self.settings))

    def _counted(self) -> dict[str, Any]:
        """How many requests and tenants each comparison counts (no tenant named: this goes to /status)."""
        names = ("both",) if self._before is None else ("canary", "rest")
        return {name: {"requests": c.counted, "tenants": len(c.weights)}
                for name, c in zip(names, self._comparisons())}

    def _canary_applied(self, canary: CanaryAssignment) -> bool:
        """Whether every canary replica has instances that serve the plan on trial, all of them applied."""
        for host in canary.hosts if not canary.instances else (self.host,):
            statuses, _ = self._board.read_all(host=host)
            mine = [s for name, s in statuses.items() if canary.targets(host, name)]
            if not mine or not all(s.plan_id == canary.plan_id and s.state == "applied" for s in mine):
                return False
        return True

    def _pins_note(self, canary: CanaryAssignment) -> str:
        """Whether the live check released the pins of the plan on trial on a canary instance ("" if not): a note
        beside the verdict, which it does not change (the request logs decide)."""
        released = []
        for host in canary.hosts:
            try:
                statuses, _ = self._board.read_all(host=host)
            except OSError:
                return ""
            released += [(name if host == self.host else f"{name}@{host}", s.pins.reason)
                         for name, s in statuses.items() if canary.targets(host, name) and s.pins is not None
                         and s.pins.plan_id == canary.plan_id and s.pins.state == "released"]
        released.sort()
        if not released:
            return ""
        return (f"the live check released the plan's pins on {len(released)} canary instance(s) "
                f"({', '.join(name for name, _ in released)}): {released[0][1]}")

    def _act(self, canary: CanaryAssignment, verdict: Verdict, now: float) -> Verdict:
        with self._lock:
            self._last, self._error = verdict, ""
        if verdict.action == "wait":
            return verdict
        promote = verdict.action == "promote"
        end_canary(self.control_dir, canary, promote=promote, settings=self.history,
                   by=applied_by("canary promote" if promote else "canary rollback"),
                   inputs={"verdict": verdict.reason})
        canary_side, rest = self._sides
        tenants = carried(*(c.weights for c in self._comparisons()))
        record = {"plan_id": canary.plan_id, "verdict": "promoted" if promote else "rolled_back",
                  "reason": verdict.reason, "at": round(now, 3), "started_at": canary.started_at,
                  "canary": canary_side.summary(), "rest": rest.summary(), "counted": self._counted(),
                  "pins": self._pins_note(canary)}
        if self._before is not None:
            record["replicas"] = list(self._others)
            record["canary_replicas"] = list(canary.hosts)
            record["before"] = {"canary": self._before[0].summary(), "rest": self._before[1].summary()}
        with self._lock:
            self._counts[record["verdict"]] += 1
            self._verdicts = [record, *self._verdicts][:KEEP_VERDICTS]
            self._trial, self._applied_at, self._before, self._others = None, None, None, ()
            self._tails = {self.host: self._tails[self.host]}
        (LOGGER.info if promote else LOGGER.warning)(
            "canary: plan %s %s after %.0f s: %s (tenants counted: %s)", canary.plan_id,
            "promoted" if promote else "rolled back", now - canary.started_at, verdict.reason, tenants)
        if promote and self.on_promote is not None:
            try:
                self.on_promote(Plan.load(self.control_dir / "plan.json"))
            except Exception:  # NOTE: the plan is served; only what follows its promotion failed
                LOGGER.exception("canary: after promoting plan %s", canary.plan_id)
        return verdict

    # -------------------------------------------------------------------------------- status and thread
    def status(self) -> dict[str, Any]:
        with self._lock:
            trial = None
            if self._trial is not None:
                canary_side, rest = self._sides
                trial = {"plan_id": self._trial.plan_id, "instances": list(self._trial.instances),
                         "canary_replicas": list(self._trial.hosts) if not self._trial.instances else [],
                         "started_at": self._trial.started_at, "applied_at": self._applied_at,
                         "canary": canary_side.summary(), "rest": rest.summary(), "counted": self._counted(),
                         "evidence": (evidence(canary_side, rest, self.settings) if self._before is None
                                      else replica_evidence(canary_side, rest, self._before, self.settings))}
                if self._before is not None:
                    trial["replicas"] = list(self._others)
                    trial["before"] = {"canary": self._before[0].summary(), "rest": self._before[1].summary()}
            return {"window_s": self.settings.canary_window_s, "judging": self._worker.running, "trial": trial,
                    "last": dataclasses.asdict(self._last), "verdicts": list(self._verdicts),
                    "counts": dict(self._counts), "error": self._error}

    def start(self, interval_s: float) -> None:
        self._worker.start(self._loop, interval_s)

    def stop(self, timeout: float = 30.0) -> None:
        self._worker.stop(timeout)

    def _loop(self, interval_s: float) -> None:
        while not self._worker.stopping.wait(interval_s):
            try:
                self.tick()
            except Exception:  # NOTE: the next tick tries again; the trial stays as it is
                LOGGER.exception("canary: judging the trial failed")
