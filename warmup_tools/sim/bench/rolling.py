"""``python -m warmup_tools bench rolling``: the static day-1 plan against re-planning every K hours, on day 2.

One run: two days of traffic and a plan from day 1, as ``bench replay`` prepares them; then day 2's first
``hours`` replayed in order (max_tokens 1) against the real server twice:

- **static**: the repository with the day-1 plan's stanzas, nothing else;
- **rolling**: the same start, plus the control folder's ``plan.json`` (the day-1 plan); every ``every_h``
  simulated hours the replay pauses and the sidecar's rolling re-plan
  (:class:`~warmup_tools.planning.live.RollingPlanner`) runs over the log so far (day 1 and the day-2
  requests already replayed, the last ``since_h`` hours), applies the new plan through the control folder
  (every instance warms what it adds, unpins what it drops) and writes the stanzas; the replay resumes
  once the instance reports it applied.

NOTE: the replay waits for each re-plan and its warm-up; on a real server both run beside the traffic
(planning in the sidecar, warming in the scheduler's lowest class), so the served requests are the same
but the wall-clock cost is hidden here.

Reported per ``every_h`` window: cold share (``cached_tokens == 0``) and cached share of prompt tokens for
static, rolling and the floor (:func:`warmup_tools.sim.bench.replay.floor`); and for every *new
application* (a generator template of a tenant and adapter that day 1 never had): the simulated minutes
from its first request until its first request with at least half of its prompt from the KV cache, and
how many of its requests came before that.
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

from warmup_tools.adapters.plan_control import write_plan_file
from warmup_tools.common.jsonl import write_json_lines
from warmup_tools.common.records import RequestRecord
from warmup_tools.ops.client import GenerateParams, StreamingClient
from warmup_tools.ops.server import TritonServer
from warmup_tools.planning.live import ReplanResult, RollingPlanner, wait_applied
from warmup_tools.planning.plan import Plan
from warmup_tools.sim.bench.replay import Served, figures, floor, prepare

#: A request is warm for its application when at least this share of its prompt came from the KV cache.
WARM_SHARE = 0.5


@dataclasses.dataclass(frozen=True, slots=True)
class Replan:
    at_h: float
    result: ReplanResult
    apply_s: float


def replay_rolling(repo: Path, records: Sequence[RequestRecord], day1: Sequence[RequestRecord], plan: Plan,
                   assets_dir: Path, work: Path, *, day2_start: float, every_h: float, since_h: float,
                   out: TextIO) -> tuple[list[Served], list[Replan]]:
    """Replay ``records`` on a server of ``repo`` with a control folder, re-planning every ``every_h`` hours."""
    control, logs = work / "control", work / "rolling-logs"
    logs.mkdir(parents=True, exist_ok=True)
    write_plan_file(control, plan)
    env = {"WARMUP_ASSETS_DIR": str(assets_dir), "WARMUP_CONTROL_DIR": str(control)}
    planner = RollingPlanner(repo, control, logs, since_s=since_h * 3600, environ={**os.environ, **env})
    served: list[Served] = []
    replans: list[Replan] = []
    boundary = day2_start + every_h * 3600
    with TritonServer(repo, env=env) as server:
        server.wait_ready(timeout=1800)
        wait_applied(control, plan.plan_id, timeout_s=600)
        with StreamingClient(server.grpc_url) as client:
            for index, record in enumerate(records):
                while record.ts >= boundary:
                    # The server's request log so far: day 1 and the day-2 requests already replayed.
                    write_json_lines(logs / "requests.jsonl", [r.to_json() for r in (*day1, *records[:index])])
                    result = planner.run_once(now=boundary)  # simulated time
                    started = time.perf_counter()
                    if result.applied:
                        wait_applied(control, result.plan_id, timeout_s=1800)
                    replans.append(Replan((boundary - day2_start) / 3600, result, time.perf_counter() - started))
                    out.write(f"  re-plan at +{replans[-1].at_h:g} h: {result.records} records, plan "
                              f"{result.previous} -> {result.plan_id}: {result.added} added, {result.kept} kept, "
                              f"{result.dropped} dropped; planned in {result.seconds:.0f} s, applied in "
                              f"{replans[-1].apply_s:.1f} s\n")
                    out.flush()
                    boundary += every_h * 3600
                result = client.generate(record.prompt, GenerateParams(
                    max_tokens=1, adapter_id=record.adapter or None, tenant_id=record.tenant))
                served.append(Served(record.ts, result.cached_tokens == 0, result.ttft_s * 1000,
                                     result.cached_tokens, result.prompt_tokens))
    out.write(f"  rolling: {len(served)} requests replayed, {len(replans)} re-plans\n")
    return served, replans


def new_applications(day1: Sequence[RequestRecord], day2: Sequence[RequestRecord],
                     runs: dict[str, Sequence[Served]]) -> dict[str, list[tuple[float | None, int]]]:
    """Per run, for each application (tenant, adapter, template) day 1 never had: minutes from its first
    request to its first warm one (None: never warm in the window) and the requests before that."""
    known = {(r.tenant, r.adapter, r.template) for r in day1}
    groups: dict[tuple[str, str, str], list[int]] = {}
    for index, record in enumerate(day2):
        key = (record.tenant, record.adapter, record.template)
        if record.template and key not in known:
            groups.setdefault(key, []).append(index)
    out: dict[str, list[tuple[float | None, int]]] = {}
    for label, served in runs.items():
        rows = []
        for indices in groups.values():
            first = day2[indices[0]].ts
            warm = next((n for n, i in enumerate(indices) if _warm(served[i])), None)
            rows.append(((day2[indices[warm]].ts - first) / 60 if warm is not None else None,
                         warm if warm is not None else len(indices)))
        out[label] = rows
    return out


def run(assets_dir: Path, *, seed: int = 0, requests_per_day: int = 3000, hours: float = 12.0,
        every_h: float = 3.0, since_h: float = 6.0, out: TextIO = sys.stdout) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-rolling-"))
    try:
        repos = prepare(work, assets_dir, seed=seed, requests_per_day=requests_per_day, out=out, hours=hours)
        plan = Plan.load(work / "plan.json")
        rolling_repo = work / "repo-rolling"
        shutil.copytree(repos.with_plan, rolling_repo)
        started = time.perf_counter()
        static = _replay_static(repos.with_plan, repos.first_hours, assets_dir, out)
        out.write(f"  static: {len(static)} requests replayed in {time.perf_counter() - started:.0f} s\n")
        rolling, replans = replay_rolling(rolling_repo, repos.first_hours, repos.day1, plan, assets_dir, work,
                                          day2_start=repos.day2_start, every_h=every_h, since_h=since_h, out=out)
        best = floor(repos.day1, repos.first_hours, repos.tokenizer, repos.block_size)
        out.write("\n" + table(repos.first_hours, repos.day2_start, every_h, hours,
                               {"static day-1 plan": static, f"re-plan every {every_h:g} h": rolling, "floor": best}))
        apps = new_applications(repos.day1, repos.first_hours,
                                {"static day-1 plan": static, f"re-plan every {every_h:g} h": rolling})
        out.write("\n" + apps_table(apps) + "\n")
        out.flush()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _replay_static(repo: Path, records: Sequence[RequestRecord], assets_dir: Path, out: TextIO) -> list[Served]:
    from warmup_tools.sim.bench.replay import replay

    return replay(repo, records, assets_dir, "static day-1 plan", out)[0]


def table(records: Sequence[RequestRecord], day2_start: float, every_h: float, hours: float,
          runs: dict[str, Sequence[Served]]) -> str:
    lines = ["| window | run | requests | cold | cold share | prompt tokens from cache |", "|---|---|---|---|---|---|"]
    windows = [(start, min(start + every_h, hours)) for start in _steps(0.0, hours, every_h)] + [(0.0, hours)]
    for start, end in windows:
        picked = [i for i, r in enumerate(records) if day2_start + start * 3600 <= r.ts < day2_start + end * 3600]
        for label, served in runs.items():
            f = figures(label, [served[i] for i in picked])
            lines.append(f"| +{start:g} to +{end:g} h | {label} | {f.requests} | {f.cold} | {f.cold_share:.1%} | "
                         f"{f.cached_share:.1%} |")
    return "\n".join(lines) + "\n"


def apps_table(apps: dict[str, list[tuple[float | None, int]]]) -> str:
    lines = [f"| run | new applications | warm (>= {WARM_SHARE:.0%} of the prompt cached) within the window | "
             "minutes to warm, median / max | requests before warm, median / max |", "|---|---|---|---|---|"]
    for label, rows in apps.items():
        warm = [(m, n) for m, n in rows if m is not None]
        minutes = [m for m, _ in warm] or [0.0]
        before = [n for _, n in rows] or [0]
        lines.append(f"| {label} | {len(rows)} | {len(warm)} | {statistics.median(minutes):.0f} / {max(minutes):.0f} "
                     f"| {statistics.median(before):.0f} / {max(before)} |")
    return "\n".join(lines)


def _warm(served: Served) -> bool:
    return served.prompt_tokens > 0 and served.cached_tokens >= WARM_SHARE * served.prompt_tokens


def _steps(start: float, stop: float, step: float) -> list[float]:
    out = []
    while start < stop - 1e-9:
        out.append(start)
        start += step
    return out
