"""``python -m warmup_tools bench tenant-flood``: one tenant floods a fleet of two replicas through the smg router;
another tenant's TTFT during the flood against its TTFT before it.

The replicas' ``lora_adapter`` runs the simulated engine (a profile's step times; the scheduler and its per-tenant
admission, Triton, the front, the sidecar and the router are the real ones) with small bounds (``max_num_seqs``,
``max_queue``), so that a few dozen streams fill them. The quiet tenant sends ``quiet_requests`` streamed completions
one after the other, before the flood and during it (once the flooder has been refused a first time: the instances
hold all they may of it). Figures: the quiet tenant's TTFT p50/p99 in each phase and the ratio of the p99s, its
failed requests, the flooder's answers by HTTP status, how often a replica's sidecar said not ready during the
flood, and the reloads and restarts the sidecars made. Each replica's front refuses a tenant over its bound
(``tenant_max_in_flight``, by default lora_adapter's share of one tenant) before anything reaches tritonserver;
``--compare`` runs the flood first with that bound off (only lora_adapter refuses), then on, each on a fresh fleet.

:func:`flood_fleet` is the measurement itself (tests/integration/test_fleet_flood.py runs it on a shorter flood).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Annotated, Any, Sequence, TextIO

from warmup_tools.common.settings import arg, environ_overrides
from warmup_tools.sim.bench.support.openai_stream import StreamError, stream_completion
from warmup_tools.sim.bench.support.tables import markdown, p99

FLOODER = "flooder"
QUIET = "quiet"
#: Each replica's scheduler bounds in the bench: small, so that a few dozen streams fill an instance.
BOUNDS = {"WARMUP_MAX_NUM_SEQS": "4", "WARMUP_MAX_QUEUE": "8"}
PROFILE = "h100-llama-3.1-8b"
#: The variable of each replica's front that sets its bound per tenant (FrontSettings.tenant_max_in_flight).
FRONT_BOUND_VARIABLE = "WARMUP_FRONT_TENANT_MAX_IN_FLIGHT"


@dataclasses.dataclass
class FloodReport:
    """What :func:`flood_fleet` saw."""

    quiet_ttft_ms: list[float]
    flood_ttft_ms: list[float]
    #: The quiet tenant's failures (before and during the flood): ``status: text``.
    quiet_errors: list[str]
    #: The flooder's answers by HTTP status (0: no answer), and the body of its first 429.
    flooder_statuses: collections.Counter
    first_429: dict[str, Any] | None
    #: Sidecar reads during the flood, and those that said not ready (``replica: reason``).
    readiness_reads: int
    not_ready: list[str]
    #: Per replica, after the flood: reloads of each model and restarts of tritonserver, from the sidecar's /status.
    recoveries: dict[str, int]
    busy_probes: dict[str, int]
    #: Per replica with a reload or restart: the sidecar's last one (what, why it failed if it did).
    last_recovery: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: The quiet tenant's TTFT inside lora_adapter (its request logs), before and during the flood: the scheduler's
    #: share of the TTFT, without the front, the router and the steps before lora_adapter.
    server_quiet_ttft_ms: list[float] = dataclasses.field(default_factory=list)
    server_flood_ttft_ms: list[float] = dataclasses.field(default_factory=list)

    @property
    def ratio(self) -> float:
        return p99(self.flood_ttft_ms) / p99(self.quiet_ttft_ms)


def flood_fleet(router_url: str, sidecar_urls: dict[str, str], *, flooders: int, quiet_requests: int,
                flood_max_tokens: int = 64, quiet_max_tokens: int = 4, max_flood_requests: int = 100_000,
                saturate_timeout_s: float = 300.0, retry_after: bool = False,
                request_log_dir: Path | None = None) -> FloodReport:
    """The quiet tenant's TTFTs before and during a flood of ``flooders`` concurrent streams of another tenant
    through ``router_url``; ``sidecar_urls`` (replica name: sidecar URL) are read for readiness meanwhile and for
    their reloads after. Every loop is bounded: the flood by ``max_flood_requests`` and by the quiet tenant's end,
    the wait for the flood to fill the instances (its first refusal) by ``saturate_timeout_s``. ``retry_after``:
    a flooding stream refused with 429 waits the answer's ``Retry-After`` before its next request (as OpenAI's
    SDKs do); otherwise it sends the next one at once. ``request_log_dir``: the fleet's request logs, from which
    the quiet tenant's TTFT inside lora_adapter is read."""
    import httpx

    with httpx.Client(timeout=600) as client:
        quiet = [_quiet_request(client, router_url, quiet_max_tokens) for _ in range(quiet_requests)]
    stop = threading.Event()
    statuses: collections.Counter = collections.Counter()
    first_429: list[dict[str, Any]] = []
    sent = iter(range(max_flood_requests))
    lock = threading.Lock()

    def flood() -> None:
        with httpx.Client(timeout=600) as flood_client:
            while not stop.is_set():
                with lock:
                    if next(sent, None) is None:
                        return
                body = {"model": "base", "prompt": f"{uuid.uuid4().hex} Tell me a long story about the sea.",
                        "max_tokens": flood_max_tokens, "user": FLOODER}
                try:
                    response = flood_client.post(f"{router_url}/v1/completions", json=body,
                                                 headers={"X-Tenant-Id": FLOODER})
                    status = response.status_code
                except httpx.HTTPError:
                    status = 0
                with lock:
                    statuses[status] += 1
                    if status == 429 and not first_429:
                        first_429.append(_json(response))
                if status == 429 and retry_after:
                    stop.wait(float(response.headers.get("retry-after", "1")))

    watcher = _ReadinessWatcher(sidecar_urls)
    threads = [threading.Thread(target=flood, name=f"flooder-{i}", daemon=True) for i in range(flooders)]
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + saturate_timeout_s
        while not first_429 and time.monotonic() < deadline and any(t.is_alive() for t in threads):
            time.sleep(0.05)
        watcher.start()
        flood_started = time.time()
        with httpx.Client(timeout=600) as client:
            during = [_quiet_request(client, router_url, quiet_max_tokens) for _ in range(quiet_requests)]
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        watcher.stop()
    recoveries, busy, last = _sidecar_counts(sidecar_urls)
    logged = _logged_ttfts(request_log_dir, quiet_requests * 2) if request_log_dir is not None else []
    return FloodReport(
        quiet_ttft_ms=[t for t, _ in quiet if t is not None], flood_ttft_ms=[t for t, _ in during if t is not None],
        quiet_errors=[e for _, e in quiet + during if e], flooder_statuses=statuses,
        first_429=first_429[0] if first_429 else None, readiness_reads=watcher.reads, not_ready=watcher.not_ready,
        recoveries=recoveries, busy_probes=busy, last_recovery=last,
        server_quiet_ttft_ms=[t for ts, t in logged if ts < flood_started],
        server_flood_ttft_ms=[t for ts, t in logged if ts >= flood_started])


def _quiet_request(client: Any, url: str, max_tokens: int) -> tuple[float | None, str]:
    """One streamed completion of the quiet tenant: its TTFT in ms (None on a failure) and the failure."""
    import httpx

    body = {"model": "base", "prompt": f"{uuid.uuid4().hex} What are your opening hours on Sunday?",
            "max_tokens": max_tokens, "user": QUIET}
    try:
        streamed = stream_completion(client, f"{url}/v1/completions", body, {"X-Tenant-Id": QUIET})
    except StreamError as exc:
        return None, str(exc)
    except httpx.HTTPError as exc:
        return None, f"{type(exc).__name__}: {exc}"
    if not streamed.usage:
        return None, "no usage in the stream"
    # NOTE: a generation whose first tokens decode to no text (the simulated engine's tokens are a function of
    # the context) was still served: its first answer came when the stream ended.
    return (streamed.ttft_s if streamed.ttft_s is not None else streamed.total_s) * 1000, ""


def _logged_ttfts(folder: Path, expected: int, timeout_s: float = 60.0) -> list[tuple[float, float]]:
    """``(ts, ttft_ms)`` of the quiet tenant's requests in the request logs, once ``expected`` are there (the
    writers flush off the scheduler's thread) or after ``timeout_s``."""
    from warmup_tools.common.records import log_files, read_request_log

    deadline = time.monotonic() + timeout_s
    while True:
        found = [(r.ts, r.ttft_ms) for r in read_request_log(log_files(folder)) if r.tenant == QUIET]
        if len(found) >= expected or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def _json(response: Any) -> dict[str, Any]:
    try:
        return dict(response.json())
    except ValueError:
        return {"text": response.text[:300]}


class _ReadinessWatcher:
    """Reads every sidecar's /ready until stopped; counts the reads and keeps each not-ready answer's reason."""

    def __init__(self, sidecar_urls: dict[str, str], poll_s: float = 0.2) -> None:
        self._urls = sidecar_urls
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="readiness-watcher", daemon=True)
        self.reads = 0
        self.not_ready: list[str] = []

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        import httpx

        with httpx.Client(timeout=10) as client:
            while not self._stop.wait(self._poll_s):
                for name, url in self._urls.items():
                    try:
                        response = client.get(f"{url}/ready")
                        status, reason = response.status_code, response.text[:200]
                    except httpx.HTTPError as exc:
                        status, reason = 0, str(exc)
                    self.reads += 1
                    if status != 200:
                        self.not_ready.append(f"{name}: {status} {reason}")


def _sidecar_counts(sidecar_urls: dict[str, str]) -> tuple[dict[str, int], dict[str, int], dict[str, Any]]:
    """Per replica: reloads of its models plus restarts of its tritonserver, its busy probes, and its last recovery
    (sidecar /status)."""
    import httpx

    recoveries, busy, last = {}, {}, {}
    with httpx.Client(timeout=30) as client:
        for name, url in sidecar_urls.items():
            status = client.get(f"{url}/status").json()
            models = status["models"].values()
            recoveries[name] = sum(m["recoveries"] + m["failed_recoveries"] for m in models) + status["restarts"]
            busy[name] = sum(m.get("busy_probes", 0) + m.get("stalled_probes", 0) for m in models)
            if status.get("last_recovery"):
                last[name] = status["last_recovery"]
    return recoveries, busy, last


def simulated_fleet_environment(profile: str = PROFILE, speedup: float = 1.0) -> dict[str, str]:
    """The variables of a replica in the bench: the simulated engine of ``profile`` with its device's KV budget, and
    :data:`BOUNDS`."""
    from warmup_tools.lora_adapter.profile import load_profile
    from warmup_tools.sim.bench.support.simulated import replica_kv_tokens, simulated_environment

    engine = load_profile(profile)
    kv_bytes = replica_kv_tokens(engine, 16, "conversation") * engine.kv_bytes_per_token
    return {**simulated_environment(profile, speedup, kv_bytes), **BOUNDS}


def run(assets_dir: Path, *,
        flooders: Annotated[int, arg("concurrent streams of the flooding tenant", ge=1)] = 48,
        quiet_requests: Annotated[int, arg("the quiet tenant's requests in each phase, one after the other",
                                           ge=1)] = 100,
        flood_max_tokens: Annotated[int, arg("tokens each flooding request asks for", ge=1)] = 64,
        retry_after: Annotated[bool, arg("a flooding stream refused with 429 waits its Retry-After (as OpenAI's SDKs "
                                         "do) instead of sending again at once")] = False,
        compare: Annotated[bool, arg("run the flood twice, each on a fresh fleet: first with the front's bound per "
                                     "tenant off (only lora_adapter refuses), then on")] = False,
        out: TextIO = sys.stdout) -> None:
    import tempfile

    from warmup_tools.fleet.fleet import Fleet
    from warmup_tools.fleet.settings import FleetSettings
    from warmup_tools.front.admission import MAX_TENANT_BOUND

    variants = ([("off", {FRONT_BOUND_VARIABLE: str(MAX_TENANT_BOUND)})] if compare else []) + [("on", {})]
    for label, front in variants:
        with tempfile.TemporaryDirectory(prefix="tenant-flood-") as work, \
                environ_overrides({**simulated_fleet_environment(), **front}):
            settings = FleetSettings(replicas=2, port=0, assets_dir=assets_dir, work_dir=Path(work),
                                     membership_interval_s=1.0)
            with Fleet(settings) as fleet:
                report = flood_fleet(fleet.router.url, {n: r.sidecar_url for n, r in fleet.replicas.items()},
                                     flooders=flooders, quiet_requests=quiet_requests,
                                     flood_max_tokens=flood_max_tokens, retry_after=retry_after,
                                     request_log_dir=fleet.request_log_dir)
        write_report(report, flooders, out, retry_after, front_bound=label)
        out.flush()


def write_report(report: FloodReport, flooders: int, out: TextIO, retry_after: bool = False,
                 front_bound: str = "on") -> None:
    def row(name: str, values: Sequence[float]) -> list[str]:
        ordered = sorted(values)
        p50 = ordered[len(ordered) // 2] if ordered else float("nan")
        return [name, str(len(values)), f"{p50:.0f}", f"{p99(values) if values else float('nan'):.0f}"]

    bounds = ", ".join(f"{k}={v}" for k, v in BOUNDS.items())
    pause = "waits Retry-After after a 429" if retry_after else "sends again at once after a 429"
    door = ("each front refuses a tenant over its bound (tenant_max_in_flight)" if front_bound == "on" else
            "the fronts' bound per tenant off (only lora_adapter refuses)")
    out.write(f"two simulated replicas ({PROFILE}, {bounds}) behind smg, {door}; {flooders} concurrent streams of "
              f"one tenant, each {pause}\n\n")
    rows = [row("before the flood (client)", report.quiet_ttft_ms),
            row("during the flood (client)", report.flood_ttft_ms)]
    if report.server_quiet_ttft_ms:
        rows += [row("before the flood (inside lora_adapter)", report.server_quiet_ttft_ms),
                 row("during the flood (inside lora_adapter)", report.server_flood_ttft_ms)]
    out.write(markdown(["quiet tenant", "requests", "TTFT p50 ms", "TTFT p99 ms"], rows) + "\n")
    if report.quiet_ttft_ms and report.flood_ttft_ms:
        out.write(f"\nTTFT p99 during / before: {report.ratio:.2f}x at the client")
        if report.server_quiet_ttft_ms and report.server_flood_ttft_ms:
            inside = p99(report.server_flood_ttft_ms) / p99(report.server_quiet_ttft_ms)
            out.write(f", {inside:.2f}x inside lora_adapter")
        out.write("\n")
    out.write(f"quiet tenant failures: {len(report.quiet_errors)}"
              + (f" (first: {report.quiet_errors[0]})" if report.quiet_errors else "") + "\n")
    out.write("flooder answers: " + ", ".join(f"HTTP {s}: {n}" for s, n in sorted(report.flooder_statuses.items()))
              + "\n")
    if report.first_429 is not None:
        out.write(f"first 429: {json.dumps(report.first_429)}\n")
    out.write(f"sidecar /ready reads during the flood: {report.readiness_reads}, not ready: {len(report.not_ready)}\n")
    out.write(f"reloads and restarts per replica: {report.recoveries}; probes busy or stalled: {report.busy_probes}\n")
    for name, recovery in report.last_recovery.items():
        out.write(f"  {name}'s last: {json.dumps(recovery)}\n")
