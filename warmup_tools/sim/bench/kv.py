"""``python -m warmup_tools bench kv``: TTFT with and without a warm KV prefix, through the ensemble.

For shared prefixes of 64, 256, 512 and 1024 tokens followed by a 16-token suffix, and for full
precision and INT8 KV storage, one run measures on the real server:

* cold: the first request with a new prefix (nothing cached);
* warm: a second request with the same prefix and another suffix (the prefix comes from the cache);
* limit: a request holding only a 16-token suffix, i.e. the time to prefill just the suffix plus the
  pipeline's fixed costs, which is the best a warm request can do.

Then, in process, the INT8 storage's accuracy against full precision (next-token agreement and logit
error on a fixed prompt set), and memory under a flood of unique prompts.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Sequence, TextIO

import torch

from warmup_tools.common.settings import arg
from warmup_tools.kv.config import KVCacheConfig
from warmup_tools.server.client import GenerateParams, StreamingClient
from warmup_tools.server.config import REPO_ROOT
from warmup_tools.server.process import TritonServer
from warmup_tools.sim.bench.support.params import LmThreads
from warmup_tools.sim.bench.support.text import make_text

if TYPE_CHECKING:
    from warmup_tools.lora_adapter.engine_api import GenerationStep
    from warmup_tools.lora_adapter.hf import HfEngine
    from warmup_tools.lora_adapter.requests import GenerateRequest
    from warmup_tools.lora_adapter.scheduler import Scheduler

LOGGER = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class KVBenchRow:
    storage: str
    prefix_tokens: int
    prompt_tokens: int
    cached_tokens: int
    cold_ms: float
    warm_ms: float
    limit_ms: float

    @property
    def warm_ratio(self) -> float:
        return self.warm_ms / self.cold_ms

    @property
    def limit_ratio(self) -> float:
        return self.limit_ms / self.cold_ms


def run_ttft(assets_dir: Path, *, prefixes: Sequence[int] = (64, 256, 512, 1024), suffix_tokens: int = 16,
             repeats: int = 7, storages: Sequence[str] = ("fp", "int8"), seed: int = 0, lm_threads: int = 0,
             out: TextIO = sys.stdout) -> list[KVBenchRow]:
    """Cold, warm and suffix-only TTFT per prefix length and storage (medians over ``repeats``)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(assets_dir / "lm")
    rows: list[KVBenchRow] = []
    for storage in storages:
        rng = random.Random(seed)
        env = {"WARMUP_ASSETS_DIR": str(assets_dir), "WARMUP_KV_STORAGE": storage, "WARMUP_CONTROL_DIR": "",
               "WARMUP_LM_THREADS": str(lm_threads)}
        with TritonServer(REPO_ROOT / "model_repository", env=env) as server:
            server.wait_ready(timeout=600)
            out.write(f"server ready ({storage} KV storage); measuring\n")
            out.flush()
            with StreamingClient(server.grpc_url) as client:
                params = GenerateParams(max_tokens=1, adapter_id="support")
                for _ in range(3):  # first requests pay one-off costs (allocations, lazy imports)
                    client.generate(make_text(tokenizer, 64, rng), params)
                for prefix_len in prefixes:
                    cold, warm, limit, cached, prompt = [], [], [], 0, 0
                    for _ in range(repeats):
                        prefix = make_text(tokenizer, prefix_len, rng)
                        first = client.generate(f"{prefix} {make_text(tokenizer, suffix_tokens, rng)}", params)
                        second = client.generate(f"{prefix} {make_text(tokenizer, suffix_tokens, rng)}", params)
                        alone = client.generate(make_text(tokenizer, suffix_tokens, rng), params)
                        cold.append(first.ttft_s)
                        warm.append(second.ttft_s)
                        limit.append(alone.ttft_s)
                        cached, prompt = second.cached_tokens, second.prompt_tokens
                    row = KVBenchRow(storage, prefix_len, prompt, cached, _ms(cold), _ms(warm), _ms(limit))
                    rows.append(row)
                    out.write(f"  prefix {prefix_len:5d}: cold {row.cold_ms:7.1f} ms  warm {row.warm_ms:6.1f} ms  "
                              f"suffix-only {row.limit_ms:6.1f} ms  (cached {cached}/{prompt})\n")
                    out.flush()
    return rows


def format_ttft_table(rows: Sequence[KVBenchRow]) -> str:
    lines = [
        "| KV storage | shared prefix | prompt tokens | cached tokens | cold TTFT ms | warm TTFT ms "
        "| suffix-only TTFT ms | warm / cold | limit (suffix-only / cold) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r.storage} | {r.prefix_tokens} | {r.prompt_tokens} | {r.cached_tokens} | {r.cold_ms:.1f} | "
                     f"{r.warm_ms:.1f} | {r.limit_ms:.1f} | {r.warm_ratio:.3f} | {r.limit_ratio:.3f} |")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True, slots=True)
class Int8Accuracy:
    prompts: int
    next_token_agreement: float
    greedy_16_agreement: float
    max_abs_logit_error: float
    mean_abs_logit_error: float
    logit_std: float


def run_int8_accuracy(assets_dir: Path, *, prompts: int = 32, prefix_tokens: int = 256, seed: int = 1) -> Int8Accuracy:
    """INT8 cached KV against full precision on a fixed prompt set: the last-token logits after a
    cached prefix, and the next 16 greedy tokens."""
    from warmup_tools.lora_adapter.hf import HfEngine
    from warmup_tools.lora_adapter.requests import GenerateRequest, SamplingParams
    from warmup_tools.lora_adapter.scheduler import Scheduler
    from warmup_tools.lora_adapter.settings import EngineConfig

    def engine(storage: str) -> HfEngine:
        return HfEngine(EngineConfig(base_model=assets_dir / "lm", adapter_root=assets_dir / "adapters",
                                     kv=KVCacheConfig(storage=storage)))

    fp, q8 = engine("fp"), engine("int8")
    rng = random.Random(seed)
    agree = greedy_agree = 0
    errors: list[float] = []
    max_err = 0.0
    stds: list[float] = []
    for i in range(prompts):
        adapter = ("support", "legal", "sql", None)[i % 4]
        prefix = make_text(fp.tokenizer, prefix_tokens, rng)
        warm_ids = tuple(fp.tokenizer.encode(prefix + " " + make_text(fp.tokenizer, 16, rng)))
        probe_ids = tuple(fp.tokenizer.encode(prefix + " " + make_text(fp.tokenizer, 16, rng)))
        results = []
        for eng in (fp, q8):
            scheduler = Scheduler(eng)
            _serve(scheduler, GenerateRequest(warm_ids, adapter, "bench", False, SamplingParams(max_tokens=1)))
            probe = GenerateRequest(probe_ids, adapter, "bench", False, SamplingParams(max_tokens=16))
            logits = _prompt_logits(eng, probe)
            steps = _serve(scheduler, probe)
            results.append((logits, [s.token_id for s in steps], steps[0].cached_tokens))
        (fp_logits, fp_tokens, _), (q_logits, q_tokens, q_cached) = results
        assert q_cached > 0, "the INT8 engine did not reuse the prefix"
        diff = (fp_logits - q_logits).abs()
        errors.append(float(diff.mean()))
        max_err = max(max_err, float(diff.max()))
        stds.append(float(fp_logits.std()))
        agree += int(torch.argmax(fp_logits) == torch.argmax(q_logits))
        greedy_agree += int(fp_tokens == q_tokens)
    return Int8Accuracy(prompts, agree / prompts, greedy_agree / prompts, max_err,
                        statistics.fmean(errors), statistics.fmean(stds))


@dataclasses.dataclass(frozen=True, slots=True)
class FloodResult:
    prompts: int
    budget_bytes: int
    peak_bytes: int
    blocks: int
    evictions: int
    rss_growth_mb: float
    seconds: float


def run_flood(assets_dir: Path, *, prompts: int = 10_000, prompt_tokens: int = 40,
              budget_bytes: int = 16 << 20, seed: int = 2) -> FloodResult:
    """Unique prompts through one engine with a small KV budget: the cache never exceeds it."""
    from warmup_tools.lora_adapter.engines import make_engine
    from warmup_tools.lora_adapter.requests import GenerateRequest, SamplingParams
    from warmup_tools.lora_adapter.scheduler import Scheduler
    from warmup_tools.lora_adapter.settings import EngineConfig

    eng = make_engine(EngineConfig(base_model=assets_dir / "lm", adapter_root=assets_dir / "adapters",
                                  kv=KVCacheConfig(budget_bytes=budget_bytes)))
    scheduler = Scheduler(eng)
    rng = random.Random(seed)
    vocab = eng.vocab_size
    peak = 0
    start = time.perf_counter()
    rss_start = _rss_mb()
    for i in range(prompts):
        ids = tuple(rng.randrange(4, vocab) for _ in range(prompt_tokens))
        _serve(scheduler, GenerateRequest(ids, ("support", "legal", "sql", None)[i % 4], f"t{i % 7}", False,
                                          SamplingParams(max_tokens=1)))
        peak = max(peak, eng.prefix_cache.stats.bytes_used)
    stats = eng.prefix_cache.stats
    return FloodResult(prompts, budget_bytes, peak, stats.blocks, stats.evictions, _rss_mb() - rss_start,
                       time.perf_counter() - start)


def run(assets_dir: Path, *, repeats: Annotated[int, arg("TTFT samples per prefix length (the median is shown)")] = 7,
        flood: Annotated[int, arg("unique prompts for the memory check (0: skip)")] = 10_000,
        lm_threads: LmThreads = 1,
        out: TextIO = sys.stdout) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    rows = run_ttft(assets_dir, repeats=repeats, lm_threads=lm_threads, out=out)
    threads = lm_threads or "torch default"
    out.write("\nTTFT through the ensemble (gRPC streaming, medians of "
              f"{repeats}; warm = same prefix, new 16-token suffix; LM threads: {threads}):\n\n"
              f"{format_ttft_table(rows)}\n")
    out.flush()
    acc = run_int8_accuracy(assets_dir)
    out.write(f"\nINT8 KV storage vs full precision ({acc.prompts} prompts, 256-token cached prefix): "
              f"next-token agreement {acc.next_token_agreement:.3f}, 16-token greedy continuation identical "
              f"{acc.greedy_16_agreement:.3f}, logit error mean {acc.mean_abs_logit_error:.4f} / max "
              f"{acc.max_abs_logit_error:.4f} (logit std {acc.logit_std:.3f})\n")
    out.flush()
    if flood:
        res = run_flood(assets_dir, prompts=flood)
        out.write(f"\nFlood: {res.prompts} unique prompts, KV budget {res.budget_bytes / 2**20:.1f} MiB: peak "
                  f"{res.peak_bytes / 2**20:.2f} MiB ({'within' if res.peak_bytes <= res.budget_bytes else 'OVER'} "
                  f"budget), {res.blocks} blocks held, {res.evictions} evictions, process RSS "
                  f"{res.rss_growth_mb:+.1f} MB, {res.seconds:.0f} s\n")


class _Collect:
    """A sequence sink that keeps a request's steps (the scheduler is stepped on the caller's thread)."""

    def __init__(self) -> None:
        self.steps: list[GenerationStep] = []
        self.error: BaseException | None = None

    def send(self, step: GenerationStep) -> None:
        self.steps.append(step)

    def fail(self, error: BaseException) -> None:
        self.error = error

    def is_cancelled(self) -> bool:
        return False


def _serve(scheduler: Scheduler, request: GenerateRequest) -> list[GenerationStep]:
    """Serve one request through the scheduler, stepped here until it ends: its steps."""
    sink = _Collect()
    scheduler.submit(request, sink)
    while scheduler.has_work():
        scheduler.step()
    if sink.error is not None:
        raise sink.error
    return sink.steps


def _prompt_logits(engine: HfEngine, request: GenerateRequest) -> torch.Tensor:
    """The logits after the prompt's last token, its longest cached prefix loaded from the prefix cache as the
    scheduler loads it (nothing is stored)."""
    from warmup_tools.lora_adapter.runner import BatchRow

    cache = engine.prefix_cache
    hashes, _ = engine.block_hashes(request)
    match = cache.match(hashes[: (len(request.prompt_ids) - 1) // cache.block_size], request.tenant)
    try:
        cached = match.num_tokens
        past = cache.load(match, engine.dtype) if cached else None
        row = BatchRow(request.prompt_ids[cached:], cached, past, request.adapter)
        return engine.forward_batch([row])[0].logits.float().clone()
    finally:
        cache.release(match)
        engine.forget_batches()


def _ms(values: Sequence[float]) -> float:
    return statistics.median(values) * 1000.0


def _rss_mb() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * resource.getpagesize() / 2**20
