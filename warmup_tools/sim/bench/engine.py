"""``python -m warmup_tools bench engine``: the continuous-batching scheduler alone, in process.

What ``bench concurrency`` measures, without Triton, the ensemble's other two models or a network client: one engine
(:func:`~warmup_tools.lora_adapter.engines.make_engine`) and its :class:`Scheduler` (what one ``lora_adapter`` instance
runs) on the chosen device and dtype. Each stream is a thread that submits its requests back to back (the same scopes,
warm system prompts and questions as ``bench concurrency``, ``max_tokens`` 32; all streams start together), for 1, 4, 8
and 16 streams in one run; per level output tokens/s, TTFT and inter-token latency p50/p95/p99, then 8 streams against 1
against the concurrency targets.

It separates the engine's share of the latencies from the pipeline's, and it is what
``scripts/gpu_bench.sh`` runs on a GPU machine: it needs torch, transformers and peft, no tritonserver.
``python -m warmup_tools.sim.bench.engine --assets-dir DIR`` runs it without the CLI (on a GPU machine that has only
torch, transformers and peft); its flags there are those of ``bench engine``, derived from :func:`run`'s signature.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, Sequence, TextIO

from warmup_tools.common.flags import add_arguments, add_settings, function_kwargs, settings_from_args
from warmup_tools.common.settings import arg
from warmup_tools.demo.prompts import SYSTEM_PROMPTS
from warmup_tools.kv.config import KVCacheConfig
from warmup_tools.lora_adapter.engine_api import GenerationStep, TextEncoder
from warmup_tools.lora_adapter.engines import make_engine
from warmup_tools.lora_adapter.requests import GenerateRequest, SamplingParams
from warmup_tools.lora_adapter.scheduler import Scheduler
from warmup_tools.lora_adapter.settings import DEFAULT_BATCHING, EngineConfig
from warmup_tools.server.config import ServeConfig
from warmup_tools.sim.bench.support.latency import (
    SCOPES,
    LevelResult,
    Sample,
    format_ratios,
    format_row,
    run_streams,
    stream_prompt,
)
from warmup_tools.sim.bench.support.params import LmThreads, MaxNumSeqs, MaxTokens


def run(assets_dir: Path, *, levels: Annotated[Sequence[int], arg("comma-separated stream counts")] = (1, 4, 8, 16),
        rounds: Annotated[int, arg("requests each stream sends back to back (at least)")] = 6,
        min_requests: Annotated[int, arg("requests per level (at least)")] = 24,
        max_tokens: MaxTokens = 32,
        max_num_seqs: MaxNumSeqs = 16,
        device: Annotated[str, arg("auto (the first CUDA device, else CPU), cpu, cuda, cuda:1")] = "auto",
        dtype: Annotated[str, arg("auto, float32, float16 or bfloat16")] = "auto",
        lm_threads: LmThreads = 1,
        out: TextIO = sys.stdout) -> list[LevelResult]:
    """Measure each level on one engine; prints a table and the 8-vs-1 ratios."""
    assets_dir = Path(assets_dir)
    engine = make_engine(EngineConfig(base_model=assets_dir / "lm", adapter_root=assets_dir / "adapters",
                                     device=device, dtype=dtype, num_threads=lm_threads,
                                     kv=KVCacheConfig()))
    config = dataclasses.replace(DEFAULT_BATCHING, max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=max(DEFAULT_BATCHING.max_num_batched_tokens, max_num_seqs))
    scheduler = Scheduler(engine, config)
    scheduler.start()
    try:
        for adapter, scope in SCOPES:  # what the model_warmup samples pre-fill
            scheduler.submit_warm(adapter, engine.encode(SYSTEM_PROMPTS[scope])).result(timeout=600)
        out.write(f"engine on {engine.device} ({engine.dtype}), max_num_seqs {max_num_seqs}, "
                  f"lm threads {lm_threads}; at least {rounds} requests per stream and {min_requests} per level, "
                  f"max_tokens {max_tokens}\n")
        _level(engine, scheduler, len(SCOPES), 1, 2)  # one-off costs: the first live request of each scope
        results = []
        for streams in levels:
            result = _level(engine, scheduler, streams, max(rounds, -(-min_requests // streams)), max_tokens)
            results.append(result)
            out.write(format_row(result) + "\n")
            out.flush()
        out.write(format_ratios(results) + "\n")
        return results
    finally:
        scheduler.stop()


class TimedSink:
    """A sequence sink that records when each token arrives."""

    def __init__(self) -> None:
        self.arrivals: list[float] = []
        self.error: BaseException | None = None
        self.done = threading.Event()

    def send(self, step: GenerationStep) -> None:
        self.arrivals.append(time.perf_counter())
        if step.finished:
            self.done.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.done.set()

    def is_cancelled(self) -> bool:
        return False


def _level(engine: TextEncoder, scheduler: Scheduler, streams: int, rounds: int, max_tokens: int) -> LevelResult:
    def request(index: int, i: int) -> Sample:
        adapter, prompt = stream_prompt(index, i)
        sink = TimedSink()
        submitted = time.perf_counter()
        scheduler.submit(GenerateRequest(engine.encode(prompt), adapter, "bench", True,
                                         SamplingParams(max_tokens=max_tokens)), sink)
        if not sink.done.wait(600):
            raise TimeoutError("no last token within 600 s")
        if sink.error is not None:
            raise sink.error
        return Sample.from_arrivals(submitted, sink.arrivals)

    # In process a stream needs no connection.
    return run_streams(streams, rounds, lambda index: contextlib.nullcontext(lambda i: request(index, i)))


def command_line() -> argparse.ArgumentParser:
    """``bench engine``'s flags without the CLI's other commands: ``--assets-dir`` (ServeConfig's) and :func:`run`'s."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_settings(parser, ServeConfig, only=("assets_dir",), file=False)
    add_arguments(parser, run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = command_line().parse_args(argv)
    run(settings_from_args(ServeConfig, args, only=("assets_dir",)).assets_dir, **function_kwargs(run, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
