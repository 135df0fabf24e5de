"""Tracing end to end: a real tritonserver and the OpenAI front, each with ``WARMUP_TRACING_ENDPOINT`` set, export
over OTLP/gRPC (the SDK's real exporter) to a collector this test runs (a gRPC ``TraceService``). A request with a
``traceparent`` gets the front's span and, below it, one span per model (``tokenizer_cache``, ``embedding_cache``,
``lora_adapter`` with ``queue``, ``prefill`` and ``decode``) in the same trace, on both pipelines: the models'
calls (composing) and the ensemble, which hands its request parameters to its steps."""

from __future__ import annotations

import concurrent.futures
import secrets
import threading

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from tests.waiting import wait_for
from warmup_tools.common.settings import environ_overrides
from warmup_tools.demo.prompts import SYSTEM_PROMPTS

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

MODELS = ("tokenizer_cache", "embedding_cache", "lora_adapter")
PHASES = ("queue", "prefill", "decode")


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver: every span it was sent, with its resource's attributes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[tuple[dict[str, str], object]] = []

    def Export(self, request, context):
        with self._lock:
            for resource_spans in request.resource_spans:
                resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope in resource_spans.scope_spans:
                    self._spans.extend((resource, span) for span in scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[tuple[dict[str, str], object]]:
        with self._lock:
            return [(r, s) for r, s in self._spans if s.trace_id.hex() == trace_id]

    def all(self) -> list[tuple[dict[str, str], object]]:
        with self._lock:
            return list(self._spans)


@pytest.fixture(scope="module")
def collector():
    receiver = Collector()
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    receiver.endpoint = f"127.0.0.1:{port}"
    try:
        yield receiver
    finally:
        server.stop(grace=None)


@pytest.fixture(scope="module")
def traced_fronts(served_assets, collector, tmp_path_factory):
    """A tritonserver whose models trace, and one front per pipeline on it, all exporting to ``collector``."""
    from tests.conftest import REPO_ROOT
    from warmup_tools.front.server import FrontServer
    from warmup_tools.front.settings import FrontSettings
    from warmup_tools.server.process import TritonServer

    tracing = {"WARMUP_TRACING_ENDPOINT": collector.endpoint, "WARMUP_TRACING_SERVICE_NAME": "replica-test"}
    server = TritonServer(REPO_ROOT / "model_repository",
                          env={"WARMUP_ASSETS_DIR": str(served_assets),
                               "WARMUP_CONTROL_DIR": str(tmp_path_factory.mktemp("control")), **tracing},
                          work_dir=tmp_path_factory.mktemp("triton_traced"))
    server.start()
    try:
        server.wait_ready(timeout=600)

        def front(pipeline: str) -> FrontServer:
            settings = FrontSettings(port=0, triton_grpc_url=server.grpc_url, triton_metrics_url=server.metrics_url,
                                     model_repository=REPO_ROOT / "model_repository", pipeline=pipeline,
                                     poll_interval_s=0.2)
            with environ_overrides(tracing):  # the front reads WARMUP_TRACING_* as it builds its engine
                return FrontServer(settings, environ={"WARMUP_ASSETS_DIR": str(served_assets)})

        with front("composing") as composing, front("ensemble") as ensemble:
            assert composing.app.state.front.traced and ensemble.app.state.front.traced
            yield {"composing": composing, "ensemble": ensemble, "server": server}
    except BaseException:
        print(server.log_tail(80))
        raise
    finally:
        server.stop()


def _complete(front, headers: dict[str, str], max_tokens: int = 4) -> dict:
    body = {"model": "legal", "prompt": SYSTEM_PROMPTS["legal"] + "\nUser: clause 7?\nAssistant:",
            "max_tokens": max_tokens}
    response = httpx.post(f"{front.url}/v1/completions", json=body, headers=headers, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def _new_ids() -> tuple[str, str]:
    return secrets.token_hex(16), secrets.token_hex(8)


def _whole_trace(collector: Collector, trace_id: str) -> dict[str, list]:
    """The trace's spans by name, once the front's and every model's (with lora_adapter's phases) are in."""
    wanted = {"front.generate", *MODELS, *PHASES}

    def complete():
        spans: dict[str, list] = {}
        for resource, span in collector.trace(trace_id):
            spans.setdefault(span.name, []).append((resource, span))
        return spans if wanted <= set(spans) else None

    return wait_for(complete, f"the spans of trace {trace_id} from the front and the three models", timeout_s=120)


@pytest.mark.parametrize("pipeline", ["composing", "ensemble"])
def test_a_request_with_a_traceparent_is_traced_through_every_model(traced_fronts, collector, pipeline):
    trace_id, parent_id = _new_ids()
    answer = _complete(traced_fronts[pipeline], {"traceparent": f"00-{trace_id}-{parent_id}-01",
                                                 "tracestate": "vendor=abc"})
    spans = _whole_trace(collector, trace_id)
    (front_resource, front), = spans["front.generate"]
    assert front.parent_span_id.hex() == parent_id  # the caller's span (smg's, a client's) is the parent
    assert front_resource["service.name"] == "replica-test" and front_resource["service.instance.id"] == "front"
    assert front.trace_state == "vendor=abc"
    for model in MODELS:
        (resource, span), = spans[model]
        assert span.parent_span_id == front.span_id, model
        assert resource["service.instance.id"].startswith(model)
    (_, adapter), = spans["lora_adapter"]
    phases = {}
    for name in PHASES:
        (_, phase), = spans[name]
        assert phase.parent_span_id == adapter.span_id
        phases[name] = {a.key: a.value for a in phase.attributes}
    usage = answer["usage"]
    assert phases["prefill"]["prompt_tokens"].int_value == usage["prompt_tokens"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    assert phases["prefill"]["cached_tokens"].int_value == cached
    assert phases["decode"]["output_tokens"].int_value == usage["completion_tokens"] == 4
    for model in ("tokenizer_cache", "embedding_cache"):
        (_, span), = spans[model]
        attributes = {a.key: a.value for a in span.attributes}
        assert attributes["cache.source"].string_value in ("local", "shared", "computed", "skipped", "deferred")
        assert attributes["cache.hit"].bool_value == (attributes["cache.source"].string_value in ("local", "shared"))


def test_a_malformed_or_oversized_traceparent_is_ignored_and_the_request_served(traced_fronts, collector):
    """Served as a request without a context: the front starts a trace of its own (sample_ratio 1), which the
    models continue; nothing of the client's text is carried."""
    front = traced_fronts["composing"]
    for header in ("00-not-a-trace-01", "00-" + "a" * 10_000, f"00-{'0' * 32}-{'1' * 16}-01"):
        roots_before = {s.trace_id for _, s in collector.all() if s.name == "front.generate" and not s.parent_span_id}
        _complete(front, {"traceparent": header, "tracestate": "x" * 30_000}, max_tokens=2)

        def new_root(before=roots_before):
            roots = [s for _, s in collector.all() if s.name == "front.generate" and not s.parent_span_id
                     and s.trace_id not in before]
            return roots[0] if roots else None

        root = wait_for(new_root, "the front's own root span")
        assert root.trace_state == ""
        _whole_trace(collector, root.trace_id.hex())


def test_an_unsampled_context_exports_nothing(traced_fronts, collector):
    front = traced_fronts["ensemble"]
    unsampled, parent_id = _new_ids()
    _complete(front, {"traceparent": f"00-{unsampled}-{parent_id}-00"}, max_tokens=2)
    # NOTE: a sampled request after it, whose spans every process exports after the unsampled one's would be.
    sampled, parent_id = _new_ids()
    _complete(front, {"traceparent": f"00-{sampled}-{parent_id}-01"}, max_tokens=2)
    _whole_trace(collector, sampled)
    assert collector.trace(unsampled) == []
