"""``python -m warmup_tools bench load``: concurrent Locust users replay day 2's first hour.

The same plan and repositories as ``bench replay`` (two days of seeded traffic, a plan from day 1), but
the first hour of day 2 is sent by concurrent Locust users (``warmup_tools/sim/load/locustfile.py
--replay-log``) against a freshly started server, once without warm-up stanzas and once with the
plan's. It reports what a load test sees right after a scale-out: TTFT percentiles, cold requests
(``cached_tokens == 0``) and failures, from Locust's own statistics.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, TextIO

from warmup_tools.common.errors import WarmupToolsError
from warmup_tools.common.jsonl import write_json_lines
from warmup_tools.common.settings import arg
from warmup_tools.server.config import REPO_ROOT
from warmup_tools.server.process import TritonServer
from warmup_tools.sim.bench.support.params import MaxTokens, Seed
from warmup_tools.sim.bench.support.workload import prepare
from warmup_tools.sim.load.stats import read_stats_json

LOCUSTFILE = REPO_ROOT / "warmup_tools" / "sim" / "load" / "locustfile.py"


@dataclasses.dataclass(frozen=True, slots=True)
class LoadResult:
    label: str
    requests: int
    failures: int
    cold: int
    ttft_p50_ms: float
    ttft_p95_ms: float
    ttft_p99_ms: float
    ttft_max_ms: float
    cold_ttft_p50_ms: float
    itl_p50_ms: float
    wall_s: float


def locust_replay(repo: Path, log: Path, assets_dir: Path, work: Path, label: str, *, users: int,
                  max_tokens: int, out: TextIO) -> LoadResult:
    """Start the server on ``repo``, replay ``log`` with ``users`` Locust users, stop the server."""
    prefix = work / f"locust-{label.replace(' ', '-')}"
    env = {"WARMUP_ASSETS_DIR": str(assets_dir), "WARMUP_CONTROL_DIR": ""}
    with TritonServer(repo, env=env) as server:
        server.wait_ready(timeout=1800)
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--host", server.grpc_url, "--headless",
             "-u", str(users), "-r", str(users), "-t", "30m", "--stop-timeout", "60", "--only-summary",
             "--replay-log", str(log), "--max-tokens", str(max_tokens), "--json-file", str(prefix)],
            capture_output=True, text=True, timeout=2400,
        )
        wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise WarmupToolsError(f"locust exited with {proc.returncode} ({label}):\n{proc.stderr[-4000:]}")
    stats = read_stats_json(prefix)
    generate = [entry for name, entry in stats.items() if name.startswith("generate ")]
    ttft, cold, itl = stats["ttft"], stats.get("cold"), stats.get("itl")
    result = LoadResult(
        label=label,
        requests=sum(entry.requests for entry in generate),
        failures=sum(entry.failures for entry in stats.values()),
        cold=cold.requests if cold else 0,
        ttft_p50_ms=ttft.percentile(0.5), ttft_p95_ms=ttft.percentile(0.95), ttft_p99_ms=ttft.percentile(0.99),
        ttft_max_ms=ttft.max_ms,
        cold_ttft_p50_ms=cold.percentile(0.5) if cold else 0.0,
        itl_p50_ms=itl.percentile(0.5) if itl else 0.0,
        wall_s=wall,
    )
    out.write(f"  {label}: {result.requests} requests in {wall:.0f} s, {result.failures} failures, "
              f"{result.cold} cold; TTFT p50 {result.ttft_p50_ms:.0f} / p95 {result.ttft_p95_ms:.0f} / "
              f"p99 {result.ttft_p99_ms:.0f} ms\n")
    out.flush()
    return result


def run(assets_dir: Path, *, users: Annotated[int, arg("concurrent Locust users")] = 4,
        max_tokens: MaxTokens = 8,
        seed: Seed = 0,
        requests_per_day: Annotated[int, arg("requests per simulated day")] = 6000,
        out: TextIO = sys.stdout) -> list[LoadResult]:
    work = Path(tempfile.mkdtemp(prefix="bench-load-"))
    try:
        repos = prepare(work, assets_dir, seed=seed, requests_per_day=requests_per_day, out=out)
        log = work / "day2-first-hour.jsonl"
        write_json_lines(log, [record.to_json() for record in repos.first_hour])
        out.write(f"{users} Locust users replay {len(repos.first_hour)} requests (max_tokens={max_tokens}) against "
                  "a freshly started server\n")
        results = [
            locust_replay(repos.without_plan, log, assets_dir, work, "without plan", users=users,
                          max_tokens=max_tokens, out=out),
            locust_replay(repos.with_plan, log, assets_dir, work, "with plan", users=users,
                          max_tokens=max_tokens, out=out),
        ]
        out.write("\n| repository | requests | failures | cold requests | TTFT p50 ms | TTFT p95 ms | TTFT p99 ms | "
                  "TTFT max ms | cold TTFT p50 ms | ITL p50 ms |\n|---|---|---|---|---|---|---|---|---|---|\n")
        for r in results:
            out.write(f"| {r.label} | {r.requests} | {r.failures} | {r.cold} ({r.cold / max(r.requests, 1):.1%}) | "
                      f"{r.ttft_p50_ms:.0f} | {r.ttft_p95_ms:.0f} | {r.ttft_p99_ms:.0f} | {r.ttft_max_ms:.0f} | "
                      f"{r.cold_ttft_p50_ms:.0f} | {r.itl_p50_ms:.0f} |\n")
        out.write("(From Locust's final statistics; Locust rounds response times to two significant digits "
                  "above 100 ms.)\n")
        return results
    finally:
        shutil.rmtree(work, ignore_errors=True)
