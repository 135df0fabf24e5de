"""Plans for a running server: apply one through the control folder, and re-plan on a schedule.

- :func:`apply_plan` checks a plan against the repository (block size, tokenizer, warm-up budget, items)
  exactly as ``stanzas --plan`` does, then makes it the control folder's ``plan.json`` through the one
  writer that keeps the plan history (:func:`~warmup_tools.control.plan_history.write_live_plan`); every
  ``lora_adapter`` instance picks it up, warms what is new and reports it
  (:mod:`warmup_tools.lora_adapter.live_plan`). :func:`wait_applied` waits for the instances.
- :func:`rollback` applies a plan of the history again (the one the served plan replaced, or a named one),
  checked and recorded like any other.
- :class:`RollingPlanner` is the sidecar's rolling re-plan: the planner's rolling mode over the request
  logs of the last hours with the plan now served as ``--previous``, applied through the control folder,
  and written as the repository's stanzas (atomically), so the next start begins from today's plan.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from warmup_tools.common.plan import Plan, PlanError
from warmup_tools.control.plan_control import PLAN_FILE, CanaryError, PlanStatus, PlanStatusBoard, read_canary
from warmup_tools.control.plan_history import (
    HistoryEntry,
    PlanHistory,
    PlanHistoryError,
    PlanHistorySettings,
    applied_by,
    write_live_plan,
)
from warmup_tools.planning.target import PlanTarget

LOGGER = logging.getLogger(__name__)


def apply_plan(plan: Plan, control_dir: Path, model_repository: Path | None = None, *,
               target: PlanTarget | None = None, tokenizer: Any | None = None, via: str = "apply-plan",
               inputs: Mapping[str, Any] | None = None, history: PlanHistorySettings | None = None) -> HistoryEntry:
    """Check ``plan`` against the repository (when one is given), then write it as ``plan.json`` and record it
    in the plan history (``via``: what applies it; ``inputs``: what it was made from, when known)."""
    check_plan(plan, model_repository, target=target, tokenizer=tokenizer)
    return write_live_plan(control_dir, plan, by=applied_by(via), inputs=inputs, settings=history)


def check_plan(plan: Plan, model_repository: Path | None = None, *, target: PlanTarget | None = None,
               tokenizer: Any | None = None) -> None:
    """:class:`PlanError` unless ``plan`` fits the repository (block size, tokenizer, warm-up budget, items);
    nothing is checked without a repository or a target."""
    if target is None and model_repository is not None:
        target = PlanTarget.from_repository(model_repository)
    if target is not None:
        from warmup_tools.common.digests import tokenizer_fingerprint

        tokenizer = tokenizer if tokenizer is not None else target.load_tokenizer()
        target.check(plan, tokenizer_fingerprint(tokenizer), tokenizer)


def rollback(control_dir: Path, ref: str | None = None, model_repository: Path | None = None, *,
             target: PlanTarget | None = None, tokenizer: Any | None = None,
             history: PlanHistorySettings | None = None) -> tuple[Plan, HistoryEntry]:
    """Serve again the plan ``ref`` names (default: the one the served plan replaced), checked against the
    repository like any plan; recorded as a new history entry whose parent is the plan served now."""
    store = PlanHistory(control_dir, history)
    current = store.current()
    if ref is None:
        if current is None:
            raise PlanHistoryError(f"{Path(control_dir) / PLAN_FILE} is not the newest plan of the history (none "
                                   "served, or written by hand): name the plan to roll back to (`plan history`)")
        if current.parent is None:
            raise PlanHistoryError(f"plan {current.id} replaced no plan: there is nothing to roll back to")
        ref = current.parent
    plan = store.load(ref)
    wanted = store.resolve(ref)
    if current is not None and current.id == wanted:
        raise PlanHistoryError(f"plan {wanted} is the plan served now: nothing to roll back")
    entry = apply_plan(plan, control_dir, model_repository, target=target, tokenizer=tokenizer, via="rollback",
                       inputs={"rollback_to": wanted, "rolled_back": current.id if current else None}, history=history)
    return plan, entry


def wait_applied(control_dir: Path, plan_id: str, *, instances: int | None = None, timeout_s: float = 600.0,
                 fresh_s: float = 30.0) -> dict[str, PlanStatus]:
    """Wait until the instances that report (within the last ``fresh_s``) have applied ``plan_id``."""
    return PlanStatusBoard(control_dir).wait_for(plan_id, instances=instances, timeout_s=timeout_s,
                                                  since=time.time() - fresh_s)


def served_plan(control_dir: Path) -> Plan | None:
    """The control folder's plan, if there is a valid one."""
    path = Path(control_dir) / PLAN_FILE
    if not path.exists():
        return None
    try:
        return Plan.load(path)
    except PlanError as exc:
        LOGGER.warning("ignoring %s as the previous plan: %s", path, exc)
        return None


@dataclasses.dataclass(frozen=True, slots=True)
class ReplanResult:
    """One rolling re-plan: the plan made, the one it replaced, and what changed."""

    plan_id: str
    previous: str | None
    records: int
    added: int
    kept: int
    dropped: int
    applied: bool
    seconds: float
    at: float
    #: "" (applied to every instance, or nothing to apply), ``started`` (the plan went on trial on a canary
    #: instance: it is applied everywhere once promoted), ``waiting`` (a plan was on trial: no re-plan) or
    #: ``replica <name>`` (in a fleet, that replica's sidecar re-plans: this one planned nothing).
    trial: str = ""


class RollingPlanner:
    """Re-plan from the logs under ``log_dir`` of the last ``since_s`` before ``now`` (default: the last
    record), keep what still earns its place (the previous plan, hysteresis), apply and write stanzas.

    The tokenizer and embedder load once, on the first run.
    """

    def __init__(self, model_repository: Path, control_dir: Path, log_dir: Path, *, since_s: float = 6 * 3600,
                 environ: Mapping[str, str] | None = None, write_stanzas: bool = True,
                 now: Callable[[], float | None] = lambda: None, history: PlanHistorySettings | None = None,
                 propose: Callable[[Plan], bool] | None = None, defer: Callable[[], str] | None = None) -> None:
        """``propose``: puts a new plan on trial (a canary) and says whether it did; its stanzas are written when
        it is promoted (:meth:`write_stanzas_of`). Without it, or when it did not, the plan goes to every instance;
        when it raises :class:`~warmup_tools.control.plan_control.CanaryError` (a trial started meanwhile), nothing is
        applied. ``defer``: in a fleet, the other replica that re-plans for it ("" : this one); a run then plans
        nothing."""
        self.model_repository = Path(model_repository)
        self.control_dir = Path(control_dir)
        self.log_dir = Path(log_dir)
        self.since_s = since_s
        self.write_stanzas = write_stanzas
        self._environ = environ
        self._now = now
        self.history = history
        self._propose = propose
        self._defer = defer
        self._tools: tuple[PlanTarget, Any, Any] | None = None

    def run_once(self, now: float | None = None) -> ReplanResult:
        """One re-plan; ``now`` (epoch seconds the window ends at) overrides the clock (a replay's time)."""
        from warmup_tools.common.jsonl import ReadStats
        from warmup_tools.common.records import log_files, read_request_log
        from warmup_tools.planning.plan_stanzas import write_plan_stanzas
        from warmup_tools.planning.select import build_plan

        started = time.perf_counter()
        running = read_canary(self.control_dir)
        if running is not None:
            LOGGER.info("re-plan skipped: plan %s is on trial since %.0f s", running.plan_id,
                        time.time() - running.started_at)
            return ReplanResult(running.plan_id, None, 0, 0, 0, 0, False, time.perf_counter() - started, time.time(),
                                "waiting")
        elsewhere = self._defer() if self._defer is not None else ""
        if elsewhere:
            LOGGER.debug("re-plan skipped: replica %s re-plans for the fleet", elsewhere)
            served = served_plan(self.control_dir)
            served_id = served.plan_id if served is not None else ""
            return ReplanResult(served_id, served_id or None, 0, 0, 0, 0, False, time.perf_counter() - started,
                                time.time(), f"replica {elsewhere}")
        target, tokenizer, embedder = self._load()
        stats = ReadStats()
        records = list(read_request_log(log_files([self.log_dir]), stats))
        end = now if now is not None else self._now()
        end = end if end is not None else max((r.ts for r in records), default=time.time())
        records = [r for r in records if end - self.since_s <= r.ts <= end]
        if not records:
            # NOTE: a plan from no records would drop every item the served plan pins: logs that are gone,
            # unreadable or all bad lines are no evidence that the traffic stopped.
            raise PlanError(f"no request record of the last {self.since_s / 3600:g} h in the logs under "
                            f"{self.log_dir} ({stats.skipped} bad lines skipped): nothing to plan from; the plan "
                            "served now stays")
        previous = served_plan(self.control_dir)
        plan = build_plan(records, tokenizer, embedder, target.default_budgets(), now=end,
                          block_size=target.block_size, kv_bytes_per_token=target.kv_bytes_per_token,
                          progress=False, previous=previous, kv=target.settings.engine.kv)
        changes = plan.summary.get("changes") or {}
        applied = previous is None or plan.plan_id != previous.plan_id
        trial = ""
        try:
            proposed = applied and previous is not None and self._propose is not None and self._propose(plan)
        except CanaryError as exc:
            LOGGER.info("re-plan not tried: %s", exc)
            proposed, applied, trial = False, False, "waiting"
        if proposed:
            applied, trial = False, "started"
        elif applied:
            apply_plan(plan, self.control_dir, target=target, tokenizer=tokenizer, via="sidecar re-plan",
                       history=self.history,
                       inputs={"log_dir": str(self.log_dir), "window": [end - self.since_s, end],
                               "records": len(records), "previous": previous.plan_id if previous else None})
            if self.write_stanzas:
                write_plan_stanzas(plan, self.model_repository, target=target, tokenizer=tokenizer)
        result = ReplanResult(plan.plan_id, previous.plan_id if previous else None, len(records),
                              int(changes.get("added", len(plan.items))), int(changes.get("kept", 0)),
                              int(changes.get("dropped", 0)), applied, time.perf_counter() - started, time.time(),
                              trial)
        LOGGER.info("re-plan over %d records of the last %g h: plan %s -> %s: %d items added, %d kept, %d dropped%s",
                    result.records, self.since_s / 3600, result.previous, result.plan_id, result.added, result.kept,
                    result.dropped, "" if applied else " (on trial on a canary instance)" if trial
                    else " (unchanged, nothing applied)")
        for item in changes.get("dropped_items") or ():
            LOGGER.info("  dropped: tenant %s adapter %s, %s tokens: %r", item.get("tenant"),
                        item.get("adapter") or "(base)", item.get("tokens"), item.get("text"))
        return result

    def write_stanzas_of(self, plan: Plan) -> None:
        """Write ``plan``'s stanzas into the repository (the plan the next start begins from)."""
        if self.write_stanzas:
            from warmup_tools.planning.plan_stanzas import write_plan_stanzas

            target, tokenizer, _ = self._load()
            write_plan_stanzas(plan, self.model_repository, target=target, tokenizer=tokenizer)

    def _load(self) -> tuple[PlanTarget, Any, Any]:
        if self._tools is None:
            from warmup_tools.embedding_cache.embedder import OnnxEmbedder

            target = PlanTarget.from_repository(self.model_repository, self._environ)
            self._tools = (target, target.load_tokenizer(), OnnxEmbedder(target.embedder))
        return self._tools
