"""``python -m warmup_tools bench preload``: does warming a new adapter hurt live requests?

One run, in process, one engine per configuration (what one ``lora_adapter`` instance runs): a live
client thread sends requests for a live adapter back to back (``max_tokens=1``, short think time),
like Triton's execute thread, while the operator adds a new adapter with long warm prompts that the
instance's control thread pre-fills. Live TTFT is measured before and during that warm-up for:

- ``fifo``, whole prompts, share 1: a plain engine lock, what a naive preload does;
- ``live_first``, whole prompts, share 1: live requests go first, but wait for a whole warm prompt;
- ``live_first``, 128-token chunks, share 1: a live request waits for one chunk at most;
- ``live_first``, 128-token chunks, share 0.5: the serial scheduler's default (warm-up rests as long as
  it works);
- ``continuous``: the continuous-batching scheduler (the shipped default), where warm chunks are the
  lowest class and only use the token budget live sequences leave in a step.
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
from typing import TextIO

from warmup_tools.adapters.registry import ControlRegistry
from warmup_tools.adapters.state import AdapterState
from warmup_tools.demo.prompts import SYSTEM_PROMPTS, USER_QUESTIONS
from warmup_tools.lora_adapter.engine import LoraEngine
from warmup_tools.lora_adapter.requests import GenerateRequest, SamplingParams
from warmup_tools.lora_adapter.scheduler import Scheduler
from warmup_tools.lora_adapter.service import LoraService
from warmup_tools.lora_adapter.settings import DEFAULT_BATCHING, EngineConfig, SchedulerConfig, ServiceConfig

CONFIGS = (("fifo", 0, 1.0), ("live_first", 0, 1.0), ("live_first", 128, 1.0), ("live_first", 128, 0.5),
           ("continuous", 0, 1.0))


@dataclasses.dataclass(frozen=True, slots=True)
class PreloadResult:
    priority: str
    chunk_tokens: int
    share: float
    warm_s: float
    idle_ttft_ms: list[float]
    warming_ttft_ms: list[float]

    @property
    def label(self) -> str:
        if self.priority == "continuous":
            return "continuous scheduler, warm class"
        chunks = f"{self.chunk_tokens}-token chunks" if self.chunk_tokens else "whole prompts"
        return f"{self.priority}, {chunks}, share {self.share:g}"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def warm_prompts(count: int, tokens: int, engine: LoraEngine, seed: int) -> list[str]:
    """Long, distinct prompts for the new adapter: its system prompt and questions up to ``tokens``."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        text = SYSTEM_PROMPTS["sql"] + f"Context {i}:\n"
        while len(engine.encode(text)) < tokens:
            text += rng.choice(USER_QUESTIONS["sql"]) + " " + rng.choice(USER_QUESTIONS["support"]) + "\n"
        prompts.append(text)
    return prompts


def measure(assets_dir: Path, priority: str, chunk_tokens: int, share: float, *, prompts: int, prompt_tokens: int,
            idle_s: float, think_s: float, lm_threads: int, seed: int) -> PreloadResult:
    engine = LoraEngine(EngineConfig(base_model=assets_dir / "lm", adapter_root=assets_dir / "adapters",
                                     adapters=("support",), num_threads=lm_threads))
    control = Path(tempfile.mkdtemp(prefix="bench-preload-"))
    scheduler = None
    if priority == "continuous":
        scheduler = Scheduler(engine, DEFAULT_BATCHING)
        scheduler.start()
        service = LoraService(engine, ServiceConfig(control_dir=control, control_poll_s=0.02), instance="bench_0",
                              batching=DEFAULT_BATCHING, scheduler=scheduler)
    else:
        service = LoraService(engine, ServiceConfig(control_dir=control, control_poll_s=0.02, warm_priority=priority),
                              instance="bench_0",
                              # chunk_tokens 0: whole prompts (a chunk longer than any prompt)
                              batching=SchedulerConfig(warm_share=share, warm_chunk_tokens=chunk_tokens or 1 << 20))
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
            if scheduler is None:
                for _ in service.generate(request):
                    break
            else:
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
    return PreloadResult(priority, chunk_tokens, share, warm_end - warm_start, idle, warming)


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


def run(assets_dir: Path, *, prompts: int = 12, prompt_tokens: int = 768, idle_s: float = 3.0, think_s: float = 0.01,
        lm_threads: int = 1, seed: int = 0, out: TextIO = sys.stdout) -> list[PreloadResult]:
    out.write(f"live client: support requests, max_tokens=1, {think_s * 1000:.0f} ms think time; warm-up: adapter sql, "
              f"{prompts} prompts of ~{prompt_tokens} tokens; LM threads {lm_threads}\n")
    results = []
    for priority, chunk, share in CONFIGS:
        result = measure(assets_dir, priority, chunk, share, prompts=prompts, prompt_tokens=prompt_tokens,
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
