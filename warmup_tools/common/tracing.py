"""OpenTelemetry tracing: the W3C trace context a request brings, continued with spans exported over OTLP.

Off by default: without ``WARMUP_TRACING_ENDPOINT`` no exporter, provider or span exists, and nothing is read from a
request (:attr:`Tracer.enabled` is False; the callers check it before doing anything else).

The context travels as the W3C ``traceparent`` and ``tracestate`` pair, read with OpenTelemetry's own propagator
from the OpenAI front's HTTP headers (:func:`context_from_headers`), a gRPC call's metadata
(:func:`context_from_metadata`) and, inside tritonserver, the request parameters of the same names
(:func:`context_from_parameters`), which the front sets on every model it calls and which an ensemble hands to its
steps (docs/tracing.md says why parameters and not Triton's own trace mode).

Every input is untrusted: a value that is not text, longer than :data:`MAX_TRACEPARENT_CHARS` /
:data:`MAX_TRACESTATE_CHARS`, repeated, or that the propagator does not accept is ignored (the request is served
untraced, never refused), and what is passed on is the propagator's own re-serialisation, not the client's text.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Mapping

from warmup_tools.common.settings import check_settings, setting

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span

LOGGER = logging.getLogger(__name__)


def _quiet_members(record: logging.LogRecord) -> bool:
    """NOTE: the propagator logs a warning quoting each malformed ``tracestate`` member it drops: a client could
    fill the log with its own text, one line a request. Those warnings are dropped (the member is, too)."""
    return not str(record.msg).startswith("Member doesn't match")


logging.getLogger("opentelemetry.trace.span").addFilter(_quiet_members)

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
#: A version-00 ``traceparent`` is 55 characters; later versions may append fields: more than this is ignored.
MAX_TRACEPARENT_CHARS = 256
#: W3C asks a vendor to pass on at least 512 characters of ``tracestate``; a longer one is dropped whole (the
#: ``traceparent`` is still taken).
MAX_TRACESTATE_CHARS = 512


@dataclasses.dataclass(frozen=True, slots=True)
class TracingSettings:
    """Whether and where spans go (``WARMUP_TRACING_<FIELD>``; tritonserver's models read the same variables from
    the environment ``serve`` starts it with)."""

    section: ClassVar[str] = "TRACING"

    endpoint: str = setting("", "OTLP/gRPC collector the spans are exported to (host:port, or http://host:port); "
                                "empty: tracing off (no exporter, no span, no header read).")
    service_name: str = setting("triton-warmup", "The service.name resource of every span; the process "
                                                 "(front, tokenizer_cache, ...) is service.instance.id.")
    sample_ratio: float = setting(1.0, "Share of the requests that bring no trace context which start a trace of "
                                       "their own; a request that brings one follows its sampled flag.", ge=0, le=1)
    insecure: bool = setting(True, "Plain-text gRPC to the collector (one on the host or in the pod); false: TLS "
                                   "with the system's roots.")
    max_queue: int = setting(2048, "Finished spans held for export in each process; more are dropped, never "
                                   "waited for (a collector that is down costs no request any time).",
                             ge=1, le=1 << 20)
    export_timeout_s: float = setting(10.0, "Seconds one export to the collector may take.", gt=0, le=300)

    def __post_init__(self) -> None:
        check_settings(self)

    @property
    def enabled(self) -> bool:
        return bool(self.endpoint)


@dataclasses.dataclass(frozen=True, slots=True)
class TraceContext:
    """A checked W3C trace context, as the propagator wrote it back."""

    traceparent: str
    tracestate: str = ""

    def parameters(self) -> dict[str, str]:
        """The request parameters that carry it to tritonserver's models."""
        return {TRACEPARENT: self.traceparent, **({TRACESTATE: self.tracestate} if self.tracestate else {})}

    def otel_context(self) -> Context:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        return TraceContextTextMapPropagator().extract(self.parameters())


def parse_trace_context(traceparent: Any, tracestate: Any = None) -> TraceContext | None:
    """The context of a ``traceparent`` and ``tracestate`` pair; None when the ``traceparent`` is absent, not
    text, too long or not accepted by the propagator. A ``tracestate`` that is not text or too long is dropped."""
    traceparent = _text(traceparent, MAX_TRACEPARENT_CHARS)
    if not traceparent:
        return None
    carrier = {TRACEPARENT: traceparent}
    tracestate = _text(tracestate, MAX_TRACESTATE_CHARS)
    if tracestate:
        carrier[TRACESTATE] = tracestate
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    propagator = TraceContextTextMapPropagator()
    try:
        context = propagator.extract(carrier)
    except Exception:  # NOTE: a client's header never fails its request
        LOGGER.debug("trace context not extracted", exc_info=True)
        return None
    if not trace.get_current_span(context).get_span_context().is_valid:
        return None
    out: dict[str, str] = {}
    propagator.inject(out, context)
    if not out.get(TRACEPARENT):
        return None
    return TraceContext(out[TRACEPARENT], out.get(TRACESTATE, "")[:MAX_TRACESTATE_CHARS])


def context_from_headers(headers: Any) -> TraceContext | None:
    """The context of an HTTP request's headers (a starlette ``Headers``, or any mapping with lower-case keys).
    Two ``traceparent`` headers are no context (W3C); several ``tracestate`` headers are one list."""
    getlist = getattr(headers, "getlist", None)
    parents = getlist(TRACEPARENT) if getlist else [v for v in [headers.get(TRACEPARENT)] if v is not None]
    if len(parents) != 1:
        return None
    states = getlist(TRACESTATE) if getlist else [v for v in [headers.get(TRACESTATE)] if v is not None]
    return parse_trace_context(parents[0], _joined(states))


def context_from_metadata(pairs: Iterable[tuple[str, Any]] | None) -> TraceContext | None:
    """The context of a gRPC call's metadata (``context.invocation_metadata()``: ``(key, value)`` pairs, values
    text or, for ``-bin`` keys, bytes). As for headers: one ``traceparent`` or none is taken."""
    parents: list[Any] = []
    states: list[Any] = []
    for key, value in pairs or ():
        name = key.lower() if isinstance(key, str) else ""
        if name == TRACEPARENT:
            parents.append(value)
        elif name == TRACESTATE:
            states.append(value)
    if len(parents) != 1:
        return None
    return parse_trace_context(parents[0], _joined(states))


def context_from_parameters(parameters: Mapping[str, Any] | None) -> TraceContext | None:
    """The context of a Triton request's parameters (set by the front or an ensemble's caller)."""
    if not parameters:
        return None
    return parse_trace_context(parameters.get(TRACEPARENT), parameters.get(TRACESTATE))


def context_of_triton_request(request: Any) -> TraceContext | None:
    """The context in a Python-backend request's parameters (``request.parameters()``, a JSON object); None when
    there is none or it is malformed."""
    try:
        text = request.parameters() or "{}"
        if len(text) > 1 << 20:
            return None
        parameters = json.loads(text)
    except (ValueError, TypeError):
        return None
    return context_from_parameters(parameters) if isinstance(parameters, dict) else None


class Tracer:
    """One process's spans. Without an endpoint (and no ``exporter``) it is off: :attr:`enabled` is False and
    :meth:`start` returns None, having imported and built nothing.

    ``exporter`` (tests): a span exporter to use instead of OTLP, such as the SDK's ``InMemorySpanExporter``."""

    def __init__(self, settings: TracingSettings, instance: str, *, exporter: Any = None) -> None:
        self.settings = settings
        self.enabled = settings.enabled or exporter is not None
        self._tracer: Any = None
        self._provider: Any = None
        self._lock = threading.Lock()
        if not self.enabled:
            return
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        if exporter is None:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=settings.endpoint, insecure=settings.insecure,
                                        timeout=settings.export_timeout_s)
        # NOTE: a provider of its own, not the global one: nothing else in the process (a library that traces
        # through the global API) starts exporting because this one is on.
        self._provider = TracerProvider(
            resource=Resource.create({"service.name": settings.service_name, "service.instance.id": instance}),
            sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)))
        self._provider.add_span_processor(BatchSpanProcessor(
            exporter, max_queue_size=settings.max_queue, max_export_batch_size=min(512, settings.max_queue),
            export_timeout_millis=int(settings.export_timeout_s * 1000)))
        self._tracer = self._provider.get_tracer("warmup_tools")

    @classmethod
    def from_environment(cls, instance: str) -> Tracer:
        """The tracer of a process configured by ``WARMUP_TRACING_*`` (a model inside tritonserver)."""
        from warmup_tools.common.settings import load_settings

        return cls(load_settings(TracingSettings), instance)

    def start(self, name: str, parent: TraceContext | Context | None = None, *, start_ns: int | None = None,
              attributes: Mapping[str, Any] | None = None, server: bool = False) -> Span | None:
        """A started span, child of ``parent`` (a root span, sampled at ``sample_ratio``, without one); None when
        off. End it with ``span.end()``."""
        if self._tracer is None:
            return None
        from opentelemetry.trace import SpanKind

        context = parent.otel_context() if isinstance(parent, TraceContext) else parent
        return self._tracer.start_span(name, context=context, kind=SpanKind.SERVER if server else SpanKind.INTERNAL,
                                       attributes=dict(attributes or {}), start_time=start_ns)

    def request_span(self, name: str, request: Any, attributes: Mapping[str, Any] | None = None) -> Span | None:
        """A started span for one Python-backend request that brings a trace context (its ``traceparent``
        parameter), child of it; None when off or without one: a model continues a trace, never starts one (its
        warm-up samples, a client without a context). End it with :func:`end_span`."""
        if self._tracer is None:
            return None
        context = context_of_triton_request(request)
        return self.start(name, context, attributes=attributes) if context is not None else None

    def child_context(self, span: Span | None) -> TraceContext | None:
        """The context to hand on below ``span`` (a recorded one; None otherwise)."""
        if span is None or not span.get_span_context().is_valid:
            return None
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier, trace.set_span_in_context(span))
        return TraceContext(carrier[TRACEPARENT], carrier.get(TRACESTATE, "")) if TRACEPARENT in carrier else None

    def flush(self, timeout_s: float = 10.0) -> bool:
        if self._provider is None:
            return True
        return bool(self._provider.force_flush(int(timeout_s * 1000)))

    def shutdown(self) -> None:
        """Export what is held, then stop (idempotent)."""
        with self._lock:
            provider, self._provider, self._tracer = self._provider, None, None
        if provider is not None:
            provider.shutdown()


#: The sources of a cache answer that are hits (warmup_tools.caches.tiered.CacheSource's values).
_HITS = ("local", "shared")


def cache_attributes(source: Any) -> dict[str, Any]:
    """A cache step's span attributes: ``cache.hit`` and ``cache.source`` (local, shared, computed, skipped,
    deferred)."""
    name = str(getattr(source, "value", source))
    return {"cache.hit": name in _HITS, "cache.source": name}


def end_span(span: Span | None, attributes: Mapping[str, Any] | None = None, *, error: BaseException | None = None,
             end_ns: int | None = None) -> None:
    """End ``span`` (nothing for None or a span already ended) with ``attributes``; ``error`` marks it failed, by
    the error's kind or type only (never its text, which may quote the request)."""
    if span is None or not span.is_recording():
        return
    if attributes:
        span.set_attributes(dict(attributes))
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        kind = getattr(error, "kind", None)
        span.set_attribute("error.type", str(getattr(kind, "value", kind) or type(error).__name__))
        span.set_status(Status(StatusCode.ERROR))
    span.end(end_time=end_ns)


def _text(value: Any, limit: int) -> str:
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return ""
    if not isinstance(value, str) or len(value) > limit or not value.isascii():
        return ""
    return value.strip()


def _joined(values: list[Any]) -> str | None:
    """Several ``tracestate`` values as one list (W3C allows it to be split over headers); None when one is not
    text or they are too long together."""
    texts = [_text(v, MAX_TRACESTATE_CHARS) for v in values]
    if not texts or not all(texts):
        return None
    joined = ",".join(texts)
    return joined if len(joined) <= MAX_TRACESTATE_CHARS else None
