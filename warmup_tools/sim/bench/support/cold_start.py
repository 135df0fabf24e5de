"""The cold-start cost of a replay, from its served requests: what ``bench fleet-scale --runs cold-start`` and
``bench replay`` print (docs/fleet.md, "At scale").

A **sample** is one served request: its arrival in (modelled) seconds from the event's reference (a fleet's start,
a replica's join, an adapter's first request), its TTFT, and its cached and prompt tokens. For an event:

- the **windows** are its first :data:`WINDOWS_S` (60 s and 5 min, modelled) after it;
- the **steady** state is the replay after its first :data:`STEADY_AFTER_S` (5 min, modelled) from the fleet's
  start, to its end; its TTFT p99 is the **steady p99**;
- a window's **P99 jump** is its TTFT p99 over the steady p99 (1.0: no jump);
- its **TTFT std** is the population standard deviation of its TTFTs; its **cached share** is its cached prompt
  tokens over its prompt tokens.

The **per-minute cached share** cuts the replay into whole :data:`MINUTE_S` windows from its start; comparing two
configurations, the worst window is the one where the first's share falls furthest below the second's.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Sequence

from warmup_tools.sim.bench.support.tables import markdown, p99

#: The windows after an event, in modelled seconds: the first minute and the first five.
WINDOWS_S = (60.0, 300.0)
#: Modelled seconds after a fleet's start from which the replay counts as steady.
STEADY_AFTER_S = 300.0
#: The width of the per-minute cached share's windows, in modelled seconds.
MINUTE_S = 60.0


@dataclasses.dataclass(frozen=True, slots=True)
class Sample:
    """One served request: arrival (modelled seconds from the replay's start), TTFT (ms; None: not known), its
    cached and prompt tokens and its adapter ("": the base model)."""

    at_s: float
    ttft_ms: float | None
    cached_tokens: int
    prompt_tokens: int
    adapter: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class Window:
    """The figures of the requests of one window (``None``: no request in it, or no TTFT to compute from)."""

    requests: int
    ttft_p99_ms: float | None
    p99_jump: float | None
    ttft_std_ms: float | None
    cached_share: float | None


def cached_share(samples: Sequence[Sample]) -> float | None:
    """Cached prompt tokens over prompt tokens (None: no prompt token)."""
    prompt = sum(s.prompt_tokens for s in samples)
    return sum(s.cached_tokens for s in samples) / prompt if prompt else None


def ttft_std(values: Sequence[float]) -> float | None:
    """The population standard deviation of ``values`` (None: none; 0 for one)."""
    return statistics.pstdev(values) if values else None


def steady_p99(samples: Sequence[Sample], after_s: float = STEADY_AFTER_S) -> float | None:
    """TTFT p99 of the samples that arrived at ``after_s`` or later (None: none with a TTFT)."""
    ttfts = [s.ttft_ms for s in samples if s.at_s >= after_s and s.ttft_ms is not None]
    return p99(ttfts) if ttfts else None


def window(samples: Sequence[Sample], start_s: float, length_s: float, steady: float | None) -> Window:
    """The figures of the samples arriving in ``[start_s, start_s + length_s)``; ``steady``: the steady p99."""
    inside = [s for s in samples if start_s <= s.at_s < start_s + length_s]
    ttfts = [s.ttft_ms for s in inside if s.ttft_ms is not None]
    tail = p99(ttfts) if ttfts else None
    jump = tail / steady if tail is not None and steady else None
    return Window(len(inside), tail, jump, ttft_std(ttfts), cached_share(inside))


def shifted(samples: Sequence[Sample], by_s: float) -> list[Sample]:
    """``samples`` with arrivals counted from ``by_s`` (an event's time) instead of the replay's start."""
    return [dataclasses.replace(s, at_s=s.at_s - by_s) for s in samples]


def after_adapters_live(samples: Sequence[Sample]) -> list[Sample]:
    """The samples of every adapter (not the base model), each counted from its adapter's first request in
    ``samples`` (the adapter going live for this traffic), pooled; empty when no request names an adapter."""
    first: dict[str, float] = {}
    for s in samples:
        if s.adapter:
            first[s.adapter] = min(first.get(s.adapter, s.at_s), s.at_s)
    return [dataclasses.replace(s, at_s=s.at_s - first[s.adapter]) for s in samples if s.adapter]


def steady_samples(by_replica: dict[str, Sequence[Sample]], joiner: str | None = None,
                   joined_at_s: float | None = None) -> list[Sample]:
    """Every replica's samples, less a ``joiner``'s in its first :data:`STEADY_AFTER_S` after ``joined_at_s``
    (a join's own cold start is not the fleet's steady state); :func:`steady_p99` takes those after the start's
    first :data:`STEADY_AFTER_S`."""
    out: list[Sample] = []
    for name, samples in by_replica.items():
        if name == joiner and joined_at_s is not None:
            out += [s for s in samples if not joined_at_s <= s.at_s < joined_at_s + STEADY_AFTER_S]
        else:
            out += samples
    return out


def minute_shares(samples: Sequence[Sample], minute_s: float = MINUTE_S,
                  until_s: float = math.inf) -> dict[int, float]:
    """The cached share of each ``minute_s`` window from 0 that ends by ``until_s`` (the replay's end: a last,
    partial window left out) with a prompt token in it, by window index."""
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        k = int(s.at_s // minute_s)
        if s.at_s >= 0 and (k + 1) * minute_s <= until_s:
            groups.setdefault(k, []).append(s)
    return {k: share for k, group in sorted(groups.items()) if (share := cached_share(group)) is not None}


def worst_window(first: dict[int, float], second: dict[int, float]) -> tuple[int, float] | None:
    """The window (index) where ``first``'s share minus ``second``'s is lowest, and that difference (in shares:
    -0.02 is 2 points below), over the windows both have (None: none in common)."""
    common = sorted(set(first) & set(second))
    if not common:
        return None
    worst = min(common, key=lambda k: (first[k] - second[k], k))
    return worst, first[worst] - second[worst]


def ratio(value: float | None) -> str:
    """A P99 jump or ratio as printed (``-`` when unknown)."""
    return "-" if value is None or not math.isfinite(value) else f"{value:.2f}"


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


@dataclasses.dataclass(frozen=True, slots=True)
class ColdRun:
    """One run of a cold-start comparison: its configuration ("plan", "no plan"), replicas, requests sent, its
    failures by reason (a Markdown table; "": none failed), every replica's served requests (samples counted
    from the replay's start), the replica that joined and when (None: none joined), and the replay's length."""

    config: str
    replicas: int
    requests: int
    failures: str
    samples: dict[str, list[Sample]]
    joiner: str | None = None
    joined_at_s: float | None = None
    #: The replay's length (the per-minute windows end by it).
    length_s: float = math.inf

    @property
    def fleet(self) -> list[Sample]:
        return [s for samples in self.samples.values() for s in samples]

    @property
    def steady(self) -> float | None:
        return steady_p99(steady_samples(self.samples, self.joiner, self.joined_at_s))

    def events(self) -> dict[str, list[Sample] | None]:
        """The samples after each event, counted from it (None: the event did not happen in this run)."""
        joined = (shifted(self.samples.get(self.joiner, []), self.joined_at_s)
                  if self.joiner is not None and self.joined_at_s is not None else None)
        adapters = after_adapters_live(self.fleet)
        return {"fleet start": self.fleet, "a replica joins": joined, "an adapter goes live": adapters or None}


def cold_start_report(plan: ColdRun, none: ColdRun, clock: str = "modelled") -> str:
    """The cold-start table (plan vs no plan per event and window), the steady and whole-replay figures, the
    per-minute cached share's worst window, and each run's failures by reason; ``clock``: what the times are
    (``modelled``: a profile's, ``measured``: this machine's)."""
    rows = []
    steady = {plan.config: plan.steady, none.config: none.steady}
    mine, theirs = plan.events(), none.events()
    for event in mine:
        for length in WINDOWS_S:
            if mine[event] is None or theirs[event] is None:
                why = ("no request names an adapter in this traffic" if event == "an adapter goes live"
                       else "no replica joined")
                rows.append((event, f"first {length:g} s", why, "", "", "", "", ""))
                continue
            a = window(mine[event], 0.0, length, steady[plan.config])
            b = window(theirs[event], 0.0, length, steady[none.config])
            rows.append((event, f"first {length:g} s", f"{a.requests} / {b.requests}",
                         f"{ms(a.ttft_p99_ms)} / {ms(b.ttft_p99_ms)}", f"{ratio(a.p99_jump)} / {ratio(b.p99_jump)}",
                         f"{ms(a.ttft_std_ms)} / {ms(b.ttft_std_ms)}",
                         f"{percent(a.cached_share)} / {percent(b.cached_share)}",
                         ratio(a.ttft_p99_ms / b.ttft_p99_ms if a.ttft_p99_ms is not None and b.ttft_p99_ms
                               else None)))
    text = markdown(("event", "window", "requests, plan / no plan", f"TTFT p99 ({clock} ms)",
                     "P99 jump (over the steady p99)", f"TTFT std ({clock} ms)", "prompt tokens from cache",
                     "TTFT p99, plan over no plan"), rows)
    whole = {run.config: (cached_share(run.fleet), p99([s.ttft_ms for s in run.fleet if s.ttft_ms is not None]))
             for run in (plan, none)}
    lines = [text, "",
             f"steady (after the first {STEADY_AFTER_S:g} s, a joiner's own first {STEADY_AFTER_S:g} s left "
             f"out): TTFT p99 {ms(steady[plan.config])} ms with the plan, {ms(steady[none.config])} ms without",
             f"whole replay: prompt tokens from cache {percent(whole[plan.config][0])} with the plan, "
             f"{percent(whole[none.config][0])} without; TTFT p99 {ms(whole[plan.config][1])} / "
             f"{ms(whole[none.config][1])} {clock} ms (plan over no plan "
             f"{ratio(whole[plan.config][1] / whole[none.config][1] if whole[none.config][1] else None)})"]
    first = minute_shares(plan.fleet, until_s=plan.length_s)
    second = minute_shares(none.fleet, until_s=none.length_s)
    worst = worst_window(first, second)
    if worst is not None:
        k, gap = worst
        lines.append(f"per-minute prompt tokens from cache ({len(set(first) & set(second))} minutes): worst "
                     f"minute {k} (from {k * MINUTE_S / 60:g} min), {first[k]:.1%} with the plan against "
                     f"{second[k]:.1%} without: {gap * 100:+.1f} points")
        lines.append("each minute, with the plan / without: " + ", ".join(
            f"{k}: {first[k]:.1%} / {second[k]:.1%}" for k in sorted(set(first) & set(second))))
    for run in (plan, none):
        lines.append(f"\nfailed requests, {run.config}: " + (f"\n\n{run.failures}" if run.failures else
                                                             f"none of {run.requests}"))
    return "\n".join(lines)
