"""Tracing: the settings, the W3C trace context read from headers, gRPC metadata and Triton request parameters
(valid, malformed, oversized), spans with the SDK's in-memory exporter, and nothing at all when off."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from starlette.datastructures import Headers

from warmup_tools.common.errors import ConfigError
from warmup_tools.common.settings import load_settings
from warmup_tools.common.tracing import (
    MAX_TRACEPARENT_CHARS,
    MAX_TRACESTATE_CHARS,
    TraceContext,
    Tracer,
    TracingSettings,
    cache_attributes,
    context_from_headers,
    context_from_metadata,
    context_from_parameters,
    context_of_triton_request,
    end_span,
    parse_trace_context,
)

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


# ------------------------------------------------------------------------------------------------ settings
def test_tracing_is_off_by_default():
    settings = load_settings(TracingSettings, env={})
    assert settings == TracingSettings() and not settings.enabled
    tracer = Tracer(settings, "test")
    assert not tracer.enabled
    assert tracer.start("x", parse_trace_context(TRACEPARENT)) is None
    assert tracer.request_span("x", _Request({"traceparent": TRACEPARENT})) is None
    assert tracer.flush() and tracer.shutdown() is None


def test_settings_come_from_the_environment():
    settings = load_settings(TracingSettings, env={"WARMUP_TRACING_ENDPOINT": "collector:4317",
                                                   "WARMUP_TRACING_SAMPLE_RATIO": "0.25",
                                                   "WARMUP_TRACING_SERVICE_NAME": "replica-a"})
    assert settings.enabled and settings.endpoint == "collector:4317"
    assert settings.sample_ratio == 0.25 and settings.service_name == "replica-a"


@pytest.mark.parametrize("env", [{"WARMUP_TRACING_SAMPLE_RATIO": "1.5"}, {"WARMUP_TRACING_SAMPLE_RATIO": "-0.1"},
                                 {"WARMUP_TRACING_MAX_QUEUE": "0"}, {"WARMUP_TRACING_EXPORT_TIMEOUT_S": "0"},
                                 {"WARMUP_TRACING_INSECURE": "maybe"}])
def test_settings_out_of_bounds_are_refused_naming_the_setting(env):
    with pytest.raises(ConfigError, match=list(env)[0].removeprefix("WARMUP_TRACING_").lower()):
        load_settings(TracingSettings, env=env)


def test_off_imports_no_sdk_and_starts_no_exporter():
    """Off (the default): the models and the front import the module and build their tracer, and neither the SDK
    nor an exporter is loaded, and no thread starts."""
    code = ("import sys, threading\n"
            "from warmup_tools.common.tracing import Tracer, context_of_triton_request\n"
            "before = threading.active_count()\n"
            "t = Tracer.from_environment('x')\n"
            "assert not t.enabled and t.request_span('s', None) is None\n"
            "assert not [m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter'))]\n"
            "assert threading.active_count() == before\n")
    env = {"PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


# ------------------------------------------------------------------------------------------------ extraction
def test_a_valid_context_is_taken_with_its_tracestate():
    context = parse_trace_context(TRACEPARENT, "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7")
    assert context == TraceContext(TRACEPARENT, "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7")
    assert context.parameters() == {"traceparent": TRACEPARENT, "tracestate": "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"}


def test_a_later_version_is_read_as_version_00():
    """W3C: a parser of version 00 reads a higher version's first fields and passes on version 00."""
    assert parse_trace_context(f"01-{TRACE_ID}-{PARENT_ID}-01-extra").traceparent == TRACEPARENT


MALFORMED = [
    None, "", 42, b"\xff\xfe", ["00"], "garbage",
    f"00-{TRACE_ID}-{PARENT_ID}",  # no flags
    f"00-{'0' * 32}-{PARENT_ID}-01",  # all-zero trace id
    f"00-{TRACE_ID}-{'0' * 16}-01",  # all-zero parent id
    f"ff-{TRACE_ID}-{PARENT_ID}-01",  # version ff is invalid
    f"00-{TRACE_ID.upper()}-{PARENT_ID}-01",  # upper case hex
    f"00-{TRACE_ID}-{PARENT_ID}-01-extra",  # version 00 has exactly four fields
    f"00-{TRACE_ID}\n-{PARENT_ID}-01",
    f"00-{TRACE_ID}-{PARENT_ID}-0\u00e9",
]


@pytest.mark.parametrize("traceparent", MALFORMED)
def test_a_malformed_traceparent_is_ignored(traceparent):
    assert parse_trace_context(traceparent, "a=b") is None


def test_an_oversized_traceparent_is_ignored_before_parsing():
    assert parse_trace_context(TRACEPARENT + "-" + "a" * MAX_TRACEPARENT_CHARS) is None
    assert parse_trace_context(f"01-{TRACE_ID}-{PARENT_ID}-01-" + "a" * (MAX_TRACEPARENT_CHARS + 1)) is None
    assert parse_trace_context("x" * (10 << 20)) is None


def test_a_bad_or_oversized_tracestate_is_dropped_and_the_parent_kept(caplog):
    for state in ("k=" + "v" * MAX_TRACESTATE_CHARS, "not a list ,,==", 7, b"\xff", "=" * 10_000):
        assert parse_trace_context(TRACEPARENT, state) == TraceContext(TRACEPARENT, "")
    # NOTE: the propagator's warning quotes the client's text: dropped, so a client cannot write the log
    assert "not a list" not in caplog.text


def test_headers_one_traceparent_and_tracestate_over_several_headers():
    headers = Headers(raw=[(b"traceparent", TRACEPARENT.encode()), (b"tracestate", b"a=1"), (b"tracestate", b"b=2")])
    assert context_from_headers(headers) == TraceContext(TRACEPARENT, "a=1,b=2")
    assert context_from_headers(Headers({"TraceParent": TRACEPARENT})).traceparent == TRACEPARENT
    assert context_from_headers({"traceparent": TRACEPARENT}) == TraceContext(TRACEPARENT)


def test_headers_without_or_with_two_traceparents_give_no_context():
    assert context_from_headers(Headers(raw=[])) is None
    two = Headers(raw=[(b"traceparent", TRACEPARENT.encode()), (b"traceparent", TRACEPARENT.encode())])
    assert context_from_headers(two) is None  # W3C: several traceparent headers are invalid


def test_headers_whose_tracestates_are_too_long_together_keep_the_parent():
    half = "k=" + "v" * (MAX_TRACESTATE_CHARS // 2)
    headers = Headers(raw=[(b"traceparent", TRACEPARENT.encode()), (b"tracestate", half.encode()),
                           (b"tracestate", half.encode())])
    assert context_from_headers(headers) == TraceContext(TRACEPARENT, "")


def test_context_from_grpc_metadata():
    """What a gRPC servicer calls with ``context.invocation_metadata()``: text or bytes values, keys of any case."""
    pairs = (("authorization", "Bearer x"), ("traceparent", TRACEPARENT), ("tracestate", "a=1"))
    assert context_from_metadata(pairs) == TraceContext(TRACEPARENT, "a=1")
    assert context_from_metadata([("TraceParent", TRACEPARENT.encode())]) == TraceContext(TRACEPARENT)
    assert context_from_metadata(None) is None and context_from_metadata([]) is None
    assert context_from_metadata([("traceparent", TRACEPARENT)] * 2) is None
    assert context_from_metadata([("traceparent", "00-bad")]) is None
    assert context_from_metadata([("traceparent", "x" * (1 << 20))]) is None
    assert context_from_metadata([(b"traceparent", TRACEPARENT)]) is None  # a key that is not text
    assert context_from_metadata([("traceparent", TRACEPARENT), ("tracestate", "z" * 4096)]) == TraceContext(
        TRACEPARENT)
    # The context carried on is the propagator's, to pass to tritonserver as request parameters.
    assert context_from_metadata(pairs).parameters() == {"traceparent": TRACEPARENT, "tracestate": "a=1"}


class _Request:
    """A Python-backend request's ``parameters()`` (a JSON object as text)."""

    def __init__(self, parameters):
        self._text = parameters if isinstance(parameters, str) else json.dumps(parameters)

    def parameters(self):
        return self._text


@pytest.mark.parametrize("parameters", ["", "not json", "[1, 2]", "{\"traceparent\": 5}", "{\"traceparent\": \"x\"}",
                                        json.dumps({"traceparent": "x" * (2 << 20)}), "{}"])
def test_triton_parameters_that_carry_no_valid_context(parameters):
    assert context_of_triton_request(_Request(parameters)) is None


def test_triton_parameters_with_a_context():
    request = _Request({"chat_roles": "[]", "traceparent": TRACEPARENT, "tracestate": "a=1"})
    assert context_of_triton_request(request) == TraceContext(TRACEPARENT, "a=1")
    assert context_from_parameters({"traceparent": TRACEPARENT}) == TraceContext(TRACEPARENT)


# ------------------------------------------------------------------------------------------------ spans
@pytest.fixture()
def exported():
    exporter = InMemorySpanExporter()
    tracer = Tracer(TracingSettings(service_name="unit"), "instance-0", exporter=exporter)
    yield tracer, exporter
    tracer.shutdown()


def _finished(tracer, exporter):
    assert tracer.flush()
    return {span.name: span for span in exporter.get_finished_spans()}


def test_a_request_span_continues_the_incoming_trace(exported):
    tracer, exporter = exported
    span = tracer.request_span("tokenizer_cache", _Request({"traceparent": TRACEPARENT}))
    child = tracer.child_context(span)
    end_span(span, {**cache_attributes("local"), "prompt_tokens": 12})
    end_span(span, error=ValueError("ended twice: nothing"))
    got = _finished(tracer, exporter)["tokenizer_cache"]
    assert f"{got.context.trace_id:032x}" == TRACE_ID and f"{got.parent.span_id:016x}" == PARENT_ID
    assert dict(got.attributes) == {"cache.hit": True, "cache.source": "local", "prompt_tokens": 12}
    assert got.resource.attributes["service.name"] == "unit"
    assert got.resource.attributes["service.instance.id"] == "instance-0"
    assert child.traceparent == f"00-{TRACE_ID}-{got.context.span_id:016x}-01"


def test_a_model_never_starts_a_trace_of_its_own(exported):
    tracer, exporter = exported
    assert tracer.request_span("tokenizer_cache", _Request({})) is None
    assert tracer.request_span("tokenizer_cache", _Request({"traceparent": "00-bad"})) is None
    assert _finished(tracer, exporter) == {}


def test_an_unsampled_context_records_nothing(exported):
    tracer, exporter = exported
    span = tracer.request_span("lora_adapter", _Request({"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-00"}))
    assert span is not None and not span.is_recording()
    end_span(span)
    assert _finished(tracer, exporter) == {}


def test_a_failed_span_carries_the_error_kind_not_its_text(exported):
    from warmup_tools.common.errors import InvalidInputError

    tracer, exporter = exported
    span = tracer.start("embedding_cache", parse_trace_context(TRACEPARENT))
    end_span(span, error=InvalidInputError("the prompt 'secret words' is too long"))
    got = _finished(tracer, exporter)["embedding_cache"]
    assert got.status.status_code.name == "ERROR" and got.status.description is None
    assert "secret" not in json.dumps(dict(got.attributes))


def test_root_spans_follow_the_sample_ratio():
    exporter = InMemorySpanExporter()
    tracer = Tracer(TracingSettings(sample_ratio=0.0), "x", exporter=exporter)
    try:
        assert not tracer.start("front.generate").is_recording()  # no context: sampled at 0
        assert tracer.start("front.generate", parse_trace_context(TRACEPARENT)).is_recording()  # sampled parent
    finally:
        tracer.shutdown()
