"""``python -m warmup_tools bench preload``: does warming a new adapter hurt live requests?

One run, in process, one engine per configuration (what one ``lora_adapter`` instance runs): a live
client thread sends requests for a live adapter back to back (``max_tokens=1``, short think time),
like Triton's execute thread, while the operator adds a new adapter with long warm prompts that the
instance's control thread pre-fills. Warm prompts are the scheduler's lowest class: they only use the token
budget live sequences leave in a step and never share a step with a live prefill. Live TTFT is measured
before and during that warm-up for three settings of that class:

- whole steps, share 1 (``warm_chunk_tokens`` = the step budget, ``warm_share`` 1): warm-up takes every
  step it can, what a naive preload does;
- 128-token chunks, share 1: a live request waits for one such chunk at most;
- the shipped defaults (``warm_chunk_tokens`` 16, ``warm_share`` 0.25): small chunks, and warm-up rests
  three times as long as it works while live traffic flows.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Annotated, TextIO

from warmup_tools.common.settings import arg
from warmup_tools.control.registry import ControlRegistry
from warmup_tools.control.state import AdapterState
from warmup_tools.demo.prompts import SYSTEM_PROMPTS, USER_QUESTIONS
from warmup_tools.lora_adapter.engine_api import TextEncoder
from warmup_tools.lora_adapter.engines import make_engine
from warmup_tools.lora_adapter.requests import GenerateRequest, SamplingParams
from warmup_tools.lora_adapter.scheduler import Scheduler
from warmup_tools.lora_adapter.service import LoraService
from warmup_tools.lora_adapter.settings import DEFAULT_BATCHING, EngineConfig, SchedulerConfig, ServiceConfig
from warmup_tools.sim.bench.support.params import LmThreads

#: (label, warm class settings) of each configuration measured.
CONFIGS = (
    ("whole steps, share 1",
     SchedulerConfig(warm_chunk_tokens=DEFAULT_BATCHING.max_num_batched_tokens, warm_share=1.0)),
    ("128-token chunks, share 1", SchedulerConfig(warm_chunk_tokens=128, warm_share=1.0)),
    (f"defaults ({DEFAULT_BATCHING.warm_chunk_tokens}-token chunks, share {DEFAULT_BATCHING.warm_share:g})",
     DEFAULT_BATCHING),
)


@dataclasses.dataclass(frozen=True, slots=True)
class PreloadResult:
    label: str
    warm_s: float
    idle_ttft_ms: list[float]
    warming_ttft_ms: list[float]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def warm_prompts(count: int, tokens: int, engine: TextEncoder, seed: int) -> list[str]:
    """Long, distinct prompts for the new adapter: its system prompt and questions up to ``tokens``."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        text = SYSTEM_PROMPTS["sql"] + f"Context {i}:\n"
        while len(engine.encode(text)) < tokens:
            text += rng.choice(USER_QUESTIONS["sql"]) + " " + rng.choice(USER_QUESTIONS["support"]) + "\n"
        prompts.append(text)
    return prompts


def measure(assets_dir: Path, label: str, batching: SchedulerConfig, *, prompts: int, prompt_tokens: int,
            idle_s: float, think_s: float, lm_threads: int, seed: int) -> PreloadResult:
    engine = make_engine(EngineConfig(base_model=assets_dir / "lm", adapter_root=assets_dir / "adapters",
                                     adapters=("support",), num_threads=lm_threads))
    control = Path(tempfile.mkdtemp(prefix="bench-preload-"))
    scheduler = Scheduler(engine, batching)
    scheduler.start()
    service = LoraService(engine, ServiceConfig(control_dir=control, control_poll_s=0.02), instance="bench_0",
                          scheduler=scheduler)
    registry = ControlRegistry(control)
    texts = warm_prompts(prompts, prompt_tokens, engine, seed)
    system = SYSTEM_PROMPTS["support"]
    samples: list[tuple[float, float]] = []  # (start, ttft ms)
    stop = threading.Event()

    def live_client() -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            ids = engine.encode(system + "User: " + rng.choice(USER_QUESTIONS["support"]) + f" ({rng.random():.6f})")
            request = GenerateRequest(ids, "support", "bench", False, SamplingParams(max_tokens=1))
            start = time.perf_counter()
            sink = _FirstToken()
            service.serve(request, sink)
            sink.wait()
            samples.append((start, (time.perf_counter() - start) * 1000))
            time.sleep(think_s)

    client = threading.Thread(target=live_client, name="live-client")
    try:
        client.start()
        time.sleep(idle_s)
        warm_start = time.perf_counter()
        registry.add("sql", texts)
        registry.wait_until("sql", AdapterState.LIVE, instances=1, timeout_s=1800, poll_s=0.01)
        warm_end = time.perf_counter()
    finally:
        stop.set()
        client.join(timeout=60)
        service.close()  # stops the scheduler too
    first = samples[0][0] if samples else 0.0
    idle = [ms for start, ms in samples if first + 0.5 <= start < warm_start]  # after the first requests
    warming = [ms for start, ms in samples if warm_start <= start < warm_end]
    return PreloadResult(label, warm_end - warm_start, idle, warming)


class _FirstToken:
    """A sequence sink that wakes the live client at its first token (or its error)."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None

    def send(self, step: object) -> None:
        self._done.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._done.set()

    def is_cancelled(self) -> bool:
        return False

    def wait(self) -> None:
        if not self._done.wait(600):
            raise TimeoutError("no first token within 600 s")
        if self.error is not None:
            raise self.error


def run(assets_dir: Path, *, prompts: Annotated[int, arg("warm prompts of the new adapter")] = 12,
        prompt_tokens: Annotated[int, arg("tokens of each warm prompt")] = 768, idle_s: float = 3.0,
        think_s: float = 0.01, lm_threads: LmThreads = 1,
        seed: int = 0, out: TextIO = sys.stdout) -> list[PreloadResult]:
    out.write(f"live client: support requests, max_tokens=1, {think_s * 1000:.0f} ms think time; warm-up: adapter sql, "
              f"{prompts} prompts of ~{prompt_tokens} tokens; LM threads {lm_threads}\n")
    results = []
    for label, batching in CONFIGS:
        result = measure(assets_dir, label, batching, prompts=prompts, prompt_tokens=prompt_tokens,
                         idle_s=idle_s, think_s=think_s, lm_threads=lm_threads, seed=seed)
        out.write(f"  {result.label}: warm-up {result.warm_s:.1f} s, {len(result.warming_ttft_ms)} live requests "
                  f"during it, TTFT p50 {pct(result.warming_ttft_ms, 0.5):.1f} ms, p99 "
                  f"{pct(result.warming_ttft_ms, 0.99):.1f} ms (idle p50 {pct(result.idle_ttft_ms, 0.5):.1f} ms)\n")
        out.flush()
        results.append(result)
    out.write("\n| warm-up | warm-up s | live requests during it | live TTFT p50 ms | p90 ms | p99 ms | max ms | "
              "idle TTFT p50 ms |\n|---|---|---|---|---|---|---|---|\n")
    for r in results:
        w = r.warming_ttft_ms
        out.write(f"| {r.label} | {r.warm_s:.1f} | {len(w)} | {pct(w, 0.5):.1f} | {pct(w, 0.9):.1f} | "
                  f"{pct(w, 0.99):.1f} | {max(w, default=float('nan')):.1f} | "
                  f"{statistics.median(r.idle_ttft_ms) if r.idle_ttft_ms else float('nan'):.1f} |\n")
    return results
