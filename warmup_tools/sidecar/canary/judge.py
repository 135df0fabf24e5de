"""The canary's judge: a plan on trial against the plan served now, compared tenant by tenant.

Pure functions over what the request logs said, one :class:`WindowStats` per window of requests; the controller
that reads the logs, starts and ends trials is :mod:`warmup_tools.sidecar.canary.controller`. Why the canary
compares what it compares, and how each rule came to be: docs/planner.md, "Canary: a plan on trial".

**Two kinds of trial.** On one instance of a replica (the others serve ``plan.json``), the canary side is that
instance's requests since the plan was applied and the rest the other instances' over the same time
(:func:`judge`). On a whole replica of a fleet, each side is compared with its own **baseline** (its requests of
the ``canary_window_s`` before the trial), and a measure is the canary replica's change less the other replicas'
change over the same time, a difference of differences (:func:`judge_replica`).

**Tenant by tenant.** Every comparison is of two windows (canary and rest; or a side's trial and its baseline):

- only the tenants seen in **both** windows count;
- each counted tenant **weighs** as many requests as it has in the smaller of the two windows, at most
  ``canary_tenant_cap``, and at most as many as the ``canary_min_tenants``-th busiest counted tenant (the least
  busy, while fewer count) (:func:`tenant_weights`);
- each measure is the weighted mean of the tenants' own shares, each tenant's share taken from all its requests
  of the window, with the same weights in both windows. The tests see each window as ``W² / Σ w²/n`` requests
  (``W`` the weights' sum, ``n`` each tenant's requests), with one pseudo-request at 0 and one at 1
  (:class:`Moments`);
- a trial on a whole replica also waits until ``canary_min_tenants`` of the tenants each side served in its
  baseline (all of them, when it served fewer) are back on that side.

- each tested measure (cold share, cached tokens, tokens from the plan) leaves out, once :data:`TRIM_FROM` tenants
  have it in both windows, the tenant whose share moved most each way (:meth:`Comparison.trimmed`): the weights
  bound how much one tenant counts, this which way it can pull, so a verdict needs the change in many tenants.

The requests a comparison *counts* are the sum of its weights; every threshold on requests below is on them.

**The measures**, canary against the rest (one instance) or the canary replica's change against the others'
(a whole replica):

- **cold share** (requests with no prompt token from the KV cache): worse when it is more than
  ``canary_cold_margin`` above *and* a one-sided z-test (:func:`greater`, :func:`rise_greater`) puts the
  difference below ``canary_alpha``;
- **prompt tokens from cache** (each tenant's cached share of its prompt tokens): worse when it is more than
  ``canary_cached_margin`` below; the same test on each request's uncached share of its prompt below
  ``canary_alpha`` makes it worse before the window ends;
- **prompt tokens from the plan** (the cached tokens from blocks the instance's plan pins, which ``lora_adapter``
  logs as ``planned_tokens``): worse, at once, when more than ``canary_cached_margin`` below with the same test on
  each request's share not from the plan below ``canary_alpha``;
- **TTFT p99** (of each counted tenant's first requests, as many as it weighs, without the tenant that holds
  most of the window's slowest 1% when the window has others: :func:`p99_ms`): worse when above
  ``canary_ttft_ratio`` times the rest's (on a whole replica: when the canary replica's ratio to its baseline is,
  to the others' ratio to theirs), once each window counts :data:`MIN_P99_REQUESTS`.

Nothing is judged before each side counts ``canary_min_requests``; on a whole replica the early tests start when
the canary replica counts them and the others one; promotion still needs them on each side. A plan whose cold
share, cached tokens or tokens from the plan are worse with the tests' confidence is rolled back at once, inside
the window; when ``canary_window_s`` has passed, a plan worse by cold share, cached tokens (one instance: the
margin alone) or TTFT p99 is rolled back and one no worse is promoted. A trial that never counts enough requests
is rolled back after three windows, saying so. A verdict's reason names no plan and no tenant (it is in
``/status``); the tenants that carried it are in the sidecar's log line (:func:`carried`).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Any, Callable

from warmup_tools.common.records import RequestRecord
from warmup_tools.sidecar.config import SidecarConfig

#: A TTFT p99 is compared only once each window counts this many requests (of fewer, the p99 is the maximum).
MIN_P99_REQUESTS = 100
#: TTFT samples kept per window, all tenants together (the counts go on).
MAX_SAMPLES = 100_000
#: Tenants one window keeps; the requests of tenants beyond them are left out (and counted).
MAX_TENANTS = 10_000
#: From this many tenants with a measure in both windows, the measure leaves out the tenant that moved most each
#: way (:meth:`Comparison.trimmed`): no one tenant decides a verdict. Fewer leave nobody out.
TRIM_FROM = 3


@dataclasses.dataclass(slots=True)
class Values:
    """A per-request measure in [0, 1] over one tenant's requests of a window: how many, their sum and the sum of
    their squares."""

    n: int = 0
    total: float = 0.0
    squares: float = 0.0

    def add(self, value: float) -> None:
        self.n += 1
        self.total += value
        self.squares += value * value

    @property
    def mean(self) -> float:
        return self.total / self.n if self.n else 0.0


@dataclasses.dataclass(slots=True)
class TenantWindow:
    """One tenant's requests of a window."""

    #: 1 for each request with no prompt token from the cache, 0 for the others.
    cold: Values = dataclasses.field(default_factory=Values)
    #: Each request's share of its prompt tokens not from the cache (requests with a prompt).
    uncached: Values = dataclasses.field(default_factory=Values)
    #: Each request's share of its prompt tokens not from the plan's pinned blocks (requests whose log says).
    unplanned: Values = dataclasses.field(default_factory=Values)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    planned_prompt_tokens: int = 0
    planned_tokens: int = 0
    #: TTFT of the tenant's first requests (up to the window's ``tenant_cap``).
    ttft_ms: list[float] = dataclasses.field(default_factory=list)

    @property
    def requests(self) -> int:
        return self.cold.n

    @property
    def cold_share(self) -> float:
        return self.cold.mean

    @property
    def cached_share(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None

    @property
    def planned_share(self) -> float | None:
        return self.planned_tokens / self.planned_prompt_tokens if self.planned_prompt_tokens else None


@dataclasses.dataclass(slots=True)
class WindowStats:
    """What one side served in one window (since the trial's plan was applied, or in its baseline), per tenant.

    ``tenant_cap``: the TTFT samples kept of each tenant (the most a tenant can weigh: ``canary_tenant_cap``)."""

    tenant_cap: int = 100_000
    tenants: dict[str, TenantWindow] = dataclasses.field(default_factory=dict)
    #: Requests of tenants beyond :data:`MAX_TENANTS`.
    left_out: int = 0
    samples: int = 0

    def add(self, record: RequestRecord) -> None:
        window = self.tenants.get(record.tenant)
        if window is None:
            if len(self.tenants) >= MAX_TENANTS:
                self.left_out += 1
                return
            window = self.tenants[record.tenant] = TenantWindow()
        cached = record.cached_tokens or 0
        prompt = record.prompt_tokens or 0
        window.cold.add(float(cached == 0))
        window.prompt_tokens += prompt
        window.cached_tokens += cached
        if prompt > 0:
            window.uncached.add(1.0 - min(cached, prompt) / prompt)
        if prompt > 0 and record.planned_tokens is not None:
            planned = min(record.planned_tokens, prompt)
            window.planned_prompt_tokens += prompt
            window.planned_tokens += planned
            window.unplanned.add(1.0 - planned / prompt)
        if record.ttft_ms is not None and len(window.ttft_ms) < self.tenant_cap and self.samples < MAX_SAMPLES:
            window.ttft_ms.append(record.ttft_ms)
            self.samples += 1

    # -------------------------------------------------------------------- every request, for /status
    @property
    def requests(self) -> int:
        return sum(t.requests for t in self.tenants.values())

    @property
    def cold(self) -> int:
        return round(sum(t.cold.total for t in self.tenants.values()))

    @property
    def cold_share(self) -> float:
        requests = self.requests
        return self.cold / requests if requests else 0.0

    @property
    def cached_share(self) -> float:
        prompt = sum(t.prompt_tokens for t in self.tenants.values())
        return sum(t.cached_tokens for t in self.tenants.values()) / prompt if prompt else 0.0

    @property
    def planned_share(self) -> float | None:
        """The share of prompt tokens served from the plan's pinned blocks (None: the logs do not say)."""
        prompt = sum(t.planned_prompt_tokens for t in self.tenants.values())
        return sum(t.planned_tokens for t in self.tenants.values()) / prompt if prompt else None

    def summary(self) -> dict[str, Any]:
        """Every request of the window (no tenant named): what ``/status`` shows of it."""
        planned = self.planned_share
        samples = [ms for t in self.tenants.values() for ms in t.ttft_ms]
        p99 = _p99(sorted(samples)) if samples else None
        return {"requests": self.requests, "tenants": len(self.tenants), "left_out": self.left_out,
                "cold_share": round(self.cold_share, 4), "cached_share": round(self.cached_share, 4),
                "planned_share": None if planned is None else round(planned, 4),
                "ttft_p99_ms": None if p99 is None else round(p99, 2)}


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    #: ``wait``, ``promote`` or ``rollback``.
    action: str
    reason: str


def tenant_weights(a: WindowStats, b: WindowStats, settings: SidecarConfig) -> dict[str, int]:
    """The tenants two windows are compared on (those seen in both), each with the requests it counts for: its
    requests in the smaller window, at most ``canary_tenant_cap`` and at most the ``canary_min_tenants``-th
    largest such count (the smallest, when fewer tenants count)."""
    both = {t: min(a.tenants[t].requests, b.tenants[t].requests) for t in sorted(a.tenants.keys() & b.tenants.keys())}
    if not both:
        return {}
    ranked = sorted(both.values(), reverse=True)
    limit = min(settings.canary_tenant_cap, ranked[min(settings.canary_min_tenants, len(ranked)) - 1])
    return {t: min(n, limit) for t, n in both.items()}


@dataclasses.dataclass(frozen=True, slots=True)
class Comparison:
    """Two windows compared tenant by tenant: ``a`` (the canary side, or a side's trial) against ``b`` (the rest,
    or the side's baseline), on the tenants of ``weights`` (:func:`tenant_weights`)."""

    a: WindowStats
    b: WindowStats
    weights: dict[str, int]

    @classmethod
    def of(cls, a: WindowStats, b: WindowStats, settings: SidecarConfig) -> Comparison:
        return cls(a, b, tenant_weights(a, b, settings))

    @property
    def counted(self) -> int:
        """The requests the comparison counts (in each of its windows): the sum of the weights."""
        return sum(self.weights.values())

    def trimmed(self, share: Callable[[TenantWindow], float | None]) -> Comparison:
        """The comparison without its two most extreme tenants by a per-tenant share: the one whose share rose most
        from ``b`` to ``a`` and the one whose share fell most (ties: by name), once :data:`TRIM_FROM` tenants have
        the share in both windows; before that, the comparison itself."""
        # NOTE: the weights cap a flood, not a direction: a tenant of a tenth of the weight that turns all cold moves
        # a share by ten points, past every margin, and the tests count its requests as evidence. Left out at each
        # end, one tenant that pulls either way is the one left out, or it lies between two tenants that are not
        # and moves the measure no further than they do. Both ends, whatever the measure's direction: one end
        # alone would let a tenant at the other end roll back a good plan, or hide a bad one (docs/planner.md).
        moved = sorted((x - y, tenant) for tenant in self.weights
                       if (x := share(self.a.tenants[tenant])) is not None
                       and (y := share(self.b.tenants[tenant])) is not None)
        if len(moved) < TRIM_FROM:
            return self
        out = {moved[0][1], moved[-1][1]}
        return Comparison(self.a, self.b, {t: w for t, w in self.weights.items() if t not in out})

    def shares(self, share: Callable[[TenantWindow], float | None]) -> tuple[float, float] | None:
        """Each window's weighted mean of a per-tenant share, over the tenants whose share is known in both
        windows (None when there is no such tenant)."""
        total, mean_a, mean_b = 0, 0.0, 0.0
        for tenant, weight in self.weights.items():
            x, y = share(self.a.tenants[tenant]), share(self.b.tenants[tenant])
            if x is not None and y is not None:
                total += weight
                mean_a += weight * x
                mean_b += weight * y
        return (mean_a / total, mean_b / total) if total else None

    def moments(self, measure: Callable[[TenantWindow], Values]) -> tuple[Moments, Moments]:
        """Each window's :class:`Moments` of a per-request measure, over the tenants with requests of it in
        both windows."""
        a, b = [], []
        for tenant, weight in self.weights.items():
            x, y = measure(self.a.tenants[tenant]), measure(self.b.tenants[tenant])
            if x.n and y.n:
                a.append((weight, x))
                b.append((weight, y))
        return Moments.of_tenants(a), Moments.of_tenants(b)

    def p99_ms(self) -> tuple[float | None, float | None]:
        """Each window's TTFT p99 over every counted tenant's first requests, as many as it weighs
        (:func:`p99_ms`)."""
        return (p99_ms({t: self.a.tenants[t].ttft_ms[:w] for t, w in self.weights.items()}),
                p99_ms({t: self.b.tenants[t].ttft_ms[:w] for t, w in self.weights.items()}))


@dataclasses.dataclass(frozen=True, slots=True)
class Moments:
    """A per-request measure in [0, 1] on one window: its mean, the variance of one request's value, and the
    requests it stands for (``n``, the two pseudo-requests included), each estimated with one pseudo-request at 0
    and one at 1 added (Agresti and Caffo's
    adjustment for a difference of proportions: a window of five requests all cold, or all alike, would
    otherwise have no variance, and the z-test a p-value of 1e-18). A window with no request stays empty
    (``n`` 0)."""

    mean: float
    var: float
    n: float

    @classmethod
    def of_tenants(cls, parts: list[tuple[int, Values]]) -> Moments:
        """The weighted mean of the tenants' means (``parts``: each tenant's weight and values). It stands for
        ``W² / Σ w²/n`` requests, the effective number of a weighted mean (all of them for one tenant), and the
        pseudo-requests; the
        variance is of the values about the mean, within and between tenants (the between part makes it larger
        than the tenants' own: the test errs on the side of no verdict)."""
        total = sum(weight for weight, values in parts if values.n)
        if not total:
            return cls(0.0, 0.0, 0)
        mean = sum(weight * values.mean for weight, values in parts if values.n) / total
        squares = sum(weight * values.squares / values.n for weight, values in parts if values.n) / total
        n = total * total / sum(weight * weight / values.n for weight, values in parts if values.n)
        padded = (n * mean + 1.0) / (n + 2.0)
        spread = squares - 2.0 * padded * mean + padded * padded  # the mean square about the padded mean
        return cls(padded, (n * spread + padded * padded + (1.0 - padded) ** 2) / (n + 1.0), n + 2.0)

    @classmethod
    def of(cls, values: list[float]) -> Moments:
        """One tenant's requests (``values``: each request's measure)."""
        one = Values()
        for value in values:
            one.add(value)
        return cls.of_tenants([(len(values), one)])

    @classmethod
    def share(cls, hits: int, n: int) -> Moments:
        """One tenant's ``n`` requests of which ``hits`` count (cold, say)."""
        return cls.of([1.0] * hits + [0.0] * (n - hits))


def greater(canary: Moments, rest: Moments) -> float:
    """One-sided z-test: the probability, with the plan making no difference, of the canary's measure being this
    much above the rest's (1.0 when either window is empty)."""
    return _upper_tail(canary.mean - rest.mean, (canary, rest))


def rise_greater(canary: Moments, canary_before: Moments, rest: Moments, rest_before: Moments) -> float:
    """One-sided z-test on a difference of differences: the probability, with the plan making no difference,
    of the canary's measure rising this much more than the rest's since before the trial (each side's own
    baseline takes out the traffic mix the router gives it)."""
    rise = (canary.mean - canary_before.mean) - (rest.mean - rest_before.mean)
    return _upper_tail(rise, (canary, canary_before, rest, rest_before))


def _upper_tail(difference: float, parts: tuple[Moments, ...]) -> float:
    if any(m.n == 0 for m in parts):
        return 1.0
    # NOTE: never 0: the pseudo-requests at 0 and 1 give every window with a request a variance of 0.5 / (n + 1)
    # at least
    var = sum(m.var / m.n for m in parts)
    return 0.5 * math.erfc(difference / math.sqrt(2.0 * var))


def p99_ms(samples: dict[str, list[float]]) -> float | None:
    """The p99 of the samples (per tenant), without the tenant with the most samples among the slowest 1% (ties:
    the first by name) when others have samples: no tenant's slow requests alone set it."""
    ranked = sorted((ms, tenant) for tenant, values in samples.items() for ms in values)
    if not ranked:
        return None
    if len({tenant for _, tenant in ranked}) > 1:
        slowest = Counter(tenant for _, tenant in ranked[_rank(len(ranked)):])
        worst = min(slowest, key=lambda tenant: (-slowest[tenant], tenant))
        ranked = [(ms, tenant) for ms, tenant in ranked if tenant != worst]
    return _p99([ms for ms, _ in ranked])


def _rank(n: int) -> int:
    """The index of the p99 among ``n`` sorted values."""
    return math.ceil(0.99 * n) - 1


def _p99(ordered: list[float]) -> float:
    return ordered[_rank(len(ordered))]


def _cold(t: TenantWindow) -> Values:
    return t.cold


def _uncached(t: TenantWindow) -> Values:
    return t.uncached


def _unplanned(t: TenantWindow) -> Values:
    return t.unplanned


def _cold_share(t: TenantWindow) -> float:
    return t.cold_share


def _cached_share(t: TenantWindow) -> float | None:
    return t.cached_share


def _planned_share(t: TenantWindow) -> float | None:
    return t.planned_share


#: The tested measures: their name in the evidence, the per-request measure the test is on, and the per-tenant
#: share each is trimmed by (:meth:`Comparison.trimmed`) and held to its margin on.
TESTS: tuple[tuple[str, Callable[[TenantWindow], Values], Callable[[TenantWindow], float | None]], ...] = (
    ("cold", _cold, _cold_share), ("uncached", _uncached, _cached_share), ("unplanned", _unplanned, _planned_share))


def evidence(canary: WindowStats, rest: WindowStats, settings: SidecarConfig) -> dict[str, float]:
    """The one-sided tests' p-values so far (what an early rollback needs below ``canary_alpha``): cold share,
    per-request uncached share, per-request share not from the plan's pinned blocks."""
    both = Comparison.of(canary, rest, settings)
    return {f"{name}_p": round(greater(*both.trimmed(share).moments(measure)), 5) for name, measure, share in TESTS}


def replica_evidence(canary: WindowStats, rest: WindowStats, before: tuple[WindowStats, WindowStats],
                     settings: SidecarConfig) -> dict[str, float]:
    """:func:`evidence` for a trial on a whole replica: the difference-of-differences tests' p-values."""
    mine, theirs = Comparison.of(canary, before[0], settings), Comparison.of(rest, before[1], settings)
    out = {}
    for name, measure, share in TESTS:
        (c, c0), (r, r0) = mine.trimmed(share).moments(measure), theirs.trimmed(share).moments(measure)
        out[f"{name}_p"] = round(rise_greater(c, c0, r, r0), 5)
    return out


def judge(canary: WindowStats, rest: WindowStats, elapsed_s: float, settings: SidecarConfig) -> Verdict:
    """The verdict on a trial on one instance ``elapsed_s`` after its plan was applied (the module docstring)."""
    both = Comparison.of(canary, rest, settings)
    need = settings.canary_min_requests
    waiting = _waiting([("the canary and the others", both.counted, need, len(both.weights), 1)], elapsed_s,
                       settings)
    if waiting is not None:
        return waiting
    worse = []
    trimmed = {name: both.trimmed(share) for name, _, share in TESTS}
    cold = trimmed["cold"].shares(_cold_share)
    assert cold is not None  # every counted tenant has requests in both windows
    if cold[0] - cold[1] > settings.canary_cold_margin:
        p = greater(*trimmed["cold"].moments(_cold))
        if p < settings.canary_alpha:
            worse.append(f"cold share {cold[0]:.1%} against {cold[1]:.1%} (p={p:.3g})")
    cached = trimmed["uncached"].shares(_cached_share)
    cached_down = cached is not None and cached[1] - cached[0] > settings.canary_cached_margin
    if cached is not None and cached_down:
        p = greater(*trimmed["uncached"].moments(_uncached))
        if p < settings.canary_alpha:
            worse.append(f"prompt tokens from cache {cached[0]:.1%} against {cached[1]:.1%} "
                         f"(per-request uncached shares higher, p={p:.3g})")
    planned = trimmed["unplanned"].shares(_planned_share)
    if planned is not None and planned[1] - planned[0] > settings.canary_cached_margin:
        p = greater(*trimmed["unplanned"].moments(_unplanned))
        if p < settings.canary_alpha:
            worse.append(f"prompt tokens from the plan's pinned blocks {planned[0]:.1%} against {planned[1]:.1%} "
                         f"(per-request shares lower, p={p:.3g})")
    if worse:
        return Verdict("rollback", "worse than the plan served now: " + "; ".join(worse))
    if elapsed_s < settings.canary_window_s:
        # NOTE: only the tested measures end a trial early; untested, a few cold requests move them a lot.
        return Verdict("wait", f"no worse so far ({elapsed_s:.0f} of {settings.canary_window_s:g} s)")
    if cached is not None and cached_down:
        worse.append(f"prompt tokens from cache {cached[0]:.1%} against {cached[1]:.1%}")
    if both.counted >= MIN_P99_REQUESTS:
        mine, theirs = both.p99_ms()
        if mine is not None and theirs is not None and mine > settings.canary_ttft_ratio * theirs:
            worse.append(f"TTFT p99 {mine:.1f} ms against {theirs:.1f} ms")
    if worse:
        return Verdict("rollback", "worse than the plan served now: " + "; ".join(worse))
    return Verdict("promote", f"no worse after {elapsed_s:.0f} s: cold share {cold[0]:.1%} against {cold[1]:.1%} "
                              f"({both.counted} requests of {len(both.weights)} tenants counted a side)")


def judge_replica(canary: WindowStats, rest: WindowStats, before: tuple[WindowStats, WindowStats],
                  elapsed_s: float, settings: SidecarConfig) -> Verdict:
    """The verdict on a trial on a whole replica: as :func:`judge`, but each measure is the canary replica's
    change since before the trial less the other replicas' change over the same time (``before``: each side's
    last ``canary_window_s`` before the trial started), so that a replica the router gives colder tenants is
    not taken for a worse plan (the module docstring)."""
    # NOTE: the early tests need canary_min_requests on the canary replica but one request of the others: their
    # requests since the trial began only estimate the fleet's drift, and how little that estimate knows is in
    # the test's variance (with the pseudo-requests, a window of one request has a variance near its largest
    # and a mean pulled toward one half). Under no difference the rate of p < alpha per look stays below alpha
    # however few requests the others have (tests/unit/sidecar/canary/test_controller.py), so waiting for their fifth
    # request bought no safety and delayed the rollback of a bad plan by minutes at low traffic. Promotion still
    # needs canary_min_requests on each side.
    mine, theirs = Comparison.of(canary, before[0], settings), Comparison.of(rest, before[1], settings)
    need = settings.canary_min_requests
    tenants = [min(settings.canary_min_tenants, len(side.tenants)) for side in before]

    def sides(rest_need: int) -> list[tuple[str, int, int, int, int]]:
        return [("the canary replica", mine.counted, need, len(mine.weights), tenants[0]),
                ("the others", theirs.counted, rest_need, len(theirs.weights), tenants[1])]

    waiting = _waiting(sides(1), elapsed_s, settings)
    if waiting is not None:
        return waiting

    def moved(name: str, share: Callable[[TenantWindow], float | None]) -> tuple[float, str, float] | None:
        """The difference of differences of a per-tenant share, its words and the canary's own change (None: a
        side does not say), each side without its two most extreme tenants (:meth:`Comparison.trimmed`)."""
        ours, others = mine.trimmed(share).shares(share), theirs.trimmed(share).shares(share)
        if ours is None or others is None:
            return None
        (c, c0), (r, r0) = ours, others
        return ((c - c0) - (r - r0), f"{name} {c0:.1%} -> {c:.1%} on {mine.counted} requests of the canary "
                                     f"replica, {r0:.1%} -> {r:.1%} on {theirs.counted} of the others", c - c0)

    def tested(measure: Callable[[TenantWindow], Values], share: Callable[[TenantWindow], float | None],
               words: str) -> None:
        """Worse, when the test on the per-request measure (on the tenants ``share`` keeps) falls below
        ``canary_alpha``."""
        (c, c0), (r, r0) = mine.trimmed(share).moments(measure), theirs.trimmed(share).moments(measure)
        p = rise_greater(c, c0, r, r0)
        if p < settings.canary_alpha:
            worse.append(f"{words} (p={p:.3g})")

    worse = []
    cold = moved("cold share", _cold_share)
    assert cold is not None  # every counted tenant has requests in both windows
    cached = moved("prompt tokens from cache", _cached_share)
    planned = moved("prompt tokens from the plan's pinned blocks", _planned_share)
    # Worse: the cold share rising more than the others', the shares from cache and from the plan falling more.
    if cold[0] > settings.canary_cold_margin:
        tested(_cold, _cold_share, cold[1])
    if cached is not None and -cached[0] > settings.canary_cached_margin:
        tested(_uncached, _cached_share, cached[1])
    if planned is not None and -planned[0] > settings.canary_cached_margin:
        tested(_unplanned, _planned_share, planned[1])
    if worse:
        return Verdict("rollback", "worse than the plan served now: " + "; ".join(worse))
    if elapsed_s < settings.canary_window_s:
        return Verdict("wait", f"no worse so far ({elapsed_s:.0f} of {settings.canary_window_s:g} s)")
    waiting = _waiting(sides(need), elapsed_s, settings)
    if waiting is not None:
        return waiting
    # NOTE: no untested cached-token margin here, unlike judge(): a difference of differences of four windows of
    # a few dozen requests moves by more than the margin by chance (the others' baseline alone, an unlucky cold
    # window that comes back, rolled back a re-plan under which the canary replica had not moved); the tests above
    # already judged the whole window.
    # NOTE: but a canary that itself got worse than its baseline by more than a margin, and by more than the others
    # did, is not promoted on a test too weak to say so yet (six requests, cold 0% -> 50%, were promoted so): it
    # is judged on more requests, and rolled back if it still looks worse when the time is up. The others'
    # swing alone (the case above) does not hold a plan back.
    beyond = [m[1] for m, sign, margin in ((cold, 1, settings.canary_cold_margin),
                                           (cached, -1, settings.canary_cached_margin),
                                           (planned, -1, settings.canary_cached_margin))
              if m is not None and sign * m[0] > margin and sign * m[2] > margin]
    if beyond:
        if elapsed_s < 3 * settings.canary_window_s:
            return Verdict("wait", "worse by more than its margin, not yet by its test; judged on more requests: "
                                   + "; ".join(beyond))
        return Verdict("rollback", f"still worse by more than its margin after {elapsed_s:.0f} s: "
                                   + "; ".join(beyond))
    if min(mine.counted, theirs.counted) >= MIN_P99_REQUESTS:
        (c, c0), (r, r0) = mine.p99_ms(), theirs.p99_ms()
        if all(x is not None and x > 0 for x in (c, c0, r, r0)):
            if c / c0 > settings.canary_ttft_ratio * (r / r0):  # type: ignore[operator]
                return Verdict("rollback", f"worse than the plan served now: TTFT p99 {c0:.1f} -> {c:.1f} ms on the "
                                           f"canary replica, {r0:.1f} -> {r:.1f} ms on the others")
    return Verdict("promote", f"no worse after {elapsed_s:.0f} s: {cold[1]}"
                              + (f"; {cached[1]}" if cached is not None else ""))


def _waiting(sides: list[tuple[str, int, int, int, int]], elapsed_s: float, settings: SidecarConfig
             ) -> Verdict | None:
    """The verdict while a side counts too little: ``sides`` are (name, requests counted, requests needed, tenants
    counted, tenants needed); None when each has enough."""
    short = [f"{counted} requests of {tenants} tenants on {name} ({need} and {need_tenants} needed)"
             for name, counted, need, tenants, need_tenants in sides if counted < need or tenants < need_tenants]
    if not short:
        return None
    if elapsed_s >= 3 * settings.canary_window_s:
        return Verdict("rollback", f"too little traffic to judge in {elapsed_s:.0f} s: " + "; ".join(short))
    return Verdict("wait", "counted so far: " + "; ".join(short))


def carried(*weights: dict[str, int], shown: int = 10) -> str:
    """Which tenants a verdict counted and for how many requests, most first (for the sidecar's log, never
    ``/status``: tenant names are the operator's)."""
    counts: dict[str, int] = {}
    for one in weights:
        for tenant, n in one.items():
            counts[tenant] = counts.get(tenant, 0) + n
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    more = f" and {len(ranked) - shown} more" if len(ranked) > shown else ""
    return ", ".join(f"{t} {n}" for t, n in ranked[:shown]) + more if ranked else "none"
