"""One instance's warm-up plan: its planned hot set, live plan changes, and its coverage report.

The planned hot set is, per adapter, the KV block hashes of the plan's items, as this instance computes
them (its base and adapter fingerprints are in every hash). It comes from

- the instance's own ``model_warmup`` samples that carry a plan id (:meth:`PlanKeeper.note_warmup`, called
  for each such sample as it is served), or
- the control folder's ``plan.json`` (:mod:`warmup_tools.control.plan_control`), which the service's control
  thread polls (:meth:`PlanKeeper.poll_once`):
  a new plan is diffed against the hot set (blocks added, kept, dropped), kept blocks are re-pinned
  under the new plan id, dropped ones unpinned (they become ordinary evictable blocks), and the items
  whose blocks are not all resident are warmed as background work (the scheduler's warm class). The
  control folder's plan, once applied, wins over the samples.

The same poll writes ``plan_status/<instance>.json`` when the coverage changes (and every
``heartbeat_s``): per adapter the planned and covered blocks, and why blocks are missing when the
warm-up budget cannot hold the plan, and the cache's live check (:meth:`PrefixCache.pin_report`: pinned
blocks, the hits they had against the hits the blocks evicted for them would have had, and whether the pins
were released).

Coverage counts :meth:`PrefixCache.covered`, not what is pinned now: a planned block's pin ends by design
(its retention passed, or the live check released the plan's pins because they cost live traffic more than
they gave), and a replica whose pins ended so is as ready as it was; the same plan does not warm such a
block again either.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from warmup_tools.common.errors import KVBudgetError
from warmup_tools.common.names import replica_name
from warmup_tools.control.plan_control import (
    AdapterCoverage,
    LivePlan,
    PinReport,
    PlanFileWatcher,
    PlanItem,
    PlanStatus,
    PlanStatusBoard,
)
from warmup_tools.control.state import AdapterLifecycle, AdapterState
from warmup_tools.kv.blocks import BlockSource
from warmup_tools.kv.hashing import BlockHash
from warmup_tools.lora_adapter.requests import GenerateRequest, SamplingParams

LOGGER = logging.getLogger(__name__)

#: The key of the base model in hot sets, statuses and metrics.
BASE = "base"

#: Per adapter (:data:`BASE` for the base model), the block hashes of the planned items.
HotSet = dict[str, set[BlockHash]]


@dataclasses.dataclass(frozen=True, slots=True)
class PlanDiff:
    """Blocks a new plan adds, keeps and drops against the hot set served now, per adapter."""

    added: Mapping[str, int]
    kept: Mapping[str, int]
    dropped: Mapping[str, int]

    def summary(self) -> str:
        total = {k: sum(getattr(self, k).values()) for k in ("added", "kept", "dropped")}
        return f"{total['added']} blocks added, {total['kept']} kept, {total['dropped']} dropped"


def diff_hot_sets(old: Mapping[str, set[BlockHash]], new: Mapping[str, set[BlockHash]]) -> PlanDiff:
    """Per adapter: blocks only in ``new`` (added), in both (kept), only in ``old`` (dropped)."""
    names = sorted(set(old) | set(new))
    empty: set[BlockHash] = set()
    return PlanDiff(
        added={n: len(new.get(n, empty) - old.get(n, empty)) for n in names if new.get(n, empty) - old.get(n, empty)},
        kept={n: len(new.get(n, empty) & old.get(n, empty)) for n in names if new.get(n, empty) & old.get(n, empty)},
        dropped={n: len(old.get(n, empty) - new.get(n, empty)) for n in names if old.get(n, empty) - new.get(n, empty)})


class PlanKeeper:
    """See the module docstring. ``warm`` pre-fills one item (adapter or None, tenant, ids, retention in seconds
    or None) under the active plan and blocks until done; ``run`` runs a function where no forward runs meanwhile
    (the scheduler's ``call``), or directly."""

    def __init__(self, engine: Any, lifecycle: AdapterLifecycle, *, instance: str,
                 warm: Callable[[str | None, str, tuple[int, ...], float | None], None],
                 run: Callable[[Callable[[], Any]], Any] = lambda fn: fn(),
                 control_dir: Path | None = None, heartbeat_s: float = 5.0,
                 clock: Callable[[], float] = time.time, host: str | None = None) -> None:
        """``host``: the replica the reports name (default the host name)."""
        self.engine = engine
        self.host = replica_name(host)
        self.lifecycle = lifecycle
        self.instance = instance
        self._warm = warm
        self._run = run
        self._clock = clock
        self.heartbeat_s = heartbeat_s
        self.plan_id: str | None = None
        self.source = "samples"
        self.state = "none"
        self.detail = ""
        self.hot: HotSet = {}
        self._live_plan: str | None = None  # the control folder's plan, once this instance applies it
        self._lock = threading.Lock()
        self._watcher = PlanFileWatcher(control_dir, who=instance, host=self.host) if control_dir is not None else None
        self._board = PlanStatusBoard(control_dir) if control_dir is not None else None
        self._warm_failures = ""
        #: The last applied plan had warm prompts that can never fit the KV budget (KVBudgetError).
        self._over_budget = False
        self._last_report: tuple[Any, ...] | None = None
        self._last_report_at = float("-inf")
        self.coverage_now: dict[str, AdapterCoverage] = {}
        #: The cache's live check at the last status (:meth:`PrefixCache.pin_report`; None without a cache).
        self.pins_now: PinReport | None = None
        self._stop = threading.Event()
        self._report_lock = threading.Lock()
        self._pending: LivePlan | None = None
        self._applier: threading.Thread | None = None

    # ----------------------------------------------------------------------------------- public API
    def note_warmup(self, request: GenerateRequest) -> GenerateRequest:
        """A model_warmup sample carrying ``plan_id`` is being served: add its blocks to the hot set.

        Once the control folder's plan is applied, a sample of another plan (a reload whose stanzas are
        older) warms without pinning, so it cannot unpin the live plan; so does a sample of a plan other
        than the one the cache holds as current. A sample already past this point when a live plan
        change lands is refused at the cache instead (:meth:`PrefixCache.store` pins only under the
        current plan), so neither order moves the instance back to the samples' plan.
        """
        cache = self.engine.prefix_cache
        if request.plan_id is None or cache is None:
            return request
        with self._lock:
            current = cache.active_plan
            if (self._live_plan is not None and request.plan_id != self._live_plan) or \
                    current not in (None, request.plan_id):
                return dataclasses.replace(request, plan_id=None)
            if request.plan_id != self.plan_id:
                self.plan_id, self.source, self.state, self.hot = request.plan_id, "samples", "applied", {}
                self.detail = "from this instance's model_warmup samples"
            hashes, _ = self.engine.block_hashes(request)
            self.hot.setdefault(request.adapter or BASE, set()).update(hashes)
        return request

    def apply(self, plan: LivePlan) -> PlanDiff:
        """Serve ``plan``: move the pins, warm what is missing, report (blocks until warmed)."""
        cache = self.engine.prefix_cache
        if cache is None:
            raise ValueError("this instance has no KV cache (kv_cache_bytes 0): nothing to warm")
        if plan.block_size != cache.block_size:
            raise ValueError(f"plan {plan.plan_id} is for KV blocks of {plan.block_size} tokens, this instance "
                             f"uses {cache.block_size}")
        hot, items, skipped = self._resolve(plan.items)
        diff = diff_hot_sets(self.hot, hot)
        keep = set().union(*hot.values()) if hot else set()
        kept, unpinned = self._run(lambda: cache.move_plan(plan.plan_id, keep))
        with self._lock:
            previous = self.plan_id
            self._live_plan = self.plan_id = plan.plan_id
            self.hot, self.source, self.state = hot, "control", "warming"
            self.detail = f"from {previous or 'no plan'}: {diff.summary()}" + (f"; {skipped}" if skipped else "")
        LOGGER.info("instance %s: plan %s -> %s: %s (%d pinned blocks kept, %d unpinned)%s", self.instance,
                    previous, plan.plan_id, diff.summary(), kept, unpinned, f"; {skipped}" if skipped else "")
        self.report(force=True)
        failed, over_budget, first_error = 0, 0, ""
        for item, hashes in items:
            if self._stop.is_set():
                return diff
            if cache.covered(hashes, plan.plan_id) == len(hashes):
                continue  # kept and pinned already, or pinned by this plan before and its pin ended by design
            try:
                self._warm(item.adapter or None, item.tenant, item.token_ids, item.retention_s)
            except Exception as exc:  # noqa: BLE001 - one item that cannot be warmed leaves the others
                failed += 1
                over_budget += isinstance(exc, KVBudgetError)
                first_error = first_error or str(exc)
                LOGGER.warning("instance %s: warming an item of plan %s failed: %s", self.instance, plan.plan_id, exc)
            self.report()  # progress (at most one write a second)
        with self._lock:
            if self.plan_id == plan.plan_id:
                self.state = "applied"
                self._warm_failures = f"{failed} items could not be warmed ({first_error})" if failed else ""
                self._over_budget = over_budget > 0
                if failed:
                    self.detail += f"; {self._warm_failures}"
        self.report(force=True)
        return diff

    def coverage(self) -> dict[str, AdapterCoverage]:
        """Per adapter of the hot set: planned blocks, resident blocks (covered by the plan: pinned under it, or
        pinned under it before and the pin ended by design), live, and why blocks are missing; every other adapter
        of the instance (retired ones aside) with nothing planned."""
        cache = self.engine.prefix_cache
        with self._lock:
            hot = {name: list(hashes) for name, hashes in self.hot.items()}
            settled = self.state == "applied"
            plan_id = self.plan_id
        states = self.lifecycle.snapshot()
        out = {}
        for name, hashes in sorted(hot.items()):
            # NOTE: pinned, not merely cached: a block that was never pinned (or a plan change unpinned) is
            # evictable, and counting it would report a plan warm whose pins were lost. But a pin that ended by
            # design (retention, the live check) counts: readiness must not fall when warm-up stops paying.
            resident = cache.covered(hashes, plan_id) if cache is not None else 0
            status = states.get(name)
            live = name == BASE or (status is not None and status.state is AdapterState.LIVE)
            shortfall = ""
            if resident < len(hashes) and settled and cache is not None:
                shortfall = self._shortfall(cache, len(hashes) - resident, len(hashes))
            out[name] = AdapterCoverage(len(hashes), resident, live, shortfall)
        # NOTE: an adapter the plan has no item for is listed too (nothing planned): the sidecar learns from
        # these reports which adapters each instance serves, so one added later has a temperature.
        for name, status in states.items():
            if name not in out and status.state is not AdapterState.RETIRED:
                out[name] = AdapterCoverage(0, 0, status.state is AdapterState.LIVE)
        self.coverage_now = dict(sorted(out.items()))
        out = self.coverage_now
        return out

    def status(self) -> PlanStatus:
        coverage = self.coverage()
        cache = self.engine.prefix_cache
        self.pins_now = PinReport.from_dict(cache.pin_report()) if cache is not None else None
        with self._lock:
            return PlanStatus(self.instance, self.plan_id, self.source, self.state, coverage, self.detail,
                              self._watcher.error if self._watcher else "", self._clock(), self.host,
                              self.pins_now)

    def report(self, force: bool = False) -> None:
        """Write this instance's status if it changed (or ``force``, or every ``heartbeat_s``)."""
        if self._board is None:
            return
        with self._report_lock:  # the poll thread and a plan being applied both report
            self._report(force)

    def poll_once(self) -> None:
        """Start applying a new plan.json if there is one (on a thread of its own, so that this one keeps
        reporting while a long plan warms; a plan that comes meanwhile waits for it), then report."""
        plan = self._watcher.poll() if self._watcher is not None else None
        if plan is not None:
            self._pending = plan
        applying = self._applier is not None and self._applier.is_alive()
        if self._pending is not None and not applying:
            plan, self._pending = self._pending, None
            if plan.plan_id != self._live_plan:
                self._applier = threading.Thread(target=self._apply_logged, args=(plan,), name="plan-apply",
                                                 daemon=True)
                self._applier.start()
        self.report()

    def close(self) -> None:
        self._stop.set()
        # NOTE: a plan being warmed stops before its next item; its thread is not joined (it may wait for a
        # scheduler that is stopping, which fails its futures).

    # ------------------------------------------------------------------------------------- helpers
    def _report(self, force: bool) -> None:
        status = self.status()
        key = (status.plan_id, status.state, status.detail, status.error, tuple(sorted(status.adapters.items())),
               status.pins)
        now = time.monotonic()
        since = now - self._last_report_at
        if not force and since < self.heartbeat_s and (key == self._last_report or since < 1.0):
            return
        try:
            self._board.report(status)
        except OSError as exc:
            LOGGER.error("instance %s cannot write its plan status: %s", self.instance, exc)
            return
        self._last_report, self._last_report_at = key, now

    def _apply_logged(self, plan: LivePlan) -> None:
        try:
            self.apply(plan)
        except ValueError as exc:
            LOGGER.error("instance %s keeps plan %s: %s", self.instance, self.plan_id, exc)
            self._watcher.error = f"plan {plan.plan_id} refused: {exc}"
        except Exception:
            LOGGER.exception("instance %s: applying plan %s failed", self.instance, plan.plan_id)

    def _resolve(self, items: tuple[PlanItem, ...]) -> tuple[HotSet, list[tuple[PlanItem, list[BlockHash]]], str]:
        """The hot set of ``items`` on this instance, the items it can warm with their hashes, and a note on
        the items it cannot (an adapter it does not serve, ids outside its vocabulary or context)."""
        hot: HotSet = {}
        usable = []
        unknown = bad = 0
        for item in items:
            if item.adapter and not self.engine.has_adapter(item.adapter):
                unknown += 1
                continue
            if max(item.token_ids) >= self.engine.vocab_size or len(item.token_ids) >= self.engine.context_length:
                bad += 1
                continue
            request = GenerateRequest(item.token_ids, item.adapter or None, item.tenant, False,
                                      SamplingParams(max_tokens=1), source=BlockSource.WARMUP)
            hashes, _ = self.engine.block_hashes(request)
            hot.setdefault(item.adapter or BASE, set()).update(hashes)
            usable.append((item, hashes))
        notes = [f"{unknown} items for adapters this instance does not serve"] if unknown else []
        notes += [f"{bad} items outside the model's vocabulary or context"] if bad else []
        return hot, usable, "; ".join(notes)

    def _shortfall(self, cache: Any, missing: int, planned: int) -> str:
        budget, used = cache.warmup_budget, cache.stats.warmup_bytes
        failed = f"; {self._warm_failures}" if self._warm_failures else ""
        # NOTE: a plan too big for the budget shows either way: blocks the store refused, or a warm prompt
        # the scheduler could not even reserve memory for.
        if cache.stats.rejected_blocks or self._over_budget:
            return (f"{missing} of {planned} planned blocks do not fit the warm-up budget ({used:,} of {budget:,} "
                    "bytes: kv_cache_bytes times the smaller of kv_warm_share and 1 - kv_live_reserve; lower the "
                    "plan's budgets or raise kv_cache_bytes)"
                    + failed)
        return f"{missing} of {planned} planned blocks are not resident (evicted, or not warmed yet){failed}"
