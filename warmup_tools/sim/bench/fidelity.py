"""``python -m warmup_tools bench fidelity``: the simulated engine against the real one on the same trace slice.

One server (tritonserver and the OpenAI front beside it, as ``serve`` runs them) with the real engine, then one
with ``engine=simulated`` and a profile fitted to the real engine on this machine (``cpu-demo-lm``,
``python -m warmup_tools profile-fit``); each replays the same requests of a public trace
(:mod:`warmup_tools.sim.traces`), open-loop at the trace's arrival times times ``slowdown``, streamed through the
same client. Figures: TTFT and inter-token latency (ITL: the time after the first token over the tokens after it)
p50/p90 of each engine and their ratio (the goal: each within 15%), and the requests whose cached prompt tokens
differ between the two (the goal: none). Both run with one LM thread and the same KV budget, so the real and the
modelled bytes per token agree.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, Iterator, Sequence, TextIO

import httpx

from warmup_tools.common.settings import arg
from warmup_tools.lora_adapter.profile import DEFAULT_PROFILE
from warmup_tools.server.config import REPO_ROOT
from warmup_tools.server.process import TritonServer
from warmup_tools.sim.bench.support.openai_stream import StreamError, stream_completion
from warmup_tools.sim.bench.support.params import LmThreads
from warmup_tools.sim.bench.support.tables import markdown
from warmup_tools.sim.traces import TRACES, TracePrompts, TraceScale, load_trace

#: The goal: the simulated engine's TTFT and ITL percentiles within this share of the real engine's.
TOLERANCE = 0.15
START_TIMEOUT_S = 600


@dataclasses.dataclass(frozen=True, slots=True)
class Served:
    """One replayed request as the client saw it."""

    ttft_ms: float
    itl_ms: float | None
    cached_tokens: int
    error: str = ""


def run(assets_dir: Path, *,
        trace: Annotated[str, arg("the public trace replayed", choices=tuple(TRACES))] = "conversation",
        requests: Annotated[int, arg("requests of the trace replayed (from its start)", ge=1)] = 120,
        block_tokens: Annotated[int, arg("tokens each of the trace's hash blocks becomes", ge=1)] = 16,
        slowdown: Annotated[float, arg("the trace's arrival times multiplied by this", ge=0.001)] = 4.0,
        max_output_tokens: Annotated[int, arg("cap on each request's scaled output tokens", ge=2)] = 16,
        profile: Annotated[str, arg("the simulated engine's profile (fitted to the real engine here)")]
        = DEFAULT_PROFILE,
        lm_threads: LmThreads = 1,
        out: TextIO = sys.stdout) -> None:
    from transformers import AutoTokenizer

    from warmup_tools.demo.assets import DemoAssets

    tokenizer = AutoTokenizer.from_pretrained(DemoAssets.at(assets_dir).lm_dir)
    prompts = TracePrompts(tokenizer, block_tokens)
    scale = TraceScale(block_tokens=block_tokens, speedup=1 / slowdown, max_output_tokens=max_output_tokens,
                       limit=requests)
    items = [(r.at_s, prompts.prompt(r), max(2, r.output_tokens)) for r in load_trace(trace, scale)]
    out.write(f"trace {trace}: its first {len(items)} requests at {block_tokens} tokens per block, arrivals x"
              f"{slowdown:g} ({items[-1][0]:.0f} s), outputs capped at {max_output_tokens} tokens (at least 2); "
              f"{lm_threads} LM thread(s)\n")
    out.flush()
    results = {}
    for engine in ("real", "simulated"):
        env = {"WARMUP_ASSETS_DIR": str(assets_dir), "WARMUP_CONTROL_DIR": "", "WARMUP_LM_THREADS": str(lm_threads),
               "WARMUP_ENGINE": engine, "WARMUP_ENGINE_PROFILE": profile}
        started = time.perf_counter()
        with served(assets_dir, env) as url:
            results[engine] = replay(url, items)
        failed = sum(1 for s in results[engine] if s.error)
        out.write(f"  {engine}: {len(items)} requests, {failed} failed, {time.perf_counter() - started:.0f} s\n")
        out.flush()
    out.write("\n" + report(results["real"], results["simulated"], profile) + "\n")


@contextlib.contextmanager
def served(assets_dir: Path, env: dict[str, str]) -> Iterator[str]:
    from warmup_tools.sim.bench.support.servers import front_process

    with TritonServer(REPO_ROOT / "model_repository", env=env) as server:
        server.wait_ready(timeout=START_TIMEOUT_S)
        with front_process(server, assets_dir, "composing") as front:
            yield front.url


def replay(url: str, items: Sequence[tuple[float, str, int]]) -> list[Served]:
    """Each (arrival s, prompt, max_tokens) streamed at its arrival; results in item order."""
    local = threading.local()
    clients: list[httpx.Client] = []
    lock = threading.Lock()

    def one(prompt: str, max_tokens: int) -> Served:
        client = getattr(local, "client", None)
        if client is None:
            client = local.client = httpx.Client(timeout=600)
            with lock:
                clients.append(client)
        body = {"model": "base", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
        try:
            streamed = stream_completion(client, f"{url}/v1/completions", body)
        except (StreamError, httpx.HTTPError) as exc:
            return Served(0.0, None, 0, f"{type(exc).__name__}: {exc}")
        tokens = int(streamed.usage.get("completion_tokens", 0))
        if streamed.ttft_s is None or not tokens:
            return Served(0.0, None, 0, "no text or no usage in the stream")
        itl = (streamed.total_s - streamed.ttft_s) * 1000 / (tokens - 1) if tokens > 1 else None
        return Served(streamed.ttft_s * 1000, itl, streamed.cached_tokens)

    start = time.perf_counter()
    try:
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            futures = []
            for at_s, prompt, max_tokens in items:
                delay = start + at_s - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                futures.append(pool.submit(one, prompt, max_tokens))
            return [f.result() for f in futures]
    finally:
        for client in clients:
            client.close()


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return statistics.quantiles(ordered, n=100, method="inclusive")[round(q * 100) - 1] if len(ordered) > 1 \
        else ordered[0]


def report(real: Sequence[Served], simulated: Sequence[Served], profile: str) -> str:
    """The table of both engines' percentiles and ratios, and the cached-token comparison."""
    rows = []
    for name, get in (("TTFT", lambda s: s.ttft_ms), ("ITL", lambda s: s.itl_ms)):
        for q in (0.5, 0.9):
            a = percentile([v for s in real if not s.error and (v := get(s)) is not None], q)
            b = percentile([v for s in simulated if not s.error and (v := get(s)) is not None], q)
            ratio = b / a if a else float("nan")
            rows.append((f"{name} p{round(q * 100)}", f"{a:.1f}", f"{b:.1f}", f"{ratio:.2f}",
                         "yes" if abs(ratio - 1) <= TOLERANCE else "no"))
    pairs = [(a, b) for a, b in zip(real, simulated) if not a.error and not b.error]
    differ = sum(1 for a, b in pairs if a.cached_tokens != b.cached_tokens)
    table = markdown(("figure", "real engine (ms)", f"simulated, profile {profile} (modelled, ms)",
                      "simulated / real", f"within {TOLERANCE:.0%}"), rows)
    return (f"{table}\n\ncached prompt tokens: {differ} of {len(pairs)} requests differ between the engines "
            f"({sum(a.cached_tokens for a, _ in pairs)} real, {sum(b.cached_tokens for _, b in pairs)} simulated)")
