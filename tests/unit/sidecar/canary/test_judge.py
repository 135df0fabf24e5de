"""The canary judge to the letter: what a window keeps, the bounds of each margin and test, the exact reasons
and summaries an operator reads (warmup_tools/sidecar/canary/judge.py)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from tests.unit.sidecar.canary.test_controller import SETTINGS
from warmup_tools.common.records import RequestRecord
from warmup_tools.sidecar.canary import judge as canary_judge
from warmup_tools.sidecar.canary.judge import (
    MIN_P99_REQUESTS,
    Comparison,
    Moments,
    WindowStats,
    carried,
    evidence,
    greater,
    judge,
    judge_replica,
    p99_ms,
    replica_evidence,
    rise_greater,
)

#: The canary's p-value as a reason prints it.
P = r"p=[0-9.e+-]+"


def requests(n, *, cold=0, tenant="acme", prompt=100, cached=80, planned=None, ttft=10.0):
    """``n`` requests of ``tenant``, the first ``cold`` of them cold."""
    stats = WindowStats()
    add(stats, n, cold=cold, tenant=tenant, prompt=prompt, cached=cached, planned=planned, ttft=ttft)
    return stats


def add(stats, n, *, cold=0, tenant="acme", prompt=100, cached=80, planned=None, ttft=10.0):
    for i in range(n):
        stats.add(RequestRecord(ts=float(i), tenant=tenant, prompt_tokens=prompt,
                                cached_tokens=0 if i < cold else cached, planned_tokens=planned, ttft_ms=ttft))
    return stats


def spread(field, mean):
    """40 requests whose tokens from cache (or from the plan) are ``mean`` - 10 and ``mean`` + 10 of 100, by turns:
    a share exactly ``mean`` %, and per-request values that vary (the test is sure, its p-value above 0)."""
    return add(requests(20, **{field: mean - 10}), 20, **{field: mean + 10})


# ---------------------------------------------------------------------------------------- what a window keeps
def test_a_window_keeps_each_request_s_measures_per_tenant():
    stats = WindowStats()
    for prompt, cached, planned, ttft in ((4, 1, 3, 5.0),  # 3/4 uncached, 1/4 not from the plan
                                          (None, None, None, None),  # nothing known: cold
                                          (0, 0, 5, None),  # no prompt: cold, nothing else
                                          (1, 1, 0, None),  # all cached, none from the plan
                                          (2, 2, 9, None)):  # more planned tokens than the prompt: all of it
        stats.add(RequestRecord(ts=0.0, tenant="a", prompt_tokens=prompt, cached_tokens=cached,
                                planned_tokens=planned, ttft_ms=ttft))
    a = stats.tenants["a"]
    assert (a.cold.n, a.cold.total, a.cold.squares) == (5, 2.0, 2.0) and a.requests == 5 and a.cold_share == 0.4
    assert (a.uncached.n, a.uncached.total, a.uncached.squares) == (3, 0.75, 0.5625)
    assert (a.unplanned.n, a.unplanned.total, a.unplanned.squares) == (3, 1.25, 1.0625)
    assert (a.prompt_tokens, a.cached_tokens, a.planned_prompt_tokens, a.planned_tokens) == (7, 4, 7, 5)
    assert a.cached_share == 4 / 7 and a.planned_share == 5 / 7 and a.ttft_ms == [5.0]
    empty = canary_judge.TenantWindow()
    assert empty.cached_share is None and empty.planned_share is None and empty.cold.mean == 0.0


def test_a_window_keeps_a_bounded_number_of_tenants_and_ttft_samples(monkeypatch):
    monkeypatch.setattr(canary_judge, "MAX_TENANTS", 2)
    monkeypatch.setattr(canary_judge, "MAX_SAMPLES", 5)
    stats = WindowStats(tenant_cap=3)
    for tenant in ("a", "b", "c", "d"):
        add(stats, 4, tenant=tenant, ttft=1.0)
    assert list(stats.tenants) == ["a", "b"] and stats.left_out == 8  # c and d: beyond MAX_TENANTS
    # Three samples of a (its tenant_cap), two of b (MAX_SAMPLES in all); the counts go on.
    assert [len(stats.tenants[t].ttft_ms) for t in ("a", "b")] == [3, 2] and stats.samples == 5
    assert stats.requests == 8 and stats.tenants["b"].requests == 4


def test_a_window_s_summary_is_every_request_rounded():
    stats = WindowStats()
    for tenant, cached, planned, ttft in (("a", 0, None, 12.3456), ("a", 1, 1, 1.0), ("b", 2, 1, 2.0)):
        stats.add(RequestRecord(ts=0.0, tenant=tenant, prompt_tokens=3, cached_tokens=cached,
                                planned_tokens=planned, ttft_ms=ttft))
    assert stats.summary() == {"requests": 3, "tenants": 2, "left_out": 0, "cold_share": 0.3333,
                               "cached_share": 0.3333, "planned_share": 0.3333, "ttft_p99_ms": 12.35}
    assert WindowStats().summary() == {"requests": 0, "tenants": 0, "left_out": 0, "cold_share": 0.0,
                                       "cached_share": 0.0, "planned_share": None, "ttft_p99_ms": None}


def test_a_p99_is_the_ninety_ninth_percentile_not_the_maximum():
    assert p99_ms({"a": [float(v) for v in range(1, 201)]}) == 198.0
    assert p99_ms({"a": [7.0]}) == 7.0


def test_the_slowest_tenant_is_left_out_of_a_p99_even_with_only_one_other_tenant():
    # The slowest 1% of 200: b's 400 and z's two 500: z has most of them and goes, not b (first by name).
    samples = {"a": [10.0] * 196, "b": [400.0, 20.0], "z": [500.0, 500.0]}
    assert p99_ms(samples) == 20.0
    assert p99_ms({"a": [10.0] * 100, "slow": [900.0, 900.0]}) == 10.0


def test_the_log_names_the_tenants_most_first_then_by_name_and_how_many_more():
    assert carried({"z": 1, "a": 1}, {"z": 2}) == "z 3, a 1"
    assert carried({"z": 1, "a": 1}) == "a 1, z 1"
    ten = {f"t{i:02d}": 1 for i in range(10)}
    assert carried(ten) == ", ".join(f"t{i:02d} 1" for i in range(10))
    assert carried({**ten, "t10": 1, "t11": 1}) == ", ".join(f"t{i:02d} 1" for i in range(10)) + " and 2 more"
    assert carried() == "none" and carried({}) == "none"


# -------------------------------------------------------------------------------------------- the statistics
def test_a_comparison_uses_only_the_tenants_that_say_in_both_windows():
    a = add(requests(4, tenant="both"), 4, tenant="a-only-prompt", prompt=100, cached=50)
    b = add(requests(4, tenant="both", cached=60), 4, tenant="a-only-prompt", prompt=None, cached=None)
    both = Comparison.of(a, b, SETTINGS)
    assert both.weights == {"a-only-prompt": 4, "both": 4}
    # The second tenant's prompts are known in a only: its cached share and uncached values count in neither.
    assert both.shares(lambda t: t.cached_share) == (0.8, 0.6)
    mine, theirs = both.moments(lambda t: t.uncached)
    assert mine == Moments.of([0.2] * 4) and theirs == Moments.of([0.4] * 4)


def test_the_difference_of_differences_takes_out_the_others_change():
    up, flat = Moments.share(40, 100), Moments.share(10, 100)
    assert rise_greater(up, flat, up, flat) == 0.5  # both rose alike: no rise of the canary's own
    assert rise_greater(flat, flat, flat, up) < 1e-4  # the others fell back to the canary's level


def test_the_evidence_in_status_is_each_test_s_p_value_to_five_places():
    canary = requests(12, cold=5, cached=60, planned=30)
    rest = requests(12, cold=2, cached=70, planned=50)
    both = Comparison.of(canary, rest, SETTINGS)
    expected = {f"{name}_p": greater(*both.moments(measure)) for name, measure in (
        ("cold", lambda t: t.cold), ("uncached", lambda t: t.uncached), ("unplanned", lambda t: t.unplanned))}
    assert all(round(p, 5) != round(p, 6) for p in expected.values())
    assert evidence(canary, rest, SETTINGS) == {k: round(p, 5) for k, p in expected.items()}
    before = (requests(12, cold=1, cached=80, planned=60), requests(12, cold=3, cached=70, planned=50))
    mine, theirs = Comparison.of(canary, before[0], SETTINGS), Comparison.of(rest, before[1], SETTINGS)
    expected = {}
    for name, measure in (("cold", lambda t: t.cold), ("uncached", lambda t: t.uncached),
                          ("unplanned", lambda t: t.unplanned)):
        (c, c0), (r, r0) = mine.moments(measure), theirs.moments(measure)
        expected[f"{name}_p"] = rise_greater(c, c0, r, r0)
    assert all(round(p, 5) != round(p, 6) for p in expected.values())
    assert replica_evidence(canary, rest, before, SETTINGS) == {k: round(p, 5) for k, p in expected.items()}


# ------------------------------------------------------------------------------------- one instance's bounds
def test_a_cold_share_worse_by_less_than_its_margin_is_no_worse_however_sure_the_test():
    # 14% against 10% cold on 10,000 requests a side: the test is sure, the difference is below 5 points.
    canary, rest = requests(10_000, cold=1400), requests(10_000, cold=1000)
    assert greater(*Comparison.of(canary, rest, SETTINGS).moments(lambda t: t.cold)) < 1e-9
    assert judge(canary, rest, 30, SETTINGS).action == "wait"


@pytest.mark.parametrize("measure", ["cold", "cached", "planned"])
def test_each_margin_and_alpha_is_a_strict_bound(measure):
    # Exactly the margin worse, on windows large enough for the test to be sure: not worse. Then alpha exactly
    # the test's p-value, the margin passed: not worse either.
    if measure == "cold":
        canary, rest = requests(4000, cold=2000, cached=100), requests(4000, cold=1000, cached=100)
        bound = dataclasses.replace(SETTINGS, canary_cold_margin=0.25, canary_cached_margin=1.0)
        values = lambda t: t.cold  # noqa: E731
    elif measure == "cached":
        canary, rest = spread("cached", 50), spread("cached", 75)
        bound = dataclasses.replace(SETTINGS, canary_cached_margin=0.25)
        values = lambda t: t.uncached  # noqa: E731
    else:
        canary, rest = spread("planned", 50), spread("planned", 75)
        bound = dataclasses.replace(SETTINGS, canary_cached_margin=0.25)
        values = lambda t: t.unplanned  # noqa: E731
    assert judge(canary, rest, 30, bound).action == "wait"
    p = greater(*Comparison.of(canary, rest, SETTINGS).moments(values))
    loose = dataclasses.replace(bound, canary_cold_margin=0.0, canary_cached_margin=0.0, canary_alpha=p)
    assert judge(canary, rest, 30, loose).action == "wait"
    assert judge(canary, rest, 30, dataclasses.replace(loose, canary_alpha=min(1.0, 2 * p))).action == "rollback"


def test_fewer_cached_or_planned_tokens_by_less_than_the_margin_are_no_worse_however_sure_the_test():
    assert judge(requests(1000, cached=85), requests(1000, cached=90), 30, SETTINGS).action == "wait"
    assert judge(requests(1000, planned=85), requests(1000, planned=90), 30, SETTINGS).action == "wait"


def test_the_ttft_bound_is_strict_and_needs_samples_on_both_sides():
    n = MIN_P99_REQUESTS
    assert judge(requests(n, ttft=15.0), requests(n, ttft=10.0), 600, SETTINGS).action == "promote"
    assert judge(requests(n, ttft=10.0), requests(n, ttft=10.0), 600, SETTINGS).action == "promote"
    assert judge(requests(n, ttft=None), requests(n, ttft=10.0), 600, SETTINGS).action == "promote"
    assert judge(requests(n, ttft=10.0), requests(n, ttft=None), 600, SETTINGS).action == "promote"
    assert judge(requests(n, ttft=None), requests(n, ttft=None), 600, SETTINGS).action == "promote"


def test_one_instance_s_reasons_word_for_word():
    assert judge(requests(9), requests(50), 30, SETTINGS).reason == (
        "counted so far: 9 requests of 1 tenants on the canary and the others (10 and 1 needed)")
    assert judge(requests(20, cold=2), requests(20, cold=3), 30, SETTINGS).reason == "no worse so far (30 of 600 s)"
    assert judge(requests(20, cold=2), requests(20, cold=3), 600, SETTINGS).reason == (
        "no worse after 600 s: cold share 10.0% against 15.0% (20 requests of 1 tenants counted a side)")
    both_worse = judge(requests(12, cold=11, cached=40), requests(12, cold=2, cached=80), 30, SETTINGS).reason
    assert re.fullmatch(rf"worse than the plan served now: cold share 91\.7% against 16\.7% \({P}\); prompt "
                        rf"tokens from cache 3\.3% against 66\.7% \(per-request uncached shares higher, {P}\)",
                        both_worse), both_worse
    planned = judge(requests(12, planned=0), requests(12, planned=80), 30, SETTINGS).reason
    assert re.fullmatch(rf"worse than the plan served now: prompt tokens from the plan's pinned blocks 0\.0% "
                        rf"against 80\.0% \(per-request shares lower, {P}\)", planned), planned
    # At the end of the window, the cached-token margin alone.
    assert judge(requests(10, cold=3), requests(10, cold=1), 600, SETTINGS).reason == (
        "worse than the plan served now: prompt tokens from cache 56.0% against 72.0%")
    # 11 points fewer tokens from cache, by chance as far as the test can tell (p 0.04), and a slower p99.
    canary = add(requests(50, cached=89, ttft=40.0), 50, cached=1, ttft=40.0)
    rest = add(requests(50, cached=99), 50, cached=13)
    assert evidence(canary, rest, SETTINGS)["uncached_p"] > SETTINGS.canary_alpha
    assert judge(canary, rest, 600, SETTINGS).reason == (
        "worse than the plan served now: prompt tokens from cache 45.0% against 56.0%; TTFT p99 40.0 ms against "
        "10.0 ms")


# ------------------------------------------------------------------------------------- a whole replica's bounds
def test_a_replica_worse_by_less_than_the_margin_than_its_baseline_is_no_worse_however_sure_the_test():
    # 10% -> 14.5% cold on the canary replica, 10% -> 11% on the others: 3.5 points more, below the margin of
    # 5, on 10,000 requests a window (the test is sure); and the two changes together would pass it.
    before = (requests(10_000, cold=1000), requests(10_000, cold=1000))
    canary, rest = requests(10_000, cold=1450), requests(10_000, cold=1100)
    assert replica_evidence(canary, rest, before, SETTINGS)["cold_p"] < 1e-9
    assert judge_replica(canary, rest, before, 30, SETTINGS).action == "wait"
    # From cache, from the plan: 5 points fewer than before, the others steady.
    for field in ("cached", "planned"):
        before = (requests(1000, **{field: 90}), requests(1000, **{field: 90}))
        verdict = judge_replica(requests(1000, **{field: 85}), requests(1000, **{field: 90}), before, 30, SETTINGS)
        assert verdict.action == "wait", (field, verdict.reason)


@pytest.mark.parametrize("measure", ["cold", "cached", "planned"])
def test_each_replica_margin_and_alpha_is_a_strict_bound(measure):
    if measure == "cold":
        windows = [requests(4000, cold=k, cached=100) for k in (2000, 1000, 1000, 1000)]
        bound = dataclasses.replace(SETTINGS, canary_cold_margin=0.25, canary_cached_margin=1.0)
        values = lambda t: t.cold  # noqa: E731
    else:
        windows = [spread("cached" if measure == "cached" else "planned", k) for k in (50, 75, 75, 75)]
        bound = dataclasses.replace(SETTINGS, canary_cached_margin=0.25)
        values = (lambda t: t.uncached) if measure == "cached" else (lambda t: t.unplanned)
    canary, c0, rest, r0 = windows
    assert judge_replica(canary, rest, (c0, r0), 30, bound).action == "wait"
    (c, cb), (r, rb) = Comparison.of(canary, c0, SETTINGS).moments(values), Comparison.of(rest, r0, SETTINGS).moments(
        values)
    p = rise_greater(c, cb, r, rb)
    loose = dataclasses.replace(bound, canary_cold_margin=0.0, canary_cached_margin=0.0, canary_alpha=p)
    assert judge_replica(canary, rest, (c0, r0), 30, loose).action == "wait"
    doubled = dataclasses.replace(loose, canary_alpha=min(1.0, 2 * p))
    assert judge_replica(canary, rest, (c0, r0), 30, doubled).action == "rollback"


def test_a_replica_s_ttft_bound_is_strict_on_the_ratio_of_ratios():
    n = MIN_P99_REQUESTS

    def verdict(c, c0, r, r0):
        return judge_replica(requests(n, ttft=c), requests(n, ttft=r), (requests(n, ttft=c0), requests(n, ttft=r0)),
                             600, SETTINGS).action

    assert verdict(15.0, 10.0, 10.0, 10.0) == "promote"  # exactly canary_ttft_ratio
    assert verdict(20.0, 10.0, 20.0, 10.0) == "promote"  # both twice as slow: the traffic, not the plan
    assert verdict(1.5, 0.5, 0.5, 0.5) == "rollback"  # under a millisecond, still three times slower
    assert verdict(15.0, 0.0, 10.0, 10.0) == "promote"  # no ratio to a baseline of 0 ms
    assert verdict(None, 10.0, 10.0, 10.0) == "promote"  # no TTFT logged: nothing to compare


def test_a_whole_replica_s_reasons_word_for_word():
    before = (requests(40, cold=20), requests(40, cold=4))
    assert judge_replica(requests(4), WindowStats(), before, 30, SETTINGS).reason == (
        "counted so far: 4 requests of 1 tenants on the canary replica (10 and 1 needed); 0 requests of 0 tenants "
        "on the others (1 and 1 needed)")
    assert judge_replica(requests(4), WindowStats(), before, 1800, SETTINGS).reason == (
        "too little traffic to judge in 1800 s: 4 requests of 1 tenants on the canary replica (10 and 1 needed); "
        "0 requests of 0 tenants on the others (1 and 1 needed)")
    assert judge_replica(requests(40, cold=20), requests(40, cold=4), before, 30, SETTINGS).reason == (
        "no worse so far (30 of 600 s)")
    assert judge_replica(requests(40, cold=20), requests(40, cold=4), before, 600, SETTINGS).reason == (
        "no worse after 600 s: cold share 50.0% -> 50.0% on 40 requests of the canary replica, 10.0% -> 10.0% on "
        "40 of the others; prompt tokens from cache 40.0% -> 40.0% on 40 requests of the canary replica, "
        "72.0% -> 72.0% on 40 of the others")
    # Logs that do not say the prompt's tokens: cold share alone; on one side only, the same.
    unknown = (requests(40, cold=20, prompt=None), requests(40, cold=4, prompt=None))
    words = ("no worse after 600 s: cold share 50.0% -> 50.0% on 40 requests of the canary replica, 10.0% -> "
             "10.0% on 40 of the others")
    assert judge_replica(*unknown, unknown, 600, SETTINGS).reason == words
    assert judge_replica(requests(40, cold=20), unknown[1], (before[0], unknown[1]), 600, SETTINGS).reason == words
    worse = judge_replica(requests(40, cold=36, cached=20), requests(40, cold=4), before, 30, SETTINGS).reason
    assert re.fullmatch(rf"worse than the plan served now: cold share 50\.0% -> 90\.0% on 40 requests of the canary "
                        rf"replica, 10\.0% -> 10\.0% on 40 of the others \({P}\); prompt tokens from cache 40\.0% -> "
                        rf"2\.0% on 40 requests of the canary replica, 72\.0% -> 72\.0% on 40 of the others \({P}\)",
                        worse), worse
    slow = judge_replica(requests(100, ttft=40.0), requests(100, ttft=10.0),
                         (requests(100, ttft=10.0), requests(100, ttft=10.0)), 600, SETTINGS).reason
    assert slow == ("worse than the plan served now: TTFT p99 10.0 -> 40.0 ms on the canary replica, 10.0 -> 10.0 ms "
                    "on the others")


# ------------------------------------------------------------------------ no one tenant decides a verdict
def tenants(spec):
    """A window of ``spec``: each tenant's (requests, of them cold)."""
    stats = WindowStats()
    for tenant, (n, cold) in spec.items():
        add(stats, n, cold=cold, tenant=tenant)
    return stats


def fleet(honest, *, worse, adversary=None):
    """A trial on a whole replica: ``honest`` tenants on each side (their requests), 10 to 30% cold in both
    baselines; a worse plan turns half of each canary tenant's requests more cold. ``adversary``: (its requests,
    its side, the way it pulls): it goes from all warm to all cold to pull toward a rollback, the other way
    round to pull toward a promotion, on whichever side that takes."""
    base = [(n, n * (i % 3 + 1) // 10) for i, n in enumerate(honest)]
    c0 = {f"c{i}": spec for i, spec in enumerate(base)}
    r0 = {f"r{i}": spec for i, spec in enumerate(base)}
    c = {t: (n, min(n, cold + (n // 2 if worse else 0))) for t, (n, cold) in c0.items()}
    r = dict(r0)
    if adversary is not None:
        n, where, pull = adversary
        rises = (pull == "rollback") == (where == "canary")
        before, during = ((n, 0), (n, n)) if rises else ((n, n), (n, 0))
        baseline, trial = (c0, c) if where == "canary" else (r0, r)
        baseline["adversary"], trial["adversary"] = before, during
    return tenants(c), tenants(r), (tenants(c0), tenants(r0))


#: (honest tenants' requests on each side, the adversary's requests, the share of its side's weight it carries).
#: A third is the most one tenant weighs among three; among six or ten, the most the third-busiest bound lets it.
ONE_AGAINST_MANY = [([20, 20], 20, 1 / 3), ([50] * 5, 28, 1 / 10), ([20, 20, 6, 6, 6], 20, 0.26),
                    ([60] * 9, 60, 1 / 10), ([60, 60] + [4] * 7, 60, 0.29)]


@pytest.mark.parametrize("honest,requests,weight", ONE_AGAINST_MANY,
                         ids=[f"{len(h) + 1}-tenants-weight-{w:.2f}" for h, _, w in ONE_AGAINST_MANY])
@pytest.mark.parametrize("where", ["canary", "rest"])
def test_one_tenant_cannot_roll_back_a_good_plan_on_a_whole_replica(honest, requests, weight, where):
    settings = dataclasses.replace(SETTINGS, canary_min_requests=5)
    canary, rest, before = fleet(honest, worse=False, adversary=(requests, where, "rollback"))
    side = (canary, before[0]) if where == "canary" else (rest, before[1])
    weights = canary_judge.tenant_weights(*side, settings)
    assert weights["adversary"] / sum(weights.values()) == pytest.approx(weight, abs=0.01)
    assert judge_replica(canary, rest, before, 30, settings).action == "wait"
    verdict = judge_replica(canary, rest, before, 600, settings)
    assert verdict.action == "promote", verdict.reason
    assert judge_replica(*fleet(honest, worse=False), 600, settings).action == "promote"  # the same without it


@pytest.mark.parametrize("honest,requests,weight", ONE_AGAINST_MANY,
                         ids=[f"{len(h) + 1}-tenants-weight-{w:.2f}" for h, _, w in ONE_AGAINST_MANY])
@pytest.mark.parametrize("where", ["canary", "rest"])
def test_one_tenant_cannot_get_a_bad_plan_promoted_on_a_whole_replica(honest, requests, weight, where):
    settings = dataclasses.replace(SETTINGS, canary_min_requests=5)
    canary, rest, before = fleet(honest, worse=True, adversary=(requests, where, "promote"))
    for elapsed in (30, 600):
        verdict = judge_replica(canary, rest, before, elapsed, settings)
        assert verdict.action == "rollback" and "cold share" in verdict.reason, (elapsed, verdict.reason)
    assert judge_replica(*fleet(honest, worse=True), 30, settings).action == "rollback"  # the same without it


def test_without_leaving_a_tenant_out_each_way_one_tenant_flips_the_verdicts_above(monkeypatch):
    # The attack the tests above defeat (issue 41): weights bound a flood, not the way a tenant pulls.
    settings = dataclasses.replace(SETTINGS, canary_min_requests=5)
    monkeypatch.setattr(canary_judge, "TRIM_FROM", 10**9)
    flipped = []
    for honest, requests, weight in ONE_AGAINST_MANY:
        for where in ("canary", "rest"):
            good = judge_replica(*fleet(honest, worse=False, adversary=(requests, where, "rollback")), 600, settings)
            bad = judge_replica(*fleet(honest, worse=True, adversary=(requests, where, "promote")), 600, settings)
            flipped.append((len(honest) + 1, round(weight, 2), where, good.action, bad.action))
    # NOTE: where a pull toward promotion now waits, it is the rule that a canary worse than its own baseline by
    # more than a margin is not promoted at the window's end (test_controller.py); with one tenant of three on the
    # canary it still promotes.
    assert [case for case in flipped if case[3] == "rollback" or case[4] == "promote"] == [
        (3, 0.33, "canary", "rollback", "promote"), (3, 0.33, "rest", "rollback", "wait"),
        (6, 0.26, "canary", "rollback", "wait"), (6, 0.26, "rest", "rollback", "wait"),
        (10, 0.1, "canary", "rollback", "rollback"), (10, 0.1, "rest", "rollback", "rollback"),
        (10, 0.29, "canary", "rollback", "wait"), (10, 0.29, "rest", "rollback", "wait")]


@pytest.mark.parametrize("count", [3, 6, 10])
def test_one_tenant_cannot_steer_a_trial_on_one_instance_either_way(count):
    # Triton deals a tenant's requests to both sides; were one to reach only the canary cold and only the
    # others warm (or the other way round), it still decides nothing.
    honest = {f"t{i}": 40 for i in range(count - 1)}

    def sides(worse, pull):
        canary = {t: (n, n // 10 + (n // 2 if worse else 0)) for t, n in honest.items()}
        rest = {t: (n, n // 10) for t, n in honest.items()}
        if pull is not None:
            canary["adversary"], rest["adversary"] = ((40, 40), (40, 0)) if pull == "rollback" else ((40, 0), (40, 40))
        return tenants(canary), tenants(rest)

    for worse, pull, expected in ((False, "rollback", "promote"), (True, "promote", "rollback")):
        assert judge(*sides(worse, None), 600, SETTINGS).action == expected
        verdict = judge(*sides(worse, pull), 600, SETTINGS)
        assert verdict.action == expected, (worse, verdict.reason)
    assert judge(*sides(True, "promote"), 30, SETTINGS).action == "rollback"


def test_a_comparison_leaves_out_the_tenant_that_moved_most_each_way_from_three_tenants():
    a = tenants({"up": (10, 10), "mid": (10, 5), "down": (10, 0), "still": (10, 3)})
    b = tenants({"up": (10, 0), "mid": (10, 4), "down": (10, 9), "still": (10, 3)})
    both = Comparison.of(a, b, SETTINGS)
    assert set(both.trimmed(lambda t: t.cold_share).weights) == {"mid", "still"}
    # Ties go by name; the share must be known in both windows to rank a tenant; under three nobody is left out.
    assert set(Comparison.of(tenants({"x": (4, 0), "y": (4, 0), "z": (4, 0)}), tenants(
        {"x": (4, 0), "y": (4, 0), "z": (4, 0)}), SETTINGS).trimmed(lambda t: t.cold_share).weights) == {"y"}
    two = Comparison.of(tenants({"x": (4, 4), "y": (4, 0)}), tenants({"x": (4, 0), "y": (4, 0)}), SETTINGS)
    assert two.trimmed(lambda t: t.cold_share) is two
    assert both.trimmed(lambda t: None) is both
