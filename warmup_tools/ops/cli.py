"""Command line: ``python -m warmup_tools <command>`` (or the ``warmup-tools`` console script)."""

from __future__ import annotations

import argparse
import datetime
import logging
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from warmup_tools.common.errors import WarmupToolsError
from warmup_tools.common.names import replica_name
from warmup_tools.server.config import REPO_ROOT, ServeConfig, load_config

if TYPE_CHECKING:
    from warmup_tools.fleet.settings import FleetSettings
    from warmup_tools.front.settings import FrontSettings
    from warmup_tools.sidecar.config import SidecarConfig

LOGGER = logging.getLogger("warmup_tools")


#: ``plan <action>``: the plan history of a control folder (``plan LOGS...`` makes a plan).
PLAN_ACTIONS = ("history", "diff", "rollback", "canary")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    words = [i for i, a in enumerate(argv) if not a.startswith("-")]
    if len(words) >= 2 and argv[words[0]] == "plan" and argv[words[1]] in PLAN_ACTIONS and words[1] == words[0] + 1:
        # NOTE: `plan` takes log paths as positionals, so its actions are parsed by their own parser (a log
        # file named like an action is given as ./history).
        parser = _plan_actions_parser()
        del argv[words[0]]
    else:
        parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:  # NOTE: httpx logs every request at INFO: a benchmark's figures would drown in them
        logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        return int(args.func(args) or 0)
    except WarmupToolsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="warmup_tools", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run tritonserver on the model repository, with the OpenAI front beside it, "
                                         "until interrupted")
    _server_flags(serve)
    _front_flags(serve, beside=True)
    serve.set_defaults(func=_cmd_serve)

    front = sub.add_parser("front", help="run the OpenAI-compatible HTTP front against a running tritonserver "
                                         "(/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics)")
    _front_flags(front, beside=False)
    front.add_argument("--triton-grpc-url", help="tritonserver's gRPC host:port (default 127.0.0.1:8001)")
    front.add_argument("--triton-metrics-url", help="tritonserver's /metrics URL (default http://127.0.0.1:8002/metrics)")
    front.add_argument("--sidecar-url", help="the sidecar's base URL: /health and requests follow its /ready")
    front.add_argument("--model-repository", type=Path,
                       help="the repository tritonserver serves (tokenizer, chat template, KV budget, trust mode)")
    front.set_defaults(func=_cmd_front)

    fleet = sub.add_parser("fleet", help="N replicas (tritonserver, sidecar and OpenAI front each) behind the smg "
                                         "router, each joining once warm, until interrupted (docs/fleet.md)")
    fleet.add_argument("--fleet-config", type=Path, help="JSON file of FleetSettings fields (docs/parameters.md)")
    fleet.add_argument("--replicas", type=int)
    fleet.add_argument("--policy", help="the router's policy (default cache_aware)")
    fleet.add_argument("--host")
    fleet.add_argument("--port", type=int, help="port of the router's OpenAI API (default 30000; 0: any free)")
    fleet.add_argument("--prometheus-port", type=int, help="port of the router's metrics (default: any free)")
    for name in ("work-dir", "control-dir", "snapshot-dir", "request-log-dir", "sidecar-config", "model-repository",
                 "assets-dir"):
        fleet.add_argument(f"--{name}", type=Path)
    _secrets_flag(fleet)
    fleet.add_argument("--lm-threads", type=int, help="torch threads of each replica's LM (default 1)")
    fleet.set_defaults(func=_cmd_fleet)

    router = sub.add_parser("router", help="run the smg router of a fleet (what compose and Kubernetes run): the "
                                           "fleet's policy, thresholds and health checks, its worker API behind the "
                                           "deployment's router_control.key in trust mode")
    router.add_argument("--fleet-config", type=Path, help="JSON file of FleetSettings fields (docs/parameters.md)")
    router.add_argument("--host")
    router.add_argument("--port", type=int, help="port of the router's OpenAI API (default 30000)")
    router.add_argument("--prometheus-port", type=int, help="port of the router's metrics (default 29000)")
    _secrets_flag(router)
    router.set_defaults(func=_cmd_router)

    join = sub.add_parser("join", help="keep a running replica's membership in a running smg router until SIGTERM: "
                                       "one worker per model it serves once its /health says warm, added and "
                                       "removed as adapters go live and retire, added again after a router "
                                       "restart, all removed at SIGTERM (compose and each Kubernetes pod run it)")
    join.add_argument("--router", required=True, help="the router's base URL, e.g. http://router:30000")
    join.add_argument("--replica", required=True, help="the replica's OpenAI front, e.g. http://triton:9000")
    _secrets_flag(join)
    join.add_argument("--interval-s", type=float,
                      help="seconds between two looks at the replica's models and the router's workers "
                           "(default: the fleet's membership_interval_s)")
    join.add_argument("--once", action="store_true",
                      help="register once the replica is warm, then exit (no updates, no removal at exit)")
    join.add_argument("--timeout-s", type=float, default=1800.0,
                      help="with --once: how long to wait for the replica to be warm")
    join.add_argument("--health-check-interval-s", type=int,
                      help="seconds between the router's probes of the replica's /health (default: the fleet's "
                           "health_check_interval_s)")
    join.set_defaults(func=_cmd_join)

    assets = sub.add_parser("assets", help="build the demo model assets (LM, tokenizer, adapters, embedder)")
    assets.add_argument("--out", type=Path, default=REPO_ROOT / ".assets")
    assets.add_argument("--seed", type=int, default=0)
    assets.add_argument("--force", action="store_true", help="rebuild even if the assets are complete")
    assets.set_defaults(func=_cmd_assets)

    stanzas = sub.add_parser("stanzas", help="write (or --check) model_warmup stanzas in the repository")
    stanzas.add_argument("--model-repository", type=Path, default=REPO_ROOT / "model_repository")
    stanzas.add_argument("--plan", type=Path, help="a plan from `warmup_tools plan` (default: the demo prompts)")
    stanzas.add_argument("--tokenizer", type=Path, default=REPO_ROOT / ".assets" / "lm",
                         help="tokenizer folder used to turn the demo warm-up prompts into token ids")
    stanzas.add_argument("--check", action="store_true", help="only validate the stanzas against the configs")
    stanzas.set_defaults(func=_cmd_stanzas)

    key = sub.add_parser("tenant-key", help="trust mode: give a tenant a new key (only its hash is stored)")
    key.add_argument("tenant")
    key.add_argument("--keys-file", type=Path, required=True, help="the tenant_keys_file of tokenizer_cache")
    key.add_argument("--secret-file", type=Path, required=True,
                     help="the deployment_secret_file of the composing models (created if missing)")
    key.set_defaults(func=_cmd_tenant_key)

    init = sub.add_parser("deploy-secrets", help="trust mode: make a deployment's secret, the probe tenant's key and "
                                                 "a random Redis password in a folder (keeps what exists)")
    init.add_argument("--dir", type=Path, required=True, help="the folder (made 0700; every file 0600)")
    init.add_argument("--redis-host", default="redis")
    init.add_argument("--redis-port", type=int, default=6379)
    init.add_argument("--redis-conf-dir", type=Path, help="also write Redis's redis.conf (requirepass) here")
    init.add_argument("--redis-uid", type=int, help="owner of redis.conf (the Redis image's user)")
    init.set_defaults(func=_cmd_deploy_secrets)

    plan_help = ("decide what to warm from request logs; writes a versioned plan. Also `plan history`, `plan diff "
                 "A B`, `plan rollback [ID]`: the plans a control folder served, and `plan canary`: a plan on trial "
                 "on one instance or replica, promoted or rolled back by the sidecar (each has its own --help)")
    plan = sub.add_parser("plan", help=plan_help, description=plan_help)
    plan.add_argument("logs", nargs="+", type=Path,
                      help="request logs (.jsonl, .jsonl.gz, rotated .jsonl.N) or folders holding them")
    plan.add_argument("--out", type=Path, default=REPO_ROOT / "runs" / "plan.json")
    plan.add_argument("--model-repository", type=Path, default=REPO_ROOT / "model_repository",
                      help="the repository the plan is for: KV block size, storage, dtype and budget, the "
                           "tokenizer and the embedder are read from its configs")
    plan.add_argument("--kv-bytes-total", type=int,
                      help="KV bytes per instance the plan may fill (default: lora_adapter's kv_cache_bytes "
                           "less kv_live_reserve)")
    plan.add_argument("--kv-bytes-per-adapter", type=int,
                      help="an upper bound per adapter (default: --kv-bytes-total; --arbitration splits the total)")
    plan.add_argument("--arbitration", choices=("measured", "fixed"), default="measured",
                      help="when the adapters' hot sets do not all fit: split the budget by each adapter's cold "
                           "share and traffic (measured), or let every adapter take up to --kv-bytes-per-adapter, "
                           "hottest blocks first (fixed); docs/planner.md")
    plan.add_argument("--embedding-entries", type=int, default=256)
    plan.add_argument("--tokenizer-entries", type=int, default=256)
    plan.add_argument("--warm-seconds", type=float, default=60.0)
    plan.add_argument("--now", type=float, help="epoch seconds the heat decays to (default: the last record)")
    plan.add_argument("--since", type=_duration, metavar="DURATION",
                      help="plan from the last DURATION of the logs only (before --now, or the last record): "
                           "30m, 6h, 2d")
    plan.add_argument("--previous", type=Path, metavar="PLAN",
                      help="the plan now served: its items are kept unless clearly beaten (no flapping), and the "
                           "new plan says what it added, kept and dropped")
    plan.add_argument("--no-progress", action="store_true")
    plan.set_defaults(func=_cmd_plan)

    apply = sub.add_parser("apply-plan", help="serve a plan on a running server without a restart (through the "
                                              "control folder); waits until every instance reports it")
    apply.add_argument("plan", type=Path, help="a plan file written by `plan`")
    apply.add_argument("--control-dir", type=Path, default=REPO_ROOT / ".control",
                       help="the lora_adapter model's control_dir (WARMUP_CONTROL_DIR)")
    _live_apply_flags(apply)
    apply.set_defaults(func=_cmd_apply_plan)

    adapters = sub.add_parser("adapters", help="add, retire or list LoRA adapters on a running server")
    adapters.add_argument("--control-dir", type=Path, default=REPO_ROOT / ".control",
                          help="the lora_adapter model's control_dir (WARMUP_CONTROL_DIR)")
    actions = adapters.add_subparsers(dest="action", required=True)
    add = actions.add_parser("add", help="load an adapter from adapter_root, warm it, make it live")
    add.add_argument("name")
    add.add_argument("--path", help="folder under adapter_root (default: the name)")
    add.add_argument("--warm-prompt", action="append", default=[], help="a prompt to pre-fill (repeatable)")
    add.add_argument("--warm-file", type=Path, help="file of prompts to pre-fill, one per line")
    add.add_argument("--register-only", action="store_true", help="register without loading it")
    add.add_argument("--wait", type=float, default=300.0, help="seconds to wait for every instance (0: don't)")
    add.add_argument("--instances", type=int, help="how many instances must report (default: all that report)")
    retire = actions.add_parser("retire", help="stop serving an adapter and free its weights")
    retire.add_argument("name")
    retire.add_argument("--wait", type=float, default=120.0)
    retire.add_argument("--instances", type=int)
    actions.add_parser("status", help="each instance's adapter states")
    adapters.set_defaults(func=_cmd_adapters)

    traffic = sub.add_parser("traffic", help="write seeded, realistic request logs (one file per day)")
    traffic.add_argument("--out", type=Path, default=REPO_ROOT / "runs" / "traffic")
    traffic.add_argument("--seed", type=int, default=0)
    traffic.add_argument("--days", type=int, default=2)
    traffic.add_argument("--requests-per-day", type=int, default=6000)
    traffic.add_argument("--gzip", action="store_true")
    traffic.set_defaults(func=_cmd_traffic)

    # Every benchmark takes --assets-dir; its other flags are the keyword arguments of its module's run().
    assets = argparse.ArgumentParser(add_help=False)
    assets.add_argument("--assets-dir", type=Path, default=REPO_ROOT / ".assets")
    bench = sub.add_parser("bench", help="benchmarks that print figures")
    bench.set_defaults(func=_cmd_bench)
    which = bench.add_subparsers(dest="bench", required=True)
    kv = which.add_parser("kv", parents=[assets],
                          help="TTFT with and without a warm KV prefix; INT8 accuracy; memory flood")
    kv.add_argument("--repeats", type=int, default=7)
    kv.add_argument("--flood", type=int, default=10_000, help="unique prompts for the memory check (0: skip)")
    kv.add_argument("--lm-threads", type=int, default=1, help="torch threads of lora_adapter (0: torch default)")

    caches = which.add_parser("caches", parents=[assets],
                              help="tokenizer/embedding cache latency, hit ratios, tiers, ensemble overhead")
    caches.add_argument("--requests", dest="n", type=int, default=300)

    stampede = which.add_parser("stampede", parents=[assets],
                                help="a warm-up's Redis keys expiring together: recomputes per key and their peak "
                                     "rate with and without TTL jitter and the single-flight lock")
    stampede.add_argument("--keys", type=int, default=200)
    stampede.add_argument("--instances", type=int, default=8)
    stampede.add_argument("--ttl-s", type=float, default=10.0)
    stampede.add_argument("--compute-ms", type=float, default=20.0, help="cost of one computation (simulated)")
    stampede.add_argument("--zipf-s", type=float, default=1.1, help="key popularity exponent")
    stampede.add_argument("--timeout-ms", type=float, default=250.0, help="redis_timeout_ms of the instances")

    rep = which.add_parser("replay", parents=[assets],
                           help="plan from day-1 logs, replay day 2's first hours with and without it, beside the "
                                "floor (the best any plan could do)")
    rep.add_argument("--seed", type=int, default=0)
    rep.add_argument("--requests-per-day", type=int, default=6000)
    rep.add_argument("--traffic", choices=("generated", "real", "heldout"), default="generated",
                     help="the project's generated traffic, a log built from real public text, or a second one "
                          "built another way (held out: tenant preambles, other questions, day-1 repeats)")
    rep.add_argument("--report", type=Path, metavar="DIR", help="write PNG plots and a markdown summary here")
    rep.add_argument("--misses-only", action="store_true",
                     help="no server: plan, then print which replayed requests the plan misses against the floor "
                          "and why (simulated without eviction)")
    rep.add_argument("--kv-bytes-total", type=int,
                     help="the plan's KV budget (default: the repository's warm-up share)")
    rep.add_argument("--kv-bytes-per-adapter", type=int, help="the plan's bound per adapter (default: the total)")
    rep.add_argument("--arbitration", choices=("measured", "fixed"), default="measured",
                     help="how the plan splits a budget the adapters' hot sets do not fit (plan --arbitration)")

    roll = which.add_parser("rolling", parents=[assets],
                            help="replay day 2 with the static day-1 plan and with a re-plan every K hours applied "
                                 "live: cold share per window, and how long new applications stay cold")
    roll.add_argument("--seed", type=int, default=0)
    roll.add_argument("--requests-per-day", type=int, default=3000)
    roll.add_argument("--hours", type=float, default=12.0, help="hours of day 2 to replay")
    roll.add_argument("--every-h", type=float, default=3.0, help="simulated hours between re-plans")
    roll.add_argument("--since-h", type=float, default=6.0, help="hours of logs each re-plan reads")
    roll.add_argument("--after-h", type=float, default=3.0,
                      help="hours replayed after a restart at the end of the window (day-1 vs today's stanzas)")

    rollout = which.add_parser("rollout", parents=[assets],
                               help="the canary on the real-text replay (two lora_adapter instances): a re-planned "
                                    "plan promoted, another tenant mix's plan rolled back; minutes to each verdict "
                                    "and each instance's cold share")
    rollout.add_argument("--seed", type=int, default=0)
    rollout.add_argument("--requests-per-day", type=int, default=6000)
    rollout.add_argument("--hours", type=float, default=3.0, help="hours of day 2 to replay")
    rollout.add_argument("--speedup", type=float, default=60.0, help="replay this many times faster than the trace")
    rollout.add_argument("--good-at-min", type=float, default=30.0, help="simulated minute of the re-plan's trial")
    rollout.add_argument("--bad-at-min", type=float, default=90.0, help="simulated minute of the bad plan's trial")
    rollout.add_argument("--window-min", type=float, help="the canary's window in simulated minutes (default: the "
                                                          "sidecar's canary_window_s)")
    rollout.add_argument("--kv-cache-ratio", type=float, default=1.25,
                         help="each instance's KV cache, in multiples of the day-1 plan's KV bytes")
    rollout.add_argument("--kv-cache-bytes", type=int, help="each instance's KV cache in bytes (overrides the ratio)")
    rollout.add_argument("--fleet", action="store_true",
                         help="two replicas behind the smg router, the plans on trial on a whole replica, judged "
                              "against the other one; each replica's cold share")

    load = which.add_parser("load", parents=[assets],
                            help="Locust users replay day 2's first hour concurrently, with and without the plan")
    load.add_argument("--users", type=int, default=4)
    load.add_argument("--max-tokens", type=int, default=8)
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--requests-per-day", type=int, default=6000)

    flood = which.add_parser("flood", parents=[assets],
                             help="unique tenants and prompts: stub RSS, /metrics series and cache bytes before/after")
    flood.add_argument("--requests", type=int, default=10_000)
    flood.add_argument("--seed", type=int, default=0)

    trust = which.add_parser("trust", parents=[assets],
                             help="trust mode: another tenant's cached_tokens and TTFT on one tenant's prompts "
                                  "vs prompts nobody sent (the TTFT side channel)")
    trust.add_argument("--prompts", type=int, default=50, help="prompts of each kind (at least 2)")
    trust.add_argument("--seed", type=int, default=7)

    # The closed-loop stream levels of bench concurrency and bench engine.
    streams = argparse.ArgumentParser(add_help=False)
    streams.add_argument("--levels", type=lambda v: tuple(int(x) for x in v.split(",")), default=(1, 4, 8, 16),
                         help="comma-separated stream counts")
    streams.add_argument("--rounds", type=int, default=6, help="requests each stream sends back to back (at least)")
    streams.add_argument("--min-requests", type=int, default=24, help="requests per level (at least)")
    streams.add_argument("--max-tokens", type=int, default=32)
    streams.add_argument("--max-num-seqs", type=int, default=16)
    streams.add_argument("--lm-threads", type=int, default=1, help="torch threads of lora_adapter (0: torch default)")

    conc = which.add_parser("concurrency", parents=[assets, streams],
                            help="tokens/s, TTFT and inter-token latency at 1, 4, 8 and 16 concurrent streams")
    conc.add_argument("--rates", type=lambda v: tuple(float(x) for x in v.split(",")), default=(),
                      help="open-loop levels after the streams: Poisson arrivals at each rate (requests/s)")
    conc.add_argument("--disconnects", type=int, default=7,
                      help="abandoned streams per transport before measuring the next request's TTFT (0: skip)")

    eng = which.add_parser("engine", parents=[assets, streams],
                           help="the continuous-batching scheduler alone, in process (no Triton): 1-16 streams")
    eng.add_argument("--device", default="auto", help="auto (the first CUDA device, else CPU), cpu, cuda, cuda:1")
    eng.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16")

    pre = which.add_parser("preload", parents=[assets],
                           help="live TTFT while a new adapter warms: three settings of the warm class")
    pre.add_argument("--prompts", type=int, default=12, help="warm prompts of the new adapter")
    pre.add_argument("--prompt-tokens", type=int, default=768)
    pre.add_argument("--lm-threads", type=int, default=1)

    snap = which.add_parser("snapshot", parents=[assets],
                            help="restart to warm READY with a KV snapshot vs without (recompute); greedy outputs "
                                 "after the restore; a second server started from the snapshot folder")
    snap.add_argument("--prompts", type=int, default=32, help="planned prompts of the hot set")
    snap.add_argument("--prompt-tokens", type=int, default=640)
    snap.add_argument("--live", type=int, default=4, help="planned and live-only prompts sent after READY")
    snap.add_argument("--max-tokens", type=int, default=16)
    snap.add_argument("--seed", type=int, default=0)
    snap.add_argument("--lm-threads", type=int, default=1)


    sidecar = sub.add_parser("sidecar", help="run tritonserver with the readiness and recovery sidecar beside it "
                                              "(/ready, /live, /status) until interrupted")
    _server_flags(sidecar)
    sidecar.add_argument("--sidecar-config", type=Path, help="JSON file of SidecarConfig fields")
    sidecar.add_argument("--sidecar-host", dest="sidecar_host")
    sidecar.add_argument("--sidecar-port", type=int, help="port of /ready, /live, /status (default 8080)")
    sidecar.add_argument("--probe-interval-s", type=float)
    sidecar.add_argument("--probe-timeout-s", type=float)
    sidecar.add_argument("--failures-to-recover", type=int)
    sidecar.add_argument("--recovery-timeout-s", type=float)
    sidecar.add_argument("--coverage-threshold", type=float,
                         help="share of each live adapter's planned hot set that must be resident on every "
                              "instance for /ready (default 0.95; 0 turns the check off)")
    sidecar.add_argument("--replan-interval-s", type=float,
                         help="re-plan from the request logs every so many seconds and apply it live (default 0: off)")
    sidecar.add_argument("--replan-log-dir", type=Path, help="the request logs to re-plan from (request_log_dir)")
    sidecar.add_argument("--replan-since-h", type=float, help="hours of logs each re-plan reads (default 6)")
    sidecar.add_argument("--fleet-log-dir", type=Path,
                         help="a fleet's shared request log folder: lora_adapter logs into its subfolder named "
                              "after the replica, the re-plan reads them all, a replica canary compares them")
    _stub_death_flags(sidecar)
    _front_flags(sidecar, beside=True)
    sidecar.set_defaults(func=_cmd_sidecar)
    front_bench = which.add_parser("front", parents=[assets],
                                   help="through the OpenAI front, per pipeline: its added TTFT and tokens/s against "
                                        "generate_stream at 1 and 8 streams; a stream abandoned at its first token")
    front_bench.add_argument("--disconnects", type=int, default=11,
                             help="streams abandoned at their first token, per pipeline (0: skip)")
    front_bench.add_argument("--requests", type=int, default=40,
                             help="requests each way per level for the front's added TTFT and tokens/s (0: skip)")
    front_bench.add_argument("--max-tokens", type=int, default=32)
    front_bench.add_argument("--lm-threads", type=int, default=1)
    fleet_bench = which.add_parser("fleet", parents=[assets],
                                   help="the real-text replay through the smg router: 1 replica vs 2 with round_robin, "
                                        "cache_aware, prefix_hash; scale-out at +30 min (stanzas only vs snapshot, "
                                        "joined warm); scale-in with SIGTERM under load")
    fleet_bench.add_argument("--seed", type=int, default=0)
    fleet_bench.add_argument("--requests-per-day", type=int, default=6000)
    fleet_bench.add_argument("--hours", type=float, default=1.0, help="hours of day 2 replayed")
    fleet_bench.add_argument("--scale-out-min", type=float, default=30.0, help="simulated minutes before the scale-out")
    fleet_bench.add_argument("--window-min", type=float, default=10.0,
                             help="simulated minutes of the new replica's requests measured")
    fleet_bench.add_argument("--streams", type=int, default=6, help="concurrent streams during the scale-in")
    fleet_bench.add_argument("--users", type=int, default=4,
                             help="concurrent clients replaying the traffic in order in the routing runs")
    fleet_bench.add_argument("--lm-threads", type=int, default=1)
    fleet_bench.add_argument("--policy", help="the router's policy in the scale-out and scale-in runs (default: "
                                              "the fleet's default)")
    rec = which.add_parser("recovery", parents=[assets],
                           help="kill the lora_adapter stub beside the sidecar: seconds to /ready 503 and back to "
                                "200, how requests failed meanwhile, failures after recovery")
    rec.add_argument("--kills", type=int, default=1)
    rec.add_argument("--probe-interval-s", type=float, default=2.0)
    rec.add_argument("--after", type=int, default=5, help="requests sent after each recovery")
    rec.add_argument("--signal", dest="signal_name", choices=["KILL", "STOP"], default="KILL",
                     help="SIGKILL the stub (a crash) or SIGSTOP it (a hang)")
    rec.add_argument("--no-watch-stubs", dest="watch_stubs", action="store_false",
                     help="the sidecar finds the dead stub through its probes only (as before stubs were watched)")
    _stub_death_flags(rec)

    temp = which.add_parser("temperature", parents=[assets],
                            help="what the sidecar reads per probe round (lowest warm coverage, lora_adapter probe "
                                 "TTFT, temperature) from a cold start, after warm-up, with a new adapter and after "
                                 "the KV cache is lost")
    temp.add_argument("--probe-interval-s", type=float, default=1.0)
    temp.add_argument("--rounds", type=int, default=15, help="probe rounds read in each steady phase")

    soak = which.add_parser("soak", parents=[assets],
                            help="long mixed traffic (planned and unplanned prefixes, four adapters, tenants, "
                                 "cancellations, bad requests) against the sidecar stack with the lora_adapter stub "
                                 "killed at an interval: lost requests, bad requests' errors, RSS / open files / "
                                 "threads per process")
    soak.add_argument("--duration", type=_duration, default=1800.0, help="how long the traffic runs (30m)")
    soak.add_argument("--kill-every", type=_duration, default=600.0, help="SIGKILL the lora_adapter stub this often")
    soak.add_argument("--concurrency", type=int, default=4, help="closed-loop clients")
    soak.add_argument("--bad-share", type=float, default=0.05, help="share of bad requests")
    soak.add_argument("--cancel-share", type=float, default=0.05, help="share of streams cancelled mid-stream")
    soak.add_argument("--direct-share", type=float, default=0.10, help="share of requests straight to lora_adapter")
    soak.add_argument("--settle", type=_duration, default=300.0,
                      help="flat after this long (after the start and after each process's own start)")
    soak.add_argument("--sample-every", type=_duration, default=5.0, help="process sampling interval")
    soak.add_argument("--grace", type=_duration, default=5.0, help="added to each recovery window after /ready 200")
    soak.add_argument("--max-tokens", type=int, default=16)
    soak.add_argument("--seed", type=int, default=0)
    soak.add_argument("--out", dest="out_dir", type=Path, default=REPO_ROOT / "runs" / "soak",
                      help="folder for summary.md, samples.csv, requests.csv and the logs")

    demo = sub.add_parser("demo", help="start the server, stream requests for two adapters, stop")
    _server_flags(demo)
    demo.add_argument("--max-tokens", type=int, default=24)
    demo.set_defaults(func=_cmd_demo)

    params = sub.add_parser("parameters", help="print the parameter reference (docs/parameters.md) generated from "
                                               "the settings objects")
    params.set_defaults(func=_cmd_parameters)
    return parser


def _plan_actions_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="warmup_tools plan", description="The plans a control folder served: "
                                     "every plan applied (apply-plan, the sidecar's re-plan, a rollback) is kept "
                                     "under <control>/plans/, content-addressed, with its parent and who applied it.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    actions = parser.add_subparsers(dest="action", required=True)
    control = argparse.ArgumentParser(add_help=False)
    control.add_argument("--control-dir", type=Path, default=REPO_ROOT / ".control",
                         help="the lora_adapter model's control_dir (WARMUP_CONTROL_DIR)")
    history = actions.add_parser("history", parents=[control],
                                 help="the plans applied, newest first: id, parent, when, by whom, items, bytes")
    history.add_argument("--limit", type=int, default=50, help="show at most this many entries")
    history.set_defaults(func=_cmd_plan_history)
    diff = actions.add_parser("diff", parents=[control],
                              help="items added, kept and dropped from plan A to plan B, with KV bytes")
    diff.add_argument("a", help="a history id (or a unique prefix, or a plan_id), or a plan file")
    diff.add_argument("b", help="the same, for the plan compared with A")
    diff.add_argument("--items", type=int, default=20, help="list at most this many added and dropped items")
    diff.set_defaults(func=_cmd_plan_diff)
    back = actions.add_parser("rollback", parents=[control],
                              help="serve again the plan the served one replaced, or a named one (checked against "
                                   "the repository, applied live like apply-plan, recorded in the history)")
    back.add_argument("id", nargs="?", help="the plan to go back to (default: the parent of the plan served now)")
    _live_apply_flags(back)
    back.set_defaults(func=_cmd_plan_rollback)
    canary = actions.add_parser("canary", parents=[control],
                                help="put a plan on trial on one lora_adapter instance of a replica, or with "
                                     "--replica alone on every instance of that replica of a fleet (the others keep "
                                     "the plan served now); the replica's sidecar promotes it or rolls it back "
                                     "(docs/planner.md); --abort ends a trial without promoting it")
    canary.add_argument("plan", nargs="?", type=Path, help="the plan file to try (checked against the repository)")
    canary.add_argument("--instance", action="append", default=[], dest="canary_instances",
                        help="an instance that serves the plan on trial (repeat; default: the replica's last one, "
                             "of those that report)")
    canary.add_argument("--replica", default="", help="the replica's name (its replica_name, else its host name; "
                                                      "default: this host's name); without --instance: every "
                                                      "instance of it, judged against the fleet's other replicas")
    canary.add_argument("--abort", action="store_true", help="end the running trial: every instance goes back to "
                                                             "the plan served now")
    canary.add_argument("--model-repository", type=Path, default=REPO_ROOT / "model_repository",
                        help="the repository the server runs: the plan is checked against it first")
    canary.set_defaults(func=_cmd_plan_canary)
    return parser


def _live_apply_flags(parser: argparse.ArgumentParser) -> None:
    """What apply-plan and plan rollback share: the check, the stanzas, the wait, the history's bound."""
    parser.add_argument("--model-repository", type=Path, default=REPO_ROOT / "model_repository",
                        help="the repository the server runs: the plan is checked against it first")
    parser.add_argument("--stanzas", action="store_true",
                        help="also write the plan's model_warmup stanzas, so the next start begins from it")
    parser.add_argument("--wait", type=float, default=600.0, help="seconds to wait for the instances (0: don't)")
    parser.add_argument("--instances", type=int, help="how many instances must report (default: all that report)")
    parser.add_argument("--history-keep", type=int, dest="plan_history_keep",
                        help="plan applications the control folder's history keeps (default 20, or "
                             "WARMUP_PLAN_HISTORY_KEEP; docs/parameters.md)")


def _history_settings(args: argparse.Namespace) -> Any:
    from warmup_tools.control.plan_history import PlanHistorySettings

    return load_config(PlanHistorySettings, None, {"plan_history_keep": getattr(args, "plan_history_keep", None)})


def _stub_death_flags(parser: argparse.ArgumentParser) -> None:
    from warmup_tools.sidecar.config import STUB_DEATH_ACTIONS

    parser.add_argument("--on-stub-death", choices=STUB_DEATH_ACTIONS,
                        help="when the stub of a decoupled model dies: restart tritonserver (its streams fail at "
                             "once) or reload the model (they wait for their deadline); default restart; see "
                             "docs/faults.md")
    parser.add_argument("--restart-grace-s", type=float,
                        help="on a restart, seconds the other requests get before tritonserver is killed (default 1)")


def _front_flags(parser: argparse.ArgumentParser, *, beside: bool) -> None:
    """The OpenAI front's flags (FrontSettings; ``beside``: as started by serve and sidecar)."""
    from warmup_tools.front.settings import PIPELINES

    parser.add_argument("--front-config", type=Path, help="JSON file of FrontSettings fields (docs/parameters.md)")
    parser.add_argument("--front-host", help="address of the OpenAI front (default 127.0.0.1)")
    parser.add_argument("--front-port", type=int, help="port of the OpenAI front (default 9000; 0: any free port)")
    parser.add_argument("--served-model-name", help="the base model's name in /v1/models (default base)")
    parser.add_argument("--pipeline", choices=PIPELINES,
                        help="composing (default: a client's disconnect cancels its generation) or ensemble")
    parser.add_argument("--tenant-keys-file", type=Path,
                        help="trust mode: bearer keys name tenants (default: tokenizer_cache's tenant_keys_file)")
    if beside:
        parser.add_argument("--no-front", dest="front", action="store_false", help="do not start the OpenAI front")


def front_settings(args: argparse.Namespace, **known: object) -> "FrontSettings":
    """The front's settings: defaults, ``--front-config``, ``WARMUP_FRONT_<FIELD>`` variables, what the
    command knows (``known``: the server's addresses), then flags."""
    import os

    from warmup_tools.front.settings import FrontSettings

    env = {"WARMUP_" + k[len("WARMUP_FRONT_"):]: v for k, v in os.environ.items() if k.startswith("WARMUP_FRONT_")}
    flags = {"host": args.front_host, "port": args.front_port, "served_model_name": args.served_model_name,
             "pipeline": args.pipeline, "tenant_keys_file": args.tenant_keys_file, **known}
    for name in ("triton_grpc_url", "triton_metrics_url", "sidecar_url"):
        if getattr(args, name, None) is not None:
            flags[name] = getattr(args, name)
    if getattr(args, "command", "") == "front" and args.model_repository is not None:
        flags["model_repository"] = args.model_repository
    return load_config(FrontSettings, args.front_config, flags, env=env)


def _start_front(args: argparse.Namespace, config: ServeConfig, server: Any, sidecar_url: str = "") -> Any:
    """The OpenAI front beside ``server`` (None with --no-front); the caller stops it."""
    if not args.front:
        return None
    from warmup_tools.front.server import FrontServer

    settings = front_settings(args, triton_grpc_url=server.grpc_url,
                              triton_metrics_url=server.metrics_url, sidecar_url=sidecar_url,
                              model_repository=config.model_repository)
    front = FrontServer(settings, environ={**os.environ, **config.server_env()})
    front.start()
    return front


def _server_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="JSON file of ServeConfig fields")
    parser.add_argument("--model-repository", type=Path)
    parser.add_argument("--assets-dir", type=Path)
    parser.add_argument("--control-dir", type=Path)
    parser.add_argument("--snapshot-dir", type=Path, help="folder of lora_adapter's KV snapshots (shared by "
                                                          "replicas; WARMUP_SNAPSHOT_DIR); default: none")
    parser.add_argument("--replica-name", help="this replica's name in shared control and snapshot folders "
                                               "(WARMUP_REPLICA_NAME); default: the host name")
    parser.add_argument("--http-port", type=int)
    parser.add_argument("--grpc-port", type=int)
    parser.add_argument("--metrics-port", type=int)
    parser.add_argument("--host")
    parser.add_argument("--log-verbose", type=int)
    parser.add_argument("--ready-timeout-s", type=float)
    parser.add_argument("--log-file", type=Path)


def _serve_config(args: argparse.Namespace) -> ServeConfig:
    flags = {name: getattr(args, name) for name in (
        "model_repository", "assets_dir", "control_dir", "snapshot_dir", "replica_name", "http_port", "grpc_port",
        "metrics_port", "host", "log_verbose", "ready_timeout_s", "log_file")}
    return load_config(ServeConfig, args.config, flags)


def _cmd_serve(args: argparse.Namespace) -> int:
    config = _serve_config(args)
    stop = _stop_on_signals()
    with _server(config) as server:
        server.wait_ready(timeout=config.ready_timeout_s)
        return _serve_with_front(args, config, server, stop,
                                 f"serving {config.model_repository}: HTTP {server.http_url}, gRPC {server.grpc_url}, "
                                 f"metrics {server.metrics_url} (log {server.log_path})")


def _serve_with_front(args: argparse.Namespace, config: ServeConfig, server: Any, stop: "_Stop", banner: str, *,
                      sidecar_url: str = "", after_drain: Any = None) -> int:
    """Start the OpenAI front beside ``server``, print ``banner`` with its address, serve until stopped, stop it.
    Stopped by SIGTERM, the front drains first (docs/fleet.md): /health fails, the requests in flight finish;
    then the caller stops tritonserver, whose lora_adapter instances write their KV snapshots."""
    front = _start_front(args, config, server, sidecar_url=sidecar_url)
    try:
        print(banner + (f"; OpenAI front {front.url}/v1" if front else "") + "; Ctrl-C stops", flush=True)
        code = _wait_while_alive(server, stop, front)
        if code == 0 and front is not None and stop.signal == signal.SIGTERM:
            print(f"SIGTERM: draining the OpenAI front (/health 503; new requests refused after "
                  f"{front.settings.drain_grace_s:g} s)", flush=True)
            left = front.drain(stop=stop.interrupted)
            print(f"drained: {front.in_flight_at_drain} request(s) were in flight at SIGTERM; "
                  + ("all finished" if not left else f"the drain timed out with {left} still in flight"), flush=True)
            if after_drain is not None:
                after_drain()
        return code
    finally:
        if front is not None:
            front.stop()


def _cmd_front(args: argparse.Namespace) -> int:
    from warmup_tools.front.server import FrontServer

    stop = _stop_on_signals()
    with FrontServer(front_settings(args)) as front:
        print(f"OpenAI front on {front.url}/v1 for tritonserver {front.settings.triton_grpc_url}; Ctrl-C stops",
              flush=True)
        while not stop.wait(1.0):
            if not front.alive():
                print("the OpenAI front stopped", file=sys.stderr)
                return 1
    return 0


class _Stop(threading.Event):
    """Set by SIGINT or SIGTERM (Ctrl-C, ``docker stop``, a pod's termination); ``signal`` says which came
    first, ``interrupted`` is set by a SIGINT (it cuts a SIGTERM's drain short)."""

    def __init__(self) -> None:
        super().__init__()
        self.signal: int | None = None
        self.interrupted = threading.Event()

    def handle(self, sig: int, _frame: object = None) -> None:
        if self.signal is None:
            self.signal = sig
        if sig == signal.SIGINT:
            self.interrupted.set()
        self.set()


def _stop_on_signals() -> _Stop:
    stop = _Stop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop.handle)
    return stop


def _server(config: ServeConfig, env: Mapping[str, str] | None = None, **options: Any) -> Any:
    from warmup_tools.server.process import ServerPorts, TritonServer

    return TritonServer(config.model_repository,
                        ports=ServerPorts(config.http_port, config.grpc_port, config.metrics_port),
                        env={**config.server_env(), **(env or {})}, log_path=config.log_file,
                        log_verbose=config.log_verbose,
                        host=config.host, exit_timeout_s=config.exit_timeout_s, **options)


def _wait_while_alive(server: Any, stop: threading.Event, front: Any = None) -> int:
    """Until ``stop``: 0; or 1 with the log tail when tritonserver exits on its own (a restart by the
    sidecar is waited for, not an exit), or when the OpenAI front stopped."""
    while not stop.wait(1.0):
        if front is not None and not front.alive():
            print("the OpenAI front stopped; stopping tritonserver", file=sys.stderr)
            return 1
        if server.exited():
            print(f"tritonserver exited with code {server.returncode}; log tail:\n{server.log_tail()}",
                  file=sys.stderr)
            return 1
    return 0


def sidecar_config(args: argparse.Namespace) -> "SidecarConfig":
    """The sidecar's settings: defaults, then ``--sidecar-config``, then flags (no environment: the
    ``WARMUP_*`` names belong to ``serve``)."""
    from warmup_tools.sidecar.config import SidecarConfig

    flags = {"host": args.sidecar_host, "port": args.sidecar_port, "probe_interval_s": args.probe_interval_s,
             "probe_timeout_s": args.probe_timeout_s, "failures_to_recover": args.failures_to_recover,
             "recovery_timeout_s": args.recovery_timeout_s, "coverage_threshold": args.coverage_threshold,
             "replan_interval_s": args.replan_interval_s, "replan_log_dir": args.replan_log_dir,
             "replan_since_h": args.replan_since_h, "fleet_log_dir": args.fleet_log_dir,
             "on_stub_death": args.on_stub_death,
             "restart_grace_s": args.restart_grace_s}
    return load_config(SidecarConfig, args.sidecar_config, flags, env={})


def _cmd_sidecar(args: argparse.Namespace) -> int:
    from warmup_tools.server.process import RepositoryKey
    from warmup_tools.sidecar.app import Sidecar, replica_log_dir

    config = _serve_config(args)
    sidecar_settings = sidecar_config(args)
    env = {}
    if sidecar_settings.fleet_log_dir is not None:
        # NOTE: in a fleet the replica's request_log_dir follows from the shared folder and its name: one source.
        mine = replica_log_dir(sidecar_settings, replica_name(config.replica_name))
        env["WARMUP_REQUEST_LOG_DIR"] = str(Path(mine).resolve())  # type: ignore[arg-type]
    stop = _stop_on_signals()
    # NOTE: the key is generated here and handed to the sidecar object only: clients of the server
    # cannot load or unload models, the sidecar can.
    with _server(config, env, explicit_model_control=True, repository_key=RepositoryKey.generate()) as server:
        # The sidecar answers from the start, so a startupProbe sees 503 with the reason while models load.
        with Sidecar(sidecar_settings, server.http_url, server.grpc_url, server.repository_key,
                     config.model_repository, control_dir=config.control_dir, server=server,
                     replica_name=config.replica_name, snapshot_dir=config.snapshot_dir) as sidecar:
            # The front answers from the start too: 503 with the sidecar's reason until /ready says 200.
            return _serve_with_front(args, config, server, stop,
                                     f"tritonserver starting on {config.model_repository}: HTTP {server.http_url}, "
                                     f"gRPC {server.grpc_url} (log {server.log_path}); sidecar {sidecar.url}/ready "
                                     "/live /status", sidecar_url=sidecar.url,
                                     after_drain=lambda: _unload_for_exit(sidecar, config.exit_timeout_s))


def fleet_settings(args: argparse.Namespace) -> "FleetSettings":
    """The fleet's settings: defaults, ``--fleet-config``, ``WARMUP_FLEET_<FIELD>`` variables, then flags."""
    from warmup_tools.fleet.settings import FleetSettings

    names = ("replicas", "policy", "host", "port", "prometheus_port", "work_dir", "control_dir", "snapshot_dir",
             "request_log_dir", "sidecar_config", "model_repository", "assets_dir", "lm_threads", "secrets_dir",
             "membership_interval_s", "health_check_interval_s")
    flags = {name: getattr(args, name, None) for name in names}
    return load_config(FleetSettings, getattr(args, "fleet_config", None), flags, env=_fleet_env())


def _secrets_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--secrets-dir", type=Path,
                        help="trust mode: the deployment's secrets folder, as `deploy-secrets` makes it (default: "
                             "WARMUP_FLEET_SECRETS_DIR; neither: open mode)")


def _fleet_env() -> dict[str, str]:
    """``WARMUP_FLEET_<FIELD>`` variables, named as load_config reads them."""
    return {"WARMUP_" + k[len("WARMUP_FLEET_"):]: v for k, v in os.environ.items() if k.startswith("WARMUP_FLEET_")}


def _cmd_fleet(args: argparse.Namespace) -> int:
    from warmup_tools.fleet.fleet import Fleet

    settings = fleet_settings(args)
    stop = _stop_on_signals()
    with Fleet(settings) as fleet:
        print(f"router ({settings.policy}) on {fleet.router.url}/v1, metrics {fleet.router.metrics_url}; replicas: "
              + ", ".join(f"{name} {r.url}" for name, r in fleet.replicas.items())
              + f"; work folder {fleet.work_dir}; Ctrl-C stops (each replica drains first)", flush=True)
        while not stop.wait(1.0):
            for name, replica in fleet.replicas.items():
                if replica.process.exited():
                    print(f"replica {name} exited; its output:\n{replica.process.log_tail()}", file=sys.stderr)
                    return 1
            if fleet.router.process.exited():
                print(f"the router exited:\n{fleet.router.process.log_tail()}", file=sys.stderr)
                return 1
    return 0


def _unload_for_exit(sidecar: Any, timeout_s: float) -> None:
    started = time.monotonic()
    done = sidecar.unload_for_exit(timeout_s=timeout_s)
    print(f"lora_adapter unloaded in {time.monotonic() - started:.1f} s (its KV snapshots written)" if done else
          f"lora_adapter was not unloaded within {timeout_s:g} s", flush=True)


def _cmd_router(args: argparse.Namespace) -> int:
    from warmup_tools.fleet.router import control_key, smg_argv

    settings = fleet_settings(args)
    argv = smg_argv(settings, port=settings.port or 30000, prometheus_port=settings.prometheus_port or 29000,
                    control_key=control_key(settings))
    print(f"smg {settings.policy} router on {settings.host}:{settings.port or 30000}, worker API "
          + ("behind the deployment's control-plane key" if settings.secrets_dir else "open (open mode)"), flush=True)
    os.execv(argv[0], argv)  # NOTE: smg takes this process's place: signals reach it, its exit is ours


def _cmd_join(args: argparse.Namespace) -> int:
    from warmup_tools.common.deployment import DeploymentSecrets
    from warmup_tools.fleet.membership import Membership
    from warmup_tools.fleet.replica import wait_warm
    from warmup_tools.fleet.router import RouterClient, control_key

    args.membership_interval_s = args.interval_s
    settings = fleet_settings(args)
    interval = settings.membership_interval_s
    replica_key = None
    if settings.secrets_dir is not None:
        secrets = DeploymentSecrets(settings.secrets_dir)
        replica_key = secrets.read_key(secrets.probe_key)
    router = RouterClient(args.router, settings.health_check_interval_s, control_key=control_key(settings))
    membership = Membership(args.replica, router, interval, replica_key=replica_key)
    if args.once:
        wait_warm(args.replica, args.timeout_s)
        membership.sync()
        workers = membership.workers
        print(f"{args.replica} joined {args.router}: {len(workers)} worker(s), models {', '.join(workers)}")
        return 0
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: membership.stop())  # run() leaves the router, then returns
    print(f"keeping {args.replica} in {args.router} (a look every {interval:g} s) until SIGTERM", flush=True)
    membership.run()
    print(f"{args.replica} left {args.router}", flush=True)
    return 0


def _cmd_assets(args: argparse.Namespace) -> int:
    from warmup_tools.demo.assets import build_demo_assets, ensure_demo_assets

    assets = build_demo_assets(args.out, args.seed) if args.force else ensure_demo_assets(args.out, args.seed)
    print(f"demo assets ready in {assets.root} (adapters: {', '.join(assets.adapters)})")
    return 0


def _cmd_stanzas(args: argparse.Namespace) -> int:
    from warmup_tools.common.plan import Plan
    from warmup_tools.demo.prompts import SYSTEM_PROMPTS
    from warmup_tools.planning.plan_stanzas import check_repository, write_plan_stanzas
    from warmup_tools.planning.prompt_stanzas import write_prompt_stanzas

    if not args.check:
        if args.plan:
            plan = Plan.load(args.plan)
            counts = write_plan_stanzas(plan, args.model_repository)
            print(f"wrote stanzas of plan {plan.plan_id} into {args.model_repository}: {counts}")
        else:
            files = write_prompt_stanzas(args.model_repository, args.tokenizer, SYSTEM_PROMPTS)
            print(f"wrote the demo model_warmup stanzas ({len(files)} data files) into {args.model_repository}")
    problems = check_repository(args.model_repository)
    for problem in problems:
        print(f"problem: {problem}", file=sys.stderr)
    if problems:
        return 1
    print(f"stanzas in {args.model_repository} are consistent with their configs")
    return 0


def _cmd_tenant_key(args: argparse.Namespace) -> int:
    from warmup_tools.common.errors import InvalidInputError
    from warmup_tools.triton.trust import add_tenant_key

    try:
        key = add_tenant_key(args.keys_file, args.secret_file, args.tenant)
    except InvalidInputError as exc:
        raise WarmupToolsError(str(exc)) from None
    print(f"tenant {args.tenant}: key {key}\n(shown once; {args.keys_file} keeps only its SHA-256)", file=sys.stderr)
    print(key)
    return 0


def _cmd_deploy_secrets(args: argparse.Namespace) -> int:
    from warmup_tools.ops.deploy_secrets import make_deployment_secrets

    files = make_deployment_secrets(args.dir, redis_host=args.redis_host, redis_port=args.redis_port,
                                    redis_conf_dir=args.redis_conf_dir, redis_uid=args.redis_uid)
    print(f"deployment secrets ready in {files.folder}")
    return 0


def _duration(text: str) -> float:
    """``90s``, ``30m``, ``6h`` or ``2d`` as seconds (argparse type)."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        value = float(text[:-1]) * units[text[-1]] if text and text[-1] in units else float(text)
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration such as 30m, 6h or 2d")
    return value


def _cmd_plan(args: argparse.Namespace) -> int:
    from warmup_tools.common.jsonl import ReadStats
    from warmup_tools.common.plan import Plan
    from warmup_tools.common.records import log_files, read_request_log
    from warmup_tools.embedding_cache.embedder import OnnxEmbedder
    from warmup_tools.planning.analyse import PlanOptions
    from warmup_tools.planning.select import build_plan, format_summary
    from warmup_tools.planning.target import PlanTarget

    target = PlanTarget.from_repository(args.model_repository)
    budgets = target.default_budgets(kv_bytes_total=args.kv_bytes_total, kv_bytes_per_adapter=args.kv_bytes_per_adapter,
                                     embedding_entries=args.embedding_entries, tokenizer_entries=args.tokenizer_entries,
                                     warm_seconds=args.warm_seconds)
    previous = Plan.load(args.previous) if args.previous else None
    stats = ReadStats()
    records = list(read_request_log(log_files(args.logs), stats))
    if args.since is not None:
        end = args.now if args.now is not None else max((r.ts for r in records), default=0.0)
        kept = [r for r in records if end - args.since <= r.ts <= end]
        print(f"{len(kept)} of {len(records)} records in the last {args.since / 3600:g} h before "
              f"{datetime.datetime.fromtimestamp(end, datetime.timezone.utc).isoformat(timespec='seconds')}",
              file=sys.stderr)
        records = kept
    plan = build_plan(records, target.load_tokenizer(), OnnxEmbedder(target.embedder),
                      budgets, now=args.now, block_size=target.block_size,
                      kv_bytes_per_token=target.kv_bytes_per_token, progress=not args.no_progress, previous=previous,
                      options=PlanOptions(arbitration=args.arbitration))
    plan.save(args.out)
    if stats.skipped:
        print(f"skipped {stats.skipped} bad or torn log line(s) of {stats.records + stats.skipped}; first: "
              + "; ".join(str(s) for s in stats.examples[:5]), file=sys.stderr)
    print(format_summary(plan))
    print(f"plan {plan.plan_id} written to {args.out}; apply it with "
          f"`python -m warmup_tools stanzas --plan {args.out}`")
    return 0


def _cmd_apply_plan(args: argparse.Namespace) -> int:
    from warmup_tools.common.plan import Plan
    from warmup_tools.planning.live import apply_plan
    from warmup_tools.planning.target import PlanTarget

    plan = Plan.load(args.plan)
    target = PlanTarget.from_repository(args.model_repository)
    tokenizer = target.load_tokenizer()
    entry = apply_plan(plan, args.control_dir, target=target, tokenizer=tokenizer,
                       inputs={"plan_file": str(args.plan)}, history=_history_settings(args))
    return _served(args, plan, entry, target, tokenizer)


def _served(args: argparse.Namespace, plan: Any, entry: Any, target: Any, tokenizer: Any) -> int:
    """After apply-plan or a rollback: the history entry, the stanzas (--stanzas), each instance (--wait)."""
    from warmup_tools.planning.live import wait_applied
    from warmup_tools.planning.plan_stanzas import write_plan_stanzas

    print(f"plan {plan.plan_id} ({len(plan.items)} KV items) written to {args.control_dir}; history id {entry.id}, "
          f"parent {entry.parent or '-'}", flush=True)
    if args.stanzas:
        counts = write_plan_stanzas(plan, args.model_repository, target=target, tokenizer=tokenizer)
        print(f"stanzas of plan {plan.plan_id} written into {args.model_repository}: {counts}")
    if args.wait > 0:
        for instance, status in sorted(wait_applied(args.control_dir, plan.plan_id, instances=args.instances,
                                                    timeout_s=args.wait).items()):
            coverage = ", ".join(f"{name} {c.resident}/{c.planned}" + (f" ({c.shortfall})" if c.shortfall else "")
                                 for name, c in sorted(status.adapters.items()))
            print(f"{instance}: applied plan {status.plan_id}: {status.detail}; resident blocks: {coverage or '-'}")
    return 0


def _cmd_plan_history(args: argparse.Namespace) -> int:
    from warmup_tools.control.plan_history import PlanHistory

    history = PlanHistory(args.control_dir)
    entries = history.entries()
    if not entries:
        print(f"no plan history in {args.control_dir}")
        return 0
    served = history.current()
    rows = [("", "id", "parent", "when (UTC)", "by", "items", "KV bytes", "plan_id")]
    for index, entry in enumerate(entries[:max(args.limit, 1)]):
        when = datetime.datetime.fromtimestamp(entry.at, datetime.timezone.utc).isoformat(timespec="seconds")
        by = f"{entry.by} ({entry.user})" if entry.user else entry.by
        rows.append(("*" if served is not None and index == 0 else "", entry.id, entry.parent or "-",
                     when.replace("+00:00", ""), by, str(entry.items), f"{entry.kv_bytes:,}", entry.plan_id))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = (c.rjust(w) if i in (5, 6) else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
        print("  ".join(cells).rstrip())
    if served is None:
        print(f"(plan.json in {args.control_dir} is not the newest plan of the history)")
    from warmup_tools.control.plan_control import read_canary

    running = read_canary(args.control_dir)
    if running is not None:
        where = ", ".join(running.instances) or "every instance"
        since = datetime.datetime.fromtimestamp(running.started_at, datetime.timezone.utc)
        print(f"on trial: {running.plan} (plan_id {running.plan_id}) on {where} of {running.host}, since "
              f"{since:%Y-%m-%d %H:%M:%S} UTC")
    return 0


def _cmd_plan_diff(args: argparse.Namespace) -> int:
    from warmup_tools.common.plan import Plan
    from warmup_tools.control.plan_history import PlanHistory, diff_plans

    history = PlanHistory(args.control_dir)

    def load(ref: str) -> Any:
        return Plan.load(Path(ref)) if os.sep in ref or ref.endswith(".json") else history.load(ref)

    a, b = load(args.a), load(args.b)
    diff = diff_plans(a, b)
    mib = 1 << 20
    print(f"plan {a.plan_id} -> plan {b.plan_id}: {len(diff.added)} items added ({diff.added_bytes / mib:.1f} MiB "
          f"of new blocks), {len(diff.kept)} kept ({diff.kept_bytes / mib:.1f} MiB of blocks in both), "
          f"{len(diff.dropped)} dropped ({diff.dropped_bytes / mib:.1f} MiB of blocks no longer warmed)")
    for sign, items in (("+", diff.added), ("-", diff.dropped)):
        for item in items[:max(args.items, 0)]:
            text = " ".join(str(item.get("text", "")).split())[:60]
            print(f"  {sign} {item['tenant']} / {item['adapter'] or '(base)'}: {len(item['token_ids'])} tokens "
                  f"{text!r}")
        if len(items) > args.items:
            print(f"  {sign} ... and {len(items) - args.items} more")
    return 0


def _cmd_plan_rollback(args: argparse.Namespace) -> int:
    from warmup_tools.planning.live import rollback
    from warmup_tools.planning.target import PlanTarget

    target = PlanTarget.from_repository(args.model_repository)
    tokenizer = target.load_tokenizer()
    settings = _history_settings(args)
    plan, entry = rollback(args.control_dir, args.id, target=target, tokenizer=tokenizer, history=settings)
    print(f"rolled back from plan {entry.inputs.get('rolled_back') or '-'} to {entry.id}")
    return _served(args, plan, entry, target, tokenizer)


def _cmd_plan_canary(args: argparse.Namespace) -> int:
    from warmup_tools.common.errors import ConfigError
    from warmup_tools.common.plan import Plan
    from warmup_tools.control.plan_control import PlanStatusBoard, read_canary
    from warmup_tools.control.plan_history import applied_by
    from warmup_tools.planning.live import check_plan
    from warmup_tools.sidecar.canary.trial import end_canary, start_canary

    if args.abort:
        running = read_canary(args.control_dir)
        if running is None:
            print(f"no plan on trial in {args.control_dir}")
            return 1
        end_canary(args.control_dir, running, promote=False, by=applied_by("plan canary --abort"))
        print(f"ended the trial of plan {running.plan_id}: every instance serves plan.json again")
        return 0
    if args.plan is None:
        raise ConfigError("name the plan file to try (or --abort)")
    host = replica_name(args.replica)
    plan = Plan.load(args.plan)
    check_plan(plan, args.model_repository)
    instances = list(args.canary_instances)
    board = PlanStatusBoard(args.control_dir)
    if args.replica and not instances:
        # A whole replica, judged by its sidecar against the replicas that report (docs/planner.md).
        from warmup_tools.sidecar.config import SidecarConfig

        replicas = board.hosts(since=time.time() - SidecarConfig().coverage_stale_s)
        if host not in replicas or len(replicas) < 2:
            raise ConfigError(f"replicas reporting to {args.control_dir} lately: {', '.join(replicas) or 'none'}; "
                              f"a trial on replica {host} needs it and another one to compare with "
                              "(or name --instance)")
    elif not instances:
        statuses, _ = board.read_all(host=host)
        if len(statuses) < 2:
            raise ConfigError(f"replica {host} has {len(statuses)} lora_adapter instance(s) reporting to "
                              f"{args.control_dir}: a canary needs one to try the plan and one to compare with")
        instances = sorted(statuses)[-1:]
    canary = start_canary(args.control_dir, plan, host=host, instances=instances, by=applied_by("plan canary"),
                          settings=_history_settings(args))
    print(f"plan {plan.plan_id} on trial on {', '.join(canary.instances) or 'every instance'} of {host} (stored as "
          f"{canary.plan}); "
          "the sidecar's /status (canary) shows the verdict")
    return 0


def _cmd_parameters(args: argparse.Namespace) -> int:
    from warmup_tools.ops.parameters import parameters_markdown

    sys.stdout.write(parameters_markdown())
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from warmup_tools.demo.assets import ensure_demo_assets
    from warmup_tools.ops.demo import run_demo

    config = _serve_config(args)
    ensure_demo_assets(config.assets_dir)
    run_demo(config, max_tokens=args.max_tokens)
    return 0


def _cmd_adapters(args: argparse.Namespace) -> int:
    from warmup_tools.control.registry import ControlRegistry
    from warmup_tools.control.state import AdapterState

    registry = ControlRegistry(args.control_dir)
    if args.action == "status":
        statuses = registry.statuses()
        if not statuses:
            print(f"no instance has reported to {args.control_dir} (is the server running with this control dir?)")
        for instance, adapters in sorted(statuses.items()):
            for name, status in sorted(adapters.items()):
                print(f"{instance}\t{name}\t{status.state.value}\trev {status.revision}\t{status.detail}")
        return 0
    if args.action == "add":
        prompts = list(args.warm_prompt)
        if args.warm_file:
            prompts += [line for line in args.warm_file.read_text().splitlines() if line.strip()]
        spec = registry.add(args.name, prompts, live=not args.register_only, path=args.path)
        target = AdapterState.REGISTERED if args.register_only else AdapterState.LIVE
    else:
        spec = registry.retire(args.name)
        target = AdapterState.RETIRED
    print(f"{spec.name}: target {spec.target} (revision {spec.revision})", flush=True)
    if args.wait > 0:
        reached = registry.wait_until(spec.name, target, instances=args.instances, timeout_s=args.wait)
        for instance, status in sorted(reached.items()):
            print(f"{instance}: {status.state.value} {status.detail}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    from warmup_tools.demo.assets import ensure_demo_assets

    module = importlib.import_module(f"warmup_tools.sim.bench.{args.bench}")
    module.run(ensure_demo_assets(args.assets_dir).root, **bench_options(args))
    return 0


def bench_options(args: argparse.Namespace) -> dict[str, object]:
    """A ``bench`` command's own flags: the keyword arguments of its module's ``run()``."""
    return {k: v for k, v in vars(args).items() if k not in ("command", "bench", "func", "verbose", "assets_dir")}


def _cmd_traffic(args: argparse.Namespace) -> int:
    from warmup_tools.sim.traffic import main_traffic

    main_traffic(args.out, args.seed, args.days, args.requests_per_day, args.gzip)
    return 0
