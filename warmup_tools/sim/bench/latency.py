"""What the concurrency benchmarks share: one level's result, percentiles, the table row and the 8-vs-1
ratios against the targets of issue 9. Imports nothing that needs a server or a client."""

from __future__ import annotations

import dataclasses
from typing import Sequence

#: Targets at 8 streams against 1 (issue 9).
TARGETS = {"tokens_per_s": 3.0, "ttft_p95": 3.0, "itl_p95": 2.5}


@dataclasses.dataclass(frozen=True, slots=True)
class LevelResult:
    streams: int
    requests: int
    errors: int
    output_tokens: int
    wall_s: float
    ttft_ms: list[float]
    itl_ms: list[float]
    error_messages: tuple[str, ...] = ()

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def format_row(r: LevelResult, label: str | None = None) -> str:
    return (f"  {label or f'{r.streams:2d} streams'}: {r.tokens_per_s:7.1f} output tokens/s  "
            f"TTFT p50/p95/p99 {pct(r.ttft_ms, .5):7.1f} {pct(r.ttft_ms, .95):7.1f} {pct(r.ttft_ms, .99):7.1f} ms  "
            f"ITL p50/p95/p99 {pct(r.itl_ms, .5):6.1f} {pct(r.itl_ms, .95):6.1f} {pct(r.itl_ms, .99):6.1f} ms  "
            f"requests {r.requests}, errors {r.errors}")


def format_ratios(results: Sequence[LevelResult]) -> str:
    by_streams = {r.streams: r for r in results}
    one, eight = by_streams.get(1), by_streams.get(8)
    if one is None or eight is None or not one.ttft_ms or not eight.ttft_ms:
        return "8 vs 1 streams: not measured"
    ratios = {
        "tokens_per_s": eight.tokens_per_s / one.tokens_per_s,
        "ttft_p95": pct(eight.ttft_ms, 0.95) / pct(one.ttft_ms, 0.95),
        "itl_p95": pct(eight.itl_ms, 0.95) / pct(one.itl_ms, 0.95),
    }
    met = {
        "tokens_per_s": ratios["tokens_per_s"] >= TARGETS["tokens_per_s"],
        "ttft_p95": ratios["ttft_p95"] <= TARGETS["ttft_p95"],
        "itl_p95": ratios["itl_p95"] <= TARGETS["itl_p95"],
    }
    return (f"8 vs 1 streams: tokens/s x{ratios['tokens_per_s']:.2f} (target >= {TARGETS['tokens_per_s']}: "
            f"{'met' if met['tokens_per_s'] else 'NOT met'}), TTFT p95 x{ratios['ttft_p95']:.2f} "
            f"(target <= {TARGETS['ttft_p95']}: {'met' if met['ttft_p95'] else 'NOT met'}), ITL p95 "
            f"x{ratios['itl_p95']:.2f} (target <= {TARGETS['itl_p95']}: {'met' if met['itl_p95'] else 'NOT met'})")
