"""Forecasting each cluster's requests in the next window: decayed frequency, and a learnt model.

The planner warms what will be hot next. The baseline forecast is the decayed frequency (requests with a
half-life, as a rate). The learnt model is LightGBM (gradient boosted trees with a Poisson objective for
counts; deterministic, one thread) over per-cluster features at a
decision time ``t``: requests in the last 1, 3, 6 and 24 hours, the decayed frequency, the hour of day,
and the tenant and adapter. It is trained on decision times before a held-out tail of the log and
scored with the baseline on that tail (weighted absolute percentage error of each cluster's count in
the window); the planner uses it only when it scores better.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Hashable, Sequence

import numpy as np

HOUR = 3600.0
_MIN_TRAIN_ROWS = 40


@dataclasses.dataclass(frozen=True, slots=True)
class HeatForecast:
    baseline_error: float | None
    learnt_error: float | None
    #: Requests per hour per key at ``now`` from the learnt model when it beat the baseline, else None.
    learnt_rates: dict[Hashable, float] | None
    reason: str

    @property
    def model(self) -> str:
        return "learnt_gbdt" if self.learnt_rates is not None else "decayed_frequency"


def forecast_heat(events: Sequence[tuple[float, Hashable, str, str]], *, now: float, half_life_s: float,
                  holdout: float = 0.2, seed: int = 0) -> HeatForecast:
    """``events`` are (ts, key, tenant, adapter) per request; keys are clusters."""
    if not events:
        return HeatForecast(None, None, None, "no clustered requests")
    ts = np.array([e[0] for e in events], dtype=np.float64)
    t0, t1 = float(ts.min()), float(ts.max())
    if t1 - t0 < 60.0:
        return HeatForecast(None, None, None, "less than a minute of logs")
    split = t0 + (1.0 - holdout) * (t1 - t0)
    window = t1 - split
    table = _Table(events, half_life_s)
    keys = sorted(table.keys, key=repr)
    actual = {k: table.count(k, split, t1 + 1e-6) for k in keys}
    total = sum(actual.values())
    if total == 0:
        return HeatForecast(None, None, None, "no requests in the held-out window")
    baseline = {k: table.decayed(k, split) / _decayed_hours(split - t0, half_life_s) * window / HOUR for k in keys}
    baseline_error = sum(abs(baseline[k] - actual[k]) for k in keys) / total
    model = _fit(table, keys, t0 + 3 * HOUR, split - window, window, seed)
    if model is None:
        return HeatForecast(baseline_error, None, None, "too little history before the held-out window to learn")
    predicted = dict(zip(keys, np.maximum(model.predict(table.features(keys, split)), 0.0)))
    learnt_error = sum(abs(predicted[k] - actual[k]) for k in keys) / total
    if learnt_error >= baseline_error:
        return HeatForecast(baseline_error, learnt_error, None, "learnt model did not beat the baseline")
    final = _fit(table, keys, t0 + 3 * HOUR, now - window, window, seed) or model
    rates = np.maximum(final.predict(table.features(keys, now)), 0.0) / (window / HOUR)
    return HeatForecast(baseline_error, learnt_error, dict(zip(keys, map(float, rates))),
                        "learnt model beat the baseline on the held-out window")


class _Table:
    """Request times per key, with the tenant and adapter of each key."""

    def __init__(self, events: Sequence[tuple[float, Hashable, str, str]], half_life_s: float) -> None:
        times: dict[Hashable, list[float]] = defaultdict(list)
        self.scope: dict[Hashable, tuple[str, str]] = {}
        for t, key, tenant, adapter in events:
            times[key].append(t)
            self.scope[key] = (tenant, adapter)
        self.times = {k: np.sort(np.asarray(v)) for k, v in times.items()}
        self.keys = list(self.times)
        self.half_life_s = half_life_s
        tenants = sorted({s[0] for s in self.scope.values()})
        adapters = sorted({s[1] for s in self.scope.values()})
        self.tenant_code = {t: i for i, t in enumerate(tenants)}
        self.adapter_code = {a: i for i, a in enumerate(adapters)}

    def count(self, key: Hashable, start: float, end: float) -> int:
        times = self.times[key]
        return int(np.searchsorted(times, end, "left") - np.searchsorted(times, start, "left"))

    def decayed(self, key: Hashable, t: float) -> float:
        times = self.times[key]
        past = times[: np.searchsorted(times, t, "left")]
        return float(np.sum(0.5 ** ((t - past) / self.half_life_s)))

    def features(self, keys: Sequence[Hashable], t: float) -> np.ndarray:
        hour = (t % 86400.0) / HOUR
        rows = []
        for k in keys:
            tenant, adapter = self.scope[k]
            rows.append([self.count(k, t - h * HOUR, t) for h in (1, 3, 6, 24)] + [
                self.decayed(k, t), math.sin(2 * math.pi * hour / 24), math.cos(2 * math.pi * hour / 24),
                self.tenant_code[tenant], self.adapter_code[adapter]])
        return np.asarray(rows, dtype=np.float64)


def _fit(table: _Table, keys: Sequence[Hashable], first: float, last: float, window: float, seed: int):
    from lightgbm import LGBMRegressor

    starts = np.arange(first, last + 1e-6, HOUR)
    if len(starts) == 0:
        return None
    x = np.concatenate([table.features(keys, t) for t in starts])
    y = np.asarray([table.count(k, t, t + window) for t in starts for k in keys], dtype=np.float64)
    if len(y) < _MIN_TRAIN_ROWS or not np.any(y):
        return None
    model = LGBMRegressor(objective="poisson", n_estimators=200, learning_rate=0.05, num_leaves=15,
                          min_child_samples=5, random_state=seed, deterministic=True, force_row_wise=True,
                          n_jobs=1, verbose=-1)
    return model.fit(x, y, categorical_feature=[7, 8])


def _decayed_hours(span_s: float, half_life_s: float) -> float:
    """Hours that the decayed weights of a uniform rate over ``span_s`` add up to."""
    lam = math.log(2) / half_life_s
    return (1.0 - math.exp(-lam * max(span_s, 1.0))) / lam / HOUR
