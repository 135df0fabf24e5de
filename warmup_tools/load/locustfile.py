"""Locust load test of the ``ensemble`` over gRPC streaming.

    locust -f warmup_tools/load/locustfile.py --host 127.0.0.1:8001 --headless -u 8 -r 2 -t 60s

Every generate request fires three kinds of named events: ``generate`` (the whole request, or the
failure with ``exception=``), ``ttft`` (time to first token) and ``itl`` (each inter-token gap), all
timed with ``perf_counter`` in milliseconds. Failures are never swallowed.
"""

from __future__ import annotations

# NOTE: gRPC must be patched for gevent before any channel exists, or the user greenlets block.
import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()

import random  # noqa: E402
import time  # noqa: E402

from locust import User, between, events, task  # noqa: E402

from warmup_tools.client import GenerateParams, StreamingClient  # noqa: E402
from warmup_tools.demo_prompts import SYSTEM_PROMPTS, USER_QUESTIONS  # noqa: E402


class TritonGrpcUser(User):
    """Owns one streaming gRPC client; concrete users only declare tasks."""

    abstract = True
    max_tokens = 16

    def on_start(self) -> None:
        self.client = StreamingClient(self.host, timeout_s=120)

    def on_stop(self) -> None:
        self.client.close()

    def generate(self, name: str, prompt: str, params: GenerateParams) -> None:
        start = time.perf_counter()
        last = None
        context = {"adapter": params.adapter_id or "base"}

        def on_piece(_: str) -> None:
            nonlocal last
            now = time.perf_counter()
            if last is None:
                events.request.fire(request_type="grpc", name="ttft", response_time=(now - start) * 1000,
                                    response_length=0, exception=None, context=context)
            else:
                events.request.fire(request_type="grpc", name="itl", response_time=(now - last) * 1000,
                                    response_length=0, exception=None, context=context)
            last = now

        try:
            result = self.client.generate(prompt, params, on_piece=on_piece)
        except Exception as exc:  # noqa: BLE001 - reported to Locust, not swallowed
            events.request.fire(request_type="grpc", name=name, response_time=(time.perf_counter() - start) * 1000,
                                response_length=0, exception=exc, context=context)
            return
        events.request.fire(request_type="grpc", name=name, response_time=(time.perf_counter() - start) * 1000,
                            response_length=result.output_tokens, exception=None, context=context)


class AdapterTrafficUser(TritonGrpcUser):
    """Requests for the demo adapters: each adapter's system prompt plus one of its questions."""

    wait_time = between(0.05, 0.3)

    @task
    def ask(self) -> None:
        adapter = random.choice(list(SYSTEM_PROMPTS))
        prompt = f"{SYSTEM_PROMPTS[adapter]}User: {random.choice(USER_QUESTIONS[adapter])}\nAssistant:"
        self.generate(f"generate {adapter}", prompt, GenerateParams(max_tokens=self.max_tokens, adapter_id=adapter))
