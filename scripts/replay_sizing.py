"""Print the planner's replay sizing (docs/planner.md, "Sizing the warm set by replay") on the shipped traces
and the real-text log: the warm shares tried, the prompt tokens each served on the log's tail, the share chosen.

    .venv/bin/python scripts/replay_sizing.py [--traces conversation,synthetic] [--real]

Traces: the planner's log is each trace's first ``--plan-min`` minutes and the target is a replica of
``bench fleet-scale`` (the simulated engine of its default profile, its KV budget), as that bench plans.
Real text: day 1 of ``sim/real_traffic.py`` (seed 0), planned for the demo repository, as ``bench replay
--traffic real`` plans.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

from warmup_tools.common.records import RequestRecord
from warmup_tools.common.settings import environ_overrides
from warmup_tools.embedding_cache.embedder import OnnxEmbedder
from warmup_tools.lora_adapter.profile import load_profile
from warmup_tools.planning import select
from warmup_tools.planning.select import build_plan
from warmup_tools.planning.target import PlanTarget
from warmup_tools.server.config import REPO_ROOT
from warmup_tools.sim.bench.fleet_scale import DEFAULT_PROFILE
from warmup_tools.sim.bench.support.simulated import replica_kv_tokens, simulated_environment
from warmup_tools.sim.traces import TracePrompts, TraceScale, load_trace

ASSETS = REPO_ROOT / ".assets"


def plan_and_report(label: str, records: list, target: PlanTarget, now: float) -> None:
    tokenizer = target.load_tokenizer()
    embedder = OnnxEmbedder(dataclasses.replace(target.embedder, num_threads=2))
    replay_seconds = [0.0]
    inner = select.replay

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            replay_seconds[0] += time.perf_counter() - started

    started = time.perf_counter()
    select.replay = timed
    try:
        plan = build_plan(records, tokenizer, embedder, target.default_budgets(), now=now,
                          block_size=target.block_size, kv_bytes_per_token=target.kv_bytes_per_token, progress=False,
                          kv=target.settings.engine.kv)
    finally:
        select.replay = inner
    seconds = time.perf_counter() - started
    replay = plan.summary["replay"]
    print(f"## {label}: {len(records)} records, planned in {seconds:.1f} s (the replays {replay_seconds[0]:.1f} s); "
          f"KV budget {target.settings.engine.kv.budget_bytes} bytes, {target.kv_bytes_per_token} bytes/token, "
          f"eviction {target.settings.engine.kv.eviction}")
    print(json.dumps(replay, indent=1))
    print(f"final plan: {len(plan.items)} items, {plan.summary['kv_bytes']} KV bytes; horizons "
          f"{json.dumps(plan.summary['horizons']['classes'])}\n", flush=True)


def traces(names: list[str], plan_min: float) -> None:
    engine = load_profile(DEFAULT_PROFILE)
    for name in names:
        kv_bytes = replica_kv_tokens(engine, 16, name) * engine.kv_bytes_per_token
        env = {**os.environ, **simulated_environment(DEFAULT_PROFILE, 4.0, kv_bytes),
               "WARMUP_ASSETS_DIR": str(ASSETS), "WARMUP_CONTROL_DIR": ""}
        with environ_overrides(env):
            target = PlanTarget.from_repository(REPO_ROOT / "model_repository", env)
            prompts = TracePrompts(target.load_tokenizer(), 16)
            requests = load_trace(name, TraceScale(block_tokens=16, max_output_tokens=4, duration_s=plan_min * 60))
            epoch = time.time() - 86400
            records = [RequestRecord(ts=epoch + r.at_s, prompt=prompts.prompt(r)) for r in requests]
            plan_and_report(f"trace {name}, first {plan_min:g} min", records, target, epoch + plan_min * 60)


def real() -> None:
    from warmup_tools.sim.real_traffic import RealTrafficConfig, generate_real

    config = RealTrafficConfig(seed=0)
    day1 = [RequestRecord.from_json(r) for r in generate_real(config) if r["ts"] < config.start + 86400]
    env = {**os.environ, "WARMUP_ASSETS_DIR": str(ASSETS), "WARMUP_CONTROL_DIR": ""}
    target = PlanTarget.from_repository(REPO_ROOT / "model_repository", env)
    plan_and_report("real-text log, day 1 (seed 0)", day1, target, config.start + 86400)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", default="conversation,synthetic", help="shipped traces, comma-separated ('' none)")
    parser.add_argument("--plan-min", type=float, default=10.0, help="minutes of each trace's start planned from")
    parser.add_argument("--real", action="store_true", help="also the real-text log's day 1")
    args = parser.parse_args()
    traces([t for t in args.traces.split(",") if t], args.plan_min)
    if args.real:
        real()


if __name__ == "__main__":
    main()
