"""A traced ``lora_adapter`` request through the real scheduler on the demo LM (driven step by step): its span
and the children for its queue wait, its prefill (with the cached tokens of a second, cache-hitting request) and
its decode, with the SDK's in-memory exporter; a refused request's span ends with its error kind."""

from __future__ import annotations

import json

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.unit.lora_adapter.test_scheduler import RecordingSink, drain, make_request
from warmup_tools.common.errors import UnknownAdapterError
from warmup_tools.common.tracing import Tracer, TracingSettings
from warmup_tools.demo.prompts import SYSTEM_PROMPTS
from warmup_tools.lora_adapter.scheduler import Scheduler
from warmup_tools.lora_adapter.settings import SchedulerConfig
from warmup_tools.lora_adapter.traced import TracedSink, refused, traced

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT = f"00-{TRACE_ID}-b7ad6b7169203331-01"


class _TritonRequest:
    def __init__(self, parameters: dict) -> None:
        self._text = json.dumps(parameters)

    def parameters(self) -> str:
        return self._text


@pytest.fixture()
def tracer():
    exporter = InMemorySpanExporter()
    tracer = Tracer(TracingSettings(), "lora_adapter_0_0", exporter=exporter)
    tracer.exporter = exporter
    yield tracer
    tracer.shutdown()


def _spans(tracer):
    assert tracer.flush()
    return tracer.exporter.get_finished_spans()


def test_a_traced_request_records_queue_prefill_and_decode(fresh_cache, tracer):
    engine = fresh_cache
    scheduler = Scheduler(engine, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))
    text = SYSTEM_PROMPTS["support"] + "User: my invoice shows two charges\nAssistant:"
    for _ in range(2):  # the second one finds the first one's prompt blocks cached
        req = make_request(engine, text, "support", max_tokens=5)
        inner = RecordingSink()
        sink = traced(inner, tracer, _TritonRequest({"traceparent": TRACEPARENT}), len(req.prompt_ids), req.adapter)
        assert isinstance(sink, TracedSink)
        scheduler.submit(req, sink)
        drain(scheduler)
        assert not inner.errors and inner.steps[-1].finished and len(inner.steps) == 5
    spans = _spans(tracer)
    requests = [s for s in spans if s.name == "lora_adapter"]
    assert len(requests) == 2
    for request, expect_cached in zip(requests, (False, True)):
        assert f"{request.context.trace_id:032x}" == TRACE_ID
        children = {s.name: s for s in spans if s.parent is not None and s.parent.span_id == request.context.span_id}
        assert set(children) == {"queue", "prefill", "decode"}
        queue, prefill, decode = children["queue"], children["prefill"], children["decode"]
        assert request.start_time <= queue.start_time <= queue.end_time <= prefill.start_time
        assert prefill.end_time <= decode.start_time <= decode.end_time <= request.end_time
        assert prefill.attributes["prompt_tokens"] == len(req.prompt_ids)
        assert (prefill.attributes["cached_tokens"] > 0) is expect_cached
        assert prefill.attributes["cached_tokens"] == request.attributes["cached_tokens"]
        assert decode.attributes["output_tokens"] == request.attributes["output_tokens"] == 5
        assert request.attributes["adapter"] == "support" and request.attributes["finish_reason"] == "length"


def test_an_untraced_request_gets_the_plain_sink(fresh_cache, tracer):
    inner = RecordingSink()
    assert traced(inner, tracer, _TritonRequest({}), 3, None) is inner
    off = Tracer(TracingSettings(), "x")
    assert traced(inner, off, _TritonRequest({"traceparent": TRACEPARENT}), 3, None) is inner
    assert _spans(tracer) == ()


def test_a_refused_request_ends_its_span_with_the_error_kind(fresh_cache, tracer):
    engine = fresh_cache
    scheduler = Scheduler(engine, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))
    req = make_request(engine, "Hello", "no-such-adapter", max_tokens=2)
    sink = traced(RecordingSink(), tracer, _TritonRequest({"traceparent": TRACEPARENT}), 2, req.adapter)
    with pytest.raises(UnknownAdapterError) as caught:
        scheduler.submit(req, sink)
    refused(sink, caught.value)
    refused(sink, caught.value)  # once only
    (span,) = [s for s in _spans(tracer) if s.name == "lora_adapter"]
    assert span.status.status_code.name == "ERROR" and span.attributes["error.type"] == "not_found"
    assert [s.name for s in _spans(tracer) if s.name != "lora_adapter"] == ["queue"]
