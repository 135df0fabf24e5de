"""One ``lora_adapter`` request's output through Triton's response sender (decoupled).

:class:`ResponseSink` is the :class:`~warmup_tools.lora_adapter.sequence.SequenceSink` model.py hands
the scheduler: streaming requests get one response per token with FINAL on the last, the others one
response with the whole text; metrics and the request log are recorded as tokens go out. It takes the
``pb_utils`` module as an argument (it only exists inside a Python backend stub), so unit tests can hand
it a fake.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Any

import numpy as np

from warmup_tools.common.records import PROBE_TENANT, RequestRecord
from warmup_tools.lora_adapter.engine_api import GenerationStep
from warmup_tools.lora_adapter.request_log import RequestLogWriter
from warmup_tools.lora_adapter.requests import GenerateRequest
from warmup_tools.triton.io import error_for

LOGGER = logging.getLogger(__name__)
#: Responses a :class:`ResponseQueue` holds before the scheduler's next send waits for room.
QUEUE_LIMIT = 4096


class ResponseQueue:
    """Sends responses on one thread of its own, in the order they were queued.

    A Python-backend ``sender.send`` is a round trip to tritonserver (about 0.3 ms a token at 8 streams, 0.5 ms
    at 1: docs/benchmarks.md): made by the scheduler's thread, it holds every sequence's next forward for it.
    Queued, the forward runs while the send goes out. A send that fails is reported to its sink
    (:meth:`ResponseSink.send` raises it at the sequence's next token, and :meth:`ResponseSink.is_cancelled`
    says so), so the scheduler ends the sequence as when a send fails in its own thread: no more of its tokens go out,
    but its final response (the error) is still tried, as it is without a queue. At most
    ``limit`` responses wait; then queuing waits for room. :meth:`close` sends what is queued, then stops.
    """

    def __init__(self, name: str = "lora-adapter-responses", limit: int = QUEUE_LIMIT) -> None:
        self._jobs: collections.deque[tuple[ResponseSink, Any, int]] = collections.deque()
        self._cond = threading.Condition()
        self._limit = limit
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, sink: ResponseSink, response: Any, flags: int) -> None:
        with self._cond:
            while len(self._jobs) >= self._limit and not self._closing:
                self._cond.wait()
            if self._closing:
                raise RuntimeError("the instance is shutting down")
            self._jobs.append((sink, response, flags))
            self._cond.notify_all()

    def close(self, timeout: float = 30.0) -> None:
        """Send what is queued (at most ``timeout`` seconds), then end the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closing:
                    self._cond.wait()
                if not self._jobs:
                    return
                sink, response, flags = self._jobs.popleft()
                self._cond.notify_all()
            if sink.send_error is not None and not flags & sink.pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL:
                # NOTE: its client is gone: no more tokens; its final response is still tried, since only a FINAL
                # lets Triton release the request, whose response factory otherwise keeps the model loaded.
                continue
            try:
                sink.sender.send(response, flags=flags)
            except Exception as exc:  # NOTE: one request's fault; the sink reports it
                LOGGER.debug("a response could not be sent", exc_info=True)
                sink.send_error = exc


@dataclasses.dataclass(slots=True)
class ResponseSink:
    """Sends a sequence's tokens through its request's response sender."""

    pb_utils: Any
    sender: Any
    request: GenerateRequest
    metrics: Any | None = None
    request_log: RequestLogWriter | None = None
    #: The prompt text, for the request log only.
    prompt_text: str | None = None
    redact: bool = False
    #: Trust mode: the key of the logged prompt digest.
    digest_key: bytes = b""
    #: False: clients always see ``cached_tokens`` 0 (metrics and the request log keep the real count).
    expose_cached_tokens: bool = True
    #: A chat request's role spans in ``prompt_text`` (the OpenAI front's ``chat_roles``), for the request log.
    roles: tuple[tuple[str, int, int], ...] | None = None
    arrived: float = dataclasses.field(default_factory=time.time)
    _pieces: list[str] = dataclasses.field(default_factory=list)
    #: A non-streamed answer's token ids so far (its one response carries them all).
    _ids: list[int] = dataclasses.field(default_factory=list)
    _ttft_ms: float = 0.0
    #: Sends the responses on a thread of its own (None: this one, at once).
    queue: ResponseQueue | None = None
    #: True once the FINAL response went out: the request gets no other.
    _closed: bool = False
    #: What a queued send of this request raised (the client is gone): the next send raises it.
    send_error: BaseException | None = None

    def send(self, step: GenerationStep) -> None:
        if self.send_error is not None:
            raise self.send_error
        final = self.pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if self.request.stream:
            self._send(self._response(step.text, step, (step.token_id,)), final if step.finished else 0)
        else:
            self._pieces.append(step.text)
            self._ids.append(step.token_id)
            if step.finished:
                self._send(self._response("".join(self._pieces), step, self._ids), final)
        self._closed = step.finished
        if step.output_tokens == 1:  # NOTE: after the send, so metrics never delay the first token
            self._ttft_ms = step.elapsed * 1000
            if self.metrics is not None:
                self.metrics.record(self.request.adapter, step.prompt_tokens, step.cached_tokens, step.elapsed)
        if (step.finished and self.request_log is not None and not self.request.is_warmup
                and self.request.tenant != PROBE_TENANT):
            req = self.request
            self.request_log.log(RequestRecord.served(
                ts=self.arrived, tenant=req.tenant, adapter=req.adapter, prompt=self.prompt_text,
                prompt_tokens=step.prompt_tokens, cached_tokens=step.cached_tokens,
                planned_tokens=step.planned_tokens, ttft_ms=self._ttft_ms,
                output_tokens=step.output_tokens, cluster=req.cluster_id, redact=self.redact,
                digest_key=self.digest_key, roles=self.roles if self.prompt_text is not None else None))

    def fail(self, error: BaseException) -> None:
        """End the request with ``error``; nothing once its FINAL response went out (a fault after the last
        token, such as a failed request-log write, must not send a second final response)."""
        if self._closed:
            return
        self._closed = True
        self._send(self.pb_utils.InferenceResponse(error=error_for(self.pb_utils, error)),
                   self.pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def is_cancelled(self) -> bool:
        # NOTE: true only for a client of lora_adapter itself (gRPC). Through ``ensemble`` Triton 2.51 checks
        # the client's cancellation between steps only, so a running lora_adapter step is never told.
        if self.send_error is not None:
            return True
        check = getattr(self.sender, "is_cancelled", None)
        return bool(check()) if check is not None else False

    def _send(self, response: Any, flags: int) -> None:
        if self.queue is None:
            self.sender.send(response, flags=flags)
        else:
            self.queue.put(self, response, flags)

    def _response(self, text: str, step: GenerationStep, token_ids: Any) -> Any:
        tensor = self.pb_utils.Tensor
        return self.pb_utils.InferenceResponse(output_tensors=[
            tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
            tensor("cached_tokens", np.array([step.cached_tokens if self.expose_cached_tokens else 0],
                                             dtype=np.int32)),
            tensor("prompt_tokens", np.array([step.prompt_tokens], dtype=np.int32)),
            tensor("output_tokens", np.array([step.output_tokens], dtype=np.int32)),
            tensor("finish_reason", np.array([step.finish_reason.encode()], dtype=np.object_)),
            tensor("token_ids", np.array(token_ids, dtype=np.int32)),
        ])
