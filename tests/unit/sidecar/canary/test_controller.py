"""The canary's verdict: the statistics, the rule, reading the request logs, and a trial from start to end."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from tests.unit.control.test_plan_history import BY, plan_of
from warmup_tools.common.jsonl import RotatingJsonLines
from warmup_tools.common.plan import PlanError
from warmup_tools.common.records import RequestRecord
from warmup_tools.control.plan_control import AdapterCoverage, CanaryError, PlanStatus, PlanStatusBoard, read_canary
from warmup_tools.control.plan_history import PlanHistory, plan_digest, write_live_plan
from warmup_tools.sidecar.canary.controller import CanaryController
from warmup_tools.sidecar.canary.judge import (
    MIN_P99_REQUESTS,
    Moments,
    WindowStats,
    evidence,
    greater,
    judge,
    judge_replica,
    replica_evidence,
    rise_greater,
)
from warmup_tools.sidecar.canary.log_tail import RequestLogTail
from warmup_tools.sidecar.canary.trial import end_canary, start_canary
from warmup_tools.sidecar.config import SidecarConfig
from warmup_tools.sidecar.endpoints import prometheus_text

SETTINGS = SidecarConfig(canary_window_s=600, canary_min_requests=10)


def side(requests, cold, *, prompt=100, cached=80, ttft=10.0):
    stats = WindowStats()
    for i in range(requests):
        stats.add(RequestRecord(ts=float(i), prompt_tokens=prompt, cached_tokens=0 if i < cold else cached,
                                ttft_ms=ttft))
    return stats


def test_the_z_test_matches_its_formula_with_the_pseudo_requests():
    # 3 of 3 against 0 of 3: with one pseudo-request at 0 and one at 1 each side is 4 of 5 against 1 of 5, each
    # with the variance 5/4 * 0.8 * 0.2 = 0.2 of one request over 5: z = 0.6 / sqrt(0.08) = 1.5 * sqrt(2).
    cold, warm = Moments.share(3, 3), Moments.share(0, 3)
    assert (cold.mean, cold.var, cold.n) == (pytest.approx(0.8), pytest.approx(0.2), 5)
    assert greater(cold, warm) == pytest.approx(0.5 * math.erfc(1.5))
    assert greater(warm, cold) == pytest.approx(1 - 0.5 * math.erfc(1.5))
    assert greater(cold, Moments.of([])) == 1.0 and greater(Moments.of([]), warm) == 1.0


def test_nothing_is_judged_before_each_side_has_its_requests():
    long_window = dataclasses.replace(SETTINGS, canary_window_s=10_000)
    assert judge(side(9, 9), side(50, 0), 10_000, long_window).action == "wait"
    late = judge(side(9, 0), side(50, 0), 1800, SETTINGS)
    assert late.action == "rollback" and "too little traffic" in late.reason


def test_a_plan_much_colder_is_rolled_back_at_once():
    verdict = judge(side(12, 11), side(12, 2), 30, SETTINGS)
    assert verdict.action == "rollback" and "cold share 91.7% against 16.7%" in verdict.reason


def test_a_small_difference_in_a_small_window_is_not_enough():
    # 3 of 10 against 1 of 10: 20 points more, but p = 0.29.
    assert judge(side(10, 3), side(10, 1), 30, SETTINGS).action == "wait"
    # Its two cold requests also cost it 16 points of cached tokens: judged at the window's end only.
    assert judge(side(10, 3), side(10, 1), 600, SETTINGS).action == "rollback"
    assert judge(side(10, 3, cached=100), side(10, 1, cached=80), 600, SETTINGS).action == "promote"


def cached_per_request(*cached, prompt=100):
    stats = WindowStats()
    for i, tokens in enumerate(cached):
        stats.add(RequestRecord(ts=float(i), prompt_tokens=prompt, cached_tokens=tokens, ttft_ms=10.0))
    return stats


def test_fewer_cached_tokens_in_every_request_roll_back_at_once():
    # Every canary request prefills half its prompt against a fifth on the others: the rank test sees it early.
    fewer = judge(side(20, 0, cached=50), side(20, 0, cached=80), 30, SETTINGS)
    assert fewer.action == "rollback" and "prompt tokens from cache 50.0% against 80.0%" in fewer.reason
    assert "per-request uncached shares higher" in fewer.reason


def test_fewer_cached_tokens_by_chance_wait_for_the_end_of_the_window():
    # 12 points fewer, from one long prompt prefilled on the canary: not significant, judged at the window's end.
    canary = cached_per_request(*[90] * 9, 30, 90, 90)
    rest = cached_per_request(*[90] * 12)
    canary.add(RequestRecord(ts=99.0, prompt_tokens=400, cached_tokens=90, ttft_ms=10.0))
    rest.add(RequestRecord(ts=99.0, prompt_tokens=100, cached_tokens=90, ttft_ms=10.0))
    assert rest.cached_share - canary.cached_share > SETTINGS.canary_cached_margin
    assert evidence(canary, rest, SETTINGS)["uncached_p"] >= SETTINGS.canary_alpha
    assert judge(canary, rest, 30, SETTINGS).action == "wait"
    assert judge(canary, rest, 600, SETTINGS).action == "rollback"


def planned_per_request(*planned, prompt=100, cached=90):
    stats = WindowStats()
    for i, tokens in enumerate(planned):
        stats.add(RequestRecord(ts=float(i), prompt_tokens=prompt, cached_tokens=cached, ttft_ms=10.0,
                                planned_tokens=tokens))
    return stats


def test_a_plan_that_does_not_hold_the_traffic_is_rolled_back_before_its_cache_goes_cold():
    # The old plan's blocks still sit unpinned in the canary's cache (cached 90% on both sides), but none of
    # the canary's requests hit a block its plan pins: rolled back on five requests a side.
    canary, rest = planned_per_request(0, 0, 0, 0, 0), planned_per_request(80, 80, 64, 80, 48)
    verdict = judge(canary, rest, 30, dataclasses.replace(SETTINGS, canary_min_requests=5))
    assert verdict.action == "rollback" and "plan's pinned blocks 0.0% against 70.4%" in verdict.reason
    # The same shares from one request a side more on one and less on the other: not enough to say.
    assert judge(planned_per_request(0, 80, 64, 80, 48), rest, 30,
                 dataclasses.replace(SETTINGS, canary_min_requests=5)).action == "wait"


def test_logs_without_planned_tokens_are_judged_on_the_rest():
    canary, rest = side(10, 0), side(10, 0)
    assert canary.planned_share is None and canary.summary()["planned_share"] is None
    assert judge(canary, rest, 600, SETTINGS).action == "promote"


def test_the_per_request_test_is_one_sided():
    assert greater(Moments.of([0.5] * 10), Moments.of([0.2] * 10)) < SETTINGS.canary_alpha
    assert greater(Moments.of([0.2] * 10), Moments.of([0.5] * 10)) > 0.99
    assert greater(Moments.of([]), Moments.of([0.5])) == 1.0


def test_a_slower_p99_rolls_back_at_the_end_of_the_window():
    n = MIN_P99_REQUESTS
    slow = judge(side(n, 0, ttft=40.0), side(n, 0, ttft=10.0), 600, SETTINGS)
    assert slow.action == "rollback" and "TTFT p99" in slow.reason
    # Below MIN_P99_REQUESTS the p99 is the maximum: not compared.
    assert judge(side(n - 1, 0, ttft=40.0), side(n - 1, 0, ttft=10.0), 600, SETTINGS).action == "promote"


def test_a_plan_no_worse_is_promoted_when_the_window_ends():
    assert judge(side(20, 2), side(20, 3), 599, SETTINGS).action == "wait"
    verdict = judge(side(20, 2), side(20, 3), 600, SETTINGS)
    assert verdict.action == "promote" and "no worse after 600 s" in verdict.reason


def records(tenant, *, ts, cold, n):
    return [RequestRecord(ts=ts + i, tenant=tenant, prompt_tokens=64, cached_tokens=0 if i < cold else 48,
                          ttft_ms=5.0).to_json() for i in range(n)]


def test_the_log_tail_reads_each_line_once_through_rotation_and_torn_lines(tmp_path):
    log = RotatingJsonLines(tmp_path / "requests-lm_0_0.jsonl", max_bytes=1500, backups=2)
    tail = RequestLogTail(tmp_path)
    log.write(records("a", ts=0, cold=0, n=5))
    assert [r.ts for _, r in tail.read()] == [0, 1, 2, 3, 4]
    log.write(records("a", ts=10, cold=0, n=12))  # rotates on the way
    assert (tmp_path / "requests-lm_0_0.jsonl.1").exists()
    seen = tail.read()
    assert [r.ts for _, r in seen] == list(range(10, 22)) and {i for i, _ in seen} == {"lm_0_0"}
    with open(tmp_path / "requests-lm_0_0.jsonl", "ab") as file:
        file.write(b'{"v":1,"ts":30')  # a line the writer has not finished
    assert tail.read() == []
    with open(tmp_path / "requests-lm_0_0.jsonl", "ab") as file:
        file.write(b',"tenant":"a"}\nnot json\n')
    assert [r.ts for _, r in tail.read()] == [30] and tail.skipped == 1
    tail.skip_to_end()
    log.write(records("a", ts=40, cold=0, n=1))
    assert [r.ts for _, r in tail.read()] == [40]


class Replica:
    """A control folder and request logs as two lora_adapter instances of replica ``r1`` write them."""

    def __init__(self, root):
        self.control, self.logs = root / "control", root / "logs"
        self.board = PlanStatusBoard(self.control)
        self.writers = {i: RotatingJsonLines(self.logs / f"requests-{i}.jsonl") for i in ("lm_0_0", "lm_0_1")}
        self.now = 1000.0

    def report(self, instance, plan_id, state="applied"):
        self.board.report(PlanStatus(instance, plan_id, "control", state, {"base": AdapterCoverage(2, 2)},
                                     reported_at=self.now, host="r1"))

    def serve(self, instance, *, cold, n, tenant="acme"):
        self.writers[instance].write(records(tenant, ts=self.now, cold=cold, n=n))


def trial(tmp_path, **settings):
    replica = Replica(tmp_path)
    good, new = plan_of(0), plan_of(0, 100)
    write_live_plan(replica.control, good, by=BY)
    for instance in ("lm_0_0", "lm_0_1"):
        replica.report(instance, good.plan_id)
    promoted = []
    controller = CanaryController(replica.control, replica.logs, dataclasses.replace(SETTINGS, **settings),
                                  host="r1", clock=lambda: replica.now, on_promote=promoted.append)
    return replica, controller, good, new, promoted


def test_a_trial_that_is_worse_is_rolled_back_with_its_reason_in_status_and_metrics(tmp_path, caplog):
    replica, controller, good, bad, _ = trial(tmp_path)
    assert controller.instances() == ["lm_0_0", "lm_0_1"]
    replica.serve("lm_0_0", cold=1, n=5)  # served before the trial: never counted
    canary = controller.propose(bad, "test")
    assert canary.instances == ("lm_0_1",) and read_canary(replica.control) == canary
    replica.report("lm_0_1", bad.plan_id, "warming")
    assert controller.tick().reason == "the canary instance is warming the plan"
    replica.report("lm_0_1", bad.plan_id)
    replica.now += 1
    assert controller.tick().action == "wait"
    replica.now += 1
    replica.serve("lm_0_1", cold=11, n=12)
    replica.serve("lm_0_0", cold=2, n=12)
    replica.now += 60
    verdict = controller.tick()
    assert verdict.action == "rollback" and "cold share 91.7% against 16.7%" in verdict.reason
    assert read_canary(replica.control) is None and PlanHistory(replica.control).current().id == plan_digest(good)
    status = controller.status()
    assert status["trial"] is None and status["counts"] == {"promoted": 0, "rolled_back": 1}
    assert status["verdicts"][0]["verdict"] == "rolled_back" and status["verdicts"][0]["canary"]["requests"] == 12
    assert "canary: plan" in caplog.text and "rolled back" in caplog.text
    text = prometheus_text({"canary": status})
    assert 'warmup_canary_verdicts_total{verdict="rolled_back"} 1.0' in text and "warmup_canary_active 0.0" in text


def test_a_trial_no_worse_is_promoted_at_the_end_of_its_window(tmp_path):
    replica, controller, good, new, promoted = trial(tmp_path)
    controller.propose(new, "test")
    replica.report("lm_0_1", new.plan_id)
    controller.tick()
    replica.now += 1
    replica.serve("lm_0_1", cold=2, n=20)
    replica.serve("lm_0_0", cold=3, n=20)
    replica.now += 300
    assert controller.tick().action == "wait"
    assert prometheus_text({"canary": controller.status()}).count("warmup_canary_active 1.0") == 1
    replica.now += 300
    assert controller.tick().action == "promote"
    assert PlanHistory(replica.control).current().id == plan_digest(new) and read_canary(replica.control) is None
    assert [p.plan_id for p in promoted] == [new.plan_id]


def test_no_canary_on_a_replica_with_one_instance_or_with_the_window_off(tmp_path):
    replica, controller, _, new, _ = trial(tmp_path)
    (replica.control / "plan_status").joinpath(sorted(p.name for p in (replica.control / "plan_status").iterdir())[1]
                                               ).unlink()
    assert controller.propose(new, "test") is None
    replica, controller, _, new, _ = trial(tmp_path / "off", canary_window_s=0)
    assert controller.propose(new, "test") is None


def test_a_canary_that_never_applies_its_plan_is_rolled_back(tmp_path):
    replica, controller, good, new, _ = trial(tmp_path)
    controller.propose(new, "test")
    replica.report("lm_0_1", new.plan_id, "warming")
    replica.now += 1800
    verdict = controller.tick()
    assert verdict.action == "rollback" and "did not apply the plan on trial" in verdict.reason


def test_a_verdict_notes_when_the_live_check_released_the_plans_pins_on_the_canary_and_is_not_changed_by_it(
        tmp_path):
    from warmup_tools.control.plan_control import PinReport

    replica, controller, good, new, _ = trial(tmp_path)
    controller.propose(new, "test")
    replica.report("lm_0_1", new.plan_id)
    controller.tick()
    replica.now += 1
    replica.serve("lm_0_1", cold=2, n=20)
    replica.serve("lm_0_0", cold=3, n=20)
    released = PinReport.from_dict({"plan_id": new.plan_id, "state": "released", "releases": 1,
                                    "reason": "over 300 s the pinned blocks gave 0 block hits and the blocks evicted "
                                              "for them would have given 40"})
    replica.board.report(PlanStatus("lm_0_1", new.plan_id, "control", "applied", {"base": AdapterCoverage(2, 2)},
                                    reported_at=replica.now, host="r1", pins=released))
    # Pins of the plan served now on the other instance are not the trial's: not noted.
    replica.board.report(PlanStatus("lm_0_0", good.plan_id, "control", "applied", {"base": AdapterCoverage(2, 2)},
                                    reported_at=replica.now, host="r1",
                                    pins=PinReport.from_dict({"plan_id": good.plan_id, "state": "released"})))
    replica.now += 600
    assert controller.tick().action == "promote"  # the request logs decide, as before
    record = controller.status()["verdicts"][0]
    assert record["pins"] == ("the live check released the plan's pins on 1 canary instance(s) (lm_0_1): over 300 s "
                              "the pinned blocks gave 0 block hits and the blocks evicted for them would have given 40")


def test_a_verdict_without_released_pins_notes_nothing(tmp_path):
    replica, controller, good, new, _ = trial(tmp_path)
    controller.propose(new, "test")
    replica.report("lm_0_1", new.plan_id, "warming")
    replica.now += 1800
    assert controller.tick().action == "rollback"
    assert controller.status()["verdicts"][0]["pins"] == ""


def test_a_trial_started_elsewhere_or_a_broken_canary_file_is_left_alone(tmp_path):
    replica, controller, good, new, _ = trial(tmp_path)
    start_canary(replica.control, new, host="r2", instances=["lm_0_1"], by=BY)
    assert "the trial runs on r2" in controller.tick().reason and read_canary(replica.control) is not None
    (replica.control / "canary.json").write_text("{")
    verdict = controller.tick()
    assert verdict.action == "wait" and "canary.json" in controller.status()["error"]


# ------------------------------------------------------------------------------- a trial on a whole replica
def test_a_replica_the_router_gives_colder_tenants_is_judged_on_its_change_not_its_level():
    # Before and during the trial, r1's tenants are colder than r2's by 40 points: the plan changed nothing.
    before = (side(40, 20), side(40, 4))
    assert judge(side(40, 20), side(40, 4), 600, SETTINGS).action == "rollback"  # what a direct comparison says
    verdict = judge_replica(side(40, 20), side(40, 4), before, 600, SETTINGS)
    assert verdict.action == "promote" and "cold share 50.0% -> 50.0%" in verdict.reason
    # The same replica 35 points colder than its own baseline while the others did not move: rolled back early.
    worse = judge_replica(side(40, 34), side(40, 4), before, 30, SETTINGS)
    assert worse.action == "rollback" and "cold share 50.0% -> 85.0% on 40 requests of the canary" in worse.reason
    # Every side colder by the same amount (the traffic changed, not the plan): no worse.
    assert judge_replica(side(40, 34), side(40, 18), before, 600, SETTINGS).action == "promote"


def test_a_replica_is_not_rolled_back_at_the_end_of_its_window_by_the_others_recovering_from_a_cold_baseline():
    # r1 served as before (10% -> 15% cold of 20 requests: chance); r2's baseline was an unlucky 30% cold window
    # that came back to 10%. The difference of differences exceeds the cached-token margin (20 points against 10)
    # on the others' swing alone, and no test comes near its level (p about 0.06): the plan is no worse.
    before = (side(20, 2), side(20, 6))
    canary, rest = side(20, 3), side(20, 2)
    assert replica_evidence(canary, rest, before, SETTINGS)["uncached_p"] > 0.05
    verdict = judge_replica(canary, rest, before, 600, SETTINGS)
    assert verdict.action == "promote", verdict.reason
    # The canary itself 20 points worse than its baseline, the others steady: rolled back, early, by the test.
    worse = judge_replica(side(20, 12), side(20, 6), before, 30, SETTINGS)
    assert worse.action == "rollback" and "cold share 10.0% -> 60.0%" in worse.reason


def test_a_replica_worse_than_its_baseline_on_too_few_requests_for_the_test_is_not_promoted():
    # 10 requests of the canary, 0% -> 50% cold, the others steady: the test does not reach canary_alpha yet (p about
    # 0.015), so at the window's end the trial is judged on more requests, and rolled back if it still looks so.
    before, canary, rest = (side(10, 0), side(20, 4)), side(10, 5), side(20, 3)
    assert replica_evidence(canary, rest, before, SETTINGS)["cold_p"] > SETTINGS.canary_alpha
    verdict = judge_replica(canary, rest, before, 600, SETTINGS)
    assert verdict.action == "wait" and "worse by more than its margin" in verdict.reason
    late = judge_replica(canary, rest, before, 1800, SETTINGS)
    assert late.action == "rollback" and "still worse by more than its margin" in late.reason
    # The others' swing alone (the test above) is no reason to hold a plan back, nor is a canary that moved less
    # than the margin.
    assert judge_replica(side(10, 0), side(20, 3), (side(10, 0), side(20, 4)), 600, SETTINGS).action == "promote"


def test_the_difference_of_differences_test_is_one_sided_and_needs_every_side():
    flat, up = Moments.share(10, 100), Moments.share(40, 100)
    assert rise_greater(up, flat, flat, flat) < 1e-4
    assert rise_greater(flat, up, flat, flat) > 0.99
    assert rise_greater(up, flat, flat, Moments.share(0, 0)) == 1.0


def test_a_few_requests_all_alike_are_not_taken_for_certainty():
    # Five requests all cold on the canary against five all warm, each side's baseline all warm: without the
    # pseudo-requests every side has no variance and the z-test says p 0 (it said 1.6e-18 on such windows).
    cold, warm = Moments.share(5, 5), Moments.share(0, 5)
    p = rise_greater(cold, warm, warm, warm)
    assert 1e-6 < p < 0.01
    assert rise_greater(*(Moments.of(v) for v in ([1.0] * 5, [0.0] * 5, [0.0] * 5, [0.0] * 5))) > 1e-6
    assert Moments.of([]).n == 0 and Moments.share(0, 0).n == 0


def test_a_replica_s_early_tests_need_one_request_of_the_others_and_stay_below_alpha_by_chance():
    # The canary replica's tokens from the plan fall from 85% to 0 on its first ten requests; the others have
    # four since the trial began (they had a quiet spell): rolled back now, not at their fifth request.
    def planned(requests, share):
        stats = WindowStats()
        for i in range(requests):
            stats.add(RequestRecord(ts=float(i), prompt_tokens=100, cached_tokens=90,
                                    planned_tokens=round(100 * share), ttft_ms=10.0))
        return stats

    settings = dataclasses.replace(SETTINGS, canary_min_requests=5)
    before = (planned(20, 0.85), planned(20, 0.85))
    worse = judge_replica(planned(10, 0.0), planned(4, 0.85), before, 60, settings)
    assert worse.action == "rollback" and "pinned blocks" in worse.reason
    assert judge_replica(planned(10, 0.0), WindowStats(), before, 60, settings).action == "wait"
    assert judge_replica(planned(4, 0.0), planned(20, 0.85), before, 60, settings).action == "wait"
    # Promotion still needs canary_min_requests on each side.
    assert judge_replica(planned(10, 0.85), planned(4, 0.85), before, 600, settings).action == "wait"
    assert judge_replica(planned(10, 0.85), planned(5, 0.85), before, 600, settings).action == "promote"
    # With no difference (each side keeps its own cold rate), the share of looks whose test falls below alpha
    # stays below alpha however few requests the others have since the trial began (seeded: deterministic).
    rng = random.Random(7)

    def drawn(p, n):
        return Moments.share(sum(rng.random() < p for _ in range(n)), n)

    for canary_p, rest_p in ((0.1, 0.15), (0.1, 0.4), (0.6, 0.6), (0.8, 0.5)):
        for rest_n in (1, 2, 4):
            looks = 2000
            hits = sum(rise_greater(drawn(canary_p, 5), drawn(canary_p, 20), drawn(rest_p, rest_n),
                                    drawn(rest_p, 20)) < settings.canary_alpha for _ in range(looks))
            assert hits / looks < settings.canary_alpha, (canary_p, rest_p, rest_n, hits)


class FleetLogs:
    """A fleet's control folder and shared request log folder as replicas r1, r2 (and more) write them, two
    lora_adapter instances each."""

    def __init__(self, root, replicas=("r1", "r2")):
        self.control, self.logs = root / "control", root / "requests"
        self.board = PlanStatusBoard(self.control)
        self.writers = {}
        self.now = 500.0
        for replica in replicas:
            for instance in ("lm_0_0", "lm_0_1"):
                self.writers[replica, instance] = RotatingJsonLines(self.logs / replica / f"requests-{instance}.jsonl")

    def report(self, replica, plan_id, state="applied"):
        for instance in ("lm_0_0", "lm_0_1"):
            self.board.report(PlanStatus(instance, plan_id, "control", state, {"base": AdapterCoverage(2, 2)},
                                         reported_at=self.now, host=replica))

    def serve(self, replica, *, cold, n, tenant="acme"):
        """``n`` requests of ``tenant``, of which ``cold`` cold, spread over the replica's two instances."""
        half = n // 2
        self.writers[replica, "lm_0_0"].write(records(tenant, ts=self.now, cold=min(cold, half), n=half))
        self.writers[replica, "lm_0_1"].write(records(tenant, ts=self.now, cold=max(0, cold - half), n=n - half))

    def controller(self, host, **settings):
        promoted = []
        controller = CanaryController(self.control, self.logs / host, dataclasses.replace(SETTINGS, **settings),
                                      host=host, clock=lambda: self.now, on_promote=promoted.append,
                                      fleet_log_dir=self.logs)
        return controller, promoted


def fleet_trial(tmp_path, *, canary_before, rest_before, replicas=("r1", "r2")):
    """r1 and r2 serve plan ``good`` with the cold requests given (of 20 each) before the trial; r1 proposes
    ``new``, which goes on trial on all of r1, applied 500 s after that baseline."""
    fleet = FleetLogs(tmp_path, replicas)
    good, new = plan_of(0), plan_of(0, 100)
    write_live_plan(fleet.control, good, by=BY)
    fleet.serve("r1", cold=canary_before, n=20)
    fleet.serve("r2", cold=rest_before, n=20)
    fleet.now = 1000.0
    for replica in ("r1", "r2"):
        fleet.report(replica, good.plan_id)
    controller, promoted = fleet.controller("r1")
    canary = controller.propose(new, "test")
    assert canary.host == "r1" and canary.instances == ()
    fleet.report("r1", new.plan_id)
    assert controller.tick().action == "wait"
    return fleet, controller, good, new, promoted


def test_the_proposal_goes_to_a_whole_replica_when_two_report_and_only_the_first_replica_proposes(tmp_path):
    fleet = FleetLogs(tmp_path, ("r1", "r2"))
    fleet.now = 1000.0
    fleet.report("r2", "p")
    first, _ = fleet.controller("r1")
    second, _ = fleet.controller("r2")
    # r1 not reporting yet: r2 re-plans, on one of its instances (it is the only replica it sees).
    assert second.proposer() == "r2" and second.replicas() == ["r2"]
    new = plan_of(0, 100)
    assert second.propose(new, "test").instances == ("lm_0_1",)
    end_canary(fleet.control, read_canary(fleet.control), promote=False, by=BY)
    fleet.report("r1", "p")
    assert first.proposer() == second.proposer() == "r1"
    assert first.propose(new, "test").instances == ()
    # A second proposal meanwhile (a sidecar that has not seen r1 yet, or `plan canary`) fails cleanly.
    with pytest.raises(CanaryError, match="on trial already"):
        second.propose(plan_of(0, 200), "test")
    # Replicas that stopped reporting are not counted: r1 alone again proposes on an instance.
    fleet.now += 60
    fleet.report("r1", "p")
    end_canary(fleet.control, read_canary(fleet.control), promote=False, by=BY)
    assert first.replicas() == ["r1"] and first.propose(new, "test").instances == ("lm_0_1",)


def test_a_whole_replica_no_worse_than_its_baseline_is_promoted_though_colder_than_the_others(tmp_path):
    fleet, controller, good, new, promoted = fleet_trial(tmp_path, canary_before=10, rest_before=2)
    fleet.now += 1
    fleet.serve("r1", cold=10, n=20)
    fleet.serve("r2", cold=2, n=20)
    fleet.now += 300
    assert controller.tick().action == "wait"
    status = controller.status()["trial"]
    assert status["replicas"] == ["r2"] and status["before"]["canary"]["cold_share"] == 0.5
    assert status["canary"]["requests"] == 20 and status["rest"]["requests"] == 20
    fleet.now += 300
    verdict = controller.tick()
    assert verdict.action == "promote", verdict.reason
    assert PlanHistory(fleet.control).current().id == plan_digest(new) and read_canary(fleet.control) is None
    assert [p.plan_id for p in promoted] == [new.plan_id]
    assert controller.status()["verdicts"][0]["before"]["rest"]["cold_share"] == 0.1


def test_a_whole_replica_colder_than_its_baseline_is_rolled_back_at_once(tmp_path):
    fleet, controller, good, bad, _ = fleet_trial(tmp_path, canary_before=2, rest_before=2)
    fleet.now += 1
    fleet.serve("r1", cold=18, n=20)
    fleet.serve("r2", cold=2, n=20)
    fleet.now += 30
    verdict = controller.tick()
    assert verdict.action == "rollback" and "cold share 10.0% -> 90.0%" in verdict.reason
    assert read_canary(fleet.control) is None and PlanHistory(fleet.control).current().id == plan_digest(good)
    assert controller.status()["counts"] == {"promoted": 0, "rolled_back": 1}


def test_a_replica_that_left_is_not_read_for_a_new_trial(tmp_path):
    # r3 served (cold) before the trial, then left: it no longer reports, and its logs stay in the folder.
    fleet = FleetLogs(tmp_path, ("r1", "r2", "r3"))
    fleet.serve("r3", cold=20, n=20)
    fleet.report("r3", "old")
    fleet, controller, good, new, _ = fleet_trial(tmp_path, canary_before=2, rest_before=2,
                                                  replicas=("r1", "r2", "r3"))
    fleet.now += 1
    fleet.serve("r1", cold=2, n=20)
    fleet.serve("r2", cold=2, n=20)
    fleet.serve("r3", cold=20, n=20)  # were it read, the others would look colder and the canary better
    fleet.now += 600
    assert controller.tick().action == "promote"
    verdict = controller.status()["verdicts"][0]
    assert verdict["replicas"] == ["r2"] and verdict["rest"]["requests"] == 20
    assert verdict["before"]["rest"]["requests"] == 20


def test_a_whole_replica_without_a_baseline_or_another_replica_is_rolled_back_saying_why(tmp_path):
    fleet = FleetLogs(tmp_path)
    fleet.serve("r1", cold=0, n=4)  # 4 requests a side before the trial, of canary_min_requests 10
    fleet.serve("r2", cold=0, n=4)
    fleet.now = 1000.0
    write_live_plan(fleet.control, plan_of(0), by=BY)
    for replica in ("r1", "r2"):
        fleet.report(replica, plan_of(0).plan_id)
    controller, _ = fleet.controller("r1")
    new = plan_of(0, 100)
    controller.propose(new, "test")
    fleet.report("r1", new.plan_id)
    verdict = controller.tick()
    assert verdict.action == "rollback" and "no baseline" in verdict.reason and "4 requests on r1" in verdict.reason
    assert read_canary(fleet.control) is None
    # `plan canary --replica r1` on a sidecar with no fleet log folder: nothing to compare with.
    start_canary(fleet.control, new, host="r1", by=BY, now=fleet.now)
    alone = CanaryController(fleet.control, fleet.logs / "r1", SETTINGS, host="r1", clock=lambda: fleet.now)
    verdict = alone.tick()
    assert verdict.action == "rollback" and "fleet_log_dir" in verdict.reason


EIGHT = tuple(f"r{i}" for i in range(1, 9))


def eight_replicas(tmp_path, *, share=None):
    """Eight replicas serving plan ``good``, 6 requests each (of three tenants) in the window before a trial r1
    proposes: one replica alone has less than canary_min_requests (10) there."""
    fleet = FleetLogs(tmp_path, EIGHT)
    good, new = plan_of(0), plan_of(0, 100)
    write_live_plan(fleet.control, good, by=BY)
    for index, replica in enumerate(EIGHT):
        for tenant in ("acme", "globex", "initech"):
            fleet.serve(replica, cold=index % 2, n=2, tenant=tenant)
    fleet.now = 1000.0
    for replica in EIGHT:
        fleet.report(replica, good.plan_id)
    settings = {} if share is None else {"canary_fleet_share": share}
    controller, promoted = fleet.controller("r1", **settings)
    return fleet, controller, good, new, promoted


def serve_the_window(fleet, canary, *, canary_cold):
    """Each replica serves 6 more requests over 240 s of the trial; those on trial ``canary_cold`` of them cold."""
    for replica in EIGHT:
        for tenant in ("acme", "globex", "initech"):
            cold = canary_cold // 3 if replica in canary.hosts else EIGHT.index(replica) % 2
            fleet.serve(replica, cold=cold, n=2, tenant=tenant)
        fleet.now += 30


def test_a_trial_in_a_fleet_of_eight_runs_on_enough_replicas_to_be_judged_and_is_promoted(tmp_path):
    fleet, controller, good, new, promoted = eight_replicas(tmp_path)
    canary = controller.propose(new, "test")
    # r1 and the busiest others (a tie: by name) until they served twice canary_min_requests: 4 of 8, the share.
    assert canary.hosts == ("r1", "r2", "r3", "r4") and canary.instances == ()
    assert read_canary(fleet.control) == canary
    assert controller.tick().action == "wait"  # r2-r4 have not applied it yet
    for replica in canary.hosts:
        fleet.report(replica, new.plan_id)
    assert controller.tick().action == "wait"
    status = controller.status()["trial"]
    assert status["canary_replicas"] == ["r1", "r2", "r3", "r4"] and status["replicas"] == ["r5", "r6", "r7", "r8"]
    assert status["before"]["canary"]["requests"] == status["before"]["rest"]["requests"] == 24
    serve_the_window(fleet, canary, canary_cold=1)
    fleet.now += 600
    verdict = controller.tick()
    assert verdict.action == "promote", verdict.reason
    assert [p.plan_id for p in promoted] == [new.plan_id]
    assert controller.status()["verdicts"][0]["canary_replicas"] == ["r1", "r2", "r3", "r4"]


def test_a_worse_plan_on_a_share_of_eight_replicas_is_rolled_back_by_the_judge(tmp_path):
    fleet, controller, good, bad, _ = eight_replicas(tmp_path)
    canary = controller.propose(bad, "test")
    for replica in canary.hosts:
        fleet.report(replica, bad.plan_id)
    assert controller.tick().action == "wait"
    serve_the_window(fleet, canary, canary_cold=6)
    assert controller.tick().action == "wait"  # 24 requests a side: not yet below canary_alpha
    serve_the_window(fleet, canary, canary_cold=6)
    verdict = controller.tick()
    assert verdict.action == "rollback" and "cold share" in verdict.reason, verdict.reason
    assert fleet.now - 1000.0 < 600  # by the judge, before the window ends
    assert read_canary(fleet.control) is None and PlanHistory(fleet.control).current().id == plan_digest(good)


def test_on_one_replica_of_eight_the_same_trial_has_too_little_traffic_to_be_judged(tmp_path):
    fleet, controller, good, new, _ = eight_replicas(tmp_path, share=0.0)
    canary = controller.propose(new, "test")
    assert canary.hosts == ("r1",)
    fleet.report("r1", new.plan_id)
    verdict = controller.tick()
    assert verdict.action == "rollback" and "no baseline" in verdict.reason and "6 requests on r1" in verdict.reason


def test_a_trial_never_takes_more_than_half_the_fleets_traffic(tmp_path):
    """r2 served most of the window before: taking it would leave the others too little to be judged against."""
    fleet = FleetLogs(tmp_path, EIGHT)
    fleet.serve("r2", cold=0, n=40)
    for replica in EIGHT:
        if replica != "r2":
            fleet.serve(replica, cold=0, n=2)
    fleet.now = 1000.0
    for replica in EIGHT:
        fleet.report(replica, "p")
    controller, _ = fleet.controller("r1")
    assert controller.canary_replicas(list(EIGHT)) == ("r1", "r3", "r4", "r5")


def test_a_trial_s_replicas_are_checked_where_canary_json_is_read(tmp_path):
    good = plan_of(0)
    with pytest.raises(CanaryError, match="replica"):
        start_canary(tmp_path, good, host="r1", replicas=["../x"], by=BY)
    canary = start_canary(tmp_path, good, host="r1", replicas=["r2", "r3"], by=BY, now=5.0)
    assert read_canary(tmp_path) == canary and canary.targets("r3", "lm_0_0") and not canary.targets("r4", "lm_0_0")
    raw = (tmp_path / "canary.json").read_bytes()
    for bad in (b'"replicas": ["r1"]', b'"replicas": ["r2", "r2"]', b'"replicas": [""]', b'"replicas": "r2"'):
        (tmp_path / "canary.json").write_bytes(raw.replace(b'"replicas": ["r2", "r3"]', bad))
        with pytest.raises(PlanError):
            read_canary(tmp_path)
    # A canary.json written before trials could span replicas (no "replicas" key) is a trial on host alone.
    (tmp_path / "canary.json").write_bytes(raw.replace(b', "replicas": ["r2", "r3"]', b""))
    assert read_canary(tmp_path).hosts == ("r1",)


def test_a_fleet_replica_s_own_logs_are_its_folder_of_the_fleet_log_folder(tmp_path):
    from warmup_tools.common.errors import ConfigError
    from warmup_tools.sidecar.app import replica_log_dir

    assert replica_log_dir(SidecarConfig(replan_log_dir=tmp_path), "r1") == tmp_path
    fleet = SidecarConfig(fleet_log_dir=tmp_path)
    assert replica_log_dir(fleet, "r1") == tmp_path / "r1"
    with pytest.raises(ConfigError, match="not this replica's folder"):
        replica_log_dir(dataclasses.replace(fleet, replan_log_dir=tmp_path / "r2"), "r1")


def test_a_replica_s_canary_is_built_from_its_sidecar_settings_and_judges_only_once_started(tmp_path):
    from warmup_tools.common.errors import ConfigError
    from warmup_tools.sidecar.app import replica_canary

    config = SidecarConfig(fleet_log_dir=tmp_path / "requests", coverage_stale_s=12.0)
    canary = replica_canary(config, tmp_path / "control", "r2")
    assert (canary.host, canary.fleet_log_dir, canary.stale_s) == ("r2", tmp_path / "requests", 12.0)
    assert canary.status()["judging"] is False  # a sidecar with canary_judge false never starts it
    canary.start(60.0)
    try:
        assert canary.status()["judging"] is True
    finally:
        canary.stop()
    with pytest.raises(ConfigError, match="request logs"):
        replica_canary(SidecarConfig(), tmp_path / "control", "r1")
