"""Where the OpenAI front's added TTFT goes: ``python scripts/front_floor.py [ROUNDS]``.

One tritonserver (the demo repository and assets, one LM thread) and the front beside it, once per pipeline
(``python -m warmup_tools front``, each in its own process). Each round sends, one at a time and in an order
that alternates between rounds (so both ends of a round see the same machine load):

* ``front``: a streamed ``/v1/completions`` of a warm demo prompt (adapter ``support``, one token) through each
  front, to its first token;
* ``generate_stream``: the same request on tritonserver's ``/v2/models/ensemble/generate_stream`` (its C++ HTTP
  server), from the same Python HTTP client (httpx);
* ``grpc``: the same request as one ``grpc.aio`` stream to ``ensemble`` from this process (Python's gRPC
  client, as the front makes it): what the front's transport costs before any work of its own;
* ``front /v1/models/base`` and ``tritonserver /v2/health/ready``: a GET each that reads only state the server
  holds (the front's model list is refreshed in the background; its ``/health`` re-reads readiness), what an HTTP
  server costs before any work.

It prints each one's TTFT (or response time) p25 and p50 in ms, and each front's p50 less generate_stream's; then
the front's CPU time per streamed request (its process's user and system time over ``ROUNDS`` more requests; one
token each, so the figure is what a request costs the front beyond its tokens).
Figures: docs/benchmarks.md ("The OpenAI front").
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import grpc
import httpx
import numpy as np
from tritonclient.grpc import service_pb2_grpc

from warmup_tools.demo.assets import ensure_demo_assets
from warmup_tools.demo.prompts import demo_prompt
from warmup_tools.front.engine.protocol import infer_request
from warmup_tools.front.settings import PIPELINES
from warmup_tools.server.config import REPO_ROOT
from warmup_tools.server.process import TritonServer
from warmup_tools.sim.bench.support.servers import front_process

PROMPT = demo_prompt("support", "where is my order?")


def first_event_ms(client: httpx.Client, url: str, body: dict, has_text) -> float:
    started, ttft = time.perf_counter(), None
    with client.stream("POST", url, json=body) as response:
        for line in response.iter_lines():
            if ttft is None and line.startswith("data: {") and has_text(json.loads(line[6:])):
                ttft = (time.perf_counter() - started) * 1000
    assert ttft is not None, f"no text from {url}"
    return ttft


def get_ms(client: httpx.Client, url: str) -> float:
    started = time.perf_counter()
    client.get(url).raise_for_status()
    return (time.perf_counter() - started) * 1000


class GrpcEnsemble:
    """One ``grpc.aio`` stream per request to ``ensemble``, on an event loop of its own thread."""

    def __init__(self, url: str) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

        async def stub() -> service_pb2_grpc.GRPCInferenceServiceStub:
            self.channel = grpc.aio.insecure_channel(url)
            return service_pb2_grpc.GRPCInferenceServiceStub(self.channel)

        self.stub = asyncio.run_coroutine_threadsafe(stub(), self.loop).result()

    def ttft_ms(self) -> float:
        async def one() -> float:
            started = time.perf_counter()
            call = self.stub.ModelStreamInfer()
            await call.write(infer_request("ensemble", "1", [
                ("text_input", "BYTES", np.array([PROMPT.encode()], dtype=np.object_)),
                ("adapter_id", "BYTES", np.array([b"support"], dtype=np.object_)),
                ("stream", "BOOL", np.array([True])), ("max_tokens", "INT32", np.array([1], dtype=np.int32))]))
            await call.done_writing()
            response = await call.read()
            ttft = (time.perf_counter() - started) * 1000
            assert not response.error_message, response.error_message
            while await call.read() is not grpc.aio.EOF:
                pass
            return ttft

        return asyncio.run_coroutine_threadsafe(one(), self.loop).result()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.channel.close(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)


def front_ttft_ms(client: httpx.Client, front_url: str) -> float:
    """A streamed one-token ``/v1/completions`` of :data:`PROMPT` (adapter ``support``) through a front."""
    return first_event_ms(client, f"{front_url}/v1/completions",
                          {"model": "support", "prompt": PROMPT, "max_tokens": 1, "stream": True},
                          lambda data: data["choices"] and data["choices"][0]["text"])


def generate_stream_ttft_ms(client: httpx.Client, triton_http: str) -> float:
    """The same request on tritonserver's ``/v2/models/ensemble/generate_stream``."""
    return first_event_ms(client, f"http://{triton_http}/v2/models/ensemble/generate_stream",
                          {"text_input": PROMPT, "max_tokens": 1, "stream": True, "adapter_id": "support"},
                          lambda data: data.get("text_output"))


#: Unmeasured calls of each way before :func:`interleaved` measures (one-off costs).
UNMEASURED_CALLS = 2


def interleaved(ways: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each way's figures over ``rounds`` rounds, one at a time, the order reversed every other round (so both
    ends of a round see the same machine load), after :data:`UNMEASURED_CALLS` unmeasured calls each."""
    for way in ways.values():
        for _ in range(UNMEASURED_CALLS):
            way()
    times: dict[str, list[float]] = {name: [] for name in ways}
    names = list(ways)
    for i in range(rounds):
        for name in names if i % 2 else names[::-1]:
            times[name].append(ways[name]())
    return times


def main(rounds: int) -> None:
    assets = ensure_demo_assets(REPO_ROOT / ".assets")
    env = {"WARMUP_ASSETS_DIR": str(assets.root), "WARMUP_CONTROL_DIR": "", "WARMUP_LM_THREADS": "1"}
    with TritonServer(REPO_ROOT / "model_repository", env=env) as server, httpx.Client(timeout=60) as client:
        server.wait_ready(timeout=600)
        ensemble = GrpcEnsemble(server.grpc_url)
        try:
            for pipeline in PIPELINES:
                with front_process(server, Path(assets.root), pipeline) as front:
                    ways = {
                        "front": lambda: front_ttft_ms(client, front.url),
                        "generate_stream": lambda: generate_stream_ttft_ms(client, server.http_url),
                        "grpc": ensemble.ttft_ms,
                        "front /v1/models/base": lambda: get_ms(client, f"{front.url}/v1/models/base"),
                        "tritonserver /v2/health/ready": lambda: get_ms(client, f"http://{server.http_url}"
                                                                                "/v2/health/ready"),
                    }
                    times = interleaved(ways, rounds)
                    p50 = {name: statistics.median(values) for name, values in times.items()}
                    for name, values in times.items():
                        print(f"{pipeline:9s} {name:30s} p25 {statistics.quantiles(values, n=4)[0]:6.2f} ms  "
                              f"p50 {p50[name]:6.2f} ms")
                    added = p50["front"] - p50["generate_stream"]
                    transport = p50["grpc"] - p50["generate_stream"]
                    http = p50["front /v1/models/base"] - p50["tritonserver /v2/health/ready"]
                    print(f"{pipeline:9s} front less generate_stream (p50): {added:+.2f} ms; grpc less "
                          f"generate_stream: {transport:+.2f} ms; /v1/models/base less /v2/health/ready: "
                          f"{http:+.2f} ms", flush=True)
                    before = front.cpu_seconds()
                    for _ in range(rounds):
                        ways["front"]()
                    cpu_ms = (front.cpu_seconds() - before) / rounds * 1000
                    print(f"{pipeline:9s} the front's CPU per streamed request: {cpu_ms:.2f} ms ({rounds} requests, "
                          "/proc)", flush=True)
        finally:
            ensemble.close()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 60)
