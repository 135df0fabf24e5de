"""Warm coverage in the sidecar's readiness: the monitor's rounds with fake probes and plan statuses."""

from __future__ import annotations

import dataclasses
import logging

from tests.unit.sidecar.test_monitor import FakeTriton
from warmup_tools.control.plan_control import AdapterCoverage, PlanStatus, PlanStatusBoard
from warmup_tools.sidecar.config import SidecarConfig
from warmup_tools.sidecar.coverage import CoverageReader, evaluate
from warmup_tools.sidecar.endpoints import prometheus_text
from warmup_tools.sidecar.monitor import Monitor

BUDGET = "4 of 20 planned blocks do not fit the warm-up budget (1,000 of 1,000 bytes)"


def status(instance="lora_adapter_0_0", plan="p1", state="applied", at=100.0, **adapters):
    return PlanStatus(instance, plan, "control", state,
                      {name: AdapterCoverage(*value) for name, value in adapters.items()}, reported_at=at)


def test_coverage_needs_every_live_adapter_above_the_threshold_on_every_fresh_instance():
    full = status(support=(20, 20), sql=(10, 10))
    verdict = evaluate({"a": full}, threshold=0.95, now=101, stale_s=30)
    assert verdict.ready and verdict.covered == {"a"}
    assert verdict.status["instances"]["a"]["adapters"]["sql"] == {
        "coverage": 1.0, "planned": 10, "resident": 10, "live": True, "shortfall": ""}

    low = status(support=(20, 16, True, BUDGET), legal=(10, 0, False))  # legal is not live: not counted
    verdict = evaluate({"a": full, "b": low}, threshold=0.95, now=101, stale_s=30)
    assert not verdict.ready
    assert verdict.reason == f"b/support: warm coverage 80.0% of its plan (16/20 blocks) is below 95%; {BUDGET}"
    assert evaluate({"b": low}, threshold=0.8, now=101, stale_s=30).ready

    assert not evaluate({}, threshold=0.95, now=101, stale_s=30).ready
    stale = evaluate({"a": full}, threshold=0.95, now=200, stale_s=30)
    assert not stale.ready and "older than 30 s" in stale.reason and stale.status["instances"]["a"]["stale"]


def test_a_live_plan_change_keeps_a_covered_instance_ready_while_it_warms():
    warming = status(plan="p2", state="warming", support=(30, 20))
    assert not evaluate({"a": warming}, threshold=0.95, now=101, stale_s=30).ready  # a new pod: not yet
    assert evaluate({"a": warming}, threshold=0.95, now=101, stale_s=30, covered={"a"}).ready


class FakeCoverage:
    def __init__(self, tmp_path, now):
        self.board = PlanStatusBoard(tmp_path)
        self.reader = CoverageReader(tmp_path, 0.95, 30.0, clock=lambda: now[0], host="")

    def __call__(self, covered):
        return self.reader(covered)


def test_ready_follows_coverage_and_status_and_metrics_show_it(tmp_path, caplog):
    now = [100.0]
    triton = FakeTriton()
    coverage = FakeCoverage(tmp_path, now)
    monitor = Monitor(SidecarConfig(), triton.probe, triton.server_ready, triton, coverage=coverage)
    monitor.run_once()
    readiness = monitor.readiness()
    assert not readiness.ready and "no lora_adapter instance has reported" in readiness.reason

    caplog.set_level(logging.WARNING)
    coverage.board.report(status(support=(20, 16, True, BUDGET)))
    monitor.run_once()
    readiness = monitor.readiness()
    assert not readiness.ready and readiness.reason.startswith("warm coverage: lora_adapter_0_0/support: warm "
                                                               "coverage 80.0%") and BUDGET in readiness.reason
    monitor.run_once()
    assert [r.getMessage() for r in caplog.records].count(f"lora_adapter_0_0/support: plan p1: {BUDGET}") == 1
    snapshot = monitor.snapshot()
    assert snapshot["ready"] is False and "warm coverage" in snapshot["reason"]
    entry = snapshot["coverage"]["instances"]["lora_adapter_0_0"]
    assert entry["plan_id"] == "p1" and entry["adapters"]["support"]["coverage"] == 0.8
    text = prometheus_text(snapshot)
    assert 'warmup_sidecar_warm_coverage{adapter="support",instance="lora_adapter_0_0"} 0.8' in text
    assert 'warmup_sidecar_warm_coverage_shortfall{adapter="support",instance="lora_adapter_0_0"} 1.0' in text

    coverage.board.report(status(support=(20, 20)))
    monitor.run_once()
    assert monitor.readiness().ready and monitor.snapshot()["reason"] == ""
    # A live plan change: warming the new plan does not take the instance out of rotation...
    coverage.board.report(status(plan="p2", state="warming", support=(30, 20)))
    monitor.run_once()
    assert monitor.readiness().ready
    # ...but a model that is down still is, whatever the coverage.
    triton.dead.add("embedding_cache")
    monitor.run_once()
    assert "embedding_cache" in monitor.readiness().reason


def test_without_a_coverage_reader_readiness_is_as_before():
    triton = FakeTriton()
    monitor = Monitor(SidecarConfig(), triton.probe, triton.server_ready, triton)
    monitor.run_once()
    assert monitor.readiness().ready and monitor.snapshot()["coverage"] == {"checked": False}


def test_a_reloaded_lora_adapter_must_reach_the_coverage_threshold_again(tmp_path):
    now = [100.0]
    triton = FakeTriton()
    coverage = FakeCoverage(tmp_path, now)
    monitor = Monitor(SidecarConfig(), triton.probe, triton.server_ready, triton, coverage=coverage)
    coverage.board.report(status(support=(20, 20)))
    monitor.run_once()
    assert monitor.readiness().ready  # covered: a later plan change may warm without leaving rotation
    # The stub dies and is reloaded; its instance comes back warming its plan from nothing.
    triton.dead.add("lora_adapter")
    coverage.board.report(status(state="warming", support=(20, 3)))
    monitor.run_once()
    assert ("reload", "lora_adapter") in triton.calls
    monitor.run_once()  # the probes pass again: only coverage can keep the pod out now
    readiness = monitor.readiness()
    assert not readiness.ready and readiness.reason == "warm coverage: lora_adapter_0_0: warming its plan"
    coverage.board.report(status(support=(20, 20)))
    monitor.run_once()
    assert monitor.readiness().ready


def test_status_and_metrics_show_each_instances_live_check_per_plan_and_adapter_without_its_plan_id(tmp_path):
    from warmup_tools.control.plan_control import PinReport
    from warmup_tools.sidecar.endpoints import public_status

    now = [100.0]
    triton = FakeTriton()
    coverage = FakeCoverage(tmp_path, now)
    monitor = Monitor(SidecarConfig(), triton.probe, triton.server_ready, triton, coverage=coverage)
    pins = PinReport.from_dict({
        "plan_id": "p1", "state": "released", "window_s": 60.0, "pin_hits": 2, "shadow_hits": 31, "releases": 1,
        "released_blocks": 9, "reason": "over 61 s the pinned blocks gave 2 block hits and the blocks evicted for "
        "them would have given 31 (plan p1)",
        "adapters": {"support": {"pin_hits": 2, "shadow_hits": 31, "released_blocks": 9},
                     "base": {"pinned_blocks": 0}}})
    # Released pins still count as covered (the instance reports them resident): the pod stays ready.
    coverage.board.report(dataclasses.replace(status(support=(20, 20)), pins=pins))
    monitor.run_once()
    assert monitor.readiness().ready
    entry = monitor.snapshot()["coverage"]["instances"]["lora_adapter_0_0"]
    assert entry["pins"]["state"] == "released" and entry["pins"]["adapters"]["support"]["shadow_hits"] == 31
    public = public_status(monitor.snapshot())["coverage"]["instances"]["lora_adapter_0_0"]["pins"]
    assert "plan_id" not in public and public["reason"].endswith("(plan <plan>)")
    text = prometheus_text(public_status(monitor.snapshot()))
    for line in ('warmup_sidecar_pin_hits{adapter="support",instance="lora_adapter_0_0"} 2.0',
                 'warmup_sidecar_pin_shadow_hits{adapter="support",instance="lora_adapter_0_0"} 31.0',
                 'warmup_sidecar_pins_released_total{adapter="support",instance="lora_adapter_0_0"} 9.0',
                 'warmup_sidecar_pinned_blocks{adapter="base",instance="lora_adapter_0_0"} 0.0',
                 'warmup_sidecar_pin_state{instance="lora_adapter_0_0",state="released"} 1.0',
                 'warmup_sidecar_pin_state{instance="lora_adapter_0_0",state="pinned"} 0.0'):
        assert line in text, line

    # An instance without a KV cache (or from before the check) has no pins: shown as null, no series.
    coverage.board.report(status(support=(20, 20)))
    monitor.run_once()
    assert monitor.snapshot()["coverage"]["instances"]["lora_adapter_0_0"]["pins"] is None
    assert "warmup_sidecar_pin_state{" not in prometheus_text(public_status(monitor.snapshot()))
