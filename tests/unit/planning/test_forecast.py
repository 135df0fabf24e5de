import math
import random

from warmup_tools.planning.forecast import HOUR, forecast_heat


def diurnal_events(days=3, seed=0):
    """Two clusters: one steady, one only busy in working hours; a learnt model can see the hour."""
    rng = random.Random(seed)
    events = []
    for hour in range(days * 24):
        local = hour % 24
        for key, rate in (("steady", 20), ("office", 60 if 9 <= local < 17 else 1)):
            for _ in range(rng.randint(int(rate * 0.8), int(rate * 1.2))):
                events.append((hour * HOUR + rng.random() * HOUR, key, "acme", "support"))
    return sorted(events)


def test_both_errors_are_reported_and_the_learnt_model_is_used_only_when_it_wins():
    events = diurnal_events()
    result = forecast_heat(events, now=3 * 24 * HOUR, half_life_s=6 * HOUR, holdout=0.2)
    assert result.baseline_error is not None and result.learnt_error is not None
    # The hour of day explains the office cluster; decayed frequency cannot see it.
    assert result.learnt_error < result.baseline_error
    assert result.model == "learnt_gbdt" and set(result.learnt_rates) == {"steady", "office"}
    assert all(math.isfinite(r) and r >= 0 for r in result.learnt_rates.values())
    # One steady cluster has nothing for the hour of day to explain: the baseline is kept.
    steady = [e for e in events if e[1] == "steady"]
    kept = forecast_heat(steady, now=3 * 24 * HOUR, half_life_s=6 * HOUR, holdout=0.2)
    assert kept.learnt_error >= kept.baseline_error
    assert kept.model == "decayed_frequency" and kept.learnt_rates is None


def test_short_logs_have_a_baseline_but_no_learnt_model():
    events = [(t * 60.0, "a", "acme", "") for t in range(30)]
    result = forecast_heat(events, now=1800.0, half_life_s=6 * HOUR)
    assert result.baseline_error is not None and result.learnt_rates is None
    assert forecast_heat([], now=0, half_life_s=HOUR).baseline_error is None
