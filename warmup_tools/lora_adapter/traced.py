"""The spans of one traced ``lora_adapter`` request (docs/tracing.md).

:class:`TracedSink` stands between the scheduler and a request's
:class:`~warmup_tools.lora_adapter.responses.ResponseSink` when the request brought a trace context and tracing is
on (otherwise model.py hands the scheduler the plain sink, and nothing here runs). It notes the times of the
request's phases as the scheduler reaches them (on the scheduler's thread, after each send: a span never delays a
token) and, when the request ends, records the ``lora_adapter`` span's children with those times: ``queue``
(arrival to first admission), ``prefill`` (admission to the first token; ``cached_tokens``, ``prompt_tokens``) and
``decode`` (first token to the last; ``output_tokens``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from warmup_tools.common.tracing import Tracer, end_span
from warmup_tools.lora_adapter.engine_api import GenerationStep

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from warmup_tools.lora_adapter.sequence import SequenceSink


class TracedSink:
    """A :class:`~warmup_tools.lora_adapter.sequence.SequenceSink` that records its request's spans."""

    __slots__ = ("sink", "span", "tracer", "_arrived", "_admitted", "_first", "_cached", "_prompt", "_done")

    def __init__(self, sink: SequenceSink, span: Span, tracer: Tracer, prompt_tokens: int) -> None:
        self.sink = sink
        self.span = span
        self.tracer = tracer
        self._arrived = time.time_ns()
        self._admitted: int | None = None
        self._first: int | None = None
        self._cached = 0
        self._prompt = prompt_tokens
        self._done = False

    def send(self, step: GenerationStep) -> None:
        try:
            self.sink.send(step)
        except BaseException as exc:  # the client is gone: the scheduler drops the sequence
            self.finish(error=exc)
            raise
        if self._first is None:
            self._first = time.time_ns()
            self._cached = step.cached_tokens
        if step.finished:
            self.finish(step)

    def fail(self, error: BaseException) -> None:
        try:
            self.sink.fail(error)
        finally:
            self.finish(error=error)

    def is_cancelled(self) -> bool:
        return self.sink.is_cancelled()

    def admitted(self, cached_tokens: int) -> None:
        """The scheduler admitted the request for the first time (its queue wait ends, its prefill starts)."""
        if self._admitted is None:
            self._admitted = time.time_ns()
            self._cached = cached_tokens

    def finish(self, step: GenerationStep | None = None, *, error: BaseException | None = None) -> None:
        """Record the phases reached and end the request's span (once)."""
        if self._done:
            return
        self._done = True
        end = time.time_ns()
        from opentelemetry import trace

        parent = trace.set_span_in_context(self.span)
        queue_end = self._admitted if self._admitted is not None else end
        self._phase(parent, "queue", self._arrived, queue_end, {})
        if self._admitted is not None:
            self._phase(parent, "prefill", self._admitted, self._first or end,
                        {"cached_tokens": self._cached, "prompt_tokens": self._prompt})
        if self._first is not None:
            self._phase(parent, "decode", self._first, end,
                        {"output_tokens": step.output_tokens if step is not None else 0})
        attributes: dict[str, Any] = {"cached_tokens": self._cached, "prompt_tokens": self._prompt}
        if step is not None:
            attributes.update(output_tokens=step.output_tokens, finish_reason=step.finish_reason)
        end_span(self.span, attributes, error=error, end_ns=end)

    def _phase(self, parent: Any, name: str, start: int, end: int, attributes: dict[str, Any]) -> None:
        end_span(self.tracer.start(name, parent, start_ns=start, attributes=attributes), end_ns=max(start, end))


def traced(sink: SequenceSink, tracer: Tracer, request: Any, prompt_tokens: int,
           adapter: str | None) -> SequenceSink | TracedSink:
    """``sink``, traced when tracing is on and the Triton ``request`` brought a trace context; else ``sink``."""
    span = tracer.request_span("lora_adapter", request, {"adapter": adapter or "", "prompt_tokens": prompt_tokens})
    return TracedSink(sink, span, tracer, prompt_tokens) if span is not None else sink


def refused(sink: Any, error: BaseException) -> None:
    """End a traced request's span with the error that refused it before the scheduler took it."""
    if isinstance(sink, TracedSink):
        sink.finish(error=error)
