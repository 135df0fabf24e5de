"""``python -m warmup_tools bench rollout``: a good plan promoted and a bad plan rolled back by the canary.

One run on the real-text traffic (:mod:`warmup_tools.sim.real_traffic`): the day-1 plan is served by a
repository whose ``lora_adapter`` has two instances, with request logs and a control folder. Day 2's first
hours are replayed in time order, paced at ``speedup`` times the trace's rate (so that the canary's window, in
seconds of the clock, covers the simulated minutes it stands for), against the real server, while the sidecar's
canary controller (:class:`~warmup_tools.sidecar.canary.controller.CanaryController`, the same code and settings the
sidecar runs, with ``canary_window_s`` divided by ``speedup``) judges after every request:

- at ``good_at_min`` the rolling re-plan (:class:`~warmup_tools.planning.live.RollingPlanner`) plans from day 1
  and the requests replayed so far and puts its plan on trial on one instance: it should be promoted;
- at ``bad_at_min`` (or once the first trial is over) a deliberately bad plan goes on trial: the day-1 plan of
  another tenant mix (the same generator with other tenants and another seed), which warms nothing today's
  tenants ask for and unpins their hot set on the canary instance: it should be rolled back.

Reported, in simulated minutes of the trace: when each trial started and ended and why, and the cold share
(``cached_tokens == 0``) of each instance's requests before the bad plan, while it was on trial and after the
rollback, from the server's own request logs. The replay stands still while a plan is made and while the canary
instance warms it. The KV cache of each instance is sized at ``kv_cache_ratio`` times the plan's KV bytes
(``--kv-cache-bytes`` to set it), and its warm-up may fill all of it but the live reserve (``kv_warm_share`` set to
``1 - kv_live_reserve`` in the bench's copy of the repository), so that a plan's warm-up competes with what it
unpins, as it does on a busy server.

``fleet=True`` (``--fleet``): the same run on a whole replica of a fleet. ``replicas`` replicas (2 by default; one
``lora_adapter`` instance and one LM thread each) behind the smg router (the fleet's default policy), sharing the
control and request log folders, each with the day-1 plan; the requests go through the router, and the plans go on
trial on every instance of replica :data:`CANARY_REPLICA` (the replica whose sidecar re-plans for a fleet: the first
by name) and, in a fleet of four or more, of as many more replicas as the trial needs to see enough traffic
(``canary_fleet_share``), judged against all the other replicas by difference of differences.
``engine="simulated"``: every ``lora_adapter`` runs the simulated engine with the demo LM's profile, its step times
divided by ``speedup`` (as the trace's arrivals are), so that eight replicas fit on a small machine. The controller
is the one that replica's sidecar builds (:func:`~warmup_tools.sidecar.app.replica_canary`), ticked by the bench
after every request; the replicas' sidecars are told not to judge (``canary_judge`` false), so that a trial has one
judge. A trial is stamped with the moment the replay stopped for it (:class:`ReplayClock`): the whole replica's
baseline is the ``canary_window_s`` of traffic replayed just before, not the seconds of the clock spent making the
plan.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import json
import os
import shutil
import socket
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Annotated, Any, Callable, Iterator, Mapping, Sequence, TextIO

from warmup_tools.common.errors import ServerError
from warmup_tools.common.jsonl import write_json_lines
from warmup_tools.common.plan import Plan
from warmup_tools.common.records import RequestRecord, read_request_log
from warmup_tools.common.settings import arg, environ_overrides
from warmup_tools.control.plan_control import CanaryAssignment, read_canary
from warmup_tools.control.plan_history import write_live_plan
from warmup_tools.kv.config import KVCacheConfig
from warmup_tools.planning.live import RollingPlanner, wait_applied
from warmup_tools.server.client import GenerateParams, StreamingClient
from warmup_tools.server.config import set_instance_count
from warmup_tools.server.process import TritonServer
from warmup_tools.sidecar.app import replica_canary
from warmup_tools.sidecar.canary.controller import CanaryController, Verdict
from warmup_tools.sidecar.config import SidecarConfig
from warmup_tools.sim.bench.support.params import Seed
from warmup_tools.sim.bench.support.workload import prepare

#: The tenants of the bad plan's traffic: none of them sends a request on day 2.
OTHER_TENANTS = ("northwind", "contoso", "fabrikam")
CANARY, OTHER = "lora_adapter_0_1", "lora_adapter_0_0"
#: ``--fleet``: the replica that proposes and judges the trials (the fleet's sidecars re-plan from the first by name,
#: on itself and, in a larger fleet, on more replicas: ``canary_fleet_share``).
CANARY_REPLICA = "r1"


@dataclasses.dataclass(slots=True)
class Trial:
    label: str
    started_min: float
    plan_id: str
    ended_min: float | None = None
    verdict: str = ""
    reason: str = ""
    #: After each request judged: (simulated minutes on trial, requests a side, cold a side, cached share a side,
    #: the two tests' p-values).
    evidence: list[dict[str, float]] = dataclasses.field(default_factory=list)
    #: A trial on a whole replica: each side's requests in the window before the trial (its baseline).
    baseline: str = ""


@dataclasses.dataclass(slots=True)
class Replayed:
    """What a replay came to: the trials, each request's wall time and simulated minute as sent, how far the pacing
    fell behind, and the errors of the requests that failed."""

    trials: list[Trial] = dataclasses.field(default_factory=list)
    sent_wall: list[float] = dataclasses.field(default_factory=list)
    sent_min: list[float] = dataclasses.field(default_factory=list)
    worst_lag: float = 0.0
    failed: list[str] = dataclasses.field(default_factory=list)


def bad_plan(work: Path, repo: Path, env: dict[str, str], *, seed: int, requests_per_day: int, now: float) -> Plan:
    """The day-1 plan of another tenant mix: the real-text generator with :data:`OTHER_TENANTS`."""
    from warmup_tools.embedding_cache.embedder import OnnxEmbedder
    from warmup_tools.planning.select import build_plan
    from warmup_tools.planning.target import PlanTarget
    from warmup_tools.sim.real_traffic import RealTrafficConfig, write_real_logs

    config = RealTrafficConfig(seed=seed + 1, requests_per_day=requests_per_day, tenants=OTHER_TENANTS, days=1)
    day1 = list(read_request_log(write_real_logs(config, work / "other-mix")[:1]))
    target = PlanTarget.from_repository(repo, {**os.environ, **env})
    return build_plan(day1, target.load_tokenizer(), OnnxEmbedder(dataclasses.replace(target.embedder, num_threads=2)),
                      target.default_budgets(), now=now, block_size=target.block_size,
                      kv_bytes_per_token=target.kv_bytes_per_token, progress=False)


@dataclasses.dataclass(slots=True)
class Stage:
    """Where the replay goes: how one request is sent (its error, or ""), the controller that judges the trials,
    and the request logs of each side (the canary first: an instance, or the replicas of a fleet a trial runs on;
    ``on_trial`` is told each trial that starts)."""

    send: Callable[[RequestRecord], str]
    controller: CanaryController
    logs: Callable[[], dict[str, list[Path]]]
    unit: str
    on_trial: Callable[[CanaryAssignment], None] = lambda canary: None


class ReplayClock:
    """The wall clock, held at the moment the replay stopped while it stands still (a plan made, then warmed): a
    trial proposed meanwhile starts when the trace stopped, so that the window before it (a whole replica's
    baseline) is the traffic replayed just before, not the seconds of the clock spent making the plan."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self.held: float | None = None

    def __call__(self) -> float:
        return self.held if self.held is not None else self._clock()

    @contextlib.contextmanager
    def hold(self) -> Iterator[float]:
        self.held = self._clock()
        try:
            yield self.held
        finally:
            self.held = None


def cold_by_side(logs: Mapping[str, Sequence[Path]], sent_wall: Sequence[float], sent_min: Sequence[float],
                 windows: dict[str, tuple[float, float]]) -> dict[str, dict[str, tuple[int, int]]]:
    """Per window (simulated minutes, start inclusive) and side (an instance or a replica: its request log files):
    (cold requests, requests); each record is placed at the simulated minute of the request sent just before it
    arrived."""
    out: dict[str, dict[str, tuple[int, int]]] = {w: {} for w in windows}
    for side, paths in logs.items():
        for record in read_request_log(sorted(paths)):
            index = bisect.bisect_right(sent_wall, record.ts) - 1
            if index < 0:
                continue  # the readiness probes' and warm-up's requests are never logged; nothing comes before
            minute = sent_min[index]
            for window, (start, end) in windows.items():
                if start <= minute < end:
                    cold, total = out[window].get(side, (0, 0))
                    out[window][side] = (cold + ((record.cached_tokens or 0) == 0), total + 1)
    return out


def goals(trials: Sequence[Trial], limit_min: float = 5.0) -> list[str]:
    """One line per trial: the re-plan promoted or not, the bad plan rolled back within ``limit_min`` or not."""
    lines = []
    for trial, wanted in zip(trials, ("promote", "rollback")):
        if trial.ended_min is None:
            lines.append(f"{trial.label}: no verdict (goal: {wanted}): **not met**")
            continue
        took = trial.ended_min - trial.started_min
        met = trial.verdict == wanted and (wanted == "promote" or took <= limit_min)
        within = f" within {limit_min:g} simulated min" if wanted == "rollback" else ""
        lines.append(f"{trial.label}: {trial.verdict} after {took:.1f} simulated min (goal: {wanted}{within}): "
                     f"{'met' if met else '**not met**'}")
    return lines


def run(assets_dir: Path, *, seed: Seed = 0,
        requests_per_day: Annotated[int, arg("requests per simulated day")] = 6000,
        hours: Annotated[float, arg("hours of day 2 to replay")] = 3.0,
        speedup: Annotated[float, arg("replay this many times faster than the trace")] = 60.0,
        good_at_min: Annotated[float, arg("simulated minute of the re-plan's trial")] = 30.0,
        bad_at_min: Annotated[float, arg("simulated minute of the bad plan's trial")] = 90.0,
        window_min: Annotated[float | None, arg("the canary's window in simulated minutes (none: the sidecar's "
                                                "canary_window_s)")] = None,
        kv_cache_ratio: Annotated[float, arg("each instance's KV cache, in multiples of the day-1 plan's KV "
                                             "bytes")] = 1.25,
        kv_cache_bytes: Annotated[int | None, arg("each instance's KV cache in bytes (overrides the "
                                                  "ratio)")] = None,
        fleet: Annotated[bool, arg("two replicas behind the smg router, the plans on trial on a whole replica, "
                                   "judged against the other one; each replica's cold share")] = False,
        replicas: Annotated[int, arg("with --fleet: replicas behind the router (the canary is one of them, judged "
                                     "against all the others)", ge=2)] = 2,
        engine: Annotated[str, arg("lora_adapter's engine: real, or simulated (the demo LM's profile, its step "
                                   "times divided by speedup, as the trace's)", choices=("real", "simulated"))]
        = "real",
        out: TextIO = sys.stdout) -> dict[str, Any]:
    defaults = SidecarConfig()
    window_min = defaults.canary_window_s / 60 if window_min is None else window_min
    work = Path(tempfile.mkdtemp(prefix="bench-rollout-"))
    try:
        repos = prepare(work, assets_dir, seed=seed, requests_per_day=requests_per_day, out=out, traffic="real",
                        hours=hours)
        day2_start, records = repos.day2_start, repos.first_hours
        repo, control, logs, plan_logs = (work / "repo-rollout", work / "control", work / "server-logs",
                                          work / "plan-logs")
        shutil.copytree(repos.with_plan, repo)
        set_instance_count(repo / "lora_adapter", 1 if fleet else 2)
        plan_bytes = sum(int(item.get("kv_bytes", 0)) for item in repos.plan.items)
        cache_bytes = kv_cache_bytes or int(plan_bytes * kv_cache_ratio)
        let_warm_up_fill(repo / "lora_adapter")
        env = {"WARMUP_ASSETS_DIR": str(assets_dir), "WARMUP_CONTROL_DIR": str(control),
               "WARMUP_REQUEST_LOG_DIR": str(logs), "WARMUP_KV_CACHE_BYTES": str(cache_bytes), "WARMUP_REDIS_URL": "",
               "WARMUP_ENGINE": engine, "WARMUP_ENGINE_SPEEDUP": str(speedup)}
        bad = bad_plan(work, repo, env, seed=seed, requests_per_day=requests_per_day, now=day2_start)
        out.write(f"day-1 plan {repos.plan.plan_id}: {len(repos.plan.items)} items, {plan_bytes / 2**20:.1f} MiB; "
                  f"bad plan {bad.plan_id} (tenants {', '.join(OTHER_TENANTS)}): {len(bad.items)} items; KV cache "
                  f"{cache_bytes / 2**20:.1f} MiB per instance, "
                  f"{f'{replicas} replicas of 1 instance' if fleet else '2 instances'}, engine {engine}\n")
        write_live_plan(control, repos.plan, by=("bench rollout", ""))
        settings = dataclasses.replace(defaults, canary_window_s=window_min * 60 / speedup)
        clock = ReplayClock()
        stage_of = functools.partial(_fleet_stage, replicas=replicas) if fleet else _server_stage
        with stage_of(work, repo, assets_dir, env, settings, clock) as stage:
            controller = stage.controller
            planner = RollingPlanner(repo, control, plan_logs, environ={**os.environ, **env}, write_stanzas=False,
                                     propose=lambda plan: controller.propose(plan, "bench rollout re-plan") is not None)
            out.write(f"canary: on {stage.unit} {next(iter(stage.logs()))}; window {window_min:g} "
                      f"simulated min ({settings.canary_window_s:.1f} s at x{speedup:g}), "
                      f"{settings.canary_min_requests} requests a side"
                      f"{' (the early tests: on the canary, and 1 on the other replicas)' if fleet else ''}, "
                      f"cold margin {settings.canary_cold_margin:.0%} "
                      f"(alpha {settings.canary_alpha:g}), cached margin {settings.canary_cached_margin:.0%}\n")
            out.flush()
            replayed = _replay(records, day2_start, stage, control, planner, bad, repos.day1, plan_logs, speedup,
                               good_at_min, bad_at_min, clock, out)
        return _report(replayed, stage.logs(), stage.unit, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def _server_stage(work: Path, repo: Path, assets_dir: Path, env: dict[str, str], settings: SidecarConfig,
                  clock: ReplayClock) -> Iterator[Stage]:
    """One server whose ``lora_adapter`` has two instances, both with the served plan applied; the canary is
    :data:`CANARY`."""
    control, logs = Path(env["WARMUP_CONTROL_DIR"]), Path(env["WARMUP_REQUEST_LOG_DIR"])
    with TritonServer(repo, env=env) as server:
        server.wait_ready(timeout=1800)
        # NOTE: before the client: a gRPC stream left idle while the instances warm is closed by the server.
        wait_applied(control, planner_plan_id(control), instances=2, timeout_s=900)
        with StreamingClient(server.grpc_url) as client:
            def send(record: RequestRecord) -> str:
                client.generate(record.prompt, GenerateParams(max_tokens=1, adapter_id=record.adapter or None,
                                                              tenant_id=record.tenant))
                return ""

            controller = replica_canary(dataclasses.replace(settings, replan_log_dir=logs), control,
                                        socket.gethostname(), clock)
            yield Stage(send, controller,
                        lambda: {i: sorted(logs.glob(f"requests-{i}.jsonl*")) for i in (CANARY, OTHER)}, "instance")


@contextlib.contextmanager
def _fleet_stage(work: Path, repo: Path, assets_dir: Path, env: dict[str, str], settings: SidecarConfig,
                 clock: ReplayClock, *, replicas: int = 2) -> Iterator[Stage]:
    """``replicas`` replicas behind the router, sharing the control and request log folders, all with the served
    plan applied; the canary is the whole replica :data:`CANARY_REPLICA` (and the replicas it takes on), judged
    against all the others by the controller its sidecar would build, and by it alone."""
    import logging

    import httpx

    from warmup_tools.fleet.fleet import Fleet
    from warmup_tools.fleet.settings import FleetSettings
    from warmup_tools.sim.bench.support.sending import send

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    control, logs = Path(env["WARMUP_CONTROL_DIR"]), Path(env["WARMUP_REQUEST_LOG_DIR"])
    sidecar = work / "sidecar.json"
    sidecar.write_text(json.dumps({"canary_judge": False}), encoding="utf-8")
    # NOTE: the replicas inherit the KV cache size; their folders and assets are the fleet's settings.
    inherited = {name: env[name] for name in ("WARMUP_KV_CACHE_BYTES", "WARMUP_REDIS_URL", "WARMUP_ENGINE",
                                              "WARMUP_ENGINE_SPEEDUP")}
    with environ_overrides(inherited):
        settings_of_fleet = FleetSettings(replicas=replicas, port=0, work_dir=work / "fleet", control_dir=control,
                                          request_log_dir=logs, sidecar_config=sidecar, model_repository=repo,
                                          assets_dir=assets_dir, lm_threads=1)
        with Fleet(settings_of_fleet) as fleet, httpx.Client(timeout=600) as client:
            for name, replica in fleet.replicas.items():
                with urllib.request.urlopen(f"{replica.sidecar_url}/status", timeout=10) as response:
                    canary = json.load(response).get("canary") or {}
                if canary.get("judging") is not False:
                    raise ServerError(f"replica {name}'s sidecar judges trials itself (canary: {canary}): its "
                                      f"settings ({sidecar}) did not reach it")
            wait_applied(control, planner_plan_id(control), instances=replicas, timeout_s=900)
            controller = replica_canary(dataclasses.replace(settings, fleet_log_dir=logs), control, CANARY_REPLICA,
                                        clock)
            serving, names = [CANARY_REPLICA], list(fleet.replicas)  # the replicas of the latest trial; all of them

            def on_trial(canary: CanaryAssignment) -> None:
                serving[:] = canary.hosts

            def sides() -> dict[str, list[Path]]:
                others = [name for name in names if name not in serving]
                rest = others[0] if len(others) == 1 else f"the other {len(others)} replicas"
                return {", ".join(serving): _files(logs, serving), rest: _files(logs, others)}

            yield Stage(lambda record: send(client, fleet.router.url, record).error, controller, sides, "replica(s)",
                        on_trial)


def _files(logs: Path, replicas: Sequence[str]) -> list[Path]:
    """The request log files of ``replicas`` under the fleet's log folder."""
    return sorted(p for r in replicas for p in (logs / r).glob("requests-*.jsonl*"))


def _replay(records: Sequence[RequestRecord], day2_start: float, stage: Stage, control: Path,
            planner: RollingPlanner, bad: Plan, day1: Sequence[RequestRecord], plan_logs: Path, speedup: float,
            good_at_min: float, bad_at_min: float, clock: ReplayClock, out: TextIO) -> Replayed:
    replayed = Replayed()
    trials, controller = replayed.trials, stage.controller
    replanned = False
    started = time.monotonic()
    for index, record in enumerate(records):
        minute = (record.ts - day2_start) / 60
        running = trials[-1] if trials and trials[-1].ended_min is None else None
        pause = time.monotonic()
        with clock.hold():
            if not replanned and minute >= good_at_min:
                replanned = True
                write_json_lines(plan_logs / "requests.jsonl", [r.to_json() for r in (*day1, *records[:index])])
                result = planner.run_once(now=record.ts)
                if result.trial == "started":
                    trials.append(Trial("re-plan (good)", minute, result.plan_id))
                    canary = read_canary(control)
                    if canary is not None:
                        stage.on_trial(canary)
                    wait_applied(control, result.plan_id, instances=_serving(canary), timeout_s=900)
                out.write(f"  +{minute:.1f} min: re-plan {result.previous} -> {result.plan_id}, "
                          f"{result.added} added, {result.dropped} dropped: "
                          f"{'on trial' if result.trial else 'applied everywhere'}\n")
            elif running is None and len(trials) < 2 and trials and minute >= bad_at_min:
                canary = controller.propose(bad, "bench rollout (bad plan)")
                if canary is not None:
                    stage.on_trial(canary)
                    trials.append(Trial("another tenant mix (bad)", minute, bad.plan_id))
                    wait_applied(control, bad.plan_id, instances=_serving(canary), timeout_s=900)
        # NOTE: the trace stands still while a plan is made and warmed (as in bench rolling): on a real
        # server both run beside the traffic, in seconds of the clock, not of the trace's 60-fold time.
        started += time.monotonic() - pause
        due = started + (record.ts - records[0].ts) / speedup
        now = time.monotonic()
        if due > now:
            time.sleep(due - now)
        replayed.worst_lag = max(replayed.worst_lag, now - due)
        replayed.sent_wall.append(time.time())
        replayed.sent_min.append(minute)
        error = stage.send(record)
        if error:
            replayed.failed.append(error)
        verdict = controller.tick()
        trial = controller.status()["trial"]
        if running is not None and trial is not None and trial.get("applied_at"):
            running.evidence.append(_evidence(minute - running.started_min, trial))
            if trial.get("before") and not running.baseline:
                running.baseline = _baseline(trial)
        if running is not None and verdict.action != "wait":
            _end(running, verdict, minute, out)
    return replayed


def let_warm_up_fill(model_dir: Path) -> None:
    """Let the model's warm-up fill its KV cache but the live reserve: ``kv_warm_share`` ``1 - kv_live_reserve``
    (their defaults) in its config.pbtxt."""
    defaults = KVCacheConfig()
    config = model_dir / "config.pbtxt"
    config.write_text(config.read_text(encoding="utf-8") + f'parameters {{ key: "kv_warm_share" value: {{ '
                      f'string_value: "{1.0 - defaults.live_reserve:g}" }} }}\n', encoding="utf-8")


def _serving(canary: CanaryAssignment | None) -> int:
    """How many instances serve a trial: one per replica of a trial on whole replicas (the fleet's replicas have
    one instance each), else one."""
    return len(canary.hosts) if canary is not None and not canary.instances else 1


def _evidence(minutes: float, trial: dict[str, Any]) -> dict[str, float]:
    canary, rest = trial["canary"], trial["rest"]
    return {"min": round(minutes, 1), "n": canary["requests"], "n_rest": rest["requests"],
            "cold": canary["cold_share"], "cold_rest": rest["cold_share"], "cached": canary["cached_share"],
            "cached_rest": rest["cached_share"], "planned": canary["planned_share"] or 0.0,
            "planned_rest": rest["planned_share"] or 0.0, **trial["evidence"]}


def _baseline(trial: dict[str, Any]) -> str:
    before = trial["before"]
    return "; ".join(f"{side} {s['requests']} requests, cold {s['cold_share']:.0%}, cached {s['cached_share']:.0%}, "
                     f"from the plan {s['planned_share'] or 0.0:.0%}"
                     for side, s in (("canary", before["canary"]), (", ".join(trial["replicas"]), before["rest"])))


def planner_plan_id(control: Path) -> str:
    return Plan.load(control / "plan.json").plan_id


def _end(trial: Trial, verdict: Verdict, minute: float, out: TextIO) -> None:
    trial.ended_min, trial.verdict, trial.reason = minute, verdict.action, verdict.reason
    out.write(f"  +{minute:.1f} min: {trial.label}: {verdict.action} after {minute - trial.started_min:.1f} "
              f"simulated min: {verdict.reason}\n")
    out.flush()


def _report(replayed: Replayed, logs: dict[str, list[Path]], unit: str, out: TextIO) -> dict[str, Any]:
    trials, failed = replayed.trials, replayed.failed
    out.write(f"\nreplayed {len(replayed.sent_min)} requests"
              + (f" ({len(failed)} failed: {'; '.join(failed[:3])})" if failed else "")
              + f"; the pacing fell behind the trace by up to {replayed.worst_lag:.1f} s\n")
    for trial in trials:
        span = f"{trial.ended_min - trial.started_min:.1f} min" if trial.ended_min is not None else "no verdict"
        out.write(f"  {trial.label}: on trial at +{trial.started_min:.1f} min, {trial.verdict or 'running'} "
                  f"({span}): {trial.reason}\n")
    for trial in trials:
        out.write(f"\n{trial.label}: the evidence as requests came (simulated minutes on trial; canary / rest)\n")
        if trial.baseline:
            out.write(f"  baseline (the window before the trial): {trial.baseline}\n")
        for e in trial.evidence:
            out.write(f"  +{e['min']:.1f} min: {e['n']}/{e['n_rest']} requests, cold {e['cold']:.0%}/"
                      f"{e['cold_rest']:.0%}, cached {e['cached']:.0%}/{e['cached_rest']:.0%}, from the plan "
                      f"{e['planned']:.0%}/{e['planned_rest']:.0%}; p: cold {e['cold_p']:.2g}, cached "
                      f"{e['uncached_p']:.2g}, from the plan {e['unplanned_p']:.2g}\n")
    out.write("\n" + "\n".join(goals(trials)) + "\n")
    bad = trials[1] if len(trials) > 1 else None
    if bad is None or bad.ended_min is None:
        out.write("the bad plan did not reach a verdict: no windows to compare\n")
        return {"trials": [dataclasses.asdict(t) for t in trials]}
    length = 30.0
    windows = {f"before the bad plan (+{bad.started_min - length:.0f} to +{bad.started_min:.0f} min)":
               (bad.started_min - length, bad.started_min),
               f"bad plan on trial (+{bad.started_min:.0f} to +{bad.ended_min:.0f} min)":
               (bad.started_min, bad.ended_min),
               f"after the rollback (+{bad.ended_min:.0f} to +{bad.ended_min + length:.0f} min)":
               (bad.ended_min, bad.ended_min + length)}
    counts = cold_by_side(logs, replayed.sent_wall, replayed.sent_min, windows)
    canary = next(iter(logs))
    out.write(f"\ncold share by {unit} ({canary} is the canary), from the request logs:\n")
    for window, per in counts.items():
        cells = [f"{name}: {c / n:.1%} ({c}/{n})" if n else f"{name}: -" for name, (c, n) in
                 ((side, per.get(side, (0, 0))) for side in logs)]
        out.write(f"  {window}: {'; '.join(cells)}\n")
    return {"trials": [dataclasses.asdict(t) for t in trials], "cold": counts}
