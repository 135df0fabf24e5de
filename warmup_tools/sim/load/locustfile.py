"""Locust load test of the ``ensemble`` over the gRPC stream (default), HTTP ``generate_stream``, or the OpenAI
front's streamed ``/v1/completions`` (``--transport openai``, what compose's Locust service uses: tritonserver's
own ports are reachable from inside the replica only).

    locust -f warmup_tools/sim/load/locustfile.py --host 127.0.0.1:8001 --headless -u 8 -r 2 -t 60s
    locust -f warmup_tools/sim/load/locustfile.py --host 127.0.0.1:8000 --transport http --headless -u 8 -t 60s
    locust -f warmup_tools/sim/load/locustfile.py --host http://127.0.0.1:9000 --transport openai --headless -u 8 -t 60s
    locust -f warmup_tools/sim/load/locustfile.py --host 127.0.0.1:8001 --headless -u 4 -r 4 -t 10m \\
        --replay-log runs/traffic/day2.jsonl

Without ``--replay-log`` each user sends a demo adapter's system prompt plus one of its questions. With
it, the users share one cursor over the request log (JSON Lines, gzip too: the traffic generator's
files or lora_adapter's own request log) and send its records in order, each with its tenant and
adapter; the run quits when the log is exhausted (or at ``-t``).

Every request fires named events: ``generate <adapter>`` (the whole request, or the failure with
``exception=``), ``ttft`` (time to first token), ``itl`` (each inter-token gap) and, for a request that
took no prompt token from the KV cache (``cached_tokens == 0``), ``cold`` with its TTFT. All are timed
with ``perf_counter`` in milliseconds. Failures are never swallowed.
"""

from __future__ import annotations

# NOTE: gRPC must be patched for gevent before any channel exists, or the user greenlets block.
import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()

import dataclasses  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Iterator  # noqa: E402

import gevent  # noqa: E402
from locust import User, between, events, task  # noqa: E402
from locust.exception import StopUser  # noqa: E402

from warmup_tools.demo.prompts import SYSTEM_PROMPTS, USER_QUESTIONS  # noqa: E402
from warmup_tools.server.client import (  # noqa: E402
    GenerateParams,
    HttpStreamingClient,
    OpenAIStreamingClient,
    StreamingClient,
)

#: ``--transport``: the client of each (all share StreamingClient's interface).
CLIENTS = {"grpc": StreamingClient, "http": HttpStreamingClient, "openai": OpenAIStreamingClient}


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    parser.add_argument("--replay-log", default="", include_in_web_ui=True,
                        help="request log (JSON Lines, gzip too) to replay in order; empty: demo prompts")
    parser.add_argument("--max-tokens", type=int, default=16, include_in_web_ui=True,
                        help="max_tokens of every request")
    parser.add_argument("--transport", choices=tuple(CLIENTS), default="grpc", include_in_web_ui=True,
                        help="grpc: the gRPC stream (--host is Triton's gRPC address); http: POST "
                             "generate_stream, server-sent events (--host is Triton's HTTP address); openai: "
                             "streamed /v1/completions (--host is the OpenAI front's URL, the adapter the model)")


class ReplayCursor:
    """One cursor over a request log, shared by all users (greenlets: no lock needed)."""

    def __init__(self, path: str) -> None:
        from warmup_tools.common.records import RequestRecord, read_request_log

        self.path = path
        self._records: Iterator[RequestRecord] = read_request_log(path)
        self.sent = 0
        self.in_flight = 0
        self.exhausted = False

    def next(self, max_tokens: int) -> tuple[str, GenerateParams] | None:
        record = next(self._records, None)
        if record is None:
            self.exhausted = True
            return None
        if record.prompt is None:
            raise ValueError(f"{self.path}: record {self.sent + 1} has no prompt text (was the log redacted?)")
        self.sent += 1
        return record.prompt, GenerateParams(max_tokens=max_tokens, adapter_id=record.adapter or None,
                                             tenant_id=record.tenant or None)


_cursor: ReplayCursor | None = None


@events.test_start.add_listener
def _open_log(environment: Any, **_: Any) -> None:
    global _cursor
    path = getattr(environment.parsed_options, "replay_log", "") if environment.parsed_options else ""
    _cursor = ReplayCursor(path) if path else None


def _quit_when_idle(environment: Any, cursor: ReplayCursor) -> None:
    """End the run once the log is exhausted and every request taken from it has been answered.

    NOTE: runs in a greenlet of its own. Quitting from inside a user's greenlet (which the runner kills)
    left a run with --csv waiting for its -t limit, and quitting while other users still had requests
    in flight dropped those requests from the statistics."""
    while cursor.in_flight:
        gevent.sleep(0.05)
    environment.runner.quit()


class TritonUser(User):
    """Owns one streaming client (gRPC stream, HTTP generate_stream or the OpenAI front); concrete users only declare
    tasks."""

    abstract = True

    def on_start(self) -> None:
        options = self.environment.parsed_options
        self.transport = options.transport if options is not None else "grpc"
        self.max_tokens = options.max_tokens if options is not None else 16
        self.client = CLIENTS[self.transport](self.host, timeout_s=120)

    def on_stop(self) -> None:
        self.client.close()

    def generate(self, name: str, prompt: str, params: GenerateParams) -> None:
        key_file = os.environ.get("WARMUP_LOAD_TENANT_KEY_FILE")
        if key_file and params.tenant_key is None and params.tenant_id in (None, "default"):
            # Trust mode (compose's secrets service makes the key): requests of tenant default carry its key.
            params = dataclasses.replace(params, tenant_id="default",
                                         tenant_key=Path(key_file).read_text(encoding="utf-8").strip())
        start = time.perf_counter()
        last = None
        context = {"adapter": params.adapter_id or "base", "tenant": params.tenant_id or ""}

        def fire(event: str, ms: float, length: int = 0, exception: Exception | None = None) -> None:
            events.request.fire(request_type=self.transport, name=event, response_time=ms, response_length=length,
                                exception=exception, context=context)

        def on_piece(_: str) -> None:
            nonlocal last
            now = time.perf_counter()
            fire("ttft" if last is None else "itl", (now - (start if last is None else last)) * 1000)
            last = now

        try:
            result = self.client.generate(prompt, params, on_piece=on_piece)
        except Exception as exc:  # noqa: BLE001 - reported to Locust, not swallowed
            fire(name, (time.perf_counter() - start) * 1000, exception=exc)
            return
        fire(name, (time.perf_counter() - start) * 1000, result.output_tokens)
        if result.cached_tokens == 0:
            fire("cold", result.ttft_s * 1000, result.prompt_tokens)


class AdapterTrafficUser(TritonUser):
    """Demo prompts, or the records of ``--replay-log`` in order."""

    wait_time = between(0.05, 0.3)

    @task
    def ask(self) -> None:
        if _cursor is not None:
            was_exhausted = _cursor.exhausted
            item = _cursor.next(self.max_tokens)
            if item is None:
                if not was_exhausted:
                    gevent.spawn(_quit_when_idle, self.environment, _cursor)
                raise StopUser()
            prompt, params = item
            _cursor.in_flight += 1
            try:
                self.generate(f"generate {params.adapter_id or 'base'}", prompt, params)
            finally:
                _cursor.in_flight -= 1
            return
        adapter = random.choice(list(SYSTEM_PROMPTS))
        prompt = f"{SYSTEM_PROMPTS[adapter]}User: {random.choice(USER_QUESTIONS[adapter])}\nAssistant:"
        self.generate(f"generate {adapter}", prompt, GenerateParams(max_tokens=self.max_tokens, adapter_id=adapter))
