"""The canary counts tenant by tenant: one tenant's flood steers no verdict, either way (docs/planner.md)."""

from __future__ import annotations

import dataclasses
import logging
import math
import random

import pytest

from tests.unit.control.test_plan_history import BY, plan_of
from tests.unit.sidecar.canary.test_controller import SETTINGS, FleetLogs, side, trial
from warmup_tools.common.records import RequestRecord
from warmup_tools.control.plan_control import read_canary
from warmup_tools.control.plan_history import PlanHistory, plan_digest, write_live_plan
from warmup_tools.sidecar.canary.judge import (
    MIN_P99_REQUESTS,
    Comparison,
    Moments,
    Values,
    WindowStats,
    carried,
    greater,
    judge,
    judge_replica,
    p99_ms,
    tenant_weights,
)


def window(*tenants, cold=(), prompt=100, cached=80, ttft=10.0):
    """A window of requests: ``tenants`` are (name, requests) pairs; the tenants named in ``cold`` are all cold."""
    stats = WindowStats()
    for name, n in tenants:
        for i in range(n):
            stats.add(RequestRecord(ts=float(i), tenant=name, prompt_tokens=prompt,
                                    cached_tokens=0 if name in cold else cached, ttft_ms=ttft))
    return stats


# ------------------------------------------------------------------------------------------- the rule
def test_a_tenant_counts_in_both_windows_or_not_at_all_and_weighs_no_more_than_the_third_busiest():
    a = window(("flood", 3000), ("b", 40), ("c", 7), ("d", 5), ("only-a", 50))
    b = window(("flood", 2500), ("b", 30), ("c", 9), ("d", 2), ("only-b", 50))
    # Seen in both: flood, b, c, d. Their smaller windows: 2500, 30, 7, 2; the third busiest is 7.
    assert tenant_weights(a, b, SETTINGS) == {"flood": 7, "b": 7, "c": 7, "d": 2}
    assert list(tenant_weights(a, b, SETTINGS)) == ["b", "c", "d", "flood"]  # by name: the same sums every run
    # canary_min_tenants 1: only the absolute cap bounds a tenant; 5 (more than count): the least busy.
    assert tenant_weights(a, b, dataclasses.replace(SETTINGS, canary_min_tenants=1, canary_tenant_cap=100)) == {
        "flood": 100, "b": 30, "c": 7, "d": 2}
    assert tenant_weights(a, b, dataclasses.replace(SETTINGS, canary_min_tenants=5)) == dict.fromkeys(
        ("b", "c", "d", "flood"), 2)
    assert tenant_weights(a, window(("x", 3)), SETTINGS) == {}
    both = Comparison.of(a, b, SETTINGS)
    assert both.counted == 23 and carried(both.weights) == "b 7, c 7, flood 7, d 2"


def test_a_measure_is_the_weighted_mean_of_the_tenants_own_shares():
    # A flood all warm on both sides and one tenant all cold on the canary, weighing the same.
    canary = window(("flood", 3000), ("x", 4), cold={"x"})
    rest = window(("flood", 3000), ("x", 4))
    both = Comparison.of(canary, rest, SETTINGS)
    assert both.weights == {"flood": 4, "x": 4}
    assert both.shares(lambda t: t.cold_share) == (0.5, 0.0)
    assert canary.cold_share == pytest.approx(4 / 3004)  # every request pooled: the flood would hide it
    assert both.shares(lambda t: t.planned_share) is None  # no log says
    # The test stands for W^2 / sum(w^2 / n) requests (8^2 / (16/3000 + 16/4)), and the two pseudo-requests.
    cold, _ = both.moments(lambda t: t.cold)
    assert cold.n == pytest.approx(64 / (16 / 3000 + 4) + 2)
    n = cold.n - 2
    assert cold.mean == pytest.approx((n * 0.5 + 1) / (n + 2))
    # The variance of a request about that mean, within and between tenants, with the pseudo-requests.
    squares = 0.5  # half of the weight is on requests at 1
    spread = squares - 2 * cold.mean * 0.5 + cold.mean ** 2
    assert cold.var == pytest.approx((n * spread + cold.mean ** 2 + (1 - cold.mean) ** 2) / (n + 1))
    # One tenant: its own requests, as Moments.of.
    one = Values()
    for value in (1.0, 0.0, 0.0, 1.0, 1.0):
        one.add(value)
    assert Moments.of_tenants([(3, one)]) == Moments.of([1.0, 0.0, 0.0, 1.0, 1.0])
    assert Moments.of_tenants([]) == Moments(0.0, 0.0, 0) == Moments.of_tenants([(2, Values())])


def test_a_tenant_s_slow_requests_alone_do_not_set_the_p99():
    # 300 requests at 10 ms of three tenants, and 30 at 900 ms of a fourth: its requests are the slowest 1%.
    samples = {"a": [10.0] * 100, "b": [10.0] * 100, "c": [10.0] * 96 + [20.0] * 4, "slow": [900.0] * 30}
    assert p99_ms(samples) == 20.0
    assert p99_ms({"slow": [900.0] * 30}) == 900.0  # alone, it is the window
    # Ties: the first by name is left out.
    assert p99_ms({"a": [5.0, 50.0], "b": [5.0, 50.0]}) == 50.0
    assert p99_ms({}) is None and p99_ms({"a": []}) is None


def test_under_no_difference_the_test_falls_below_alpha_about_as_often_as_alpha_says():
    # One tenant: the exact rate over every outcome of n requests on the canary and m on the others, each cold
    # with probability p. The z-test is a normal approximation: within 1.3 alpha (Fisher's exact test, which
    # it replaces, cannot weigh tenants).
    alpha = SETTINGS.canary_alpha
    for n, m in ((5, 5), (10, 10), (10, 30), (20, 20), (20, 60)):
        windows = [Moments.share(x, n) for x in range(n + 1)], [Moments.share(y, m) for y in range(m + 1)]
        for p in (0.1, 0.3, 0.5, 0.7):
            rate = sum(math.comb(n, x) * p ** x * (1 - p) ** (n - x) * math.comb(m, y) * p ** y * (1 - p) ** (m - y)
                       for x in range(n + 1) for y in range(m + 1) if greater(windows[0][x], windows[1][y]) < alpha)
            assert rate < 1.3 * alpha, (n, m, p, rate)
    # Tenants of different cold rates (seeded: deterministic): the variance between them makes it rarer.
    rng = random.Random(11)

    def drawn(tenants):
        stats = WindowStats()
        for name, (p, n) in tenants.items():
            for _ in range(n):
                stats.add(RequestRecord(ts=0.0, tenant=name, prompt_tokens=100,
                                        cached_tokens=0 if rng.random() < p else 80))
        return stats

    for tenants in ({"a": (0.1, 5), "b": (0.5, 5), "c": (0.9, 5)},
                    {"a": (0.3, 40), "b": (0.7, 4)}, {"a": (0.2, 3), "b": (0.6, 10), "c": (0.1, 6), "d": (0.8, 4)}):
        looks = 1000
        hits = sum(greater(*Comparison.of(drawn(tenants), drawn(tenants), SETTINGS).moments(lambda t: t.cold))
                   < alpha for _ in range(looks))
        assert hits / looks < alpha, (tenants, hits)


# ------------------------------------------------------------------------------------ one tenant's flood
def test_one_tenant_s_warm_flood_on_both_sides_cannot_save_a_bad_plan(tmp_path, caplog):
    # Four tenants each see one request in three go cold on the canary instance; a fifth sends 3,000 warm
    # requests to each side. Pooled, or with the flood cut to a fixed 20 requests a side, the other tenants' cold
    # requests are 12.5% of the canary's, their lost cached tokens under the margin: promoted.
    replica, controller, good, bad, _ = trial(tmp_path)
    controller.propose(bad, "test")
    replica.report("lm_0_1", bad.plan_id)
    controller.tick()
    replica.now += 1
    for tenant in ("globex", "initech", "umbrella", "hooli"):
        replica.serve("lm_0_1", cold=1, n=3, tenant=tenant)
        replica.serve("lm_0_0", cold=0, n=3, tenant=tenant)
    replica.serve("lm_0_1", cold=0, n=3000, tenant="acme")
    replica.serve("lm_0_0", cold=0, n=3000, tenant="acme")
    replica.now += 600
    with caplog.at_level(logging.WARNING, logger="warmup_tools.sidecar.canary.controller"):
        verdict = controller.tick()
    assert verdict.action == "rollback", verdict.reason
    assert read_canary(replica.control) is None and PlanHistory(replica.control).current().id == plan_digest(good)
    counted = controller.status()["verdicts"][0]["counted"]
    assert counted == {"both": {"requests": 15, "tenants": 5}}  # the flood counts 3 requests a side, as each
    # The log line says which tenants carried the verdict.
    assert "tenants counted: acme 3, globex 3, hooli 3, initech 3, umbrella 3" in caplog.text


def _whole_replica_trial(tmp_path):
    """Six warm tenants on each of two replicas before the trial, then a plan on trial on the whole of r1 (applied
    there): the fleet's logs, the canary controller of r1, the tenants of each replica and the plans promoted."""
    fleet = FleetLogs(tmp_path)
    mine, theirs = [f"a{i}" for i in range(6)], [f"b{i}" for i in range(6)]
    for tenant in mine:
        fleet.serve("r1", cold=0, n=4, tenant=tenant)
    for tenant in theirs:
        fleet.serve("r2", cold=0, n=4, tenant=tenant)
    fleet.now = 1000.0
    good, trial = plan_of(0), plan_of(0, 100)
    write_live_plan(fleet.control, good, by=BY)
    for replica in ("r1", "r2"):
        fleet.report(replica, good.plan_id)
    controller, promoted = fleet.controller("r1", canary_min_requests=5)
    controller.propose(trial, "test")
    fleet.report("r1", trial.plan_id)
    return fleet, controller, mine, theirs, trial, promoted


def test_one_tenant_s_cold_requests_cannot_roll_back_a_good_plan_on_a_whole_replica(tmp_path):
    # Six tenants on each replica before the trial, all warm; the plan on trial changes nothing for them.
    fleet, controller, mine, theirs, new, promoted = _whole_replica_trial(tmp_path)
    assert controller.tick().action == "wait"
    fleet.now += 1
    # 120 s in: a0 sends 6 prompts never seen before (cold on any plan), and so does a newcomer; the others
    # replica's tenants go on as before. Pooled, the canary replica went from 0 to 100% cold: rolled back.
    fleet.serve("r1", cold=6, n=6, tenant="a0")
    fleet.serve("r1", cold=10, n=10, tenant="newcomer")
    for tenant in theirs:
        fleet.serve("r2", cold=0, n=2, tenant=tenant)
    fleet.now += 119
    verdict = controller.tick()
    assert verdict.action == "wait" and "1 tenants on the canary replica" in verdict.reason, verdict.reason
    # The canary replica's other tenants come back, warm: a0's cold requests weigh as one of three tenants.
    fleet.now += 100
    for tenant in mine[1:]:
        fleet.serve("r1", cold=0, n=2, tenant=tenant)
    fleet.now += 1
    assert controller.tick().action == "wait"
    trial_status = controller.status()["trial"]
    assert trial_status["counted"] == {"canary": {"requests": 12, "tenants": 6},
                                       "rest": {"requests": 12, "tenants": 6}}
    assert trial_status["canary"]["cold_share"] == pytest.approx(16 / 26, abs=1e-4)  # every request: for /status
    fleet.now += 400
    verdict = controller.tick()
    assert verdict.action == "promote", verdict.reason
    assert [p.plan_id for p in promoted] == [new.plan_id]


def test_the_same_cold_requests_from_most_tenants_roll_the_plan_back_at_once(tmp_path):
    # The check of the test above: when the plan is what changed, every tenant of the canary replica sees it.
    fleet, controller, mine, theirs, bad, _ = _whole_replica_trial(tmp_path)
    controller.tick()
    fleet.now += 1
    for tenant in mine:
        fleet.serve("r1", cold=4, n=4, tenant=tenant)
    for tenant in theirs:
        fleet.serve("r2", cold=0, n=2, tenant=tenant)
    fleet.now += 119
    verdict = controller.tick()
    assert verdict.action == "rollback" and "cold share 0.0% -> 100.0%" in verdict.reason, verdict.reason
    assert PlanHistory(fleet.control).current().id == plan_digest(plan_of(0))  # the plan before the trial


def test_a_whole_replica_waits_for_the_tenants_of_its_baseline_or_all_of_them_when_fewer():
    settings = dataclasses.replace(SETTINGS, canary_min_requests=5)
    before = (window(("a", 10), ("b", 10)), window(("x", 10), ("y", 10), ("z", 10), ("w", 10)))
    colder = window(("a", 10), ("b", 10), cold={"a", "b"})
    # Two tenants in the canary replica's baseline: both back is enough there; the others need three of four.
    assert "1 tenants on the others (1 and 3 needed)" in judge_replica(
        colder, window(("x", 2)), before, 60, settings).reason
    verdict = judge_replica(colder, window(("x", 2), ("y", 2), ("z", 2)), before, 60, settings)
    assert verdict.action == "rollback", verdict.reason
    assert judge_replica(window(("a", 10), cold={"a"}), window(("x", 2), ("y", 2), ("z", 2)), before, 60,
                         settings).action == "wait"
    late = judge_replica(window(("a", 10), cold={"a"}), window(("x", 2), ("y", 2), ("z", 2)), before, 1800,
                         settings)
    assert late.action == "rollback" and "too little traffic" in late.reason
    assert "1 tenants on the canary replica (5 and 2 needed)" in late.reason


def test_one_instance_needs_no_baseline_tenants_a_tenant_is_compared_with_itself():
    # Triton deals a tenant's requests to both sides: a lone tenant all cold is cold on both, whatever it sends.
    assert judge(window(("acme", 20), cold={"acme"}), window(("acme", 20), cold={"acme"}), 600,
                 SETTINGS).action == "promote"
    verdict = judge(window(("acme", 20), cold={"acme"}), window(("acme", 20)), 30, SETTINGS)
    assert verdict.action == "rollback" and "cold share 100.0% against 0.0%" in verdict.reason


# -------------------------------------------------------------------- levels against changes (whole replica)
def test_a_replica_warmer_than_the_others_that_got_colder_is_rolled_back():
    # The canary replica went from 5% to 50% cold while the others stayed at 60%: by level it is still the
    # warmer, by its change it is 45 points worse.
    before = (side(40, 2), side(40, 24))
    verdict = judge_replica(side(40, 20), side(40, 24), before, 30, SETTINGS)
    assert verdict.action == "rollback" and "cold share 5.0% -> 50.0%" in verdict.reason, verdict.reason


def per_request(requests, *, cached=90, planned=None, ttft=10.0):
    stats = WindowStats()
    for i in range(requests):
        stats.add(RequestRecord(ts=float(i), prompt_tokens=100, cached_tokens=cached, planned_tokens=planned,
                                ttft_ms=ttft))
    return stats


def test_a_replica_that_lost_cached_or_planned_tokens_is_rolled_back_though_above_the_others():
    # From cache: 90% -> 60% on the canary replica, 40% on the others throughout.
    before = (per_request(30, cached=90), per_request(30, cached=40))
    verdict = judge_replica(per_request(30, cached=60), per_request(30, cached=40), before, 30, SETTINGS)
    assert verdict.action == "rollback" and "prompt tokens from cache 90.0% -> 60.0%" in verdict.reason
    # From the plan: 85% -> 50%, the others at 30% throughout.
    before = (per_request(30, planned=85), per_request(30, planned=30))
    verdict = judge_replica(per_request(30, planned=50), per_request(30, planned=30), before, 30, SETTINGS)
    assert verdict.action == "rollback" and "plan's pinned blocks 85.0% -> 50.0%" in verdict.reason
    # Neither moved: promoted, however far apart their levels.
    verdict = judge_replica(per_request(30, cached=90, planned=85), per_request(30, cached=40, planned=30),
                            (per_request(30, cached=90, planned=85), per_request(30, cached=40, planned=30)),
                            600, SETTINGS)
    assert verdict.action == "promote", verdict.reason


def test_a_replica_s_ttft_is_judged_on_its_ratio_to_its_baseline():
    n = MIN_P99_REQUESTS
    # 10 -> 30 ms on the canary replica, 50 ms on the others throughout: faster than them, three times slower
    # than itself.
    slower = judge_replica(per_request(n, ttft=30.0), per_request(n, ttft=50.0),
                           (per_request(n, ttft=10.0), per_request(n, ttft=50.0)), 600, SETTINGS)
    assert slower.action == "rollback" and "TTFT p99 10.0 -> 30.0 ms" in slower.reason
    # 40 ms on the canary replica throughout, 10 on the others: slower than them, as slow as before.
    steady = judge_replica(per_request(n, ttft=40.0), per_request(n, ttft=10.0),
                           (per_request(n, ttft=40.0), per_request(n, ttft=10.0)), 600, SETTINGS)
    assert steady.action == "promote", steady.reason
    # Below MIN_P99_REQUESTS a window's p99 is its maximum: not compared.
    assert judge_replica(per_request(n - 1, ttft=30.0), per_request(n, ttft=50.0),
                         (per_request(n, ttft=10.0), per_request(n, ttft=50.0)), 600, SETTINGS).action == "promote"


# ------------------------------------------------------------------------------------------- public /status
def test_the_public_status_names_no_plan_and_no_tenant_while_the_log_names_both(tmp_path, caplog):
    import json
    import urllib.request

    from tests.unit.sidecar.test_monitor import FakeTriton, get, monitor_for
    from warmup_tools.sidecar.endpoints import SidecarHttpServer

    replica, controller, good, bad, _ = trial(tmp_path)
    monitor = monitor_for(FakeTriton())
    monitor.sections["canary"] = controller.status
    server = SidecarHttpServer(monitor, port=0)
    server.start()
    tenants = ("globex", "initech", "umbrella")
    secrets = {good.plan_id, bad.plan_id, plan_digest(good), plan_digest(bad), *tenants}

    def public() -> str:
        monitor.run_once()
        bodies = [json.dumps(get(server.url + "/status")[1])]
        with urllib.request.urlopen(server.url + "/metrics", timeout=10) as response:
            bodies.append(response.read().decode())
        return "\n".join(bodies)

    try:
        # A trial that never applies its plan: rolled back, the reason in /status.
        controller.propose(bad, "test")
        replica.report("lm_0_1", bad.plan_id, "warming")
        controller.tick()
        replica.now += 1800
        with caplog.at_level(logging.WARNING, logger="warmup_tools.sidecar.canary.controller"):
            verdict = controller.tick()
        assert verdict.action == "rollback" and bad.plan_id not in verdict.reason
        assert controller.status()["verdicts"][0]["plan_id"] == bad.plan_id  # the operator's side keeps it
        assert f"canary: plan {bad.plan_id} rolled back" in caplog.text
        # A trial judged on several tenants, running and then promoted.
        for instance in ("lm_0_0", "lm_0_1"):
            replica.report(instance, good.plan_id)
        new = plan_of(0, 200)
        assert controller.propose(new, "test") is not None
        secrets |= {new.plan_id, plan_digest(new)}
        replica.report("lm_0_1", new.plan_id)
        controller.tick()
        replica.now += 1
        for tenant in tenants:
            replica.serve("lm_0_1", cold=0, n=4, tenant=tenant)
            replica.serve("lm_0_0", cold=0, n=4, tenant=tenant)
        replica.now += 60
        controller.tick()
        running = public()
        assert '"trial": {' in running and '"counted": {"both": {"requests": 12, "tenants": 3}}' in running
        replica.now += 600
        with caplog.at_level(logging.INFO, logger="warmup_tools.sidecar.canary.controller"):
            assert controller.tick().action == "promote"
        assert f"canary: plan {new.plan_id} promoted" in caplog.text
        assert "tenants counted: globex 4, initech 4, umbrella 4" in caplog.text
        ended = public()
        assert "no worse after" in ended and "did not apply the plan on trial" in ended
        for body in (running, ended):
            assert not [name for name in secrets if name in body], body
    finally:
        server.stop()
