"""Locust load test of the ``ensemble`` over gRPC streaming.

    locust -f warmup_tools/load/locustfile.py --host 127.0.0.1:8001 --headless -u 8 -r 2 -t 60s
    locust -f warmup_tools/load/locustfile.py --host 127.0.0.1:8001 --headless -u 4 -r 4 -t 10m \\
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

import random  # noqa: E402
import time  # noqa: E402
from typing import Any, Iterator  # noqa: E402

import gevent  # noqa: E402
from locust import User, between, events, task  # noqa: E402
from locust.exception import StopUser  # noqa: E402

from warmup_tools.client import GenerateParams, StreamingClient  # noqa: E402
from warmup_tools.demo_prompts import SYSTEM_PROMPTS, USER_QUESTIONS  # noqa: E402


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    parser.add_argument("--replay-log", default="", include_in_web_ui=True,
                        help="request log (JSON Lines, gzip too) to replay in order; empty: demo prompts")
    parser.add_argument("--max-tokens", type=int, default=16, include_in_web_ui=True,
                        help="max_tokens of every request")


class ReplayCursor:
    """One cursor over a request log, shared by all users (greenlets: no lock needed)."""

    def __init__(self, path: str) -> None:
        from warmup_tools.planner import iter_log_records  # noqa: PLC0415

        self.path = path
        self._records: Iterator[dict] = iter_log_records(path)
        self.sent = 0
        self.in_flight = 0
        self.exhausted = False

    def next(self) -> tuple[str, GenerateParams] | None:
        record = next(self._records, None)
        if record is None:
            self.exhausted = True
            return None
        prompt = record.get("prompt")
        if not isinstance(prompt, str):
            raise ValueError(f"{self.path}: record {self.sent + 1} has no prompt text (was the log redacted?)")
        self.sent += 1
        return prompt, GenerateParams(adapter_id=record.get("adapter") or None,
                                      tenant_id=record.get("tenant") or None)


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


class TritonGrpcUser(User):
    """Owns one streaming gRPC client; concrete users only declare tasks."""

    abstract = True

    def on_start(self) -> None:
        self.client = StreamingClient(self.host, timeout_s=120)
        options = self.environment.parsed_options
        self.max_tokens = options.max_tokens if options is not None else 16

    def on_stop(self) -> None:
        self.client.close()

    def generate(self, name: str, prompt: str, params: GenerateParams) -> None:
        start = time.perf_counter()
        last = None
        context = {"adapter": params.adapter_id or "base", "tenant": params.tenant_id or ""}

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
        if result.cached_tokens == 0:
            events.request.fire(request_type="grpc", name="cold", response_time=result.ttft_s * 1000,
                                response_length=result.prompt_tokens, exception=None, context=context)


class AdapterTrafficUser(TritonGrpcUser):
    """Demo prompts, or the records of ``--replay-log`` in order."""

    wait_time = between(0.05, 0.3)

    @task
    def ask(self) -> None:
        if _cursor is not None:
            was_exhausted = _cursor.exhausted
            item = _cursor.next()
            if item is None:
                if not was_exhausted:
                    gevent.spawn(_quit_when_idle, self.environment, _cursor)
                raise StopUser()
            prompt, params = item
            params = GenerateParams(max_tokens=self.max_tokens, adapter_id=params.adapter_id,
                                    tenant_id=params.tenant_id)
            _cursor.in_flight += 1
            try:
                self.generate(f"generate {params.adapter_id or 'base'}", prompt, params)
            finally:
                _cursor.in_flight -= 1
            return
        adapter = random.choice(list(SYSTEM_PROMPTS))
        prompt = f"{SYSTEM_PROMPTS[adapter]}User: {random.choice(USER_QUESTIONS[adapter])}\nAssistant:"
        self.generate(f"generate {adapter}", prompt, GenerateParams(max_tokens=self.max_tokens, adapter_id=adapter))
