"""``python -m warmup_tools bench replay``: does a plan from yesterday's logs warm today's first hours?

One run: two days of traffic (the seeded generator, or ``--traffic real``: a log built from real public
text, :mod:`warmup_tools.sim.real_traffic`), a plan from day 1, its stanzas written into a copy of the
repository; then day 2's first three hours replayed in order against the real server twice, without
warm-up stanzas and with the plan's. Per window (the first hour and the first three hours, both from
the same replay, since a replay in order serves the first hour exactly as a shorter replay would):
the share of cold requests (``cached_tokens == 0``), the share of prompt tokens served from the KV
cache, TTFT, and the same two shares for the **floor**, the best any plan from day 1 could do. Then the cold
start (:mod:`warmup_tools.sim.bench.support.cold_start`), with the plan and without: the first 60 s and 5 min of day 2
(the server's start) and after each adapter's first request, in day 2's own time.

The floor (:mod:`warmup_tools.sim.bench.support.workload`, with the day's preparation and the replay itself): a
replayed request can reuse at most the blocks of its longest block-aligned token prefix that some day-1 request of
its tenant and adapter carried, or that an earlier replayed request carried. ``--report DIR`` writes PNG plots and a
markdown summary.
"""

from __future__ import annotations

import collections
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Annotated, Any, Sequence, TextIO

from warmup_tools.common.errors import ConfigError
from warmup_tools.common.plan import Plan
from warmup_tools.common.records import RequestRecord
from warmup_tools.common.settings import arg
from warmup_tools.planning.analyse import BlockTrie
from warmup_tools.sim.bench.support.cold_start import ColdRun, Sample, cold_start_report
from warmup_tools.sim.bench.support.params import Seed
from warmup_tools.sim.bench.support.workload import (
    TRAFFIC,
    Served,
    WindowFigures,
    _ids,
    figures,
    floor,
    prepare,
    replay,
    simulate,
)

#: The replayed windows, in hours from the start of day 2.
WINDOWS_H = (1, 3)


def misses(day1: Sequence[RequestRecord], replayed: Sequence[RequestRecord], plan: Plan, tokenizer: Any,
           block_size: int) -> str:
    """Why requests the floor serves warm are cold with ``plan`` (simulated: no eviction), and where the cached
    tokens between the plan and the floor go: by how many day-1 requests carried the first block the plan
    lacks (once: below ``min_block_requests``; more: the budget or the choice of frontier), raw calls
    (no application: ``template`` is None) apart."""
    planned = simulate(plan.items, replayed, tokenizer, block_size)
    best = simulate(day1, replayed, tokenizer, block_size)
    counts: dict[tuple[str, str], BlockTrie] = {}
    carried: dict[tuple[tuple[str, str], int], int] = collections.Counter()
    for record in day1:
        key = (record.tenant, record.adapter)
        for node in counts.setdefault(key, BlockTrie(block_size)).chain(_ids(tokenizer, record)):
            carried[(key, node)] += 1
    cold: collections.Counter[str] = collections.Counter()
    tokens: collections.Counter[str] = collections.Counter()
    for record, mine, floor_ in zip(replayed, planned, best):
        kind = "raw call" if record.template is None else "application call"
        if floor_.cold:
            why = "no full block" if floor_.prompt_tokens <= block_size else "first block new on day 2"
            cold[f"cold at the floor too ({kind}): {why}"] += 1
            continue
        if floor_.cached_tokens == mine.cached_tokens:
            continue
        key = (record.tenant, record.adapter)
        nodes = counts.setdefault(key, BlockTrie(block_size)).chain(_ids(tokenizer, record))
        missing = nodes[mine.cached_tokens // block_size]
        seen = carried.get((key, missing), 0)
        why = ("carried by 1 day-1 request" if seen == 1 else f"carried by {'2-4' if seen < 5 else '5+'} day-1 requests"
               if seen else "carried by an earlier day-2 request only")
        tokens[f"{kind}, first missing block {why}"] += floor_.cached_tokens - mine.cached_tokens
        if mine.cold:
            cold[f"cold with the plan, warm at the floor ({kind}): first block {why}"] += 1
    summary = plan.summary
    budgets = plan.budgets
    lines = [f"simulated (no eviction), {len(replayed)} requests: plan {sum(s.cold for s in planned)} cold, "
             f"{figures('plan', planned).cached_share:.1%} prompt tokens from cache; floor {sum(s.cold for s in best)}"
             f" cold, {figures('floor', best).cached_share:.1%}",
             f"plan: {summary.get('items')} items, {summary.get('kv_bytes', 0) / 2**20:.1f} of "
             f"{budgets.get('kv_bytes_total', 0) / 2**20:.1f} MiB, {summary.get('expected_warm_seconds', 0):.1f} of "
             f"{budgets.get('warm_seconds', 0):g} warm-up seconds"]
    lines += [f"  {n:5d}  {label}" for label, n in sorted(cold.items())]
    lines.append("cold requests per adapter, plan / floor:")
    for adapter in sorted({r.adapter for r in replayed}):
        mine = [s for r, s in zip(replayed, planned) if r.adapter == adapter]
        at_floor = [s for r, s in zip(replayed, best) if r.adapter == adapter]
        lines.append(f"  {adapter or 'base'}: {sum(s.cold for s in mine)}/{len(mine)} "
                     f"({figures('plan', mine).cold_share:.1%}) / {sum(s.cold for s in at_floor)} "
                     f"({figures('floor', at_floor).cold_share:.1%}); prompt tokens from cache "
                     f"{figures('plan', mine).cached_share:.1%} / {figures('floor', at_floor).cached_share:.1%}")
    total = sum(s.prompt_tokens for s in best) or 1
    lines.append("prompt tokens the floor serves from cache and the plan does not:")
    lines += [f"  {n:7d} ({n / total:.1%} of prompt tokens)  {label}" for label, n in sorted(tokens.items())]
    return "\n".join(lines)


def run(assets_dir: Path, *, seed: Seed = 0,
        requests_per_day: Annotated[int, arg("requests per simulated day")] = 6000,
        traffic: Annotated[str, arg("the project's generated traffic, a log built from real public text, or a "
                                    "second one built another way (held out: tenant preambles, other questions, "
                                    "day-1 repeats)", choices=TRAFFIC)] = "generated",
        report: Annotated[Path | None, arg("write PNG plots and a markdown summary in this folder")] = None,
        misses_only: Annotated[bool, arg("no server: plan, then print which replayed requests the plan misses "
                                         "against the floor and why (simulated without eviction)")] = False,
        kv_bytes_total: Annotated[int | None, arg("the plan's KV budget (none: the repository's warm-up "
                                                  "share)")] = None,
        kv_bytes_per_adapter: Annotated[int | None, arg("the plan's bound per adapter (none: the total)")] = None,
        arbitration: Annotated[str, arg("how the plan splits a budget the adapters' hot sets do not fit (plan "
                                        "--arbitration)", choices=("measured", "fixed"))] = "measured",
        out: TextIO = sys.stdout) -> None:
    if traffic not in TRAFFIC:
        raise ConfigError(f"--traffic must be one of {', '.join(TRAFFIC)}, not {traffic!r}")
    work = Path(tempfile.mkdtemp(prefix="bench-replay-"))
    try:
        budgets = {k: v for k, v in (("kv_bytes_total", kv_bytes_total),
                                     ("kv_bytes_per_adapter", kv_bytes_per_adapter)) if v is not None}
        repos = prepare(work, assets_dir, seed=seed, requests_per_day=requests_per_day, out=out, traffic=traffic,
                        hours=max(WINDOWS_H), budgets=budgets, arbitration=arbitration)
        out.write("\nwhat the plan misses, day 2's first hours:\n" + misses(
            repos.day1, repos.first_hours, repos.plan, repos.tokenizer, repos.block_size) + "\n")
        out.flush()
        if misses_only:
            return
        without, load_without = replay(repos.without_plan, repos.first_hours, assets_dir, "without plan", out)
        planned, load_planned = replay(repos.with_plan, repos.first_hours, assets_dir, "with plan", out)
        best = floor(repos.day1, repos.first_hours, repos.tokenizer, repos.block_size)
        mismatched = sum(a.prompt_tokens != b.prompt_tokens for a, b in zip(without, best))
        if mismatched:
            out.write(f"warning: {mismatched} requests have another prompt length on the server than in the "
                      "floor's tokenisation\n")
        rows = []
        for hours in WINDOWS_H:
            end = repos.day2_start + hours * 3600
            n = sum(1 for r in repos.first_hours if r.ts < end)  # records are in time order
            rows.append((hours, figures("without plan", without[:n]), figures("with plan", planned[:n]),
                         figures("floor", best[:n])))
        out.write("\n" + table(rows, {"without plan": load_without, "with plan": load_planned}) + "\n")
        out.write("\ncold start (times in day 2's time from its start, the server started just before; TTFTs "
                  "measured):\n\n" + cold_start(repos.first_hours, planned, without, repos.day2_start) + "\n")
        out.flush()
        if report is not None:
            write_report(Path(report), traffic, repos.day2_start, rows, without, planned, best)
            out.write(f"report written to {report}\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def cold_start(records: Sequence[RequestRecord], planned: Sequence[Served], without: Sequence[Served],
               start: float) -> str:
    """The cold-start comparison (:mod:`warmup_tools.sim.bench.support.cold_start`) of the replay with the plan and
    without: ``records`` replayed (each one's adapter), served in order as ``planned`` and ``without``, from
    ``start`` (epoch seconds of day 2's start). One replica: no join."""
    def run(config: str, served: Sequence[Served]) -> ColdRun:
        samples = [Sample(s.ts - start, s.ttft_ms, s.cached_tokens, s.prompt_tokens, r.adapter)
                   for r, s in zip(records, served)]
        return ColdRun(config, 1, len(served), "", {"replica": samples},
                       length_s=max((s.at_s for s in samples), default=0.0))

    return cold_start_report(run("plan", planned), run("no plan", without), clock="measured")


def table(rows: Sequence[tuple[int, WindowFigures, WindowFigures, WindowFigures]],
          load_s: dict[str, float]) -> str:
    lines = ["| window | repository | requests | cold | cold share | prompt tokens from cache | TTFT p50 ms | "
             "TTFT p90 ms | ready after s |", "|---|---|---|---|---|---|---|---|---|"]
    for hours, *results in rows:
        for r in results:
            ttft = ("-", "-") if r.label == "floor" else (f"{r.ttft_p50_ms:.1f}", f"{r.ttft_p90_ms:.1f}")
            ready = f"{load_s[r.label]:.0f}" if r.label in load_s else "-"
            lines.append(f"| first {hours} h | {r.label} | {r.requests} | {r.cold} | {r.cold_share:.1%} | "
                         f"{r.cached_share:.1%} | {ttft[0]} | {ttft[1]} | {ready} |")
    for hours, without, planned, best in rows:
        possible = without.cold_share - best.cold_share
        taken = (without.cold_share - planned.cold_share) / possible if possible > 0 else 1.0
        lines.append(f"\nfirst {hours} h: the plan is {planned.cold_share - best.cold_share:+.1%} cold and "
                     f"{planned.cached_share - best.cached_share:+.1%} cached tokens from the floor; it takes "
                     f"{taken:.0%} of the possible cold-share reduction")
    return "\n".join(lines)


def write_report(folder: Path, traffic: str, day2_start: float, rows: Sequence[tuple[Any, ...]],
                 without: Sequence[Served], planned: Sequence[Served], best: Sequence[Served]) -> None:
    """PNG plots (TTFT distribution, cold share over the window) and a markdown summary in ``folder``."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    folder.mkdir(parents=True, exist_ok=True)

    def save(ax: Any, name: str, xlabel: str, ylabel: str, title: str) -> None:
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title} ({traffic} traffic)")
        ax.grid(True, alpha=0.3)
        ax.legend()
        ax.figure.tight_layout()
        ax.figure.savefig(folder / name, dpi=120)
        plt.close(ax.figure)

    _, ax = plt.subplots(figsize=(7, 4))
    for label, served in (("without plan", without), ("with plan", planned)):
        ttfts = sorted(s.ttft_ms for s in served)
        ax.plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], label=label)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    save(ax, "ttft.png", "TTFT (ms, log scale)", "share of requests at or below",
         f"TTFT, day 2's first {max(WINDOWS_H)} h replayed")

    bucket_s = 900.0
    _, ax = plt.subplots(figsize=(7, 4))
    for label, served in (("without plan", without), ("with plan", planned), ("floor", best)):
        buckets: dict[int, list[bool]] = {}
        for s in served:
            buckets.setdefault(int((s.ts - day2_start) // bucket_s), []).append(s.cold)
        keys = sorted(buckets)
        ax.plot([(k + 0.5) * bucket_s / 60 for k in keys], [100 * sum(buckets[k]) / len(buckets[k]) for k in keys],
                marker="o", label=label, linestyle="--" if label == "floor" else "-")
    save(ax, "cold_share.png", "minutes into day 2", "cold requests (%)", f"Cold share per {bucket_s / 60:.0f} minutes")

    summary = [f"# bench replay: {traffic} traffic", "",
               "A plan made from day 1, day 2's first hours replayed in order with and without it; the floor is "
               "the best any plan from day 1 could do (see `warmup_tools/sim/bench/replay.py`).", "",
               table(rows, {}), "", "![TTFT distribution](ttft.png)", "",
               "![cold share over the window](cold_share.png)", ""]
    (folder / "summary.md").write_text("\n".join(summary), encoding="utf-8")


