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

Then a restart at the end of the window: day 2's next ``after_h`` hours on fresh servers of both
repositories, with their stanzas only: the day-1 plan's, or those the last re-plan wrote ("the next
restart begins from today's plan").

Reported per ``every_h`` window: cold share (``cached_tokens == 0``) and cached share of prompt tokens for
each run and the floor (:func:`warmup_tools.sim.bench.support.workload.floor`); and for every *new application* (a
generator template of a tenant and adapter that day 1 never had): the simulated minutes from its first
request until its first request served with more cached tokens than any day-1 request of its scope could
give (its own prefix, not only the tenant's system prompt, came from the cache), and how many of its
requests came before that.
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
from typing import Annotated, Any, Sequence, TextIO

from warmup_tools.common.jsonl import write_json_lines
from warmup_tools.common.plan import Plan
from warmup_tools.common.records import RequestRecord
from warmup_tools.common.settings import arg
from warmup_tools.control.plan_history import write_live_plan
from warmup_tools.planning.analyse import BlockTrie
from warmup_tools.planning.live import ReplanResult, RollingPlanner, wait_applied
from warmup_tools.server.client import GenerateParams, StreamingClient
from warmup_tools.server.process import TritonServer
from warmup_tools.sim.bench.support.params import Seed
from warmup_tools.sim.bench.support.workload import Served, figures, floor, prepare, replay


@dataclasses.dataclass(frozen=True, slots=True)
class Replan:
    at_h: float
    result: ReplanResult
    apply_s: float


def replay_rolling(repo: Path, records: Sequence[RequestRecord], day1: Sequence[RequestRecord], plan: Plan,
                   assets_dir: Path, work: Path, *, day2_start: float, every_h: float, since_h: float,
                   out: TextIO, end: float | None = None) -> tuple[list[Served], list[Replan]]:
    """Replay ``records`` on a server of ``repo`` with a control folder, re-planning every ``every_h`` hours
    (and at ``end``, when given: the plan the next start begins from)."""
    control, logs = work / "control", work / "rolling-logs"
    logs.mkdir(parents=True, exist_ok=True)
    write_live_plan(control, plan, by=("bench rolling", ""))
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
                    replans.append(_replan(planner, control, boundary, day2_start, out))
                    boundary += every_h * 3600
                result = client.generate(record.prompt, GenerateParams(
                    max_tokens=1, adapter_id=record.adapter or None, tenant_id=record.tenant))
                served.append(Served(record.ts, result.cached_tokens == 0, result.ttft_s * 1000,
                                     result.cached_tokens, result.prompt_tokens))
            if end is not None:  # the re-plan at the end of the window: the stanzas the next start begins from
                write_json_lines(logs / "requests.jsonl", [r.to_json() for r in (*day1, *records)])
                replans.append(_replan(planner, control, end, day2_start, out))
    out.write(f"  rolling: {len(served)} requests replayed, {len(replans)} re-plans\n")
    return served, replans


def _replan(planner: RollingPlanner, control: Path, at: float, day2_start: float, out: TextIO) -> Replan:
    result = planner.run_once(now=at)  # simulated time
    started = time.perf_counter()
    if result.applied:
        wait_applied(control, result.plan_id, timeout_s=1800)
    replan = Replan((at - day2_start) / 3600, result, time.perf_counter() - started)
    out.write(f"  re-plan at +{replan.at_h:g} h: {result.records} records, plan {result.previous} -> "
              f"{result.plan_id}: {result.added} added, {result.kept} kept, {result.dropped} dropped; planned in "
              f"{result.seconds:.0f} s, then waited {replan.apply_s:.1f} s for the instance\n")
    out.flush()
    return replan


def day1_tokens(day1: Sequence[RequestRecord], records: Sequence[RequestRecord], tokenizer: Any,
                block_size: int) -> list[int]:
    """Per record, the prompt tokens of its longest block prefix some day-1 request of its tenant and
    adapter carried (what the day-1 plan could know of it)."""
    tries: dict[tuple[str, str], BlockTrie] = {}
    known: dict[tuple[str, str], set[int]] = {}
    for record in day1:
        key = (record.tenant, record.adapter)
        trie = tries.setdefault(key, BlockTrie(block_size))
        known.setdefault(key, set()).update(trie.chain(tokenizer.encode(record.prompt or "", add_special_tokens=True)))
    out = []
    for record in records:
        key = (record.tenant, record.adapter)
        nodes = tries.setdefault(key, BlockTrie(block_size)).chain(
            tokenizer.encode(record.prompt or "", add_special_tokens=True))
        seen = known.get(key, set())
        out.append(next((i for i, node in enumerate(nodes) if node not in seen), len(nodes)) * block_size)
    return out


def new_applications(day1: Sequence[RequestRecord], day2: Sequence[RequestRecord], known_tokens: Sequence[int],
                     runs: dict[str, Sequence[Served]]) -> dict[str, list[tuple[float | None, int]]]:
    """Per run, for each application (tenant, adapter, template) day 1 never had: minutes from its first
    request in ``day2`` to its first request served with more cached tokens than day 1 could know of
    (``known_tokens``: its own prefix came from the cache; None: never in the window), and the requests
    before that."""
    seen = {(r.tenant, r.adapter, r.template) for r in day1}
    groups: dict[tuple[str, str, str], list[int]] = {}
    for index, record in enumerate(day2):
        key = (record.tenant, record.adapter, record.template)
        if record.template and key not in seen:
            groups.setdefault(key, []).append(index)
    out: dict[str, list[tuple[float | None, int]]] = {}
    for label, served in runs.items():
        rows = []
        for indices in groups.values():
            first = day2[indices[0]].ts
            warm = next((n for n, i in enumerate(indices) if served[i].cached_tokens > known_tokens[i]), None)
            rows.append(((day2[indices[warm]].ts - first) / 60 if warm is not None else None,
                         warm if warm is not None else len(indices)))
        out[label] = rows
    return out


def run(assets_dir: Path, *, seed: Seed = 0,
        requests_per_day: Annotated[int, arg("requests per simulated day")] = 3000,
        hours: Annotated[float, arg("hours of day 2 to replay")] = 12.0,
        every_h: Annotated[float, arg("simulated hours between re-plans")] = 3.0,
        since_h: Annotated[float, arg("hours of logs each re-plan reads")] = 6.0,
        after_h: Annotated[float, arg("hours replayed after a restart at the end of the window (day-1 vs today's "
                                      "stanzas)")] = 3.0,
        out: TextIO = sys.stdout) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-rolling-"))
    try:
        repos = prepare(work, assets_dir, seed=seed, requests_per_day=requests_per_day, out=out,
                        hours=hours + after_h)
        end = repos.day2_start + hours * 3600
        records = [r for r in repos.first_hours if r.ts < end]
        later = [r for r in repos.first_hours if r.ts >= end]
        plan = Plan.load(work / "plan.json")
        rolling_repo = work / "repo-rolling"
        shutil.copytree(repos.with_plan, rolling_repo)
        static = _replay_static(repos.with_plan, records, assets_dir, out, "static day-1 plan")
        rolling, _ = replay_rolling(rolling_repo, records, repos.day1, plan, assets_dir, work,
                                    day2_start=repos.day2_start, every_h=every_h, since_h=since_h, out=out, end=end)
        # A restart at the end of the window: from the day-1 stanzas, or from the stanzas the re-plan wrote.
        static_after = _replay_static(repos.with_plan, later, assets_dir, out, "restart, day-1 stanzas")
        rolling_after = _replay_static(rolling_repo, later, assets_dir, out, "restart, today's stanzas")
        best = floor(repos.day1, repos.first_hours, repos.tokenizer, repos.block_size)
        rolling_label = f"re-plan every {every_h:g} h"
        out.write("\n" + table(records, repos.day2_start, every_h, hours,
                               {"static day-1 plan": static, rolling_label: rolling, "floor": best[:len(records)]}))
        out.write(table(later, end, after_h, after_h, {"restart, day-1 stanzas": static_after,
                                                      "restart, today's stanzas": rolling_after,
                                                      "floor": best[len(records):]}, offset_h=hours))
        known = day1_tokens(repos.day1, repos.first_hours, repos.tokenizer, repos.block_size)
        out.write("\nnew applications (a template of a tenant and adapter day 1 never had), served with more "
                  "cached tokens than day 1 could know of:\n")
        out.write(apps_table(new_applications(repos.day1, records, known[:len(records)],
                                              {"static day-1 plan": static, rolling_label: rolling})) + "\n")
        out.write(apps_table(new_applications(repos.day1, later, known[len(records):],
                                              {"restart, day-1 stanzas": static_after,
                                               "restart, today's stanzas": rolling_after})) + "\n")
        out.flush()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _replay_static(repo: Path, records: Sequence[RequestRecord], assets_dir: Path, out: TextIO,
                   label: str) -> list[Served]:
    """``records`` on a fresh server of ``repo`` without a control folder: its stanzas only."""
    return replay(repo, records, assets_dir, label, out)[0]


def table(records: Sequence[RequestRecord], day2_start: float, every_h: float, hours: float,
          runs: dict[str, Sequence[Served]], offset_h: float = 0.0) -> str:
    """Cold share and cached share per ``every_h`` window of ``records`` (from ``day2_start``) and overall."""
    lines = ["| window | run | requests | cold | cold share | prompt tokens from cache |", "|---|---|---|---|---|---|"]
    windows = [(start, min(start + every_h, hours)) for start in _steps(0.0, hours, every_h)]
    windows += [(0.0, hours)] if len(windows) > 1 else []
    for start, end in windows:
        picked = [i for i, r in enumerate(records) if day2_start + start * 3600 <= r.ts < day2_start + end * 3600]
        for label, served in runs.items():
            f = figures(label, [served[i] for i in picked])
            lines.append(f"| +{start + offset_h:g} to +{end + offset_h:g} h | {label} | {f.requests} | {f.cold} | "
                         f"{f.cold_share:.1%} | {f.cached_share:.1%} |")
    return "\n".join(lines) + "\n"


def apps_table(apps: dict[str, list[tuple[float | None, int]]]) -> str:
    lines = ["| run | new applications | warm within the window | minutes to warm, median / max | "
             "requests before warm, median / max |", "|---|---|---|---|---|"]
    for label, rows in apps.items():
        warm = [(m, n) for m, n in rows if m is not None]
        minutes = [m for m, _ in warm] or [0.0]
        before = [n for _, n in rows] or [0]
        lines.append(f"| {label} | {len(rows)} | {len(warm)} | {statistics.median(minutes):.0f} / {max(minutes):.0f} "
                     f"| {statistics.median(before):.0f} / {max(before)} |")
    return "\n".join(lines)


def _steps(start: float, stop: float, step: float) -> list[float]:
    out = []
    while start < stop - 1e-9:
        out.append(start)
        start += step
    return out
