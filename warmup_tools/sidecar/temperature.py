"""Service temperature: cold, warm or hot, per replica and per adapter, with hysteresis. No I/O.

One ready bit says whether a replica may serve; a router choosing among ready replicas also wants to know
which of them serve from a warm KV cache. Each probe round the monitor turns what it saw into one
:class:`Reading` per scope (the replica, and each adapter its ``lora_adapter`` instances report) and
feeds them to :meth:`TemperatureTracker.observe`:

- **cold**: not serving (the replica is not ready; an adapter is not live on every instance that reports it);
- **warm**: serving, but the planned hot set is resident below ``hot_share`` (on the instance where it is
  lowest), or the probe's time to first token is above ``hot_ttft_s`` (or unknown);
- **hot**: serving, the hot set resident at ``hot_share`` or above and the probe TTFT within ``hot_ttft_s``.

Cold follows readiness at once, both ways (``/ready`` answers 200 exactly when the replica is warm or hot).
Between warm and hot a scope moves only after ``confirm_rounds`` rounds in a row read the other state, so
one slow probe or one report taken mid-warm-up does not flap a router's choice; a scope that starts
serving is warm until that many rounds read it hot.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Iterable


class Temperature(str, enum.Enum):
    COLD = "cold"
    WARM = "warm"
    HOT = "hot"

    @property
    def level(self) -> int:
        """0 cold, 1 warm, 2 hot: the value of the ``warmup_temperature`` gauge (higher is better)."""
        return _LEVELS[self]


_LEVELS = {Temperature.COLD: 0, Temperature.WARM: 1, Temperature.HOT: 2}

#: The scope of the replica as a whole; adapters are scoped by name (the base model is ``base``), and no
#: adapter is named "".
REPLICA = ""


@dataclasses.dataclass(frozen=True, slots=True)
class Reading:
    """What one probe round saw of one scope."""

    serving: bool
    #: Share of the planned hot set resident (the lowest over instances); 1.0 when nothing is planned.
    resident_share: float = 1.0
    #: Time to first token of the round's probe, seconds; None when no probe passed.
    ttft_s: float | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Thresholds:
    hot_share: float
    hot_ttft_s: float
    confirm_rounds: int


@dataclasses.dataclass(frozen=True, slots=True)
class Transition:
    scope: str
    old: Temperature
    new: Temperature
    why: str

    @property
    def label(self) -> str:
        """``replica`` or ``adapter <name>`` (how the log line names the scope)."""
        return "replica" if self.scope == REPLICA else f"adapter {self.scope}"


def classify(reading: Reading, thresholds: Thresholds) -> tuple[Temperature, str]:
    """The state one reading alone calls for, and why (the reason a transition is logged with)."""
    if not reading.serving:
        return Temperature.COLD, "not serving"
    misses = []
    if reading.resident_share < thresholds.hot_share:
        misses.append(f"hot set {reading.resident_share:.0%} resident, below {thresholds.hot_share:.0%}")
    if reading.ttft_s is None:
        misses.append("no probe TTFT")
    elif reading.ttft_s > thresholds.hot_ttft_s:
        misses.append(f"probe TTFT {reading.ttft_s * 1000:.0f} ms above {thresholds.hot_ttft_s * 1000:.0f} ms")
    if misses:
        return Temperature.WARM, "; ".join(misses)
    ttft = reading.ttft_s or 0.0
    return Temperature.HOT, (f"hot set {reading.resident_share:.0%} resident, probe TTFT {ttft * 1000:.0f} ms")


@dataclasses.dataclass(slots=True)
class _Scope:
    state: Temperature = Temperature.COLD
    #: The state the last rounds read, if not ``state``, and for how many rounds in a row.
    pending: Temperature | None = None
    streak: int = 0
    why: str = "not probed yet"


class TemperatureTracker:
    """The temperature of each scope from its readings, one call of :meth:`observe` per probe round."""

    def __init__(self, thresholds: Thresholds) -> None:
        self.thresholds = thresholds
        self._scopes: dict[str, _Scope] = {REPLICA: _Scope()}
        #: Transitions so far, by ``(scope kind, from, to)``; scope kind is ``replica`` or ``adapter``.
        self.counts: dict[tuple[str, str, str], int] = {}

    def observe(self, readings: dict[str, Reading]) -> list[Transition]:
        """Fold one round's readings in; scopes absent from ``readings`` (an adapter no instance reports any
        more) are forgotten, the replica never is. Returns the transitions this round made."""
        for gone in [s for s in self._scopes if s not in readings and s != REPLICA]:
            del self._scopes[gone]
        out = []
        for name, reading in readings.items():
            scope = self._scopes.setdefault(name, _Scope())
            target, why = classify(reading, self.thresholds)
            new = self._step(scope, target)
            scope.why = why
            if new is not None:
                out.append(Transition(name, scope.state, new, why))
                kind = ("replica" if name == REPLICA else "adapter", scope.state.value, new.value)
                self.counts[kind] = self.counts.get(kind, 0) + 1
                scope.state = new
        return out

    def state(self, scope: str = REPLICA) -> Temperature:
        found = self._scopes.get(scope)
        return found.state if found is not None else Temperature.COLD

    def adapters(self) -> dict[str, Temperature]:
        return {name: s.state for name, s in sorted(self._scopes.items()) if name != REPLICA}

    def snapshot(self) -> dict[str, object]:
        """``/status``'s ``temperature`` entry (JSON-ready)."""
        def entry(scope: _Scope) -> dict[str, object]:
            return {"state": scope.state.value, "why": scope.why,
                    "pending": None if scope.pending is None else {"state": scope.pending.value,
                                                                   "rounds": scope.streak}}

        return {"replica": entry(self._scopes[REPLICA]),
                "adapters": {n: entry(s) for n, s in sorted(self._scopes.items()) if n != REPLICA},
                "thresholds": dataclasses.asdict(self.thresholds),
                "transitions": [{"scope": k, "from": a, "to": b, "count": n}
                                for (k, a, b), n in sorted(self.counts.items())]}

    # ------------------------------------------------------------------------------------- helpers
    def _step(self, scope: _Scope, target: Temperature) -> Temperature | None:
        """The state ``scope`` moves to after reading ``target``, or None (see the module docstring)."""
        if target is scope.state:
            scope.pending, scope.streak = None, 0
            return None
        scope.streak = scope.streak + 1 if scope.pending is target else 1
        scope.pending = target
        if target is Temperature.COLD or scope.streak >= self.thresholds.confirm_rounds:
            scope.pending, scope.streak = None, 0
            return target
        if scope.state is Temperature.COLD:
            # NOTE: serving again is a fact readiness already decided; hot must still be earned over rounds.
            return Temperature.WARM
        return None


def replica_reading(ready: bool, shares: Iterable[float], ttft_s: float | None) -> Reading:
    """The replica's reading: ready, the lowest resident share of any live adapter on any instance."""
    return Reading(ready, min(shares, default=1.0), ttft_s)
