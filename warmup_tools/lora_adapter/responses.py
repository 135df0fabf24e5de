"""One ``lora_adapter`` request's output through Triton's response sender (decoupled).

:class:`ResponseSink` is the :class:`~warmup_tools.lora_adapter.scheduler.SequenceSink` model.py hands
the scheduler: streaming requests get one response per token with FINAL on the last, the others one
response with the whole text; metrics and the request log are recorded as tokens go out. It takes the
``pb_utils`` module as an argument (it only exists inside a Python backend stub), so unit tests can hand
it a fake.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from warmup_tools.common.records import PROBE_TENANT, RequestRecord
from warmup_tools.lora_adapter.engine_api import GenerationStep
from warmup_tools.lora_adapter.request_log import RequestLogWriter
from warmup_tools.lora_adapter.requests import GenerateRequest
from warmup_tools.triton.io import error_for


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
    _ttft_ms: float = 0.0
    #: True once the FINAL response went out: the request gets no other.
    _closed: bool = False

    def send(self, step: GenerationStep) -> None:
        final = self.pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if self.request.stream:
            self.sender.send(self._response(step.text, step), flags=final if step.finished else 0)
        else:
            self._pieces.append(step.text)
            if step.finished:
                self.sender.send(self._response("".join(self._pieces), step), flags=final)
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
        self.sender.send(self.pb_utils.InferenceResponse(error=error_for(self.pb_utils, error)),
                         flags=self.pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def is_cancelled(self) -> bool:
        # NOTE: true only for a client of lora_adapter itself (gRPC). Through ``ensemble`` Triton 2.51 checks
        # the client's cancellation between steps only, so a running lora_adapter step is never told.
        check = getattr(self.sender, "is_cancelled", None)
        return bool(check()) if check is not None else False

    def _response(self, text: str, step: GenerationStep) -> Any:
        tensor = self.pb_utils.Tensor
        return self.pb_utils.InferenceResponse(output_tensors=[
            tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
            tensor("cached_tokens", np.array([step.cached_tokens if self.expose_cached_tokens else 0],
                                             dtype=np.int32)),
            tensor("prompt_tokens", np.array([step.prompt_tokens], dtype=np.int32)),
            tensor("output_tokens", np.array([step.output_tokens], dtype=np.int32)),
            tensor("finish_reason", np.array([step.finish_reason.encode()], dtype=np.object_)),
        ])
