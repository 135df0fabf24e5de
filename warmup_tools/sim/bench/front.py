"""``python -m warmup_tools bench front``: what the OpenAI front adds, and what a client that goes away costs.

One run starts the real server and, in turn, two fronts beside it (``python -m warmup_tools front``, each in its
own process), one per ``pipeline`` (``composing``: the three models
in turn, a stream to ``lora_adapter`` last; ``ensemble``: one gRPC stream to the ensemble). For each, it first
sends the same streamed request (a warm demo prompt, adapter support, ``max_tokens`` 32) through the front's
``/v1/completions`` and through Triton's ``/v2/models/ensemble/generate_stream``, ``requests`` each way, in
blocks of 1 or 8 concurrent requests that alternate between the two (the machine is shared: alternating
keeps a load change from landing on one side), and prints each side's TTFT p50 and output tokens/s. Then it
abandons ``disconnects`` streamed chat completions (``max_tokens`` 200, adapter support) at their first token
by closing the HTTP connection, and measures: how long the running-sequences gauge takes to drop to 0 after
the close (read every 10 ms, for at most 2 s; the figure includes one scrape), the TTFT of the next request,
sent at once (beside the abandoned stream if it still runs), against the same request with no abandoned
stream (sent, with the instance idle, just before each abandon: the two alternate), and how many tokens the
abandoned stream generated after the close. Before each abandon the instance is idle (the gauge at 0).
Figures: docs/benchmarks.md.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any, TextIO

from warmup_tools.common.settings import arg
from warmup_tools.demo.prompts import SYSTEM_PROMPTS
from warmup_tools.front.settings import PIPELINES
from warmup_tools.server.client import metric_sum, scrape_metrics
from warmup_tools.server.config import REPO_ROOT
from warmup_tools.server.process import TritonServer, free_port_block
from warmup_tools.sim.bench.support.latency import pct
from warmup_tools.sim.bench.support.params import LmThreads, MaxTokens
from warmup_tools.sim.bench.support.servers import front_process

ABANDONED_MAX_TOKENS = 200
#: Longest wait for an abandoned stream to leave the batch (an ensemble stream runs to its max_tokens).
DRAIN_S = 120.0
#: How long the gauge is watched after the close before the next request is sent anyway.
DROP_WAIT_S = 2.0


def run(assets_dir: Path, *, disconnects: Annotated[int, arg("streams abandoned at their first token, per pipeline "
                                                    "(0: skip)")] = 11,
        requests: Annotated[int, arg("requests each way per level for the front's added TTFT and tokens/s (0: "
                                     "skip)")] = 40,
        max_tokens: MaxTokens = 32,
        lm_threads: LmThreads = 1,
        out: TextIO = sys.stdout) -> dict:
    import httpx

    env = {"WARMUP_ASSETS_DIR": str(assets_dir), "WARMUP_CONTROL_DIR": "", "WARMUP_LM_THREADS": str(lm_threads)}
    figures: dict[str, dict[str, float]] = {}
    with TritonServer(REPO_ROOT / "model_repository", env=env) as server:
        server.wait_ready(timeout=600)

        def gauges() -> tuple[float, float]:
            samples = scrape_metrics(server.metrics_url)
            return (metric_sum(samples, "warmup_scheduler_running_sequences"),
                    metric_sum(samples, "warmup_output_tokens_total"))

        def wait_idle() -> None:
            end = time.monotonic() + DRAIN_S
            while gauges()[0] > 0 and time.monotonic() < end:
                time.sleep(0.05)

        for pipeline in PIPELINES:
            # NOTE: the composing front also serves smg's gRPC worker protocol (the support adapter's listener): its
            # added TTFT is measured in the same interleaved blocks.
            grpc_port = free_port_block("127.0.0.1", GRPC_SLOTS) if pipeline == "composing" else 0
            with front_process(server, assets_dir, pipeline, grpc_worker_port=grpc_port) as front, \
                    httpx.Client(base_url=front.url, timeout=300) as client:
                _next_ttft(client)  # one-off costs
                grpc_target = _grpc_target(front.url, assets_dir) if grpc_port else None
                if requests:
                    for streams in (1, 8):
                        figures[f"{pipeline}-c{streams}"] = cost = _added_cost(front.url, server.http_url, streams,
                                                                               requests, max_tokens, grpc_target)
                        added = cost["front_ttft"] - cost["generate_ttft"]
                        ratio = (cost["front_tps"] / cost["generate_tps"] - 1) * 100
                        grpc = (f"; gRPC worker (VllmEngine.Generate, token ids) TTFT p50 {cost['grpc_ttft']:.1f} ms "
                                f"(added {cost['grpc_ttft'] - cost['generate_ttft']:+.1f} ms), tokens/s "
                                f"{cost['grpc_tps']:.1f}" if grpc_target else "")
                        out.write(f"pipeline {pipeline}, {streams} stream(s), {requests} requests each way, "
                                  f"interleaved: TTFT p50 front {cost['front_ttft']:.1f} ms, generate_stream "
                                  f"{cost['generate_ttft']:.1f} ms (added {added:+.1f} ms); tokens/s front "
                                  f"{cost['front_tps']:.1f}, generate_stream {cost['generate_tps']:.1f} "
                                  f"({ratio:+.1f}%){grpc}\n")
                        out.flush()
                if not disconnects:
                    continue
                baseline, drops, after, ttfts, still = [], [], [], [], 0
                for i in range(disconnects):
                    wait_idle()
                    baseline.append(_next_ttft(client))  # undisturbed, next to each disturbed one (the machine drifts)
                    wait_idle()
                    closed_at, tokens_at_close = _abandon(front.url, i, gauges)
                    while gauges()[0] > 0 and time.monotonic() - closed_at < DROP_WAIT_S:
                        time.sleep(0.01)
                    if gauges()[0] > 0:
                        still += 1
                    else:
                        drops.append((time.monotonic() - closed_at) * 1000)
                    ttfts.append(_next_ttft(client))  # at once: beside the abandoned stream if it still runs
                    wait_idle()
                    after.append(gauges()[1] - tokens_at_close - 1)  # less the next request's one token
                figures[pipeline] = {"still_running": still, "drop_ms_p50": pct(drops, 0.5) if drops else None,
                                     "drop_ms_max": max(drops, default=None),
                                     "tokens_after_p50": pct(after, 0.5), "ttft_ms_p50": pct(ttfts, 0.5),
                                     "baseline_ttft_ms_p50": pct(baseline, 0.5)}
                f = figures[pipeline]
                dropped = (f"running gauge at 0 after {f['drop_ms_p50']:.0f} ms (p50; max {f['drop_ms_max']:.0f} ms)"
                           if drops else "")
                out.write(f"pipeline {pipeline}: {disconnects} streams abandoned at their first token: {dropped}"
                          f"{'; ' if drops and still else ''}"
                          f"{f'{still} still running {DROP_WAIT_S:g} s after the close' if still else ''}; "
                          f"{f['tokens_after_p50']:.0f} tokens generated after the close (p50); next request's TTFT "
                          f"{f['ttft_ms_p50']:.1f} ms against {f['baseline_ttft_ms_p50']:.1f} ms undisturbed "
                          f"({(f['ttft_ms_p50'] / f['baseline_ttft_ms_p50'] - 1) * 100:+.1f}%)\n")
                out.flush()
    return figures


def _chat(adapter: str, question: str, max_tokens: int) -> dict:
    return {"model": adapter, "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": SYSTEM_PROMPTS[adapter]},
                         {"role": "user", "content": question}]}


def _first_token(lines) -> None:
    for line in lines:
        if line.startswith("data: {"):
            delta = json.loads(line[6:])["choices"][0]["delta"]
            if delta.get("content"):
                return


def _next_ttft(client) -> float:
    """TTFT in ms of one streamed chat completion (support's warm system prompt, one token)."""
    started = time.perf_counter()
    with client.stream("POST", "/v1/chat/completions", json=_chat("support", "where is my order?", 1)) as response:
        lines = response.iter_lines()
        _first_token(lines)
        ttft = (time.perf_counter() - started) * 1000
        for _ in lines:
            pass
    return ttft


def _abandon(url: str, i: int, gauges) -> tuple[float, float]:
    """Open a long stream, read its first token, close the connection; the close time and the token count then."""
    import httpx

    with httpx.Client(base_url=url, timeout=300) as client:
        # NOTE: the same adapter as the next request, so its TTFT pays no adapter switch either way.
        body = _chat("support", f"Explain every step of ticket {i} in detail.", ABANDONED_MAX_TOKENS)
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            _first_token(response.iter_lines())
            tokens = gauges()[1]
    return time.monotonic(), tokens


#: gRPC worker listeners the bench's front may open (the base model and the demo's adapters).
GRPC_SLOTS = 8


def _grpc_target(front_url: str, assets_dir: Path) -> tuple[str, Any]:
    """The support adapter's gRPC worker listener (from the front's /grpc-workers) and the LM tokenizer, which gives
    the same token ids tokenizer_cache would (what smg sends a worker)."""
    import httpx
    from transformers import AutoTokenizer

    workers = httpx.get(f"{front_url}/grpc-workers", timeout=10).json()["workers"]
    port = next(w["port"] for w in workers if w["model"] == "support")
    return f"127.0.0.1:{port}", AutoTokenizer.from_pretrained(str(assets_dir / "lm"))


def _added_cost(front_url: str, triton_http: str, streams: int, requests: int, max_tokens: int,
                grpc_target: tuple[str, Any] | None = None) -> dict[str, float]:
    """The same streamed request (a warm demo prompt, adapter support, ``max_tokens``) through the front's
    /v1/completions and through Triton's /v2/models/ensemble/generate_stream (and, with ``grpc_target``, through the
    front's gRPC worker listener of adapter support, as smg calls it: token ids), in blocks of ``streams``
    concurrent requests that alternate between the ways; TTFT p50 and output tokens/s (the server's counts over
    each block's wall time) of each."""
    import concurrent.futures

    import httpx

    from warmup_tools.demo.prompts import USER_QUESTIONS, demo_prompt

    prompts = [demo_prompt("support", q) for q in USER_QUESTIONS["support"]]

    def timed_stream(client: httpx.Client, url: str, body: dict, text_of, tokens_of) -> tuple[float, int]:
        """One streamed request read as server-sent events: ms to the first event with text, and the output
        tokens the events report (the largest count seen)."""
        started, ttft, tokens = time.perf_counter(), None, 0
        with client.stream("POST", url, json=body) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                data = json.loads(line[6:])
                if ttft is None and text_of(data):
                    ttft = time.perf_counter() - started
                tokens = max(tokens, tokens_of(data))
        return (ttft or 0.0) * 1000, tokens

    def front_one(client: httpx.Client, prompt: str) -> tuple[float, int]:
        body = {"model": "support", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                "stream_options": {"include_usage": True}}
        return timed_stream(client, f"{front_url}/v1/completions", body,
                            lambda data: data["choices"] and data["choices"][0]["text"],
                            lambda data: (data.get("usage") or {}).get("completion_tokens", 0))

    def generate_one(client: httpx.Client, prompt: str) -> tuple[float, int]:
        body = {"text_input": prompt, "max_tokens": max_tokens, "stream": True, "adapter_id": "support"}
        return timed_stream(client, f"http://{triton_http}/v2/models/ensemble/generate_stream", body,
                            lambda data: data.get("text_output"), lambda data: int(data.get("output_tokens", 0)))

    ways = [("front", front_one), ("generate", generate_one)]
    channel = None
    if grpc_target is not None:
        import grpc
        from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

        channel = grpc.insecure_channel(grpc_target[0])
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        token_ids = {prompt: grpc_target[1].encode(prompt, add_special_tokens=True) for prompt in prompts}
        counter = iter(range(1 << 30))

        def grpc_one(_client: httpx.Client, prompt: str) -> tuple[float, int]:
            request = vllm_engine_pb2.GenerateRequest(
                request_id=f"bench-{next(counter)}", stream=True,
                tokenized=vllm_engine_pb2.TokenizedInput(input_ids=token_ids[prompt]),
                sampling_params=vllm_engine_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens))
            started, ttft, produced = time.perf_counter(), None, 0
            for response in stub.Generate(request, timeout=300):
                if response.HasField("chunk") and response.chunk.token_ids:
                    ttft = ttft if ttft is not None else time.perf_counter() - started
                    produced = max(produced, response.chunk.completion_tokens)
                elif response.HasField("complete"):
                    produced = max(produced, response.complete.completion_tokens)
            return (ttft or 0.0) * 1000, produced

        ways.append(("grpc", grpc_one))
    ttfts: dict[str, list[float]] = {way: [] for way, _ in ways}
    tokens = {way: 0 for way, _ in ways}
    seconds = {way: 0.0 for way, _ in ways}
    clients = [httpx.Client(timeout=300) for _ in range(streams)]
    try:
        with concurrent.futures.ThreadPoolExecutor(streams) as pool:
            for block in range(max(1, requests // streams)):
                # NOTE: the ways take turns in a rotating order, so that no way always follows the same one.
                shift = block % len(ways)
                for way, one in ways[shift:] + ways[:shift]:
                    started = time.perf_counter()
                    results = list(pool.map(one, clients, [prompts[(block + i) % len(prompts)]
                                                           for i in range(streams)]))
                    seconds[way] += time.perf_counter() - started
                    ttfts[way] += [r[0] for r in results]
                    tokens[way] += sum(r[1] for r in results)
    finally:
        for client in clients:
            client.close()
        if channel is not None:
            channel.close()
    return {f"{way}_{kind}": value for way, _ in ways
            for kind, value in (("ttft", pct(ttfts[way], 0.5)), ("tps", tokens[way] / seconds[way]))}

