"""``python -m warmup_tools bench concurrency``: throughput and latency as concurrent streams grow.

One run starts the real server on the model repository and, for 1, 4, 8 and 16 concurrent streams,
has each stream (its own gRPC connection to ``ensemble``, streaming) send ``rounds`` requests back to
back (more at low levels, so that every level has at least ``min_requests`` samples): scopes support,
legal, sql and the base model in turn, each a warm system prompt (pre-filled by
the model_warmup samples; the base model's after its first request) followed by a distinct question,
``max_tokens`` 32. Per level it prints output tokens/s (all streams' output tokens over the level's
wall time), time to first token and inter-token latency (p50/p95/p99, client side), and errors; then
8 streams against 1 against the concurrency targets (tokens/s >= 3.0x, TTFT p95 <= 3x, ITL p95 <= 2.5x).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, Callable, Iterator, Sequence, TextIO

from warmup_tools.common.settings import arg
from warmup_tools.demo.prompts import demo_prompt
from warmup_tools.server.client import GenerateError, GenerateParams, GenerateResult, StreamingClient, grpc_inputs
from warmup_tools.server.config import REPO_ROOT
from warmup_tools.server.process import TritonServer
from warmup_tools.sim.bench.support.latency import (
    SCOPES,
    LevelResult,
    Sample,
    format_ratios,
    format_row,
    level_result,
    pct,
    run_streams,
    stream_prompt,
)
from warmup_tools.sim.bench.support.params import LmThreads, MaxNumSeqs, MaxTokens


def run(assets_dir: Path, *, levels: Annotated[Sequence[int], arg("comma-separated stream counts")] = (1, 4, 8, 16),
        rounds: Annotated[int, arg("requests each stream sends back to back (at least)")] = 6,
        min_requests: Annotated[int, arg("requests per level (at least)")] = 24,
        max_tokens: MaxTokens = 32,
        max_num_seqs: MaxNumSeqs = 16,
        lm_threads: LmThreads = 1,
        disconnects: Annotated[int, arg("abandoned streams per transport before measuring the next request's "
                                        "TTFT (0: skip)")] = 7,
        rates: Annotated[Sequence[float], arg("open-loop levels after the streams: Poisson arrivals at each rate "
                                              "(requests/s), comma-separated")] = (),
        out: TextIO = sys.stdout) -> list[LevelResult]:
    """Measure each concurrency level on one server; prints a table and the 8-vs-1 ratios. ``rates``:
    open-loop levels after those, requests arriving as a Poisson process at each rate (requests/s)."""
    env = {"WARMUP_ASSETS_DIR": str(assets_dir), "WARMUP_CONTROL_DIR": "", "WARMUP_LM_THREADS": str(lm_threads),
           "WARMUP_MAX_NUM_SEQS": str(max_num_seqs)}
    results: list[LevelResult] = []
    with TritonServer(REPO_ROOT / "model_repository", env=env) as server:
        server.wait_ready(timeout=600)
        out.write(f"server ready (max_num_seqs {max_num_seqs}, lm threads {lm_threads}); "
                  f"at least {rounds} requests per stream and {min_requests} per level, max_tokens {max_tokens}\n")
        out.flush()
        with StreamingClient(server.grpc_url) as client:  # one-off costs, and the base model's prefix
            for adapter, scope in SCOPES:
                client.generate(demo_prompt(scope, "warm-up"), GenerateParams(max_tokens=2, adapter_id=adapter))
        for streams in levels:
            result = _level(server.grpc_url, streams, max(rounds, -(-min_requests // streams)), max_tokens)
            results.append(result)
            out.write(format_row(result) + "\n")
            out.flush()
            for message in result.error_messages[:3]:
                out.write(f"    error: {message}\n")
        for rate in rates:
            result = _open_level(server.grpc_url, rate, max(min_requests, 4 * max_num_seqs), max_tokens)
            out.write(format_row(result, f"Poisson {rate:g}/s") + "\n")
            out.flush()
        if disconnects:
            out.write(measure_disconnects(server, assets_dir, disconnects) + "\n")
    out.write(format_ratios(results) + "\n")
    return results


#: Output tokens asked for by an abandoned stream (long enough to outlast the next request many times).
ABANDONED_MAX_TOKENS = 200


def measure_disconnects(server: TritonServer, assets_dir: Path, count: int) -> str:
    """The next request's TTFT after a client abandons a long stream at its first token, against no
    abandoned stream: a gRPC stream to ``lora_adapter`` itself cancelled, a gRPC stream to ``ensemble``
    cancelled, an HTTP ``generate_stream`` connection to ``ensemble`` closed. Before each abandon the
    instance is idle again (the running-sequences gauge at 0), so each figure has one abandoned stream;
    after each next request it counts whether the abandoned sequence was still running."""
    import numpy as np
    import requests
    import tritonclient.grpc as grpcclient
    from transformers import AutoTokenizer

    from warmup_tools.server.client import metric_sum, scrape_metrics

    probe = demo_prompt("support", "where is my order?")
    tokenizer = AutoTokenizer.from_pretrained(assets_dir / "lm")
    long_params = GenerateParams(max_tokens=ABANDONED_MAX_TOKENS, adapter_id="legal")

    def running() -> float:
        return metric_sum(scrape_metrics(server.metrics_url), "warmup_scheduler_running_sequences")

    def wait_idle(deadline_s: float = 300.0) -> None:
        end = time.monotonic() + deadline_s
        while running() > 0:
            if time.monotonic() > end:
                raise RuntimeError(f"lora_adapter still runs sequences after {deadline_s:.0f} s")
            time.sleep(0.05)

    def next_ttft() -> float:
        with StreamingClient(server.grpc_url) as client:
            return client.generate(probe, GenerateParams(max_tokens=1, adapter_id="support")).ttft_s * 1000

    def grpc_abandon(model: str, inputs: list) -> None:
        first = threading.Event()
        client = grpcclient.InferenceServerClient(server.grpc_url)
        client.start_stream(callback=lambda result, error: first.set())
        client.async_stream_infer(model, inputs)
        first.wait(120)
        client.stop_stream(cancel_requests=True)
        client.close()

    def direct(i: int) -> None:
        ids = np.array(tokenizer.encode(f"Tell me a long story, part {i}."), dtype=np.int32)
        tensors = [("input_ids", ids, "INT32"),
                   ("max_tokens", np.array([ABANDONED_MAX_TOKENS], dtype=np.int32), "INT32"),
                   ("stream", np.array([True]), "BOOL"),
                   ("adapter_id", np.array([b"legal"], dtype=np.object_), "BYTES")]
        inputs = []
        for name, array, dtype in tensors:
            tensor = grpcclient.InferInput(name, list(array.shape), dtype)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        grpc_abandon("lora_adapter", inputs)

    def ensemble_grpc(i: int) -> None:
        grpc_abandon("ensemble", grpc_inputs(f"Tell me a long story, part {i}.", long_params, True))

    def ensemble_http(i: int) -> None:
        body = {"text_input": f"Another long story, part {i}.", "max_tokens": ABANDONED_MAX_TOKENS, "stream": True,
                "adapter_id": "legal"}
        with requests.post(f"http://{server.http_url}/v2/models/ensemble/generate_stream", json=body, stream=True,
                           timeout=120) as response:
            next(line for line in response.iter_lines() if line)

    wait_idle()
    baseline = [next_ttft() for _ in range(count)]
    parts = [f"next request's TTFT, median of {count}: no abandoned stream {pct(baseline, 0.5):.1f} ms"]
    for label, abandon in (("gRPC stream to lora_adapter cancelled", direct),
                           ("gRPC stream to ensemble cancelled", ensemble_grpc),
                           ("HTTP generate_stream to ensemble closed", ensemble_http)):
        ttfts, still_running = [], 0
        for i in range(count):
            wait_idle()
            abandon(i)
            ttfts.append(next_ttft())
            still_running += running() > 0
        parts.append(f"after a {label} at its first token {pct(ttfts, 0.5):.1f} ms (max {max(ttfts):.0f} ms; "
                     f"abandoned sequence still running afterwards: {still_running} of {count})")
    wait_idle()
    return ";\n  ".join(parts)


def _sample(result: GenerateResult) -> Sample:
    """A request's sample as the client saw it (its server-side output token count)."""
    gaps = [(b - a) * 1000 for a, b in zip(result.arrivals_s, result.arrivals_s[1:])]
    return Sample(result.ttft_s * 1000, gaps, result.output_tokens)


def _open_level(url: str, rate: float, count: int, max_tokens: int, seed: int = 0) -> LevelResult:
    """``count`` requests arriving as a Poisson process of ``rate`` per second (open loop: an arrival does
    not wait for earlier requests), each on a free connection of a pool opened beforehand."""
    import concurrent.futures
    import queue
    import random

    rng = random.Random(seed)
    gaps = [rng.expovariate(rate) for _ in range(count)]
    lock = threading.Lock()
    samples: list[Sample] = []
    errors: list[str] = []
    pool: queue.Queue[StreamingClient] = queue.Queue()
    opened = [StreamingClient(url, timeout_s=600) for _ in range(16)]
    for client in opened:
        pool.put(client)

    def one(i: int) -> None:
        try:
            client = pool.get_nowait()
        except queue.Empty:  # more requests in flight than connections: open one more
            client = StreamingClient(url, timeout_s=600)
            with lock:
                opened.append(client)
        adapter, prompt = stream_prompt(1000 + i, 0)
        try:
            result = client.generate(prompt, GenerateParams(max_tokens=max_tokens, adapter_id=adapter))
        except GenerateError as exc:
            with lock:
                errors.append(str(exc))
            return
        finally:
            pool.put(client)
        with lock:
            samples.append(_sample(result))

    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="arrival") as executor:
            began = due = time.perf_counter()
            futures = []
            for i, gap in enumerate(gaps):
                due += gap
                time.sleep(max(0.0, due - time.perf_counter()))
                futures.append(executor.submit(one, i))
            concurrent.futures.wait(futures)
        wall = time.perf_counter() - began
    finally:
        for client in opened:
            client.close()
    return level_result(0, count, samples, errors, wall)


def _level(url: str, streams: int, rounds: int, max_tokens: int) -> LevelResult:
    @contextlib.contextmanager
    def open_stream(index: int) -> Iterator[Callable[[int], Sample]]:
        with StreamingClient(url, timeout_s=600) as client:  # one gRPC connection per stream
            def request(i: int) -> Sample:
                adapter, prompt = stream_prompt(index, i)
                return _sample(client.generate(prompt, GenerateParams(max_tokens=max_tokens, adapter_id=adapter)))

            yield request

    return run_streams(streams, rounds, open_stream)
