"""Service temperature: one reading to a state (a table), and the hysteresis between warm and hot."""

from __future__ import annotations

import pytest

from warmup_tools.sidecar.temperature import (
    REPLICA,
    Reading,
    Temperature,
    TemperatureTracker,
    Thresholds,
    classify,
    replica_reading,
)

COLD, WARM, HOT = Temperature.COLD, Temperature.WARM, Temperature.HOT
LIMITS = Thresholds(hot_share=0.95, hot_ttft_s=0.25, confirm_rounds=3)


@pytest.mark.parametrize("reading, state, why", [
    (Reading(False, 1.0, 0.01), COLD, "not serving"),
    (Reading(False, 0.0, None), COLD, "not serving"),
    (Reading(True, 1.0, 0.05), HOT, "hot set 100% resident, probe TTFT 50 ms"),
    (Reading(True, 0.95, 0.25), HOT, "hot set 95% resident"),  # both bounds are inclusive
    (Reading(True, 0.94, 0.05), WARM, "hot set 94% resident, below 95%"),
    (Reading(True, 1.0, 0.26), WARM, "probe TTFT 260 ms above 250 ms"),
    (Reading(True, 1.0, None), WARM, "no probe TTFT"),
    (Reading(True, 0.5, 0.9), WARM, "hot set 50% resident, below 95%; probe TTFT 900 ms above 250 ms"),
])
def test_one_reading_calls_for_a_state_with_its_reason(reading, state, why):
    got, reason = classify(reading, LIMITS)
    assert got is state and why in reason


def states(tracker, readings, scope=REPLICA):
    out = []
    for reading in readings:
        tracker.observe({scope: reading} if scope == REPLICA else {REPLICA: reading, scope: reading})
        out.append(tracker.state(scope))
    return out


HOT_R, WARM_R, COLD_R = Reading(True, 1.0, 0.05), Reading(True, 0.5, 0.05), Reading(False)


@pytest.mark.parametrize("readings, expected", [
    # Serving starts warm; hot only after three hot rounds in a row.
    ([HOT_R] * 4, [WARM, WARM, HOT, HOT]),
    ([WARM_R, HOT_R, HOT_R, HOT_R], [WARM, WARM, WARM, HOT]),
    # One or two odd rounds do not flap; the streak starts again after each.
    ([HOT_R] * 3 + [WARM_R, HOT_R, WARM_R, WARM_R, HOT_R], [WARM, WARM, HOT, HOT, HOT, HOT, HOT, HOT]),
    ([HOT_R] * 3 + [WARM_R] * 3, [WARM, WARM, HOT, HOT, HOT, WARM]),
    # Cold follows readiness at once, both ways, whatever the streak.
    ([HOT_R] * 3 + [COLD_R, HOT_R], [WARM, WARM, HOT, COLD, WARM]),
    ([COLD_R, WARM_R, COLD_R], [COLD, WARM, COLD]),
])
def test_hysteresis_between_warm_and_hot(readings, expected):
    assert states(TemperatureTracker(LIMITS), readings) == expected


def test_one_confirming_round_moves_at_once():
    tracker = TemperatureTracker(Thresholds(0.95, 0.25, confirm_rounds=1))
    assert states(tracker, [HOT_R, WARM_R, HOT_R, COLD_R]) == [HOT, WARM, HOT, COLD]


def test_transitions_are_returned_and_counted_by_scope_kind_and_states():
    tracker = TemperatureTracker(LIMITS)
    first = tracker.observe({REPLICA: HOT_R, "sql": WARM_R})
    assert [(t.label, t.old, t.new) for t in first] == [("replica", COLD, WARM), ("adapter sql", COLD, WARM)]
    for _ in range(2):
        tracker.observe({REPLICA: HOT_R, "sql": WARM_R})
    tracker.observe({REPLICA: COLD_R, "sql": COLD_R})
    assert tracker.counts == {("replica", "cold", "warm"): 1, ("replica", "warm", "hot"): 1,
                              ("replica", "hot", "cold"): 1, ("adapter", "cold", "warm"): 1,
                              ("adapter", "warm", "cold"): 1}
    snapshot = tracker.snapshot()
    assert snapshot["replica"]["state"] == "cold" and snapshot["adapters"]["sql"]["why"] == "not serving"
    assert {"scope": "replica", "from": "warm", "to": "hot", "count": 1} in snapshot["transitions"]


def test_an_adapter_no_instance_reports_is_forgotten_and_an_adapter_named_replica_is_its_own_scope():
    tracker = TemperatureTracker(LIMITS)
    tracker.observe({REPLICA: HOT_R, "replica": WARM_R, "legal": HOT_R})
    assert set(tracker.adapters()) == {"replica", "legal"}
    tracker.observe({REPLICA: HOT_R, "replica": WARM_R})
    assert set(tracker.adapters()) == {"replica"} and tracker.state("legal") is COLD


def test_pending_state_shows_in_the_snapshot():
    tracker = TemperatureTracker(LIMITS)
    tracker.observe({REPLICA: HOT_R})
    tracker.observe({REPLICA: HOT_R})
    assert tracker.snapshot()["replica"]["pending"] == {"state": "hot", "rounds": 2}


def test_the_replica_reads_the_lowest_share_and_full_when_nothing_is_planned():
    assert replica_reading(True, [1.0, 0.4, 0.9], 0.1) == Reading(True, 0.4, 0.1)
    assert replica_reading(True, [], 0.1) == Reading(True, 1.0, 0.1)
