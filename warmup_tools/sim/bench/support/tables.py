"""What benchmarks print: Markdown tables (pasted into docs/benchmarks.md as they are) and percentiles."""

from __future__ import annotations

import statistics
from typing import Sequence


def markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def p99(values: Sequence[float]) -> float:
    """The 99th percentile (nearest rank below; 0 for no values)."""
    ordered = sorted(values) or [0.0]
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def percentiles(samples_s: Sequence[float]) -> tuple[float, float]:
    """p50 and p99 in milliseconds."""
    ordered = sorted(samples_s)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return statistics.median(ordered) * 1000, p99 * 1000
