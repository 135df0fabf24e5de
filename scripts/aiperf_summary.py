"""Summarise the runs of scripts/aiperf_front.sh: TTFT p50 and output tokens/s per endpoint and concurrency
(the median over repeats), from each run's profile_export_aiperf.json.

Usage: python scripts/aiperf_summary.py OUT_DIR
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path


def main(folder: Path) -> None:
    runs: dict[tuple[str, int], list[tuple[float, float, int]]] = {}
    for export in sorted(folder.glob("*/profile_export_aiperf.json")):
        match = re.fullmatch(r"(.+)-c(\d+)-r\d+", export.parent.name)
        if match is None:
            continue
        data = json.loads(export.read_text())
        errors = int((data.get("error_request_count") or {}).get("avg", 0))
        runs.setdefault((match[1], int(match[2])), []).append(
            (data["time_to_first_token"]["p50"], data["output_token_throughput"]["avg"], errors))
    print("| endpoint | concurrency | runs | TTFT p50 (ms), each run | TTFT p50, median | output tokens/s, each run "
          "| tokens/s, median | errors |")
    print("|---|---|---|---|---|---|---|---|")
    for (name, conc), values in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        ttfts, tps, errors = zip(*values)
        print(f"| {name} | {conc} | {len(values)} | {', '.join(f'{t:.1f}' for t in ttfts)} | "
              f"{statistics.median(ttfts):.1f} | {', '.join(f'{t:.1f}' for t in tps)} | {statistics.median(tps):.1f} "
              f"| {sum(errors)} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
