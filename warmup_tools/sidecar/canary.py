"""The canary's verdict: a plan on trial against the plan the other instances serve, judged from the request logs.

A plan on trial (``canary.json``: :mod:`warmup_tools.adapters.canary`) is served by one lora_adapter instance of
this replica, or, in a fleet, by every instance of one replica; the others serve ``plan.json``.

**One instance.** Triton spreads the replica's requests over its instances in turn, so both sides see the same
traffic. From the moment the canary instance reports the plan applied, the controller reads each instance's
request log (``requests-<instance>.jsonl`` under the replica's ``request_log_dir``) and compares, canary against
the rest (below).

**A whole replica** (``canary.json`` names a replica and no instance; judged by that replica's sidecar). Every
replica logs into its own subfolder of the fleet's shared log folder (``fleet_log_dir/<replica_name>/``). The
canary side is this replica's logs, the rest the logs of the replicas that reported to the control folder's
status board when the trial's plan was applied (a replica that left is not read; one that joins during the trial
is not either: it has no baseline). The router does not give replicas the same traffic: behind ``cache_aware``
each tenant's prefixes stick to one replica, so one replica may serve the tenants with long shared system prompts
and another the one-off prompts, and their cold shares differ by tens of points under the same plan. A direct
comparison would roll back a good plan tried on the colder replica, and promote a bad one tried on the warmer.
So each measure is a **difference of differences**: the canary replica's change from its own baseline (its
requests of the ``canary_window_s`` before the trial started) less the other replicas' change over the same
time. The tenant mix each replica gets is stable from one window to the next (the stickiness that makes the
replicas differ keeps each one's mix steady), so it cancels out of each replica's change, and a drift of the
whole traffic (the hour of the day) cancels out of the difference. The early tests become one-sided z-tests on
the difference of differences (:func:`rise_greater`: of the cold share, and of the mean per-request uncached
share and share not from the plan), and TTFT p99 compares the ratios to each side's own baseline
(:func:`judge_replica`). The price is variance (four samples instead of two): a trial needs a baseline of
``canary_min_requests`` on each side, or it is rolled back at once, saying so. Round-robin routing needs no
baseline, but the difference of differences holds under it too, so one rule serves every policy.

The measures, canary against the rest:

- **cold share** (requests with no prompt token from the KV cache): worse when it is more than
  ``canary_cold_margin`` above the rest's *and* a one-sided Fisher exact test puts the difference below
  ``canary_alpha`` (so that a small window cannot roll back a good plan by chance);
- **prompt tokens from cache**: worse when the canary's share is more than ``canary_cached_margin`` below; a
  one-sided Mann-Whitney U test on each request's uncached share of its prompt (:func:`uncached_greater`)
  below ``canary_alpha`` makes it worse before the window ends (a plan that unpins the hot set shows in every
  request's prefill, not only in the requests with nothing cached);
- **prompt tokens from the plan** (the cached tokens that came from blocks the instance's plan pins, which
  ``lora_adapter`` logs as ``planned_tokens``): worse, at once, when the canary's share is more than
  ``canary_cached_margin`` below the rest's with the same rank test below ``canary_alpha``. This is the leading
  signal: a plan that does not hold today's hot prefixes shows it from the first requests, while the blocks
  the old plan pinned still sit unpinned in the canary's cache and keep its cached share up until they are
  evicted;
- **TTFT p99**: worse when above ``canary_ttft_ratio`` times the rest's, once each side has
  :data:`MIN_P99_REQUESTS` requests (below that a p99 is the maximum).

Nothing is judged before each side has ``canary_min_requests`` requests; on a whole replica the early tests start
when the canary replica has them and the others have one (their requests since the trial began only estimate the
fleet's drift, and the test's variance counts how little a few of them say), and promotion still needs them on
each side. A plan whose cold share, cached
tokens or tokens from the plan are worse with the tests' confidence is rolled back at once, inside the
window (the tests guard against chance); when ``canary_window_s`` has passed, a plan worse by cold share,
cached tokens or TTFT p99 is rolled back and one no worse is promoted (made the plan of every instance,
through the history). On a whole replica the end of the window adds TTFT p99 only: its cached-token margin
untested would be a coin toss on four small windows (:func:`judge_replica`). A trial that never gets enough
traffic, or whose canary never applies the plan, is rolled back after three windows, saying so. Every verdict
is one log line, the last ones and the running trial are in ``/status`` (``canary``), and ``/metrics`` counts
them.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

from warmup_tools.adapters.canary import end_canary, start_canary
from warmup_tools.adapters.plan_control import CanaryAssignment, PlanStatusBoard, read_canary
from warmup_tools.adapters.plan_history import PlanHistorySettings, applied_by
from warmup_tools.common.plan import Plan, PlanError
from warmup_tools.common.records import RecordError, RequestRecord
from warmup_tools.sidecar.config import SidecarConfig

LOGGER = logging.getLogger(__name__)

#: A TTFT p99 is compared only once each side has this many requests (of fewer, the p99 is the maximum).
MIN_P99_REQUESTS = 100
#: TTFT samples kept per side and trial (the counts go on; the p99 is of the first ones).
MAX_SAMPLES = 100_000
#: Verdicts kept for ``/status``.
KEEP_VERDICTS = 10
#: Bytes of one request log read per tick at most (the rest is read at the next ticks).
MAX_READ_BYTES = 8 << 20
LOG_PREFIX, LOG_SUFFIX = "requests-", ".jsonl"


#: Tenants one side of a trial keeps counts for; the requests of tenants beyond them are left out.
MAX_TENANTS = 10_000


@dataclasses.dataclass(slots=True)
class WindowStats:
    """What one side served since the trial's plan was applied (or in its baseline).

    No tenant carries a side: at most ``tenant_cap`` requests of each tenant are counted (0: no cap), and with
    ``only`` (a whole replica's trial: the tenants the side served in its baseline) no other tenant's; what is
    left out is counted in ``left_out``."""

    tenant_cap: int = 0
    only: frozenset[str] | None = None
    #: Requests counted per tenant.
    tenants: dict[str, int] = dataclasses.field(default_factory=dict)
    left_out: int = 0
    requests: int = 0
    cold: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_ms: list[float] = dataclasses.field(default_factory=list)
    #: Each request's share of prompt tokens not from the cache (the first :data:`MAX_SAMPLES`).
    uncached: list[float] = dataclasses.field(default_factory=list)
    #: The prompt tokens of the requests whose log says how many came from the plan's pinned blocks, those
    #: tokens, and each such request's share of prompt tokens *not* from them.
    planned_prompt_tokens: int = 0
    planned_tokens: int = 0
    unplanned: list[float] = dataclasses.field(default_factory=list)

    def add(self, record: RequestRecord) -> None:
        tenant = record.tenant or ""
        counted = self.tenants.get(tenant, 0)
        if ((self.only is not None and tenant not in self.only) or (self.tenant_cap and counted >= self.tenant_cap)
                or (not counted and len(self.tenants) >= MAX_TENANTS)):
            self.left_out += 1
            return
        self.tenants[tenant] = counted + 1
        cached = record.cached_tokens or 0
        prompt = record.prompt_tokens or 0
        self.requests += 1
        self.cold += cached == 0
        self.prompt_tokens += prompt
        self.cached_tokens += cached
        if record.ttft_ms is not None and len(self.ttft_ms) < MAX_SAMPLES:
            self.ttft_ms.append(record.ttft_ms)
        if prompt > 0 and len(self.uncached) < MAX_SAMPLES:
            self.uncached.append(1.0 - min(cached, prompt) / prompt)
        if prompt > 0 and record.planned_tokens is not None:
            planned = min(record.planned_tokens, prompt)
            self.planned_prompt_tokens += prompt
            self.planned_tokens += planned
            if len(self.unplanned) < MAX_SAMPLES:
                self.unplanned.append(1.0 - planned / prompt)

    @property
    def cold_share(self) -> float:
        return self.cold / self.requests if self.requests else 0.0

    @property
    def cached_share(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def planned_share(self) -> float | None:
        """The share of prompt tokens served from the plan's pinned blocks (None: the logs do not say)."""
        return self.planned_tokens / self.planned_prompt_tokens if self.planned_prompt_tokens else None

    @property
    def ttft_p99_ms(self) -> float | None:
        if not self.ttft_ms:
            return None
        ordered = sorted(self.ttft_ms)
        return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]

    def summary(self) -> dict[str, Any]:
        p99 = self.ttft_p99_ms
        planned = self.planned_share
        return {"requests": self.requests, "tenants": len(self.tenants), "left_out": self.left_out,
                "cold_share": round(self.cold_share, 4),
                "cached_share": round(self.cached_share, 4),
                "planned_share": None if planned is None else round(planned, 4),
                "ttft_p99_ms": None if p99 is None else round(p99, 2)}


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    #: ``wait``, ``promote`` or ``rollback``.
    action: str
    reason: str


def fisher_greater(a_hits: int, a_n: int, b_hits: int, b_n: int) -> float:
    """One-sided Fisher exact test: the probability, with no difference between the sides, that side A gets
    ``a_hits`` or more of the ``a_hits + b_hits`` hits (hypergeometric upper tail)."""
    total, hits = a_n + b_n, a_hits + b_hits
    if not 0 <= a_hits <= a_n or not 0 <= b_hits <= b_n:
        raise ValueError("hits must lie between 0 and the requests of their side")
    denominator = math.comb(total, a_n)
    upper = sum(math.comb(hits, k) * math.comb(total - hits, a_n - k) for k in range(a_hits, min(hits, a_n) + 1))
    return upper / denominator


def uncached_greater(canary: list[float], rest: list[float]) -> float:
    """One-sided Mann-Whitney U test: the probability, with no difference between the sides, of the canary's
    per-request uncached shares ranking this far above the rest's (1.0 when either side has none)."""
    if not canary or not rest:
        return 1.0
    from scipy.stats import mannwhitneyu  # NOTE: scipy loads in ~0.3 s; only a trial with traffic needs it

    return float(mannwhitneyu(canary, rest, alternative="greater").pvalue)


def evidence(canary: WindowStats, rest: WindowStats) -> dict[str, float]:
    """The one-sided tests' p-values so far (what an early rollback needs below ``canary_alpha``): cold share,
    per-request uncached share, per-request share not from the plan's pinned blocks."""
    return {"cold_p": round(fisher_greater(canary.cold, canary.requests, rest.cold, rest.requests), 5),
            "uncached_p": round(uncached_greater(canary.uncached, rest.uncached), 5),
            "unplanned_p": round(uncached_greater(canary.unplanned, rest.unplanned), 5)}


def judge(canary: WindowStats, rest: WindowStats, elapsed_s: float, settings: SidecarConfig) -> Verdict:
    """The verdict on a trial ``elapsed_s`` after its plan was applied (see the module docstring)."""
    waiting = _too_little(canary, rest, elapsed_s, settings)
    if waiting is not None:
        return waiting
    worse = []
    cold_up = canary.cold_share - rest.cold_share
    if cold_up > settings.canary_cold_margin:
        p = fisher_greater(canary.cold, canary.requests, rest.cold, rest.requests)
        if p < settings.canary_alpha:
            worse.append(f"cold share {canary.cold_share:.1%} against {rest.cold_share:.1%} "
                         f"({canary.cold}/{canary.requests} against {rest.cold}/{rest.requests}, p={p:.3g})")
    cached_down = rest.cached_share - canary.cached_share
    if cached_down > settings.canary_cached_margin:
        p = uncached_greater(canary.uncached, rest.uncached)
        if p < settings.canary_alpha:
            worse.append(f"prompt tokens from cache {canary.cached_share:.1%} against {rest.cached_share:.1%} "
                         f"(per-request uncached shares ranked higher, p={p:.3g})")
    mine, theirs = canary.planned_share, rest.planned_share
    if mine is not None and theirs is not None and theirs - mine > settings.canary_cached_margin:
        p = uncached_greater(canary.unplanned, rest.unplanned)
        if p < settings.canary_alpha:
            worse.append(f"prompt tokens from the plan's pinned blocks {mine:.1%} against {theirs:.1%} "
                         f"(per-request shares ranked lower, p={p:.3g})")
    if worse:
        return Verdict("rollback", "worse than the plan served now: " + "; ".join(worse))
    if elapsed_s < settings.canary_window_s:
        # NOTE: only the tested measures end a trial early; untested, a few cold requests move them a lot.
        return Verdict("wait", f"no worse so far ({elapsed_s:.0f} of {settings.canary_window_s:g} s)")
    if cached_down > settings.canary_cached_margin:
        worse.append(f"prompt tokens from cache {canary.cached_share:.1%} against {rest.cached_share:.1%}")
    if min(canary.requests, rest.requests) >= MIN_P99_REQUESTS:
        mine, theirs = canary.ttft_p99_ms, rest.ttft_p99_ms
        if mine is not None and theirs is not None and mine > settings.canary_ttft_ratio * theirs:
            worse.append(f"TTFT p99 {mine:.1f} ms against {theirs:.1f} ms")
    if worse:
        return Verdict("rollback", "worse than the plan served now: " + "; ".join(worse))
    return Verdict("promote", f"no worse after {elapsed_s:.0f} s: cold share {canary.cold_share:.1%} against "
                              f"{rest.cold_share:.1%}, prompt tokens from cache {canary.cached_share:.1%} "
                              f"against {rest.cached_share:.1%} ({canary.requests} and {rest.requests} requests)")


@dataclasses.dataclass(frozen=True, slots=True)
class Moments:
    """A per-request measure in [0, 1] on one side: its mean, its variance and the requests, each estimated with
    one pseudo-request at 0 and one at 1 added (Agresti and Caffo's adjustment for a difference of proportions:
    a side of five requests all cold, or all alike, would otherwise have no variance, and the z-test a p-value
    of 1e-18). A side with no request stays empty (``n`` 0)."""

    mean: float
    var: float
    n: int

    @classmethod
    def of(cls, values: list[float]) -> Moments:
        if not values:
            return cls(0.0, 0.0, 0)
        padded = [*values, 0.0, 1.0]
        n = len(padded)
        mean = sum(padded) / n
        return cls(mean, sum((v - mean) ** 2 for v in padded) / (n - 1), n)

    @classmethod
    def share(cls, hits: int, n: int) -> Moments:
        if n <= 0:
            return cls(0.0, 0.0, 0)
        p = (hits + 1) / (n + 2)
        return cls(p, p * (1.0 - p), n + 2)


def rise_greater(canary: Moments, canary_before: Moments, rest: Moments, rest_before: Moments) -> float:
    """One-sided z-test on a difference of differences: the probability, with the plan making no difference,
    of the canary's measure rising this much more than the rest's since before the trial (normal approximation;
    each side's own baseline takes out the traffic mix the router gives it)."""
    parts = (canary, canary_before, rest, rest_before)
    if any(m.n == 0 for m in parts):
        return 1.0
    rise = (canary.mean - canary_before.mean) - (rest.mean - rest_before.mean)
    var = sum(m.var / m.n for m in parts)
    if var <= 0.0:
        return 0.0 if rise > 0 else 1.0
    return 0.5 * math.erfc(rise / math.sqrt(2.0 * var))


def replica_evidence(canary: WindowStats, rest: WindowStats, before: tuple[WindowStats, WindowStats]
                     ) -> dict[str, float]:
    """:func:`evidence` for a trial on a whole replica: the difference-of-differences tests' p-values."""
    (c0, r0), p = before, rise_greater
    return {"cold_p": round(p(*_cold(canary, c0, rest, r0)), 5),
            "uncached_p": round(p(*(Moments.of(s.uncached) for s in (canary, c0, rest, r0))), 5),
            "unplanned_p": round(p(*(Moments.of(s.unplanned) for s in (canary, c0, rest, r0))), 5)}


def judge_replica(canary: WindowStats, rest: WindowStats, before: tuple[WindowStats, WindowStats],
                  elapsed_s: float, settings: SidecarConfig) -> Verdict:
    """The verdict on a trial on a whole replica: as :func:`judge`, but each measure is the canary replica's
    change since before the trial less the other replicas' change over the same time (``before``: each side's
    last ``canary_window_s`` before the trial started), so that a replica the router gives colder tenants is
    not taken for a worse plan (see the module docstring)."""
    # NOTE: the early tests need canary_min_requests on the canary replica but one request of the others: their
    # requests since the trial began only estimate the fleet's drift, and how little that estimate knows is in
    # the test's variance (with the pseudo-requests, a side of one request has a variance near its largest and a
    # mean pulled toward one half). Under no difference the rate of p < alpha per look stays below alpha however
    # few requests the others have (tests/unit/sidecar/test_canary.py), so waiting for their fifth request bought
    # no safety and delayed the rollback of a bad plan by minutes at low traffic. Promotion still needs
    # canary_min_requests on each side.
    waiting = _too_little(canary, rest, elapsed_s, settings, rest_need=1)
    if waiting is not None:
        return waiting
    c0, r0 = before
    sides = (canary, c0, rest, r0)

    def moved(name: str, value: Callable[[WindowStats], float]) -> str:
        return (f"{name} {value(c0):.1%} -> {value(canary):.1%} on {canary.requests} requests of the canary "
                f"replica, {value(r0):.1%} -> {value(rest):.1%} on {rest.requests} of the others")

    worse = []
    cold_up = (canary.cold_share - c0.cold_share) - (rest.cold_share - r0.cold_share)
    if cold_up > settings.canary_cold_margin:
        p = rise_greater(*_cold(canary, c0, rest, r0))
        if p < settings.canary_alpha:
            worse.append(f"{moved('cold share', lambda s: s.cold_share)} (p={p:.3g})")
    cached_down = (c0.cached_share - canary.cached_share) - (r0.cached_share - rest.cached_share)
    if cached_down > settings.canary_cached_margin:
        p = rise_greater(*(Moments.of(s.uncached) for s in sides))
        if p < settings.canary_alpha:
            worse.append(f"{moved('prompt tokens from cache', lambda s: s.cached_share)} (p={p:.3g})")
    planned = [s.planned_share for s in sides]
    if all(x is not None for x in planned):
        mine, mine_before, theirs, theirs_before = planned  # type: ignore[misc]
        if (mine_before - mine) - (theirs_before - theirs) > settings.canary_cached_margin:
            p = rise_greater(*(Moments.of(s.unplanned) for s in sides))
            if p < settings.canary_alpha:
                name = "prompt tokens from the plan's pinned blocks"
                worse.append(f"{moved(name, lambda s: s.planned_share or 0.0)} (p={p:.3g})")
    if worse:
        return Verdict("rollback", "worse than the plan served now: " + "; ".join(worse))
    if elapsed_s < settings.canary_window_s:
        return Verdict("wait", f"no worse so far ({elapsed_s:.0f} of {settings.canary_window_s:g} s)")
    waiting = _too_little(canary, rest, elapsed_s, settings)
    if waiting is not None:
        return waiting
    # NOTE: no untested cached-token margin here, unlike judge(): a difference of differences of four windows of
    # a few dozen requests moves by more than the margin by chance (the others' baseline alone, an unlucky cold
    # window that comes back, rolled back a re-plan under which the canary replica had not moved); the tests above
    # already judged the whole window.
    if min(s.requests for s in sides) >= MIN_P99_REQUESTS:
        p99 = [s.ttft_p99_ms for s in sides]
        if all(x is not None and x > 0 for x in p99):
            mine, mine_before, theirs, theirs_before = p99  # type: ignore[misc]
            if mine / mine_before > settings.canary_ttft_ratio * (theirs / theirs_before):
                worse.append(f"TTFT p99 {mine_before:.1f} -> {mine:.1f} ms on the canary replica, "
                             f"{theirs_before:.1f} -> {theirs:.1f} ms on the others")
    if worse:
        return Verdict("rollback", "worse than the plan served now: " + "; ".join(worse))
    return Verdict("promote", f"no worse after {elapsed_s:.0f} s: "
                              f"{moved('cold share', lambda s: s.cold_share)}; "
                              f"{moved('prompt tokens from cache', lambda s: s.cached_share)}")


def _too_little(canary: WindowStats, rest: WindowStats, elapsed_s: float, settings: SidecarConfig, *,
                rest_need: int | None = None) -> Verdict | None:
    """The verdict while the canary has fewer than ``canary_min_requests`` requests or the rest fewer than
    ``rest_need`` (default the same; None: enough to judge)."""
    need = settings.canary_min_requests
    rest_need = need if rest_need is None else rest_need
    if canary.requests >= need and rest.requests >= rest_need:
        return None
    if elapsed_s >= 3 * settings.canary_window_s:
        return Verdict("rollback", f"too little traffic to judge in {elapsed_s:.0f} s: {canary.requests} "
                                   f"requests on the canary, {rest.requests} on the others "
                                   f"({need} on the canary and {rest_need} on the others needed)")
    return Verdict("wait", f"{canary.requests} and {rest.requests} requests of {need} on the canary and "
                           f"{rest_need} on the others")


def _carried(*sides: WindowStats, shown: int = 10) -> str:
    """Which tenants' requests the verdict counted, most first (for the sidecar's log, never ``/status``)."""
    counts: dict[str, int] = {}
    for side in sides:
        for tenant, n in side.tenants.items():
            counts[tenant] = counts.get(tenant, 0) + n
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    more = f" and {len(ranked) - shown} more" if len(ranked) > shown else ""
    return ", ".join(f"{t or 'default'} {n}" for t, n in ranked[:shown]) + more if ranked else "none"


def _cold(*sides: WindowStats) -> list[Moments]:
    return [Moments.share(s.cold, s.requests) for s in sides]


class RequestLogTail:
    """New complete lines of each instance's request log (``requests-<instance>.jsonl``) since the last read; a
    rotated file's rest is read from its ``.1`` before the new file."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self._at: dict[str, tuple[int, int]] = {}  # instance -> (inode, offset)
        self.skipped = 0

    def skip_to_end(self) -> None:
        """Forget what the logs hold now: only lines written from here on are read."""
        self._at = {}
        for instance, path in self._files():
            st = os.stat(path)
            self._at[instance] = (st.st_ino, st.st_size)

    def read(self) -> list[tuple[str, RequestRecord]]:
        out: list[tuple[str, RequestRecord]] = []
        for instance, path in self._files():
            try:
                inode = os.stat(path).st_ino
            except FileNotFoundError:
                continue
            known, offset = self._at.get(instance, (inode, 0))
            if known != inode:  # rotated: the old file is now .1
                rotated = path.with_name(path.name + ".1")
                if rotated.exists() and os.stat(rotated).st_ino == known:
                    out += self._lines(instance, rotated, offset)[0]
                offset = 0
            lines, offset = self._lines(instance, path, offset)
            out += lines
            self._at[instance] = (inode, offset)
        return out

    def recent(self, since: float, until: float) -> list[RequestRecord]:
        """The records stamped in ``[since, until)`` among the last :data:`MAX_READ_BYTES` of each log (with the
        end of its rotated ``.1`` when the log is shorter): a trial's baseline, read once, never the whole log."""
        out: list[RequestRecord] = []
        for instance, path in self._files():
            budget = MAX_READ_BYTES
            for file in (path, path.with_name(path.name + ".1")):
                try:
                    size = os.stat(file).st_size
                except FileNotFoundError:
                    break
                start = max(0, size - budget)
                lines, _ = self._lines(instance, file, start, skip_partial=start > 0)
                out += [r for _, r in lines if since <= r.ts < until]
                budget -= size - start
                if budget <= 0:
                    break
        return out

    def _files(self) -> list[tuple[str, Path]]:
        if not self.directory.is_dir():
            return []
        return sorted((p.name[len(LOG_PREFIX):-len(LOG_SUFFIX)], p) for p in self.directory.iterdir()
                      if p.name.startswith(LOG_PREFIX) and p.name.endswith(LOG_SUFFIX) and p.is_file())

    def _lines(self, instance: str, path: Path, offset: int, *, skip_partial: bool = False
               ) -> tuple[list[tuple[str, RequestRecord]], int]:
        import json

        try:
            with open(path, "rb") as file:
                file.seek(offset)
                raw = file.read(MAX_READ_BYTES)
        except OSError:
            return [], offset
        end = raw.rfind(b"\n") + 1  # NOTE: a torn last line is read once the writer completes it
        begin = raw.find(b"\n") + 1 if skip_partial else 0  # a read from the middle starts at a line's start
        out = []
        for line in raw[begin:end].splitlines():
            try:
                out.append((instance, RequestRecord.from_json(json.loads(line))))
            except (ValueError, RecordError, TypeError):
                self.skipped += 1
        return out, offset + end


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
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

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
        """Put ``plan`` on trial: on this whole replica when two or more replicas of the fleet report (judged
        against the others), else on this replica's last instance; None when there is nothing to compare with
        (the caller applies the plan everywhere). :class:`CanaryError` when a trial is running already."""
        if self.settings.canary_window_s <= 0:
            return None
        replicas = self.replicas()
        if len(replicas) >= 2 and self.host in replicas:
            canary = start_canary(self.control_dir, plan, host=self.host, by=applied_by(by), settings=self.history,
                                  now=self._clock())
            LOGGER.info("canary: plan %s on trial on every instance of replica %s (the plan served now stays on "
                        "%s)", plan.plan_id, self.host, ", ".join(r for r in replicas if r != self.host))
            return canary
        instances = self.instances()
        if len(instances) < 2:
            return None
        canary = start_canary(self.control_dir, plan, host=self.host, instances=instances[-1:],
                              by=applied_by(by), settings=self.history, now=self._clock())
        LOGGER.info("canary: plan %s on trial on instance %s of %s (the plan served now stays on %s)",
                    plan.plan_id, instances[-1], self.host, ", ".join(instances[:-1]))
        return canary

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
                    verdict = Verdict("rollback", f"the canary instance did not apply plan {canary.plan_id} within "
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
                    (canary_side if replica == self.host else rest).add(record)
                elif replica == self.host:
                    (canary_side if canary.targets(self.host, instance) else rest).add(record)
        elapsed = now - self._applied_at
        if whole and self._before is not None:
            return self._act(canary, judge_replica(canary_side, rest, self._before, elapsed, self.settings), now)
        return self._act(canary, judge(canary_side, rest, elapsed, self.settings), now)

    def _compare_with_the_fleet(self, canary: CanaryAssignment) -> Verdict | None:
        """At the start of a trial on this whole replica: the replicas to compare with (those reporting now whose
        logs are in ``fleet_log_dir``: a replica that left is not read, one that joins later has no baseline and
        is not either) and each side's baseline, the ``canary_window_s`` before the trial started. A rollback
        verdict when there is no other replica or no baseline to judge against."""
        assert self.fleet_log_dir is not None
        others = tuple(r for r in self.replicas() if r != self.host and (self.fleet_log_dir / r).is_dir())
        if not others:
            return Verdict("rollback", "no other replica reports with request logs under "
                                       f"{self.fleet_log_dir}: nothing to compare a whole replica with")
        tails = {self.host: self._tails[self.host]}
        tails.update({r: RequestLogTail(self.fleet_log_dir / r) for r in others})
        since = canary.started_at - self.settings.canary_window_s
        before = (self._side(), self._side())
        for replica, tail in tails.items():
            for record in tail.recent(since, canary.started_at):
                before[replica != self.host].add(record)
        # NOTE: each side is judged on the tenants it served in its baseline: a tenant new to the canary replica
        # (cold on any plan) cannot roll back a good plan, nor can its absence from the others save a bad one.
        sides = (self._side(frozenset(before[0].tenants)), self._side(frozenset(before[1].tenants)))
        need = self.settings.canary_min_requests
        if min(before[0].requests, before[1].requests) < need:
            return Verdict("rollback", f"no baseline to judge a whole replica against: {before[0].requests} requests "
                                       f"on {self.host} and {before[1].requests} on {', '.join(others)} in the "
                                       f"{self.settings.canary_window_s:g} s before the trial ({need} each needed)")
        with self._lock:
            self._tails, self._before, self._others, self._sides = tails, before, others, sides
        return None

    def _side(self, only: frozenset[str] | None = None) -> WindowStats:
        return WindowStats(tenant_cap=self.settings.canary_tenant_cap, only=only)

    def _canary_applied(self, canary: CanaryAssignment) -> bool:
        statuses, _ = self._board.read_all(host=self.host)
        mine = [s for name, s in statuses.items() if canary.targets(self.host, name)]
        return bool(mine) and all(s.plan_id == canary.plan_id and s.state == "applied" for s in mine)

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
        record = {"plan_id": canary.plan_id, "verdict": "promoted" if promote else "rolled_back",
                  "reason": verdict.reason, "at": round(now, 3), "started_at": canary.started_at,
                  "canary": canary_side.summary(), "rest": rest.summary()}
        if self._before is not None:
            record["replicas"] = list(self._others)
            record["before"] = {"canary": self._before[0].summary(), "rest": self._before[1].summary()}
        with self._lock:
            self._counts[record["verdict"]] += 1
            self._verdicts = [record, *self._verdicts][:KEEP_VERDICTS]
            self._trial, self._applied_at, self._before, self._others = None, None, None, ()
            self._tails = {self.host: self._tails[self.host]}
        (LOGGER.info if promote else LOGGER.warning)(
            "canary: plan %s %s after %.0f s: %s (tenants counted: %s)", canary.plan_id,
            "promoted" if promote else "rolled back", now - canary.started_at, verdict.reason,
            _carried(canary_side, rest))
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
                         "started_at": self._trial.started_at, "applied_at": self._applied_at,
                         "canary": canary_side.summary(), "rest": rest.summary(),
                         "evidence": (evidence(canary_side, rest) if self._before is None
                                      else replica_evidence(canary_side, rest, self._before))}
                if self._before is not None:
                    trial["replicas"] = list(self._others)
                    trial["before"] = {"canary": self._before[0].summary(), "rest": self._before[1].summary()}
            return {"window_s": self.settings.canary_window_s, "judging": self._thread is not None, "trial": trial,
                    "last": dataclasses.asdict(self._last), "verdicts": list(self._verdicts),
                    "counts": dict(self._counts), "error": self._error}

    def start(self, interval_s: float) -> None:
        self._thread = threading.Thread(target=self._loop, args=(interval_s,), name="sidecar-canary", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.tick()
            except Exception:  # NOTE: the next tick tries again; the trial stays as it is
                LOGGER.exception("canary: judging the trial failed")
