"""``python -m warmup_tools bench fleet-scale``: fleets of 1 to 8 replicas (or more) whose ``lora_adapter`` runs the
simulated engine (``engine=simulated``, a profile's step times waited), behind the smg router, replaying a public
production trace (:mod:`warmup_tools.sim.traces`). Everything but the forward is the real one: tritonserver, the
ensemble, the KV prefix cache with its budget, plans and stanzas, snapshots, the sidecar, the front, the router.

The trace's first ``plan_min`` minutes are the planner's request log; the next ``replay_min`` minutes are replayed
open-loop (each request at its arrival, divided by ``speedup``) through the router. Every replica's KV budget is
the profile's device capacity in the trace's blocks (``kv_capacity_tokens / source_block`` blocks of
``block_tokens`` tokens): the fleet's caches are as full, relative to the trace, as the modelled GPUs' would be.

Runs (each a fleet of its own, one after the other):

1. **Routing**: ``replicas`` x ``policies``, every replica warming the whole plan (its stanzas).
2. **Oracle**: one replica with the largest fleet's KV capacity and engine speed (one cache of the fleet's size).
3. **Plans** at the largest fleet with ``plan_policy``: the whole plan on every replica, the plan split across
   the replicas (a plan for the fleet's total warm-up budget, its prompts sent once through the router before
   the replay, so each lands on the replica the router will send it to), no plan.
4. **Scale-out**: ``largest - 3`` replicas; at half the replay three replicas join together: cold (no stanzas,
   joined at READY), warmed (the plan's stanzas, joined once warm), restored (the fleet's KV snapshots and the
   stanzas, joined once warm). Figure per joiner: modelled TTFT p99 of its first ``window_min`` minutes over the
   fleet's p99 before the join.
5. **Scale-in and router restart** at the largest fleet: two replicas leave together at a third of the replay
   (failed requests meanwhile), the router restarts at two thirds (refused requests, seconds until every
   replica's workers are back).
6. **Cold start** (``--runs cold-start``, not in the default) at the largest fleet: the whole plan's stanzas on
   every replica, then none, back to back on the same ``cold_min`` modelled minutes, one more replica launched at
   ``join_min`` (warmed with the plan, cold without): per event (the fleet's start, the join, each adapter's
   first request) and window (the first 60 s and 5 min), TTFT p99, its P99 jump over the steady p99, TTFT std
   and cached share, plan against no plan; the per-minute cached share's worst gap
   (:mod:`warmup_tools.sim.bench.support.cold_start`).

7. **Worker protocols** (``--runs protocols``, not in the default) at the largest fleet with ``plan_policy``, once per
   ``--worker-protocols`` (``http``: smg routes ``cache_aware`` on its own tree of the text it routed; ``grpc``: on
   the replicas' KV events, :mod:`warmup_tools.fleet.membership`), on the same replay, each with two more replicas
   joining together at half the replay, once warm: a warmed one (the plan's stanzas and the fleet's snapshots) and
   a cold one (neither); and the oracle's run on the same items: per protocol the share of prompt tokens from
   cache and its ratio to the oracle's, TTFT p50/p99, each joiner's cached share and TTFT p99 in its first modelled
   minute against the fleet's steady share, failures.

Every run counts its failed requests by HTTP status, error kind and replica (the router names the worker it
routed to). ``--trace real-text`` replays the project's real-text traffic instead of a public trace.

Per run: share of prompt tokens served from the KV cache (all, and in the first ``window_min`` minutes), cold
share (requests with no cached token), modelled TTFT p50/p99 (``lora_adapter``'s own TTFT from its request log,
times ``speedup``), requests per replica, each replica's KV bytes at the end over its budget.

Every TTFT here is **modelled** (the profile named in the output); cached-token shares and request counts are
counted, not modelled. Every process of every replica, the router and the client share this machine's cores.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Annotated, Any, Sequence, TextIO

import httpx

from warmup_tools.common.errors import ConfigError
from warmup_tools.common.records import RequestRecord, log_files, read_request_log
from warmup_tools.common.settings import arg, environ_overrides
from warmup_tools.fleet.fleet import Fleet
from warmup_tools.fleet.replica import Replica
from warmup_tools.fleet.router import ServedModel
from warmup_tools.fleet.settings import ROUTER_POLICIES, WORKER_PROTOCOLS, FleetSettings
from warmup_tools.lora_adapter.profile import load_profile
from warmup_tools.server.client import metric_sum, scrape_metrics
from warmup_tools.server.config import REPO_ROOT
from warmup_tools.sim.bench.support.cold_start import ColdRun, Sample, cold_start_report
from warmup_tools.sim.bench.support.sending import Answer, failures_table, send
from warmup_tools.sim.bench.support.simulated import replica_kv_tokens, simulated_environment
from warmup_tools.sim.bench.support.tables import markdown, p99
from warmup_tools.sim.traces import TRACES, TracePrompts, TraceScale, load_trace

LOGGER = logging.getLogger(__name__)

#: The profile the bench models by default: a published H100 figure set for Llama-3.1-8B.
DEFAULT_PROFILE = "h100-llama-3.1-8b"
#: Seconds between the replicas' periodic KV snapshots (the restored joiner reads them).
SNAPSHOT_INTERVAL_S = 10
#: Joiners of the scale-out run, in the order they are launched.
JOINERS = ("cold", "warmed", "restored")
#: The ``--trace`` of the project's real-text traffic (:func:`real_text`), beside :data:`TRACES`.
REAL_TEXT = "real-text"
#: The runs of a ``bench fleet-scale``, in the order they run.
RUNS = ("routing", "oracle", "plans", "scale-out", "scale-in", "cold-start", "protocols")
#: Modelled minutes the scale-out run's replay goes on beyond the joiners' window (they start, restore and warm
#: after half the replay before they join: a few wall seconds, so minutes at ``speedup``).
JOIN_LEAD_MIN = 5.0
#: Modelled seconds from the replay's start after which the fleet's cached share counts as steady (the protocols
#: run; at most half the replay).
STEADY_AFTER_S = 300.0
#: What ``cache_aware`` routes on over each worker protocol (the protocols run's rows).
PROTOCOL_LABELS = {"http": "http: smg's tree of the text it routed", "grpc": "grpc: the replicas' KV events"}
#: Modelled seconds of a joiner's first window in the protocols run (its cached share against the steady share).
JOINER_WINDOW_S = 60.0


@dataclasses.dataclass(frozen=True, slots=True)
class Item:
    """One replayed request: its arrival (modelled seconds from the replay's start), text and output length; the
    real-text traffic's also its tenant and adapter ("": the base model)."""

    at_s: float
    prompt: str
    max_tokens: int
    tenant: str = "default"
    adapter: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class Workload:
    """What every run replays, and the plans and repositories made from the trace's first part."""

    #: Every run replays the items before ``replay_s``; the scale-out run goes on for its joiners' window.
    items: list[Item]
    replay_s: float
    plan_records: list[RequestRecord]
    base_repo: Path
    whole_repo: Path
    #: The split plan's prompts (a plan for the fleet's total warm-up budget).
    split_prompts: list[str]
    kv_budget_bytes: int
    plan_summary: str
    #: The model the replicas serve as a router over gRPC workers needs it (its LM folder and KV block size).
    served: ServedModel | None = None

    @property
    def replayed(self) -> list[Item]:
        return [i for i in self.items if i.at_s < self.replay_s]


@dataclasses.dataclass(frozen=True, slots=True)
class Row:
    label: str
    replicas: int
    requests: int
    failed: int
    cached_share: float
    early_cached_share: float
    cold_share: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    per_replica: str
    kv_use: str


def run(assets_dir: Path, *,
        trace: Annotated[str, arg("the public trace replayed, or real-text: the project's real-text traffic "
                                  "(planned from its day 1, day 2 replayed)", choices=(*TRACES, REAL_TEXT))]
        = "conversation",
        replicas: Annotated[str, arg("fleet sizes of the routing runs, comma-separated (the largest is used for "
                                     "the oracle, plan, scale-out and scale-in runs)")] = "1,2,4,8",
        policies: Annotated[str, arg("router policies of the routing runs at the largest size, comma-separated "
                                     "(the smaller sizes use plan_policy)")] = "round_robin,cache_aware,prefix_hash",
        plan_policy: Annotated[str, arg("the router's policy in the oracle, plan, scale-out and scale-in runs",
                                        choices=ROUTER_POLICIES)] = "cache_aware",
        profile: Annotated[str, arg("the simulated engine's profile (a shipped name or a JSON path)")]
        = DEFAULT_PROFILE,
        block_tokens: Annotated[int, arg("tokens each of the trace's hash blocks becomes", ge=1)] = 16,
        plan_min: Annotated[float, arg("minutes of the trace's start the plan is made from", ge=0.001)] = 10.0,
        replay_min: Annotated[float, arg("minutes of the trace after the plan's part replayed", ge=0.001)] = 20.0,
        window_min: Annotated[float, arg("modelled minutes of the early figures (after the start, after a join)",
                                         ge=0.001)] = 10.0,
        speedup: Annotated[float, arg("arrivals and step times divided by this (modelled times multiplied back)",
                                      ge=0.001)] = 4.0,
        max_output_tokens: Annotated[int, arg("cap on each request's scaled output tokens", ge=1)] = 4,
        runs: Annotated[str, arg("which runs, comma-separated: routing, oracle, plans, scale-out, scale-in, "
                                 "cold-start (not in the default: its plan-vs-no-plan table at the largest size), "
                                 "protocols (not in the default: each --worker-protocols side by side)")]
        = "routing,oracle,plans,scale-out,scale-in",
        worker_protocols: Annotated[str, arg("--runs protocols: the routers' worker protocols compared, "
                                             "comma-separated (http: cache_aware on smg's tree of what it routed; "
                                             "grpc: on the replicas' KV events)")] = "http,grpc",
        protocol_plan: Annotated[bool, arg("--runs protocols: every replica warms the whole plan (its stanzas); "
                                           "--no-protocol-plan: none (the joiner then restores the fleet's "
                                           "snapshots only)")] = True,
        concurrency: Annotated[int, arg("most requests in flight from the client", ge=1)] = 64,
        cold_min: Annotated[float, arg("modelled minutes each cold-start run replays from the fleet's start",
                                       ge=0.001)] = 13.0,
        join_min: Annotated[float, arg("modelled minute at which the cold-start runs launch one more replica "
                                       "(it joins once warm, a few wall seconds later)", ge=0.0)] = 5.0,
        requests_per_day: Annotated[int, arg("--trace real-text: requests per simulated day", ge=1)] = 30000,
        seed: Annotated[int, arg("--trace real-text: the traffic's seed")] = 0,
        logs_dir: Annotated[Path | None, arg("copy the logs of every replay and cold-start run (replicas, "
                                             "tritonservers, router) into a folder of its own here")] = None,
        out: TextIO = sys.stdout) -> None:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    sizes = sorted({int(n) for n in replicas.split(",") if n.strip()})
    chosen = {r.strip() for r in runs.split(",") if r.strip()}
    if chosen - set(RUNS):
        raise ConfigError(f"--runs: unknown {', '.join(sorted(chosen - set(RUNS)))}; known: {', '.join(RUNS)}")
    protocols = [p.strip() for p in worker_protocols.split(",") if p.strip()]
    if "protocols" in chosen and (not protocols or set(protocols) - set(WORKER_PROTOCOLS)):
        raise ConfigError(f"--worker-protocols: {worker_protocols!r}; each one of {', '.join(WORKER_PROTOCOLS)}")
    largest = sizes[-1]
    engine = load_profile(profile)
    about = TRACES[trace].about if trace in TRACES else (
        f"the project's real-text traffic at {requests_per_day} requests a day (seed {seed})")
    kv_tokens = replica_kv_tokens(engine, block_tokens, trace)
    kv_bytes = kv_tokens * engine.kv_bytes_per_token
    work = Path(tempfile.mkdtemp(prefix="bench-fleet-scale-"))
    env = {**simulated_environment(profile, speedup, kv_bytes), "WARMUP_SNAPSHOT_INTERVAL_S": str(SNAPSHOT_INTERVAL_S)}
    try:
        with environ_overrides(env):
            load = workload(work, assets_dir, trace, TraceScale(block_tokens=block_tokens,
                                                                 max_output_tokens=max_output_tokens,
                                                                 duration_s=(plan_min + max(
                                                                     replay_min + window_min + JOIN_LEAD_MIN,
                                                                     cold_min)) * 60),
                            plan_min=plan_min, replay_min=replay_min, split_replicas=largest,
                            requests_per_day=requests_per_day, seed=seed)
            planned_from = "day 1" if trace == REAL_TEXT else f"its first {plan_min:g} min"
            out.write(f"trace {trace}: {about}; {len(load.plan_records)} requests planned from {planned_from}, "
                      f"{len(load.replayed)} replayed from the next {replay_min:g} min at x{speedup:g}"
                      f"\nmodelled: profile {engine.name} ({engine.hardware}, {engine.model}); each replica's KV "
                      f"budget {kv_tokens} tokens ({kv_tokens // block_tokens} blocks of {block_tokens}); "
                      f"outputs capped at {max_output_tokens} tokens\n{load.plan_summary}\n")
            out.flush()
            bench = Bench(work, assets_dir, load, speedup=speedup, window_s=window_min * 60, concurrency=concurrency,
                          out=out, logs_dir=logs_dir)
            rows: list[Row] = []
            if "routing" in chosen:
                for n in sizes:
                    routing = [p.strip() for p in policies.split(",")] if n == largest else [plan_policy]
                    for policy in routing if n > 1 else ["round_robin"]:
                        rows.append(bench.replay_run(f"{n} x {policy}", n, policy, load.whole_repo))
            oracle: Row | None = None
            if "oracle" in chosen or "protocols" in chosen:
                with environ_overrides({"WARMUP_KV_CACHE_BYTES": str(kv_bytes * largest),
                                        "WARMUP_ENGINE_SPEEDUP": str(speedup * largest),
                                        "WARMUP_ENGINE_TIME_SCALE": str(speedup)}):
                    oracle = bench.replay_run(f"oracle: 1 cache of {largest} replicas' capacity", 1,
                                              "round_robin", load.whole_repo, modelled_ttft=False,
                                              kv_budget_bytes=load.kv_budget_bytes * largest)
                if "oracle" in chosen:
                    rows.append(oracle)
            if "plans" in chosen:
                rows.append(bench.replay_run(f"{largest} x {plan_policy}, plan split", largest, plan_policy,
                                             load.base_repo, prime=load.split_prompts))
                rows.append(bench.replay_run(f"{largest} x {plan_policy}, no plan", largest, plan_policy,
                                             load.base_repo))
            if rows:
                out.write("\n" + table(rows) + "\n")
                out.flush()
            if "scale-out" in chosen:
                bench.scale_out(max(1, largest - len(JOINERS)), plan_policy)
            if "scale-in" in chosen:
                bench.scale_in_and_restart(largest, plan_policy)
            if "cold-start" in chosen:
                bench.cold_start(largest, plan_policy if largest > 1 else "round_robin", cold_min * 60, join_min * 60)
            if "protocols" in chosen and oracle is not None:
                bench.protocols(largest, plan_policy, protocols, oracle,
                                load.whole_repo if protocol_plan else load.base_repo)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def workload(work: Path, assets_dir: Path, trace: str, scale: TraceScale, *, plan_min: float, replay_min: float,
             split_replicas: int, requests_per_day: int = 0, seed: int = 0) -> Workload:
    """The replayed items and the plans of the trace's first ``plan_min`` minutes (under the environment the
    replicas get: the simulated engine's profile and KV budget). ``trace`` :data:`REAL_TEXT`: the project's
    real-text traffic at ``requests_per_day`` (``seed``), planned from all of day 1 (the real-text replay of
    docs/planner.md) and replayed from day 2's start for ``scale.duration_s`` less ``plan_min`` minutes."""
    from warmup_tools.embedding_cache.embedder import OnnxEmbedder
    from warmup_tools.planning.analyse import PlanOptions
    from warmup_tools.planning.plan_stanzas import COMPOSING_MODELS, write_plan_stanzas
    from warmup_tools.planning.select import build_plan, format_summary
    from warmup_tools.planning.stanzas import write_model_warmup
    from warmup_tools.planning.target import PlanTarget

    base_repo, whole_repo = work / "repo-without-plan", work / "repo-with-plan"
    for repo in (base_repo, whole_repo):
        shutil.copytree(REPO_ROOT / "model_repository", repo)
        for model in COMPOSING_MODELS:
            write_model_warmup(repo / model, [])
    target = PlanTarget.from_repository(whole_repo, {**os.environ, "WARMUP_ASSETS_DIR": str(assets_dir),
                                                     "WARMUP_CONTROL_DIR": ""})
    tokenizer = target.load_tokenizer()
    if trace == REAL_TEXT:
        plan_records, items, now = real_text(work, scale, plan_min=plan_min, requests_per_day=requests_per_day,
                                             seed=seed)
    else:
        prompts = TracePrompts(tokenizer, scale.block_tokens)
        requests = load_trace(trace, scale)
        split_at = plan_min * 60
        epoch = time.time() - 86400  # the plan's log: yesterday, in the trace's own spacing
        plan_records = [RequestRecord(ts=epoch + r.at_s, prompt=prompts.prompt(r))
                        for r in requests if r.at_s < split_at]
        items = [Item(r.at_s - split_at, prompts.prompt(r), r.output_tokens) for r in requests if r.at_s >= split_at]
        now = epoch + split_at
    embedder = OnnxEmbedder(dataclasses.replace(target.embedder, num_threads=2))

    def plan(scale_budget: int) -> Any:
        budgets = target.default_budgets()
        budgets = dataclasses.replace(budgets, kv_bytes_total=budgets.kv_bytes_total * scale_budget,
                                      kv_bytes_per_adapter=budgets.kv_bytes_per_adapter * scale_budget,
                                      warm_seconds=budgets.warm_seconds * scale_budget)
        # NOTE: the plan every replica warms is sized by replay against one replica's cache, as `plan` sizes it;
        # the split plan's prompts are sent once as live traffic (nothing pinned), so it is cut by budget alone.
        return build_plan(plan_records, tokenizer, embedder, budgets, now=now, block_size=target.block_size,
                          kv_bytes_per_token=target.kv_bytes_per_token, progress=False,
                          kv=target.settings.engine.kv if scale_budget == 1 else None,
                          options=PlanOptions(replay_replicas=split_replicas))

    whole = plan(1)
    write_plan_stanzas(whole, whole_repo, target=target, tokenizer=tokenizer)
    split = plan(split_replicas)
    split_prompts = [tokenizer.decode(item["token_ids"], skip_special_tokens=True) for item in split.items
                     if item.get("kind") == "kv_prefix"]
    summary = (f"plan (whole, each replica): {format_summary(whole)}\nplan (split, {split_replicas} replicas' "
               f"budget): {len(split_prompts)} prefixes")
    return Workload(items, replay_min * 60, plan_records, base_repo, whole_repo, split_prompts,
                    target.settings.engine.kv.budget_bytes,
                    summary, ServedModel(Path(target.tokenizer_dir).resolve(), target.block_size))


def real_text(work: Path, scale: TraceScale, *, plan_min: float, requests_per_day: int,
              seed: int) -> tuple[list[RequestRecord], list[Item], float]:
    """The real-text traffic (:mod:`warmup_tools.sim.real_traffic`): day 1's records (the plan's log), day 2's
    first ``scale.duration_s`` less ``plan_min`` minutes as items (outputs of ``scale.max_output_tokens``), and
    day 2's start (the plan's ``now``)."""
    from warmup_tools.sim.real_traffic import RealTrafficConfig, write_real_logs

    config = RealTrafficConfig(seed=seed, requests_per_day=requests_per_day)
    day1, day2 = write_real_logs(config, work / "logs")[:2]
    start = config.start + 86400
    length = (scale.duration_s or 86400.0) - plan_min * 60
    items = [Item(r.ts - start, r.prompt or "", scale.max_output_tokens, r.tenant, r.adapter)
             for r in sorted(read_request_log([day2]), key=lambda r: r.ts) if r.ts - start < length]
    return list(read_request_log([day1])), items, start


class Bench:
    """The runs of one ``bench fleet-scale`` (module doc), each a fleet of its own under ``work``."""

    def __init__(self, work: Path, assets_dir: Path, load: Workload, *, speedup: float, window_s: float,
                 concurrency: int, out: TextIO, logs_dir: Path | None = None) -> None:
        self.work, self.assets_dir, self.load = work, assets_dir, load
        self.speedup, self.window_s, self.concurrency, self.out = speedup, window_s, concurrency, out
        self.logs_dir = logs_dir
        self._runs = 0

    def settings(self, replicas: int, policy: str, repo: Path, worker_protocol: str = "http") -> FleetSettings:
        self._runs += 1
        return FleetSettings(replicas=replicas, policy=policy, port=0, work_dir=self.work / f"run{self._runs}",
                             model_repository=repo, assets_dir=self.assets_dir, lm_threads=1,
                             worker_protocol=worker_protocol)

    def replay_run(self, label: str, replicas: int, policy: str, repo: Path, *, prime: Sequence[str] = (),
                   modelled_ttft: bool = True, kv_budget_bytes: int | None = None) -> Row:
        """One replay through a fleet of its own; ``kv_budget_bytes``: each replica's, when not the workload's."""
        budget = kv_budget_bytes or self.load.kv_budget_bytes
        started = time.perf_counter()
        with Fleet(self.settings(replicas, policy, repo)) as fleet:
            if prime:
                replay(fleet.router.url, [Item(0.0, p, 1) for p in prime], math.inf, self.concurrency)
            taken = {name: r.requests_taken() for name, r in fleet.replicas.items()}
            replay_epoch = time.time()
            answers = replay(fleet.router.url, self.load.replayed, self.speedup, self.concurrency)
            per_replica = "/".join(str(r.requests_taken() - taken[n]) for n, r in fleet.replicas.items())
            kv_use = "/".join(f"{kv_bytes(r) / budget:.0%}" for r in fleet.replicas.values())
            logs = fleet.request_log_dir
            workers = replicas_by_worker(fleet)
        ttfts = [t for ts, t in self.modelled_ttfts(logs) if ts >= replay_epoch] if modelled_ttft else []
        row = summarise(label, replicas, answers, ttfts, self.window_s, per_replica, kv_use)
        self.out.write(f"  {label}: {len(answers)} requests, {row.failed} failed, "
                       f"{time.perf_counter() - started:.0f} s{self.logs_note(fleet)}\n")
        if row.failed:
            self.out.write(failures_table(answers, workers) + "\n")
        self.out.flush()
        return row

    def modelled_ttfts(self, logs: Path) -> list[tuple[float, float]]:
        """(arrival epoch, modelled TTFT ms) of every request the replicas under ``logs`` served."""
        return [(r.ts, r.ttft_ms * self.speedup) for r in read_request_log(log_files(logs)) if r.ttft_ms is not None]

    def scale_out(self, start: int, policy: str) -> None:
        """``start`` replicas; at half the replay the three :data:`JOINERS` join together (module doc). The replay
        goes on for the joiners' window after the replay's end (the trace's next minutes)."""
        items = self.load.items
        half = self.load.replay_s / 2
        joined: dict[str, float] = {}
        with Fleet(self.settings(start, policy, self.load.whole_repo)) as fleet:
            joiners: dict[str, Replica] = {}

            def join_all() -> None:
                joiners["cold"] = fleet.launch(restore=False, warm_gate=False, model_repository=self.load.base_repo)
                joiners["warmed"] = fleet.launch(restore=False, warm_gate=True)
                joiners["restored"] = fleet.launch(restore=True, warm_gate=True)
                with concurrent.futures.ThreadPoolExecutor(len(joiners)) as pool:
                    for kind, future in [(k, pool.submit(join_at, fleet, r)) for k, r in joiners.items()]:
                        joined[kind] = future.result()

            replay_epoch = time.time()
            answers = replay(fleet.router.url, items, self.speedup, self.concurrency,
                             events=[(half, join_all)])
            logs = fleet.request_log_dir
            workers = replicas_by_worker(fleet)
            names = {kind: r.name for kind, r in joiners.items()}
        first_join = min(joined.values())
        steady = [t for ts, t in self.modelled_ttfts(logs) if replay_epoch <= ts < first_join]
        steady_p99 = p99(steady)
        lines = []
        for kind in JOINERS:
            at = joined[kind]
            window = (at, at + self.window_s / self.speedup)
            mine = [t for ts, t in self.modelled_ttfts(logs / names[kind]) if window[0] <= ts < window[1]]
            ratio = p99(mine) / steady_p99 if mine and steady_p99 else float("nan")
            lines.append((kind, f"{(at - replay_epoch) * self.speedup / 60:.1f}", str(len(mine)),
                          f"{p99(mine):.0f}" if mine else "-", f"{ratio:.2f}"))
        failed = sum(1 for a in answers if a.error)
        self.out.write(f"\nscale-out: a fleet of {start} ({policy}), three replicas joining at {half / 60:.1f} "
                       f"modelled min; fleet's modelled TTFT p99 before: {steady_p99:.0f} ms; {failed} of "
                       f"{len(answers)} requests "
                       f"failed\n\n")
        self.out.write(markdown(("joiner", "joined at (modelled min)", f"its requests in {self.window_s / 60:g} min",
                                 "its TTFT p99 (modelled ms)", "over the fleet's p99 before"), lines) + "\n")
        if failed:
            self.out.write("\n" + failures_table(answers, workers) + "\n")
        self.out.flush()

    def scale_in_and_restart(self, size: int, policy: str) -> None:
        """Two replicas leave at a third of the replay, the router restarts at two thirds (module doc)."""
        items = self.load.replayed
        end = self.load.replay_s
        marks: dict[str, float] = {}
        with Fleet(self.settings(size, policy, self.load.whole_repo)) as fleet:
            def leave() -> None:
                marks["leave"] = time.time()
                departures = fleet.scale_in_many(list(fleet.replicas)[:2])
                marks["left"] = time.time()
                marks["clean"] = float(all(d.clean for d in departures))

            def restart() -> None:
                marks["restart"] = time.time()
                fleet.restart_router()
                marks["router_up"] = time.time()
                deadline = time.monotonic() + 120
                while not fleet.workers_listed() and time.monotonic() < deadline:
                    time.sleep(0.2)
                marks["workers_back"] = time.time()

            workers = replicas_by_worker(fleet)  # NOTE: before the two leave: their failures name them too
            answers = replay(fleet.router.url, items, self.speedup, self.concurrency,
                             events=[(end / 3, leave), (2 * end / 3, restart)], epoch_out=marks)
            workers.update(replicas_by_worker(fleet))
        start = marks["epoch"]
        def between(since: str, until: str) -> list[Answer]:
            return [a for a in answers if marks[since] <= start + a.ts / self.speedup < marks[until]]

        in_leave, in_restart = between("leave", "left"), between("restart", "workers_back")
        other = [a for a in answers if not (marks["leave"] <= start + a.ts / self.speedup < marks["left"]
                                            or marks["restart"] <= start + a.ts / self.speedup < marks["workers_back"])]
        self.out.write(
            f"\nscale-in: 2 of {size} replicas left together under load ({policy}): {len(in_leave)} requests "
            f"arrived meanwhile, {sum(bool(a.error) for a in in_leave)} failed; drained and exited by themselves: "
            f"{bool(marks.get('clean'))}\nrouter restart: {marks['router_up'] - marks['restart']:.1f} s to answer "
            f"again, {marks['workers_back'] - marks['router_up']:.1f} s more until every replica was a worker again; "
            f"{len(in_restart)} requests arrived meanwhile, {sum(bool(a.error) for a in in_restart)} failed "
            f"(refused while it restarted); outside both windows {sum(bool(a.error) for a in other)} of "
            f"{len(other)} failed\n")
        if any(a.error for a in answers):
            self.out.write("\n" + failures_table(answers, workers) + "\n")
        self.out.flush()


    def cold_start(self, replicas: int, policy: str, cold_s: float, join_s: float) -> None:
        """The cold-start runs (module doc): ``replicas`` replicas with the whole plan's stanzas, then with none,
        back to back, each replaying the items before ``cold_s`` (modelled) with one more replica launched at
        ``join_s`` (warmed with the plan's stanzas and joined once warm; with no plan, a cold one)."""
        items = [i for i in self.load.items if i.at_s < cold_s]
        results = {config: self.cold_run(config, replicas, policy, repo, items, join_s)
                   for config, repo in (("plan", self.load.whole_repo), ("no plan", self.load.base_repo))}
        self.out.write(f"\ncold start: {replicas} x {policy} from the fleet's start, one more replica launched at "
                       f"{join_s / 60:g} modelled min; {len(items)} requests in {cold_s / 60:g} modelled min; the "
                       f"whole plan's stanzas on every replica (plan) or none (no plan)\n\n")
        self.out.write(cold_start_report(results["plan"], results["no plan"]) + "\n")
        self.out.flush()

    def cold_run(self, config: str, replicas: int, policy: str, repo: Path, items: Sequence[Item],
                 join_s: float) -> ColdRun:
        """One cold-start run (:meth:`cold_start`): its samples from the replicas' request logs."""
        started = time.perf_counter()
        joined: dict[str, Any] = {}
        with Fleet(self.settings(replicas, policy, repo)) as fleet:
            def join() -> None:
                replica = fleet.launch(restore=False, warm_gate=True)
                fleet.join(replica)
                joined.update(name=replica.name, at=time.time())
                workers[replica.url] = replica.name

            workers = replicas_by_worker(fleet)
            epoch = time.time()
            answers = replay(fleet.router.url, items, self.speedup, self.concurrency, events=[(join_s, join)])
            logs = fleet.request_log_dir
        records = {name.name: list(read_request_log(log_files(name))) for name in logs.iterdir() if name.is_dir()}
        run = ColdRun(config, replicas, len(answers), failures_table(answers, workers), {
            name: [Sample((r.ts - epoch) * self.speedup, None if r.ttft_ms is None else r.ttft_ms * self.speedup,
                          r.cached_tokens or 0, r.prompt_tokens or 0, r.adapter)
                   for r in served if r.ts >= epoch] for name, served in records.items()},
            joined.get("name"), (joined["at"] - epoch) * self.speedup if "at" in joined else None,
            max((i.at_s for i in items), default=0.0))
        self.out.write(f"  cold start, {config}: {len(answers)} requests, {sum(bool(a.error) for a in answers)} "
                       f"failed, {time.perf_counter() - started:.0f} s{self.logs_note(fleet)}\n")
        self.out.flush()
        return run

    def protocols(self, replicas: int, policy: str, protocols: Sequence[str], oracle: Row, repo: Path) -> None:
        """The protocols runs (module doc): one fleet per worker protocol on the same replay, each with one replica
        joining at half of it; one table against the oracle's cached share (``oracle``, the same items)."""
        results = [self.protocol_run(protocol, replicas, policy, repo) for protocol in protocols]
        plan = "the whole plan's stanzas on every replica" if repo == self.load.whole_repo else "no plan"
        self.out.write(f"\nworker protocols: {replicas} x {policy}, {plan}, two more replicas joining together at "
                       f"{self.load.replay_s / 2 / 60:g} modelled min once warm (one warmed: the plan's stanzas and "
                       f"the fleet's snapshots; one cold: neither); "
                       f"{len(self.load.replayed)} requests each; the oracle (one cache of {replicas} replicas' "
                       f"capacity) served {oracle.cached_share:.1%} of prompt tokens from cache\n\n")
        self.out.write(protocols_table(results, oracle.cached_share) + "\n")
        for result in results:
            if result.failures:
                self.out.write(f"\nfailed, {result.label}:\n{result.failures}\n")
        self.out.flush()

    def protocol_run(self, protocol: str, replicas: int, policy: str, repo: Path) -> ProtocolResult:
        """One fleet whose router reaches its replicas over ``protocol``: the replay, a replica joining at half."""
        started = time.perf_counter()
        items = self.load.replayed
        joined: dict[str, Any] = {}
        settings = self.settings(replicas, policy, repo, worker_protocol=protocol)
        with Fleet(settings, self.load.served if settings.grpc else None) as fleet:
            def join() -> None:
                warmed = fleet.launch(restore=True, warm_gate=True)
                cold = fleet.launch(restore=False, warm_gate=True, model_repository=self.load.base_repo)
                for replica in (warmed, cold):
                    fleet.join(replica)
                joined.update(warmed=warmed.name, cold=cold.name, at=time.time())

            epoch = time.time()
            answers = replay(fleet.router.url, items, self.speedup, self.concurrency,
                             events=[(self.load.replay_s / 2, join)])
            workers = replicas_by_worker(fleet)
            logs = fleet.request_log_dir
        label = protocol if policy != "cache_aware" else PROTOCOL_LABELS[protocol]
        samples = {d.name: [Sample((r.ts - epoch) * self.speedup,
                                   None if r.ttft_ms is None else r.ttft_ms * self.speedup,
                                   r.cached_tokens or 0, r.prompt_tokens or 0, r.adapter)
                            for r in read_request_log(log_files(d)) if r.ts >= epoch]
                   for d in sorted(logs.iterdir()) if d.is_dir()}
        result = protocol_result(label, answers, samples, (joined.get("warmed"), joined.get("cold")),
                                 (joined["at"] - epoch) * self.speedup if "at" in joined else None,
                                 self.load.replay_s, failures_table(answers, workers),
                                 "/".join(str(len(served)) for served in samples.values()))
        self.out.write(f"  {label}: {len(answers)} requests, {result.failed} failed, "
                       f"{time.perf_counter() - started:.0f} s{self.logs_note(fleet)}\n")
        self.out.flush()
        return result

    def logs_note(self, fleet: Fleet) -> str:
        """Where the run of ``fleet`` leaves its logs when the bench keeps them (``--logs-dir``): a copy of every
        replica's, its tritonserver's and the router's, made once the fleet has stopped."""
        if self.logs_dir is None:
            return ""
        into = self.logs_dir / fleet.work_dir.name
        into.mkdir(parents=True, exist_ok=True)
        for path in fleet.work_dir.glob("*.log"):
            shutil.copy2(path, into / path.name)
        return f" (logs: {into})"


def replicas_by_worker(fleet: Fleet) -> dict[str, str]:
    """Each replica's name by its URL (the router names the worker it routed a request to by its URL:
    :data:`warmup_tools.sim.bench.fleet.ROUTED_WORKER_HEADER`), and by each of its gRPC workers' URLs."""
    named = {replica.url: name for name, replica in fleet.replicas.items()}
    for name, membership in fleet.memberships.items():
        if membership.protocol == "grpc":
            named.update({membership.worker_url(model): name for model in membership.workers})
    return named


@dataclasses.dataclass(frozen=True, slots=True)
class JoinerWindow:
    """A joiner's first :data:`JOINER_WINDOW_S` modelled seconds: its requests, their cached share and modelled
    TTFT p99 (None: it got no request)."""

    requests: int = 0
    share: float | None = None
    ttft_p99_ms: float | None = None

    def cell(self) -> str:
        if self.share is None:
            return "- (0)"
        p99_ms = "-" if self.ttft_p99_ms is None else f"{self.ttft_p99_ms:,.0f}"
        return f"{self.share:.1%} / {p99_ms} ({self.requests})"


@dataclasses.dataclass(frozen=True, slots=True)
class ProtocolResult:
    """One worker protocol's run (:meth:`Bench.protocol_run`)."""

    label: str
    requests: int
    failed: int
    cached_share: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    #: The warmed joiner's and the cold joiner's first :data:`JOINER_WINDOW_S` modelled seconds.
    warmed: JoinerWindow
    cold: JoinerWindow
    #: The fleet's cached share from :data:`STEADY_AFTER_S` (at most half the replay) to the end, less the
    #: joiners' first windows.
    steady_share: float
    failures: str
    per_replica: str


def protocol_result(label: str, answers: Sequence[Answer], samples: dict[str, list[Sample]],
                    joiners: tuple[str | None, str | None], joined_s: float | None, replay_s: float, failures: str,
                    per_replica: str) -> ProtocolResult:
    """A protocol run's figures: the cached share from the answers (as every other run's), the modelled TTFTs,
    the joiners' first windows (``joiners``: the warmed one's and the cold one's names) and the steady share from
    the replicas' request logs (``samples``: per replica, modelled seconds from the replay's start)."""
    ok = [a for a in answers if not a.error]
    prompt = sum(a.prompt_tokens for a in ok)
    ttfts = sorted(s.ttft_ms for served in samples.values() for s in served if s.ttft_ms is not None)

    def share(group: Sequence[Sample]) -> float:
        tokens = sum(s.prompt_tokens for s in group)
        return sum(s.cached_tokens for s in group) / tokens if tokens else 0.0

    def in_window(name: str, s: Sample) -> bool:
        return name in joiners and joined_s is not None and joined_s <= s.at_s < joined_s + JOINER_WINDOW_S

    def window(name: str | None) -> JoinerWindow:
        first = [s for s in samples.get(name or "", []) if in_window(name or "", s)]
        if not first:
            return JoinerWindow()
        times = sorted(s.ttft_ms for s in first if s.ttft_ms is not None)
        return JoinerWindow(len(first), share(first), p99(times) if times else None)

    steady_from = min(STEADY_AFTER_S, replay_s / 2)
    steady = [s for name, served in samples.items() for s in served
              if s.at_s >= steady_from and not in_window(name, s)]
    return ProtocolResult(label, len(answers), len(answers) - len(ok),
                          sum(a.cached_tokens for a in ok) / prompt if prompt else 0.0,
                          statistics.median(ttfts) if ttfts else None, p99(ttfts) if ttfts else None,
                          window(joiners[0]), window(joiners[1]), share(steady), failures, per_replica)


def protocols_table(results: Sequence[ProtocolResult], oracle_share: float) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:,.0f}"

    return markdown(("worker protocol (cache_aware on)", "requests (failed)", "prompt tokens from cache",
                     "of the oracle's", "TTFT p50 / p99 (modelled ms)",
                     f"warmed joiner's first {JOINER_WINDOW_S:g} s: cached / TTFT p99 (requests)",
                     f"cold joiner's first {JOINER_WINDOW_S:g} s", "fleet's steady share", "requests per replica"),
                    [(r.label, f"{r.requests:,} ({r.failed})", f"{r.cached_share:.1%}",
                      f"{r.cached_share / oracle_share:.0%}" if oracle_share else "-",
                      f"{ms(r.ttft_p50_ms)} / {ms(r.ttft_p99_ms)}", r.warmed.cell(), r.cold.cell(),
                      f"{r.steady_share:.1%}", r.per_replica) for r in results])


def join_at(fleet: Fleet, replica: Replica) -> float:
    """Join ``replica`` once warm; the epoch it joined at."""
    fleet.join(replica)
    return time.time()


def kv_bytes(replica: Replica) -> float:
    """The KV bytes the replica's ``lora_adapter`` instances hold now (0 when its metrics do not answer)."""
    try:
        samples = scrape_metrics(replica.metrics_url, prefix="warmup_kv_cache_bytes")
    except (OSError, ValueError):
        return 0.0
    return metric_sum(samples, "warmup_kv_cache_bytes")


def replay(url: str, items: Sequence[Item], speedup: float, concurrency: int, *,
           events: Sequence[tuple[float, Any]] = (), epoch_out: dict[str, float] | None = None) -> list[Answer]:
    """``items`` sent open-loop through ``url``: each at its ``at_s / speedup`` (``inf``: all at once), at most
    ``concurrency`` in flight; ``events``: (modelled seconds, callable) run on a thread of their own at that time.
    Answers in item order, each with its ``at_s`` as ``ts``."""
    local = threading.local()
    clients: list[httpx.Client] = []
    lock = threading.Lock()

    def one(item: Item) -> Answer:
        client = getattr(local, "client", None)
        if client is None:
            client = local.client = httpx.Client(timeout=600)
            with lock:
                clients.append(client)
        answer = send(client, url, RequestRecord(ts=item.at_s, prompt=item.prompt, tenant=item.tenant,
                                                 adapter=item.adapter), item.max_tokens)
        return dataclasses.replace(answer, ts=item.at_s)

    pending = sorted(events, key=lambda e: e[0])
    threads = []
    start = time.perf_counter()
    if epoch_out is not None:
        epoch_out["epoch"] = time.time()
    try:
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            futures = []
            for item in items:
                while pending and pending[0][0] <= item.at_s:
                    thread = threading.Thread(target=pending.pop(0)[1], daemon=True)
                    thread.start()
                    threads.append(thread)
                if math.isfinite(speedup):
                    delay = start + item.at_s / speedup - time.perf_counter()
                    if delay > 0:
                        time.sleep(delay)
                futures.append(pool.submit(one, item))
            answers = [f.result() for f in futures]
        for thread in threads:
            thread.join()
    finally:
        for client in clients:
            client.close()
    return answers


def summarise(label: str, replicas: int, answers: Sequence[Answer], ttfts: Sequence[float], window_s: float,
              per_replica: str, kv_use: str) -> Row:
    ok = [a for a in answers if not a.error]
    early = [a for a in ok if a.ts < window_s]

    def share(group: Sequence[Answer]) -> float:
        prompt = sum(a.prompt_tokens for a in group)
        return sum(a.cached_tokens for a in group) / prompt if prompt else 0.0

    ordered = sorted(ttfts)
    return Row(label, replicas, len(answers), len(answers) - len(ok), share(ok), share(early),
               sum(a.cached_tokens == 0 for a in ok) / max(1, len(ok)),
               statistics.median(ordered) if ordered else None, p99(ordered) if ordered else None, per_replica, kv_use)


def table(rows: Sequence[Row]) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    return markdown(("run", "requests (failed)", "prompt tokens from cache", "in the first window", "cold share",
                     "TTFT p50 (modelled ms)", "TTFT p99 (modelled ms)", "requests per replica",
                     "KV use per replica"),
                    [(r.label, f"{r.requests} ({r.failed})", f"{r.cached_share:.1%}", f"{r.early_cached_share:.1%}",
                      f"{r.cold_share:.1%}", ms(r.ttft_p50_ms), ms(r.ttft_p99_ms), r.per_replica, r.kv_use)
                     for r in rows])
