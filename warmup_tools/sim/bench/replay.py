"""``python -m warmup_tools bench replay``: does a plan from yesterday's logs warm today's first hour?

One run: generate two days of traffic (seeded), plan from day 1, write the plan's stanzas into a copy
of the repository, then replay day 2's first hour against the real server twice, without warm-up
stanzas and with the plan's, and report the share of cold requests (``cached_tokens == 0``) and TTFT.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence, TextIO

from warmup_tools.common.records import RequestRecord, read_request_log
from warmup_tools.ops.client import GenerateParams, StreamingClient
from warmup_tools.ops.config import REPO_ROOT
from warmup_tools.ops.server import TritonServer
from warmup_tools.planning.plan_stanzas import COMPOSING_MODELS, write_plan_stanzas
from warmup_tools.planning.stanzas import write_model_warmup


@dataclasses.dataclass(frozen=True, slots=True)
class ReplayResult:
    label: str
    requests: int
    cold: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    cached_share: float
    load_s: float

    @property
    def cold_share(self) -> float:
        return self.cold / self.requests if self.requests else 0.0


def replay(repo: Path, records: Sequence[RequestRecord], assets_dir: Path, label: str, out: TextIO) -> ReplayResult:
    start = time.perf_counter()
    with TritonServer(repo, env=_server_env(assets_dir)) as server:
        server.wait_ready(timeout=1800)
        load_s = time.perf_counter() - start
        cold, ttfts, cached, prompt = 0, [], 0, 0
        with StreamingClient(server.grpc_url) as client:
            for record in records:
                result = client.generate(record.prompt, GenerateParams(
                    max_tokens=1, adapter_id=record.adapter or None, tenant_id=record.tenant))
                cold += result.cached_tokens == 0
                ttfts.append(result.ttft_s * 1000)
                cached += result.cached_tokens
                prompt += result.prompt_tokens
    ttfts.sort()
    res = ReplayResult(label, len(records), cold, statistics.median(ttfts), ttfts[int(0.9 * (len(ttfts) - 1))],
                       cached / prompt if prompt else 0.0, load_s)
    out.write(f"  {label}: {res.requests} requests, {res.cold} cold ({res.cold_share:.1%}), TTFT p50 "
              f"{res.ttft_p50_ms:.1f} ms, p90 {res.ttft_p90_ms:.1f} ms, {res.cached_share:.1%} of prompt tokens "
              f"from the KV cache; server ready in {res.load_s:.0f} s\n")
    out.flush()
    return res


@dataclasses.dataclass(frozen=True, slots=True)
class Repositories:
    """Day 2's first hour and two copies of the repository: without warm-up stanzas, and with the plan's."""

    first_hour: list[RequestRecord]
    without_plan: Path
    with_plan: Path


def prepare(work: Path, assets_dir: Path, *, seed: int, requests_per_day: int, out: TextIO) -> Repositories:
    """Generate two days of traffic, plan from day 1, and write both repositories under ``work``."""
    from warmup_tools.embedding_cache.embedder import OnnxEmbedder
    from warmup_tools.planning.select import build_plan, format_summary
    from warmup_tools.planning.target import PlanTarget
    from warmup_tools.sim.traffic import TrafficConfig, write_logs

    config = TrafficConfig(seed=seed, requests_per_day=requests_per_day)
    day1, day2 = write_logs(config, work / "logs")[:2]
    day1_records = list(read_request_log([day1]))
    day2_start = config.start + 86400
    first_hour = [r for r in read_request_log([day2]) if r.ts < day2_start + 3600]
    out.write(f"traffic: {len(day1_records)} day-1 requests; replaying day 2's first hour: {len(first_hour)} "
              "requests\n")
    baseline = work / "repo-without-plan"
    planned = work / "repo-with-plan"
    shutil.copytree(REPO_ROOT / "model_repository", baseline)
    shutil.copytree(REPO_ROOT / "model_repository", planned)
    target = PlanTarget.from_repository(planned, {**os.environ, **_server_env(assets_dir)})
    tokenizer = target.load_tokenizer()
    embedder = OnnxEmbedder(target.embedder_dir, num_threads=2)
    plan = build_plan(day1_records, tokenizer, embedder, target.default_budgets(), now=day2_start,
                      block_size=target.block_size, kv_bytes_per_token=target.kv_bytes_per_token, progress=False)
    plan.save(work / "plan.json")
    out.write(format_summary(plan) + "\n")

    for model in COMPOSING_MODELS:
        write_model_warmup(baseline / model, [])
    counts = write_plan_stanzas(plan, planned, target=target)
    out.write(f"stanzas from plan {plan.plan_id}: {counts}\n")
    out.flush()
    return Repositories(first_hour, baseline, planned)


def run(assets_dir: Path, *, seed: int = 0, requests_per_day: int = 6000, out: TextIO = sys.stdout) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-replay-"))
    try:
        repos = prepare(work, assets_dir, seed=seed, requests_per_day=requests_per_day, out=out)
        results = [replay(repos.without_plan, repos.first_hour, assets_dir, "without plan", out),
                   replay(repos.with_plan, repos.first_hour, assets_dir, "with plan   ", out)]
        out.write("\n| repository | requests | cold requests | cold share | TTFT p50 ms | TTFT p90 ms | "
                  "prompt tokens from cache | ready after s |\n|---|---|---|---|---|---|---|---|\n")
        for r in results:
            out.write(f"| {r.label.strip()} | {r.requests} | {r.cold} | {r.cold_share:.1%} | {r.ttft_p50_ms:.1f} | "
                      f"{r.ttft_p90_ms:.1f} | {r.cached_share:.1%} | {r.load_s:.0f} |\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _server_env(assets_dir: Path) -> dict[str, str]:
    return {"WARMUP_ASSETS_DIR": str(assets_dir), "WARMUP_CONTROL_DIR": ""}
