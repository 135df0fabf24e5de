"""``python -m warmup_tools bench fleet``: the real-text replay of ``bench replay --traffic real`` through the
smg router, in front of one replica or two.

One run, every replica with the day-1 plan's stanzas and one LM thread (docs/benchmarks.md):

1. **Routing.** Day 2's first ``hours`` replayed in order (max_tokens 1) by ``users`` concurrent clients through
   the router to 1 replica and to 2 replicas with each of :data:`COMPARED_POLICIES`: cold share, share of prompt
   tokens from the KV cache, TTFT p50/p99, requests per replica; and the router's added TTFT (p50 through
   the router minus straight to the replica, alternating, on the 1-replica fleet). Several clients, because a
   router balances on the requests each replica has in flight: one request at a time leaves every replica at
   zero, and smg's ``cache_aware`` then sends every request that matches no replica to the first one in its
   list (its least-loaded replica, on a tie), which makes the split a matter of which replica that is.
2. **Scale-out** at +``scale_out_min`` simulated minutes of the same replay on 2 replicas (``policy``): (a) a
   third replica without the snapshot folder whose /health says 200 as soon as tritonserver is READY
   (shipped stanzas only), (b) one restored from the fleet's snapshot folder and joined once warm; the replay
   by ``users`` clients throughout. Figure: TTFT p99 of the requests the new replica serves in its first
   ``window_min`` simulated minutes over the fleet's p99 before the event, both from the replicas' request
   logs (``lora_adapter``'s TTFT, from the request's arrival there).
3. **Scale-in.** ``streams`` concurrent streamed requests, one replica stopped with SIGTERM while they run:
   failed requests (goal 0) and whether its snapshot was written.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Annotated, Callable, Sequence, TextIO

import httpx

from warmup_tools.common.records import RequestRecord, log_files, read_request_log
from warmup_tools.common.settings import arg, environ_overrides
from warmup_tools.fleet.fleet import Fleet
from warmup_tools.fleet.replica import Replica
from warmup_tools.fleet.settings import ROUTER_POLICIES, FleetSettings
from warmup_tools.sim.bench.support.params import LmThreads, Seed
from warmup_tools.sim.bench.support.sending import Answer, send
from warmup_tools.sim.bench.support.tables import markdown, p99
from warmup_tools.sim.bench.support.workload import prepare

#: The routing policies compared on two replicas (against one replica alone).
COMPARED_POLICIES = ("round_robin", "cache_aware", "prefix_hash")
#: Requests each way for the router's added TTFT.
OVERHEAD_PAIRS = 100
#: Seconds between the replicas' periodic KV snapshots during the bench (the scale-out restores from them).
SNAPSHOT_INTERVAL_S = 20


@dataclasses.dataclass(frozen=True, slots=True)
class Figures:
    label: str
    requests: int
    cold_share: float
    cached_share: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    per_replica: str = ""
    failed: int = 0


def figures(label: str, answers: Sequence[Answer], per_replica: str = "") -> Figures:
    ok = [a for a in answers if not a.error]
    ttfts = sorted(a.ttft_ms for a in ok) or [0.0]
    prompt = sum(a.prompt_tokens for a in ok)
    return Figures(label, len(answers), sum(a.cached_tokens == 0 for a in ok) / max(1, len(ok)),
                   sum(a.cached_tokens for a in ok) / prompt if prompt else 0.0, statistics.median(ttfts),
                   p99(ttfts), per_replica, len(answers) - len(ok))


def replay(url: str, records: Sequence[RequestRecord], users: int = 1,
           sender: Callable[[httpx.Client, str, RequestRecord], Answer] = send) -> list[Answer]:
    """``records`` through ``url`` by ``users`` clients, each sending the next record not yet sent as soon as
    its previous one has ended (so they go out in order, at most ``users`` at once); answers in record order."""
    answers: list[Answer | None] = [None] * len(records)
    order = iter(range(len(records)))
    lock = threading.Lock()

    def user() -> None:
        with httpx.Client(timeout=600) as client:
            while True:
                with lock:
                    i = next(order, None)
                if i is None:
                    return
                answers[i] = sender(client, url, records[i])

    with concurrent.futures.ThreadPoolExecutor(max(1, users)) as pool:
        for future in [pool.submit(user) for _ in range(max(1, users))]:
            future.result()
    return [a for a in answers if a is not None]


def run(assets_dir: Path, *, seed: Seed = 0,
        requests_per_day: Annotated[int, arg("requests per simulated day")] = 6000,
        hours: Annotated[float, arg("hours of day 2 replayed")] = 1.0,
        scale_out_min: Annotated[float, arg("simulated minutes before the scale-out")] = 30.0,
        window_min: Annotated[float, arg("simulated minutes of the new replica's requests measured")] = 10.0,
        streams: Annotated[int, arg("concurrent streams during the scale-in")] = 6,
        lm_threads: LmThreads = 1,
        policy: Annotated[str | None, arg("the router's policy in the scale-out and scale-in runs (none: the "
                                          "fleet's default)", choices=ROUTER_POLICIES)] = None,
        users: Annotated[int, arg("concurrent clients replaying the traffic in order in the routing runs")] = 4,
        out: TextIO = sys.stdout) -> None:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    policy = policy or FleetSettings().policy
    work = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    try:
        with environ_overrides({"WARMUP_SNAPSHOT_INTERVAL_S": str(SNAPSHOT_INTERVAL_S)}):  # the replicas inherit it
            repos = prepare(work, assets_dir, seed=seed, requests_per_day=requests_per_day, out=out, traffic="real",
                            hours=hours)
            records = repos.first_hours

            def settings(replicas: int, policy: str, name: str) -> FleetSettings:
                return FleetSettings(replicas=replicas, policy=policy, port=0, work_dir=work / name,
                                     model_repository=repos.with_plan, assets_dir=assets_dir, lm_threads=lm_threads)

            rows = []
            fleets = [("1 replica", 1, "round_robin")] + [(f"2 replicas, {p}", 2, p) for p in COMPARED_POLICIES]
            for label, replicas, routing in fleets:
                with Fleet(settings(replicas, routing, label.replace(" ", "").replace(",", "-"))) as fleet:
                    answers = replay(fleet.router.url, records, users)
                    share = "/".join(str(r.requests_taken()) for r in fleet.replicas.values())
                    rows.append(figures(label, answers, share))
                    out.write(f"  {label}: {len(answers)} requests replayed by {users} clients\n")
                    out.flush()
                    if replicas == 1:
                        overhead = router_overhead(fleet, next(r for r in records if r.prompt))
            out.write("\n" + table(rows) + "\n")
            out.write(f"\nrouter overhead (1 replica, one cached request {overhead[3]} times each way, alternating): "
                      f"TTFT p50 {overhead[0]:.1f} ms through the router, {overhead[1]:.1f} ms straight to the "
                      f"replica; median of the paired differences {overhead[2]:+.1f} ms\n")
            out.flush()
            scale_rows = [scale_out(settings(2, policy, f"scale-out-{variant}"), records, repos.day2_start,
                                    scale_out_min, window_min, restore=variant == "b", out=out, users=users)
                          for variant in ("a", "b")]
            out.write("\n" + scale_table(scale_rows) + "\n")
            out.flush()
            scale_in(settings(2, policy, "scale-in"), records, streams, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def router_overhead(fleet: Fleet, record: RequestRecord,
                    pairs: int = OVERHEAD_PAIRS) -> tuple[float, float, float, int]:
    """TTFT p50 through the router and straight to the (only) replica, and the median of the paired
    differences: one request repeated (after the first, its prompt is in the KV cache, so the LM's share of
    the TTFT is smallest and steadiest), the two ways alternating which goes first."""
    replica = next(iter(fleet.replicas.values()))
    through, direct, differences = [], [], []
    with httpx.Client(timeout=600) as client:
        send(client, replica.url, record)  # its prefix now cached
        for i in range(pairs):
            pair = [(through, fleet.router.url), (direct, replica.url)]
            got = {}
            for sink, url in pair if i % 2 else pair[::-1]:
                answer = send(client, url, record)
                if not answer.error:
                    sink.append(answer.ttft_ms)
                    got[url] = answer.ttft_ms
            if len(got) == 2:
                differences.append(got[fleet.router.url] - got[replica.url])
    return (statistics.median(through or [0.0]), statistics.median(direct or [0.0]),
            statistics.median(differences or [0.0]), len(differences))


@dataclasses.dataclass(frozen=True, slots=True)
class ScaleOut:
    variant: str
    before_p99_ms: float
    new_requests: int
    new_p99_ms: float
    new_cold_share: float
    join_s: float

    @property
    def ratio(self) -> float:
        return self.new_p99_ms / self.before_p99_ms if self.before_p99_ms else 0.0


def scale_out(settings: FleetSettings, records: Sequence[RequestRecord], day2_start: float, at_min: float,
              window_min: float, *, restore: bool, out: TextIO, users: int = 1) -> ScaleOut:
    """Replay on 2 replicas; at ``at_min`` add a third (``restore``: from the snapshot folder, joined when warm;
    else without snapshots, joined at READY) and replay its first ``window_min``, both by ``users`` clients.

    The figures come from the replicas' own request logs (``lora_adapter``'s TTFT from the request's arrival,
    its cached tokens), read once the fleet has stopped: the new replica's log holds exactly the requests it
    served, and every replica's records before the join give the fleet's p99 before the event."""
    at, end = day2_start + at_min * 60, day2_start + (at_min + window_min) * 60
    before = [r for r in records if r.ts < at]
    window = [r for r in records if at <= r.ts < end]
    variant = "(b) snapshot, joined warm" if restore else "(a) stanzas only, joined at READY"
    with Fleet(settings) as fleet:
        replay(fleet.router.url, before, users)
        started = time.perf_counter()
        joined_at = time.time()
        new = fleet.launch(restore=restore, warm_gate=restore)
        fleet.join(new)
        join_s = time.perf_counter() - started
        replay(fleet.router.url, window, users)
        logs = fleet.request_log_dir
    # NOTE: read after the fleet stopped: each replica's request log writer has flushed and closed.
    served_before = [r.ttft_ms for r in read_request_log(log_files(logs))
                     if r.ts < joined_at and r.ttft_ms is not None]
    mine = [Answer(r.ts, r.ttft_ms or 0.0, r.cached_tokens or 0, r.prompt_tokens or 0)
            for r in read_request_log(log_files(logs / new.name))]
    stats = figures(variant, mine)
    result = ScaleOut(variant, p99(served_before), len(mine), stats.ttft_p99_ms, stats.cold_share, join_s)
    out.write(f"  scale-out {variant}: joined after {join_s:.0f} s; {len(mine)} of {len(window)} window requests "
              f"went to it\n")
    out.flush()
    return result


def scale_in(settings: FleetSettings, records: Sequence[RequestRecord], streams: int, out: TextIO) -> None:
    """``streams`` concurrent 64-token streams through the router, one replica stopped with SIGTERM meanwhile."""
    with Fleet(settings) as fleet:
        leaving: Replica = next(iter(fleet.replicas.values()))
        picked = [r for r in records if r.prompt][:streams]
        clients = [httpx.Client(timeout=600) for _ in picked]
        try:
            with concurrent.futures.ThreadPoolExecutor(len(picked)) as pool:
                futures = [pool.submit(send, c, fleet.router.url, r, 64) for c, r in zip(clients, picked)]
                deadline = time.monotonic() + 600
                while leaving.in_flight() == 0 and not all(f.done() for f in futures) and time.monotonic() < deadline:
                    time.sleep(0.02)
                in_flight = leaving.in_flight()
                departure = fleet.scale_in(leaving.name)
                answers = [f.result() for f in futures]
        finally:
            for client in clients:
                client.close()
    failed = [a.error for a in answers if a.error]
    out.write(f"\nscale-in: {len(answers)} streamed requests, {in_flight} in flight on {leaving.name} at SIGTERM; "
              f"failed {len(failed)}{': ' + '; '.join(failed[:3]) if failed else ''}; drained and exited by itself: "
              f"{departure.clean}; snapshot written: {', '.join(departure.snapshots_written) or 'no'}\n")
    out.flush()


def table(rows: Sequence[Figures]) -> str:
    return markdown(("fleet", "requests", "cold share", "prompt tokens from cache", "TTFT p50", "TTFT p99",
                     "requests per replica"),
                    [(f.label, f"{f.requests}" + (f" ({f.failed} failed)" if f.failed else ""), f"{f.cold_share:.1%}",
                      f"{f.cached_share:.1%}", f"{f.ttft_p50_ms:.1f} ms", f"{f.ttft_p99_ms:.1f} ms", f.per_replica)
                     for f in rows])


def scale_table(rows: Sequence[ScaleOut]) -> str:
    return markdown(("scale-out", "joined after", "its requests in the window", "its cold share", "its TTFT p99",
                     "fleet p99 before", "ratio"),
                    [(r.variant, f"{r.join_s:.0f} s", str(r.new_requests), f"{r.new_cold_share:.1%}",
                      f"{r.new_p99_ms:.1f} ms", f"{r.before_p99_ms:.1f} ms", f"{r.ratio:.2f}x") for r in rows])
