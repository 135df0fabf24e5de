"""The engine on tritonserver: gRPC on ``grpc.aio`` (requests built by :mod:`~warmup_tools.front.engine.protocol`),
Triton's /metrics and readiness.

A request takes one of two paths (``pipeline``):

* ``composing`` (the default): ``tokenizer_cache`` and ``embedding_cache`` as unary inferences (``ModelInfer``),
  then a stream to ``lora_adapter``: the steps the ensemble runs, in the same order with the same inputs.
  Cancelling that stream (a client gone, a stop string) cancels the request inside ``lora_adapter``'s scheduler.
* ``ensemble``: one stream to ``ensemble``. Triton 2.51 checks an ensemble request for cancellation between
  steps only, so a cancelled stream's generation runs on to ``max_tokens`` (docs/openai.md).

NOTE: every request is a gRPC call of its own, never one of many on a shared ``ModelStreamInfer`` stream (which
would save a call's set-up per unary inference): with generation streams to ``lora_adapter`` running beside such a
stream, tritonserver 2.51 crashes (SIGSEGV in ``TRITONBACKEND_ResponseSend``, from the Python backend) within 60
rounds of 8 concurrent requests, where separate calls ran 240 rounds without one (docs/openai.md, "Cancellation").

The model state (adapters and their lifecycle states), the load signals and the readiness come from a
background task that reads tritonserver's /metrics (and the sidecar's /ready) every ``poll_interval_s``: a
request never waits for them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import re
import time
from typing import Any, AsyncIterator, Callable, Mapping, Sequence

import aiohttp
import grpc
import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.grpc import InferResult, service_pb2

from warmup_tools.common.tracing import TraceContext, Tracer
from warmup_tools.common.wire import ENSEMBLE_STEPS, EnsembleStep, ErrorKind, input_tensors, untag
from warmup_tools.front.engine.engine import (
    EngineError,
    GenerateChunk,
    GenerateInput,
    LoadSignals,
    ModelState,
    Readiness,
)
from warmup_tools.front.engine.protocol import Tensor, infer_request

LOGGER = logging.getLogger(__name__)

#: The request parameter that carries a rendered conversation's role spans to lora_adapter's request log.
ROLES_PARAMETER = "chat_roles"
_COUNTERS = ("prompt_tokens", "cached_tokens", "output_tokens")
#: tritonserver's own words for a failure on the server's side (no model of this package wrote them, so they carry no
#: kind): a model's stub that died, a model not ready or not loaded (the front names the repository's own models, so
#: one Triton does not know is the replica's fault, not the client's).
_TRITON_PHRASES: tuple[tuple[str, ErrorKind], ...] = (
    ("is not healthy", ErrorKind.UNAVAILABLE),
    ("is not ready", ErrorKind.UNAVAILABLE),
    ("request for unknown model", ErrorKind.UNAVAILABLE),
)
#: The kind of tritonserver's own error by the gRPC status that ended a unary call. NOTE: a status that would be the
#: client's (INVALID_ARGUMENT, NOT_FOUND) is not taken: tritonserver's own check of a request the front built is the
#: front's fault, and every refusal of a model carries its kind in its message.
_STATUS_KINDS = {"StatusCode.UNAVAILABLE": ErrorKind.UNAVAILABLE, "StatusCode.DEADLINE_EXCEEDED": ErrorKind.TIMEOUT,
                 "StatusCode.CANCELLED": ErrorKind.UNAVAILABLE, "StatusCode.RESOURCE_EXHAUSTED": ErrorKind.BUSY}
#: What tritonserver puts before a model's message: the request's id, the ensemble step that failed.
_TRITON_PREFIX = re.compile(r"^(?:\[request id: [^\]]*\] *|in ensemble '[^']*', *)+")


def classify(message: str, status: str | None = None) -> ErrorKind:
    """The kind of an error tritonserver answered (its message, and its gRPC status, ``StatusCode.X``, when it
    ended a unary call): the kind a model's message starts with (common/wire.py); for tritonserver's own text,
    its words or its status, else ``internal``."""
    kind, text = untag(_TRITON_PREFIX.sub("", message))
    if kind is not None:
        return kind
    lowered = text.lower()
    for phrase, phrase_kind in _TRITON_PHRASES:
        if phrase in lowered:
            return phrase_kind
    return _STATUS_KINDS.get(status or "", ErrorKind.INTERNAL)


#: The reason a client reads (a request's 503, /health) while the sidecar's /ready fails: its own reason names
#: models and instances and quotes tritonserver, and goes to the log (the sidecar's /status has it too).
NOT_READY = "the replica is warming up or recovering; retry, another replica may serve the request"


def engine_error(message: str, status: str | None = None) -> EngineError:
    """The :class:`EngineError` of an error tritonserver answered (:func:`classify`). A model's own message about
    the request keeps its kind and goes to the client without tritonserver's prefixes and the kind's tag.
    tritonserver's own text is no refusal the client can act on, whatever its status: a failure on the server's
    side, whose text goes to the log only (generation.openai_error)."""
    if status == "StatusCode.UNAVAILABLE" and "failed to connect" in message.lower():
        return EngineError(ErrorKind.UNAVAILABLE, "tritonserver is not reachable")
    return EngineError(classify(message, status), untag(_TRITON_PREFIX.sub("", message))[1])


def ensemble_inputs(request: GenerateInput) -> list[Tensor]:
    """The ``ensemble`` input tensors of one generation (common/wire.py's table): the prompt, the identity and
    the sampling inputs the request sets; always streamed."""
    return input_tensors({"text_input": request.prompt, "stream": True, "adapter_id": request.adapter or None,
                          "tenant_id": request.tenant or None, "tenant_key": request.tenant_key or None,
                          **request.sampling})


def _step_inputs(step: EnsembleStep, tensors: dict[str, tuple[str, np.ndarray]]) -> list[Tensor]:
    """``step``'s inputs from the ensemble's tensors, as its ``input_map`` says (an absent optional one is left out)."""
    return [(name, *tensors[source]) for name, source in step.inputs.items() if source in tensors]


@dataclasses.dataclass(frozen=True, slots=True)
class TokenChunk:
    """One response of a generation from token ids (:meth:`TritonEngine.generate_tokens`): its new token ids and
    the counters so far; the last one has ``finish_reason`` (``stop`` or ``length``)."""

    token_ids: tuple[int, ...]
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str = ""


def _text_chunk(result: InferResult, reason: str) -> GenerateChunk:
    text = result.as_numpy("text_output").reshape(-1)[0].decode("utf-8", errors="replace")
    if not reason:
        return GenerateChunk(text)
    # NOTE: the counters are read from the last response only (each read parses the tensor): the usage is the
    # last response's, and this runs once per token.
    return GenerateChunk(text, finish_reason=reason,
                         **{name: int(result.as_numpy(name).reshape(-1)[0]) for name in _COUNTERS})


def _token_chunk(result: InferResult, reason: str) -> TokenChunk:
    ids = result.as_numpy("token_ids")
    return TokenChunk(tuple(int(t) for t in ids.reshape(-1)) if ids is not None else (), finish_reason=reason,
                      **{name: int(result.as_numpy(name).reshape(-1)[0]) for name in _COUNTERS})


#: Triton's bidirectional streaming method, which a generation calls as a server-streaming one (below).
STREAM_METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"
INFER_METHOD = "/inference.GRPCInferenceService/ModelInfer"
READY_METHOD = "/inference.GRPCInferenceService/ServerReady"


#: As tritonclient sets them: a message is bounded by the front's own request limits, not by gRPC's 4 MB default.
_CHANNEL_OPTIONS = (("grpc.max_send_message_length", 2**31 - 1), ("grpc.max_receive_message_length", 2**31 - 1))


class TritonEngine:
    """The :class:`~warmup_tools.front.engine.engine.Engine` on one tritonserver."""

    def __init__(self, grpc_url: str, metrics_url: str, *, sidecar_url: str = "", pipeline: str = "composing",
                 kv_capacity_bytes: int | None = None, kv_instances: int = 1, timeout_s: float = 600.0,
                 poll_interval_s: float = 1.0, tracer: Tracer | None = None) -> None:
        self.grpc_url = grpc_url
        #: Spans of the generations (None or off: no span, no trace context passed on).
        self.tracer = tracer if tracer is not None and tracer.enabled else None
        self.metrics_url = metrics_url
        self.sidecar_url = sidecar_url.rstrip("/")
        self.pipeline = pipeline
        self.kv_capacity_bytes = kv_capacity_bytes
        self.timeout_s = timeout_s
        self.poll_interval_s = poll_interval_s
        self._channel: grpc.aio.Channel | None = None
        self._infer: grpc.aio.UnaryUnaryMultiCallable | None = None
        self._generate: grpc.aio.UnaryStreamMultiCallable | None = None
        self._ready_call: grpc.aio.UnaryUnaryMultiCallable | None = None
        self._http: aiohttp.ClientSession | None = None
        self._poller: asyncio.Task | None = None
        self._models = ModelState({})
        self._load = LoadSignals()
        self._readiness = Readiness(False, "not checked yet")
        self._sidecar_reason = ""
        self._polled = 0.0
        self._refresh_lock: asyncio.Lock | None = None

    # --------------------------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        # NOTE: a grpc.aio channel belongs to the event loop it was made on: made here, on uvicorn's.
        self._channel = grpc.aio.insecure_channel(self.grpc_url, options=_CHANNEL_OPTIONS)
        self._infer = self._channel.unary_unary(
            INFER_METHOD, request_serializer=service_pb2.ModelInferRequest.SerializeToString,
            response_deserializer=service_pb2.ModelInferResponse.FromString)
        # NOTE: a generation sends one request and half-closes: called as server-streaming, gRPC sends the call's
        # headers, its one message and the half-close in one batch, where the bidirectional call (tritonclient's
        # stream_infer) takes three, each a socket write and a wake-up of gRPC's poller thread (the front's CPU per
        # request it saves: CHANGELOG.md). The wire is the same HTTP/2 stream; cancelling the call still cancels
        # the request inside tritonserver.
        self._generate = self._channel.unary_stream(
            STREAM_METHOD, request_serializer=service_pb2.ModelInferRequest.SerializeToString,
            response_deserializer=service_pb2.ModelStreamInferResponse.FromString)
        self._ready_call = self._channel.unary_unary(
            READY_METHOD, request_serializer=service_pb2.ServerReadyRequest.SerializeToString,
            response_deserializer=service_pb2.ServerReadyResponse.FromString)
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        self._refresh_lock = asyncio.Lock()
        try:  # NOTE: connects the channel now, not on the first request (whose TTFT would pay for it)
            await self._server_ready()
        except grpc.aio.AioRpcError:
            pass  # not up yet: the poller and the first request will connect
        self._poller = asyncio.create_task(self._poll(), name="front-poll")

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
        if self._channel is not None:
            await self._channel.close()
        if self._http is not None:
            await self._http.close()
        if self.tracer is not None:
            await asyncio.to_thread(self.tracer.shutdown)

    # --------------------------------------------------------------------------------- generation
    async def generate(self, request: GenerateInput) -> AsyncIterator[GenerateChunk]:
        assert self._generate is not None, "start() first"
        parameters = ({ROLES_PARAMETER: json.dumps([list(span) for span in request.roles], separators=(",", ":"))}
                      if request.roles else None)
        span, trace = self._span(request.trace, self.pipeline, request.adapter)
        if trace is not None:  # NOTE: every model continues the trace from the front's span
            parameters = {**(parameters or {}), **trace.parameters()}
        inputs = ensemble_inputs(request)
        if self.pipeline == "ensemble":
            model = "ensemble"
        else:
            model = ENSEMBLE_STEPS[-1].model
            try:
                inputs = await self._composing_inputs(inputs, trace.parameters() if trace is not None else None)
            except BaseException:
                if span is not None:
                    span.end()
                raise
        async for chunk in self._spanned(span, self._stream(model, inputs, parameters, _text_chunk)):
            yield chunk

    async def generate_tokens(self, input_ids: Sequence[int], adapter: str | None, tenant: str | None,
                              sampling: Mapping[str, Any], trace: TraceContext | None = None, *,
                              text: str | None = None) -> AsyncIterator[TokenChunk]:
        """A generation from token ids (smg's gRPC worker protocol: the router tokenizes and detokenizes): one
        stream to ``lora_adapter`` with ``input_ids``, the identity and the sampling inputs (wire names), whatever
        ``pipeline`` says; each response's token ids. ``text``: the prompt's text for lora_adapter's request log
        (``text_input``). Closing the iterator cancels the call, and the sequence in lora_adapter's scheduler.
        Raises :class:`EngineError`."""
        span, child = self._span(trace, "tokens", adapter)
        inputs = input_tensors({"input_ids": np.asarray(input_ids, dtype=np.int32), "stream": True,
                                "adapter_id": adapter or None, "tenant_id": tenant or None,
                                "text_input": text or None, **sampling})
        parameters = child.parameters() if child is not None else None
        async for chunk in self._spanned(span, self._stream(ENSEMBLE_STEPS[-1].model, inputs, parameters,
                                                            _token_chunk)):
            yield chunk

    def _span(self, trace: TraceContext | None, pipeline: str, adapter: str | None) -> tuple[Any, Any]:
        """The front's span of one generation (continuing ``trace``) and the context the models continue from it;
        ``(None, None)`` with tracing off."""
        if self.tracer is None:
            return None, None
        span = self.tracer.start("front.generate", trace, server=True,
                                 attributes={"pipeline": pipeline, "adapter": adapter or ""})
        return span, self.tracer.child_context(span)

    @staticmethod
    async def _spanned(span: Any, chunks: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """``chunks`` passed on; the last one's counts set on ``span``, which ends with the stream (or with an error,
        or when the consumer stops early)."""
        try:
            async for chunk in chunks:
                if span is not None and chunk.finish_reason:
                    span.set_attributes({"prompt_tokens": chunk.prompt_tokens, "cached_tokens": chunk.cached_tokens,
                                         "output_tokens": chunk.output_tokens})
                yield chunk
        finally:
            await chunks.aclose()
            if span is not None:
                span.end()

    async def _composing_inputs(self, inputs: list[Tensor],
                                parameters: dict[str, str] | None = None) -> list[Tensor]:
        """The ensemble's steps before the last (common/wire.py's ``ENSEMBLE_STEPS``, the wiring of
        ensemble/config.pbtxt) as unary inferences, in order, each on the tensors the ensemble would map to it;
        the last step's (``lora_adapter``'s) inputs. NOTE: each step is asked only for the outputs the ensemble
        maps (embedding_cache: cluster_id, not the embedding's 384 floats nobody reads)."""
        tensors = {name: (datatype, array) for name, datatype, array in inputs}
        *before, last = ENSEMBLE_STEPS
        for step in before:
            result = await self._unary(step.model, _step_inputs(step, tensors), tuple(step.outputs), parameters)
            for output, tensor in step.outputs.items():
                tensors[tensor] = (result.get_output(output).datatype, result.as_numpy(output))
        return _step_inputs(last, tensors)

    async def _unary(self, model: str, inputs: list[Tensor], outputs: tuple[str, ...] = (),
                     parameters: dict[str, str] | None = None) -> InferResult:
        """``model``'s answer to one inference; its error as :class:`EngineError` (the kind from its message
        and gRPC status)."""
        assert self._infer is not None, "start() first"
        try:
            response = await self._infer(infer_request(model, "", inputs, outputs, parameters=parameters),
                                         timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise EngineError(ErrorKind.TIMEOUT, f"no answer from {model} within {self.timeout_s:g} s") from None
            raise engine_error(exc.details() or "", str(exc.code())) from None
        return InferResult(response)

    async def _stream(self, model: str, inputs: list[Tensor], parameters: dict[str, str] | None,
                      read: Callable[[InferResult, str], Any] = _text_chunk) -> AsyncIterator[Any]:
        """The chunks of one generation stream, each response made one by ``read(result, finish_reason)``."""
        assert self._generate is not None, "start() first"
        responses = self._generate(infer_request(model, "", inputs, parameters=parameters), timeout=self.timeout_s)
        ended = False
        try:
            async for response in responses:
                if response.error_message:
                    # NOTE: a model's error is its request's final response (lora_adapter refuses a flood's excess
                    # so, hundreds a second): the call is read to its end like a finished one, not cancelled.
                    ended = await _end_cleanly(responses)
                    raise engine_error(response.error_message)
                result = InferResult(response.infer_response)
                reason = result.as_numpy("finish_reason").reshape(-1)[0].decode("utf-8")
                chunk = read(result, reason)
                if not reason:
                    yield chunk
                    continue
                # NOTE: the call is ended before the last chunk is handed on: a consumer that stops at the last
                # chunk never resumes this generator, whose close would then cancel the call.
                ended = await _end_cleanly(responses)
                yield chunk
                break
        except asyncio.CancelledError:
            raise
        except grpc.RpcError as exc:  # the stream broke: the server went away, or the deadline passed
            if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise EngineError(ErrorKind.TIMEOUT,
                                  f"no answer from tritonserver within {self.timeout_s:g} s") from None
            LOGGER.warning("the generation stream to %s (%s) failed: %s", self.grpc_url, model, exc)
            raise EngineError(ErrorKind.UNAVAILABLE, "the stream to tritonserver failed; retry") from None
        finally:
            # NOTE: cancelling the gRPC call cancels the request in tritonserver (on the composing path
            # lora_adapter's scheduler drops the sequence within a step): a client gone, a stop string, an
            # error. A finished call is not cancelled: it ends with OK (_end_cleanly), so that no stream stays
            # open on the channel and none is cancelled after its last response (see _end_cleanly).
            if not ended:
                responses.cancel()

    # --------------------------------------------------------------------------------- state
    async def models(self, refresh: bool = False) -> ModelState:
        if refresh:
            await self._refresh(min_age_s=0.05)
        return self._models

    async def readiness(self, refresh: bool = False) -> Readiness:
        if refresh:
            await self._refresh(min_age_s=0.05)
        return self._readiness

    async def load(self) -> LoadSignals:
        return self._load

    async def _poll(self) -> None:
        while True:
            await self._refresh(min_age_s=0.0)
            await asyncio.sleep(self.poll_interval_s)

    async def _refresh(self, min_age_s: float) -> None:
        assert self._refresh_lock is not None
        async with self._refresh_lock:
            if time.monotonic() - self._polled < min_age_s:
                return
            self._readiness = await self._check_ready()
            try:
                text = await self._get_text(self.metrics_url)
                self._models, self._load = parse_triton_metrics(text, self.kv_capacity_bytes)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
                LOGGER.debug("tritonserver metrics not read: %s", exc)
            self._polled = time.monotonic()

    async def _check_ready(self) -> Readiness:
        try:
            if self.sidecar_url:
                assert self._http is not None
                async with self._http.get(f"{self.sidecar_url}/ready") as response:
                    body = await response.text()
                    if response.status == 200:
                        if await self._server_ready():
                            return Readiness(True, **_temperature(body))
                        return Readiness(False, "the front's connection to tritonserver is not up yet")
                    self._log_sidecar_reason(body)
                    return Readiness(False, NOT_READY)
            ready = await self._server_ready()
            return Readiness(ready, "" if ready else "tritonserver is not ready")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, grpc.aio.AioRpcError) as exc:
            LOGGER.debug("readiness not read: %s", exc)
            return Readiness(False, "the replica is not reachable yet")

    def _log_sidecar_reason(self, body: str) -> None:
        """The sidecar's reason for not ready (it names models and instances, and quotes tritonserver): for the
        front's log, once each time it changes."""
        try:
            reason = str(json.loads(body).get("reason", body))[:300]
        except (ValueError, AttributeError):
            reason = body[:300]
        if reason != self._sidecar_reason:
            self._sidecar_reason = reason
            LOGGER.info("the sidecar says the replica is not ready: %s", reason)

    async def _server_ready(self) -> bool:
        """tritonserver's ``ServerReady``, on the channel the inferences use (raises ``AioRpcError`` when it does not
        reach the server). NOTE: a channel made before tritonserver listened is in reconnect backoff for a while
        after the server is up; until it connects, requests fail with "failed to connect", so readiness is asked on
        that channel: the front is not ready before its channel is."""
        assert self._ready_call is not None, "start() first"
        return bool((await self._ready_call(service_pb2.ServerReadyRequest(), timeout=5)).ready)

    async def _get_text(self, url: str) -> str:
        assert self._http is not None
        async with self._http.get(url) as response:
            response.raise_for_status()
            return await response.text()


def _temperature(body: str) -> dict[str, Any]:
    """The temperature fields of the sidecar's ``/ready`` body (none from a body without them)."""
    try:
        data = json.loads(body)
        adapters = data.get("adapters") or {}
        return {"temperature": str(data.get("temperature", ""))[:16],
                "adapters": {str(k)[:128]: str(v)[:16] for k, v in list(adapters.items())[:256]}}
    except (ValueError, AttributeError):
        return {}


#: The metrics :func:`parse_triton_metrics` reads.
_READ_METRICS = ("warmup_adapter_state{", "warmup_scheduler_running_sequences", "warmup_scheduler_waiting_sequences",
                 "warmup_kv_running_bytes{")


def parse_triton_metrics(text: str, kv_capacity_bytes: int | None) -> tuple[ModelState, LoadSignals]:
    """The adapters' states and the load signals in tritonserver's /metrics text.

    An adapter is live when every instance that reports it says ``live``; otherwise the reason is its state on
    the first instance where it is not. Running and waiting sequences add up over instances; KV use is the bytes the
    running sequences hold over ``kv_capacity_bytes`` times the instances that report (vLLM's KV cache usage: cached
    blocks the running sequences may evict are free room, and a warm cache is full of them)."""
    states: dict[str, dict[str, str]] = {}
    running = waiting = 0.0
    kv_bytes: dict[str, float] = {}
    # NOTE: only the samples read below are parsed: the parser is pure Python, and parsing every family of
    # tritonserver's /metrics each poll cost the front's event loop several milliseconds a second.
    wanted = "\n".join(line for line in text.splitlines() if line.startswith(_READ_METRICS))
    for family in text_string_to_metric_families(wanted):
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, sample.value
            if name == "warmup_adapter_state" and value == 1 and labels.get("model", "lora_adapter") == "lora_adapter":
                states.setdefault(labels["adapter"], {})[labels.get("instance", "")] = labels["state"]
            elif name == "warmup_scheduler_running_sequences":
                running += value
            elif name == "warmup_scheduler_waiting_sequences":
                waiting += value
            elif name == "warmup_kv_running_bytes":
                instance = labels.get("instance", "")
                kv_bytes[instance] = kv_bytes.get(instance, 0.0) + value
    adapters: dict[str, str | None] = {}
    for adapter, by_instance in states.items():
        if adapter == "base":
            continue
        not_live = sorted((i, s) for i, s in by_instance.items() if s != "live")
        # NOTE: the reason reaches clients (a 404, /v1/models): it names the state, not the instance.
        adapters[adapter] = None if not not_live else f"adapter '{adapter}' is {not_live[0][1]}"
    usage = None
    if kv_capacity_bytes and kv_bytes:
        usage = min(1.0, sum(kv_bytes.values()) / (kv_capacity_bytes * len(kv_bytes)))
        usage = usage if math.isfinite(usage) else None
    return ModelState(adapters), LoadSignals(running=running, waiting=waiting, kv_usage=usage)


#: Seconds a finished generation's gRPC call has to end with OK after its last response before it is cancelled.
STREAM_END_TIMEOUT_S = 5.0


async def _end_cleanly(responses: Any) -> bool:
    """Read a finished generation's call to its end (the server ends it with OK once its last response is
    out and the request stream is closed): whether it ended in :data:`STREAM_END_TIMEOUT_S`.

    NOTE: tritonserver 2.51 does not let go of a decoupled model's request whose call is cancelled just after
    its FINAL response: the model then never unloads, and a replica's exit snapshot is never written
    (docs/fleet.md, "Leaving without losing a request")."""

    async def rest() -> None:
        async for _ in responses:
            pass

    try:
        await asyncio.wait_for(rest(), STREAM_END_TIMEOUT_S)
    except (asyncio.TimeoutError, grpc.RpcError):
        return False
    return True
