"""``python -m warmup_tools bench single``: one stream served by the continuous scheduler and by the serial
path, in one run, in process.

One :class:`LoraEngine` (the demo LM and adapters, one torch thread) and one :class:`Scheduler`. Requests
alternate between the two paths (support, legal, sql and the base model in turn, each a warm system prompt
and a distinct question, ``max_tokens`` 32; the first pair is a warm-up and not counted): **serial** runs
``engine.generate`` to its last token on the scheduler's thread while the scheduler holds nothing else (the
serial path's code, without Triton's gate), **continuous** submits the request to the scheduler and waits
for its last token. Per path: TTFT, inter-token latency (p50, p95) and output tokens/s (median over the
requests), then continuous against serial. Nothing else runs: this is the scheduler's price for a single
stream, the number ``scheduler=continuous`` must not lose on.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Callable, TextIO

from warmup_tools.demo.prompts import SYSTEM_PROMPTS, USER_QUESTIONS
from warmup_tools.lora_adapter.engine import LoraEngine
from warmup_tools.lora_adapter.requests import GenerateRequest, SamplingParams
from warmup_tools.lora_adapter.scheduler import Scheduler
from warmup_tools.lora_adapter.settings import DEFAULT_BATCHING, EngineConfig
from warmup_tools.sim.bench.engine import TimedSink

ADAPTERS: tuple[str | None, ...] = ("support", "legal", "sql", None)


def run(assets_dir: Path, *, requests: int = 24, max_tokens: int = 32, lm_threads: int = 1,
        out: TextIO = sys.stdout) -> dict[str, dict[str, float]]:
    """Measure both paths, ``requests`` each (after one warm-up pair); prints a table and the ratios."""
    engine = LoraEngine(EngineConfig(base_model=assets_dir / "lm", adapter_root=assets_dir / "adapters",
                                     num_threads=lm_threads))
    scheduler = Scheduler(engine, DEFAULT_BATCHING)
    scheduler.start()
    try:
        samples: dict[str, list[tuple[float, list[float], float]]] = {"serial": [], "continuous": []}
        paths: dict[str, Callable[[GenerateRequest], list[float]]] = {
            "serial": lambda r: _serial(scheduler, engine, r), "continuous": lambda r: _continuous(scheduler, r)}
        for index in range(requests + 1):
            order = ("serial", "continuous") if index % 2 == 0 else ("continuous", "serial")
            for name in order:
                request = _request(engine, index, name, max_tokens)
                start = time.perf_counter()
                times = paths[name](request)
                if index:  # the first pair warms both paths
                    gaps = [b - a for a, b in zip(times, times[1:])]
                    samples[name].append((times[0] - start, gaps, len(times) / (times[-1] - start)))
    finally:
        scheduler.stop()
    figures = {name: _figures(rows) for name, rows in samples.items()}
    out.write(f"one stream, {requests} requests per path, max_tokens {max_tokens}, device {engine.device}, "
              f"{lm_threads} torch thread(s)\n")
    out.write("| path | TTFT p50 / p95 ms | ITL p50 / p95 ms | output tokens/s |\n|---|---|---|---|\n")
    for name, f in figures.items():
        out.write(f"| {name} | {f['ttft_p50']:.1f} / {f['ttft_p95']:.1f} | {f['itl_p50']:.2f} / {f['itl_p95']:.2f} "
                  f"| {f['tokens_per_s']:.1f} |\n")
    c, s = figures["continuous"], figures["serial"]
    out.write(f"continuous vs serial: tokens/s x{c['tokens_per_s'] / s['tokens_per_s']:.3f}, TTFT p50 "
              f"x{c['ttft_p50'] / s['ttft_p50']:.3f}, ITL p50 x{c['itl_p50'] / s['itl_p50']:.3f}\n")
    out.flush()
    return figures


def _request(engine: LoraEngine, index: int, path: str, max_tokens: int) -> GenerateRequest:
    adapter = ADAPTERS[index % len(ADAPTERS)]
    scope = adapter or "support"
    questions = USER_QUESTIONS[scope]
    text = (f"{SYSTEM_PROMPTS[scope]}User: {questions[index % len(questions)]} (request {index}, {path})\n"
            "Assistant:")
    return GenerateRequest(engine.encode(text), adapter, "default", True, SamplingParams(max_tokens=max_tokens))


def _serial(scheduler: Scheduler, engine: LoraEngine, request: GenerateRequest) -> list[float]:
    times: list[float] = []

    def generate() -> None:
        for _ in engine.generate(request):
            times.append(time.perf_counter())

    scheduler.call(generate).result()  # on the scheduler's thread, with nothing else scheduled
    return times


def _continuous(scheduler: Scheduler, request: GenerateRequest) -> list[float]:
    sink = TimedSink()
    scheduler.submit(request, sink)
    sink.done.wait()
    if sink.error is not None:
        raise sink.error
    return sink.arrivals


def _figures(rows: list[tuple[float, list[float], float]]) -> dict[str, float]:
    ttft = sorted(r[0] * 1e3 for r in rows)
    itl = sorted(g * 1e3 for r in rows for g in r[1])
    return {"ttft_p50": statistics.median(ttft), "ttft_p95": _pct(ttft, 95), "itl_p50": statistics.median(itl),
            "itl_p95": _pct(itl, 95), "tokens_per_s": statistics.median(r[2] for r in rows)}


def _pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]
