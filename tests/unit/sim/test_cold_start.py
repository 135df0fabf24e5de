"""The cold-start figures of bench fleet-scale and bench replay, on crafted samples: windows after an event, the
steady p99 and the P99 jump, the TTFT standard deviation, the per-minute cached share and its worst window."""

from __future__ import annotations

import math

from warmup_tools.sim.bench.support.cold_start import (
    Sample,
    after_adapters_live,
    cached_share,
    minute_shares,
    shifted,
    steady_p99,
    steady_samples,
    ttft_std,
    window,
    worst_window,
)


def test_a_window_holds_the_requests_arriving_in_it_and_its_p99_jump_is_over_the_steady_p99():
    samples = [Sample(0.0, 900.0, 0, 100), Sample(30.0, 300.0, 50, 100), Sample(59.9, 600.0, 100, 100),
               Sample(60.0, 100.0, 100, 100), Sample(400.0, 200.0, 0, 100), Sample(500.0, 300.0, 0, 100)]
    steady = steady_p99(samples)
    assert steady == 300.0, "the requests from 300 modelled s on"
    first = window(samples, 0.0, 60.0, steady)
    assert first.requests == 3 and first.ttft_p99_ms == 900.0 and first.p99_jump == 3.0
    assert math.isclose(first.cached_share, 150 / 300)
    assert math.isclose(first.ttft_std_ms, math.sqrt(((900 - 600) ** 2 + (300 - 600) ** 2 + 0) / 3))
    five = window(samples, 0.0, 300.0, steady)
    assert five.requests == 4 and five.p99_jump == 3.0 and math.isclose(five.cached_share, 250 / 400)


def test_a_window_with_nothing_in_it_or_no_steady_state_has_no_figures():
    empty = window([Sample(10.0, 5.0, 1, 2)], 100.0, 60.0, 5.0)
    assert (empty.requests, empty.ttft_p99_ms, empty.p99_jump, empty.ttft_std_ms, empty.cached_share) == (
        0, None, None, None, None)
    early_only = [Sample(10.0, 5.0, 1, 2)]
    assert steady_p99(early_only) is None
    assert window(early_only, 0.0, 60.0, steady_p99(early_only)).p99_jump is None
    no_ttft = window([Sample(1.0, None, 0, 10)], 0.0, 60.0, 100.0)
    assert no_ttft.requests == 1 and no_ttft.ttft_p99_ms is None and no_ttft.cached_share == 0.0


def test_the_standard_deviation_is_the_populations():
    assert ttft_std([]) is None and ttft_std([7.0]) == 0.0
    assert ttft_std([1.0, 3.0]) == 1.0


def test_a_joiners_first_minutes_are_not_the_fleets_steady_state():
    fleet = {"r1": [Sample(400.0, 100.0, 0, 1)],
             "r2": [Sample(350.0, 5000.0, 0, 1), Sample(700.0, 120.0, 0, 1), Sample(2000.0, 110.0, 0, 1)]}
    kept = steady_samples(fleet, "r2", 340.0)
    assert sorted(s.at_s for s in kept) == [400.0, 700.0, 2000.0], "the joiner's 5000 ms at 350 s is its own"
    assert steady_p99(kept) == 120.0
    assert len(steady_samples(fleet)) == 4
    joined = shifted(fleet["r2"], 340.0)
    assert [s.at_s for s in joined] == [10.0, 360.0, 1660.0]
    assert window(joined, 0.0, 60.0, 120.0).p99_jump == 5000.0 / 120.0


def test_each_adapter_counts_from_its_own_first_request():
    samples = [Sample(5.0, 1.0, 0, 1), Sample(20.0, 2.0, 0, 1, "sql"), Sample(50.0, 3.0, 0, 1, "legal"),
               Sample(70.0, 4.0, 0, 1, "sql")]
    live = after_adapters_live(samples)
    assert sorted((s.adapter, s.at_s) for s in live) == [("legal", 0.0), ("sql", 0.0), ("sql", 50.0)]
    assert after_adapters_live([Sample(5.0, 1.0, 0, 1)]) == [], "the base model only: no adapter goes live"


def test_the_per_minute_share_and_its_worst_window_between_two_runs():
    plan = [Sample(0.0, None, 10, 100), Sample(59.0, None, 10, 100), Sample(61.0, None, 90, 100),
            Sample(150.0, None, 0, 0), Sample(200.0, None, 40, 100), Sample(-1.0, None, 100, 100)]
    none = [Sample(1.0, None, 30, 100), Sample(65.0, None, 50, 100), Sample(190.0, None, 40, 100),
            Sample(250.0, None, 99, 100)]
    mine, theirs = minute_shares(plan), minute_shares(none)
    assert mine == {0: 0.1, 1: 0.9, 3: 0.4}, "no prompt token in minute 2; before the start left out"
    assert theirs == {0: 0.3, 1: 0.5, 3: 0.4, 4: 0.99}
    minute, gap = worst_window(mine, theirs)
    assert minute == 0 and math.isclose(gap, -0.2), "minutes both runs have only"
    assert worst_window({0: 0.5}, {1: 0.5}) is None
    assert minute_shares(none, until_s=240.0) == {0: 0.3, 1: 0.5, 3: 0.4}, "minute 4 ends after the replay"
    assert cached_share([]) is None


def test_the_report_compares_the_plan_with_none_per_event_and_window():
    from warmup_tools.sim.bench.support.cold_start import ColdRun, cold_start_report

    def fleet(first_ttft: float, first_cached: int) -> dict[str, list[Sample]]:
        early = [Sample(float(t), first_ttft, first_cached, 100) for t in range(0, 60, 10)]
        later = [Sample(float(t), 100.0, 50, 100) for t in range(60, 900, 10)]
        joiner = [Sample(400.0 + t, 2 * first_ttft, first_cached, 100) for t in range(0, 60, 10)]
        return {"r1": early + later, "r2": joiner}

    plan = ColdRun("plan", 1, 100, "", fleet(150.0, 80), "r2", 400.0)
    none = ColdRun("no plan", 1, 100, "| HTTP status | ... |", fleet(300.0, 0), "r2", 400.0)
    text = cold_start_report(plan, none)
    assert "| fleet start | first 60 s | 6 / 6 | 150 / 300 | 1.50 / 3.00 | 0 / 0 | 80.0% / 0.0% | 0.50 |" in text
    assert "| a replica joins | first 60 s | 6 / 6 | 300 / 600 | 3.00 / 6.00 |" in text
    assert "| an adapter goes live | first 60 s | no request names an adapter in this traffic |" in text
    assert "steady (after the first 300 s, a joiner's own first 300 s left out): TTFT p99 100 ms" in text
    assert "worst minute 6 (from 6 min), 80.0% with the plan against 0.0% without: +80.0 points" not in text
    assert "+0.0 points" in text, "from minute 1 on both runs serve alike: the worst gap is 0"
    assert "failed requests, plan: none of 100" in text and "failed requests, no plan: \n\n| HTTP status" in text
    alone = cold_start_report(ColdRun("plan", 1, 1, "", {"r1": [Sample(1.0, 5.0, 0, 1)]}),
                              ColdRun("no plan", 1, 1, "", {"r1": [Sample(1.0, 5.0, 0, 1)]}), clock="measured")
    assert "| a replica joins | first 300 s | no replica joined |" in alone and "TTFT p99 (measured ms)" in alone
