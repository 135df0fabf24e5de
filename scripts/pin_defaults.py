"""Measure the pin defaults out of sample: the warm share's cap (``kv_warm_share``), whether a hit extends a pin's
deadline (``kv_pin_refresh_on_hit``) and the live check (``kv_pin_check_s``), on the shipped traces and the
real-text log.

    .venv/bin/python scripts/pin_defaults.py [--traces conversation,synthetic] [--real] [--caps 0.25,0.5,0.85]

Per log and cap, a plan is made from the planner's log as the product makes it (replay-sized on the log's own
tail, horizons learnt), then the traffic AFTER the log (the next ``--replay-min`` minutes of a trace; day 2's
first 3 hours of the real-text log) is replayed against one replica's cache model
(:func:`warmup_tools.planning.replay.replay`: the real ``PrefixCache`` with the target's settings, one request
at a time) with the plan warmed first and without it, for each refresh / live-check setting. Printed: prompt
tokens from cache with the plan and without, and the worst 1-minute window's difference. Figures are the
cache model's (no engine, no batching, one replica); they compare settings on the same traffic.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import time

from warmup_tools.common.records import RequestRecord
from warmup_tools.common.settings import environ_overrides
from warmup_tools.embedding_cache.embedder import OnnxEmbedder
from warmup_tools.lora_adapter.profile import load_profile
from warmup_tools.planning.replay import ReplayRequest, WarmItem, replay
from warmup_tools.planning.select import build_plan
from warmup_tools.planning.target import PlanTarget
from warmup_tools.server.config import REPO_ROOT
from warmup_tools.sim.bench.fleet_scale import DEFAULT_PROFILE
from warmup_tools.sim.bench.support.simulated import replica_kv_tokens, simulated_environment
from warmup_tools.sim.traces import TracePrompts, TraceScale, load_trace

ASSETS = REPO_ROOT / ".assets"
VARIANTS = (("refresh off, check on", False, None), ("refresh on, check on", True, None),
            ("refresh off, check off", False, 0.0))


def minute_shares(requests, served_by_request):
    served, total = collections.Counter(), collections.Counter()
    start = requests[0].ts
    for request, tokens in zip(requests, served_by_request):
        minute = int((request.ts - start) // 60)
        served[minute] += tokens
        total[minute] += len(request.ids)
    return {m: served[m] / total[m] for m in total if total[m]}


def per_request(kv, bpt, warm, requests, start):
    outcome = replay(kv, bpt, warm, requests, start=start)
    return outcome, outcome.served_per_request


def evaluate(label, records, future, target, now, caps):
    tokenizer = target.load_tokenizer()
    embedder = OnnxEmbedder(dataclasses.replace(target.embedder, num_threads=2))
    encoded = {}
    requests = []
    for record in future:
        ids = encoded.get(record.prompt)
        if ids is None:
            ids = encoded[record.prompt] = list(tokenizer.encode(record.prompt, add_special_tokens=True))
        requests.append(ReplayRequest(record.ts, record.tenant or "default", record.adapter or "", ids))
    total = sum(len(r.ids) for r in requests)
    print(f"## {label}: {len(records)} records planned, {len(requests)} replayed ({total} prompt tokens)", flush=True)
    base_kv = target.settings.engine.kv
    for cap in caps:
        kv = dataclasses.replace(base_kv, warm_share=cap)
        budgets = dataclasses.replace(target.default_budgets(), kv_bytes_total=kv.warmup_budget_bytes)
        budgets = dataclasses.replace(budgets, kv_bytes_per_adapter=min(budgets.kv_bytes_per_adapter,
                                                                       budgets.kv_bytes_total))
        started = time.perf_counter()
        plan = build_plan(records, tokenizer, embedder, budgets, now=now, block_size=target.block_size,
                          kv_bytes_per_token=target.kv_bytes_per_token, progress=False, kv=kv)
        sized = plan.summary.get("replay", {})
        warm = [WarmItem(i["tenant"], i["adapter"], i["token_ids"], i.get("retention_s")) for i in plan.items
                if i.get("kind") == "kv_prefix"]
        print(f"cap {cap:g}: plan {len(warm)} items, {plan.summary['kv_bytes']} bytes, chosen share "
              f"{sized.get('chosen_share')} (planned in {time.perf_counter() - started:.0f} s)", flush=True)
        for name, refresh, check in VARIANTS:
            variant = dataclasses.replace(kv, pin_refresh_on_hit=refresh,
                                          pin_check_s=kv.pin_check_s if check is None else check)
            with_plan, served_plan = per_request(variant, target.kv_bytes_per_token, warm, requests, now)
            without, served_none = per_request(variant, target.kv_bytes_per_token, [], requests, now)
            a, b = minute_shares(requests, served_plan), minute_shares(requests, served_none)
            worst = min(((a[m] - b[m]) * 100, m) for m in a if m in b)
            first = (a.get(0, 0.0) - b.get(0, 0.0)) * 100
            gain = (with_plan.served_tokens - without.served_tokens) / total * 100
            print(f"  {name}: from cache {with_plan.served_tokens / total:.2%} with the plan, "
                  f"{without.served_tokens / total:.2%} without ({gain:+.2f} points); first minute {first:+.1f} "
                  f"points; worst minute {worst[1]} {worst[0]:+.1f} points", flush=True)


def traces(names, plan_min, replay_min, caps):
    engine = load_profile(DEFAULT_PROFILE)
    for name in names:
        kv_bytes = replica_kv_tokens(engine, 16, name) * engine.kv_bytes_per_token
        env = {**os.environ, **simulated_environment(DEFAULT_PROFILE, 4.0, kv_bytes),
               "WARMUP_ASSETS_DIR": str(ASSETS), "WARMUP_CONTROL_DIR": ""}
        with environ_overrides(env):
            target = PlanTarget.from_repository(REPO_ROOT / "model_repository", env)
            prompts = TracePrompts(target.load_tokenizer(), 16)
            requests = load_trace(name, TraceScale(block_tokens=16, max_output_tokens=4,
                                                   duration_s=(plan_min + replay_min) * 60))
            epoch = time.time() - 86400
            records = [RequestRecord(ts=epoch + r.at_s, prompt=prompts.prompt(r)) for r in requests]
            split = epoch + plan_min * 60
            evaluate(f"trace {name}: first {plan_min:g} min planned, next {replay_min:g} min replayed",
                     [r for r in records if r.ts < split], [r for r in records if r.ts >= split], target, split, caps)


def real(caps):
    from warmup_tools.sim.real_traffic import RealTrafficConfig, generate_real

    config = RealTrafficConfig(seed=0)
    rows = [RequestRecord.from_json(r) for r in generate_real(config)]
    day2 = config.start + 86400
    env = {**os.environ, "WARMUP_ASSETS_DIR": str(ASSETS), "WARMUP_CONTROL_DIR": ""}
    target = PlanTarget.from_repository(REPO_ROOT / "model_repository", env)
    evaluate("real-text log: day 1 planned, day 2's first 3 h replayed", [r for r in rows if r.ts < day2],
             [r for r in rows if day2 <= r.ts < day2 + 3 * 3600 and r.prompt], target, day2, caps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", default="conversation,synthetic", help="shipped traces, comma-separated ('' none)")
    parser.add_argument("--plan-min", type=float, default=10.0)
    parser.add_argument("--replay-min", type=float, default=20.0)
    parser.add_argument("--caps", default="0.25,0.5,0.85", help="kv_warm_share values, comma-separated")
    parser.add_argument("--real", action="store_true", help="also the real-text log")
    args = parser.parse_args()
    caps = [float(c) for c in args.caps.split(",")]
    traces([t for t in args.traces.split(",") if t], args.plan_min, args.replay_min, caps)
    if args.real:
        real(caps)


if __name__ == "__main__":
    main()
