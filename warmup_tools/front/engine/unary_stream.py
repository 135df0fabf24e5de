"""Unary inferences multiplexed over one long-lived gRPC stream to tritonserver.

Each ``grpc.aio`` call costs the front's event loop about a millisecond of CPU to set up, write, half-close and
tear down (measured with a sampling profiler on the development machine), and the composing pipeline makes
two unary calls per request before its generation stream. Triton's ``ModelStreamInfer`` takes any number of
requests on one stream, answers each with its request ``id`` (errors included) and runs them concurrently, so
the front keeps one stream open and matches answers to callers by id: a unary inference is then one write and
one read. Generation streams stay one gRPC call each, since cancelling that call is what cancels the request
inside ``lora_adapter``; a unary inference has nothing to cancel.

A broken stream (tritonserver restarted, the channel lost) fails every inference waiting on it; the next one
opens a new stream.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Mapping, Sequence

import grpc
import numpy as np
from tritonclient.grpc import InferResult, service_pb2, service_pb2_grpc
from tritonclient.utils import serialize_byte_tensor

from warmup_tools.front.engine.engine import EngineError

LOGGER = logging.getLogger(__name__)

#: One input tensor: name, Triton datatype, values.
Tensor = tuple[str, str, np.ndarray]


def infer_request(model: str, request_id: str, inputs: Sequence[Tensor], outputs: Sequence[str] = (), *,
                  parameters: Mapping[str, str] | None = None) -> service_pb2.ModelInferRequest:
    """The protobuf of one inference (string ``parameters`` for the request); BYTES tensors are length-prefixed
    as Triton expects."""
    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    for key, value in (parameters or {}).items():
        request.parameters[key].string_param = value
    for name, datatype, array in inputs:
        request.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
        if datatype == "BYTES":  # NOTE: a 0-d object array holding the length-prefixed bytes (empty: size 0)
            serialized = serialize_byte_tensor(array)
            request.raw_input_contents.append(serialized.item() if serialized.size else b"")
        else:
            request.raw_input_contents.append(np.ascontiguousarray(array).tobytes())
    for name in outputs:
        request.outputs.add(name=name)
    return request


class UnaryStream:
    """Unary inferences over one ``ModelStreamInfer`` stream on ``channel``, opened on first use.

    Must be used from one event loop (the channel's)."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        self._call: grpc.aio.StreamStreamCall | None = None
        self._reader: asyncio.Task | None = None
        self._waiting: dict[str, asyncio.Future] = {}
        self._ids = itertools.count()
        self._open_lock = asyncio.Lock()
        #: NOTE: a gRPC call takes one write at a time (a second concurrent write fails the call).
        self._write_lock = asyncio.Lock()

    @property
    def waiting(self) -> int:
        """Inferences sent and not answered yet."""
        return len(self._waiting)

    async def infer(self, model: str, inputs: Sequence[Tensor], outputs: Sequence[str] = (), *,
                    timeout_s: float) -> InferResult:
        """``model``'s answer; an error answer raises the model's message as :class:`EngineError` (kind
        classified by the caller from ``status`` None), a lost stream or no answer in time raise
        ``unavailable`` / ``timeout``."""
        call = await self._open()
        request_id = f"u{next(self._ids)}"
        answer: asyncio.Future = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = answer
        try:
            message = infer_request(model, request_id, inputs, outputs)
            async with self._write_lock:
                await call.write(message)
            response = await asyncio.wait_for(answer, timeout_s)
        except asyncio.TimeoutError:
            raise EngineError("timeout", f"no answer from {model} within {timeout_s:g} s") from None
        except (grpc.RpcError, asyncio.InvalidStateError):
            self._lost(call)
            raise EngineError("unavailable", "the stream to tritonserver failed; retry") from None
        finally:
            self._waiting.pop(request_id, None)
        if response.error_message:
            raise UnaryError(response.error_message)
        return InferResult(response.infer_response)

    async def close(self) -> None:
        call, reader = self._call, self._reader
        self._call = self._reader = None
        if call is not None:
            call.cancel()
        if reader is not None:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        self._fail_all()

    async def _open(self) -> grpc.aio.StreamStreamCall:
        if self._call is not None and not self._call.done():
            return self._call
        async with self._open_lock:
            if self._call is None or self._call.done():
                self._call = self._stub.ModelStreamInfer()
                self._reader = asyncio.create_task(self._read(self._call), name="front-unary-stream")
            return self._call

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        try:
            while True:
                response = await call.read()
                if response is grpc.aio.EOF:
                    break
                answer = self._waiting.get(response.infer_response.id)
                if answer is not None and not answer.done():
                    answer.set_result(response)
        except grpc.RpcError as exc:
            LOGGER.info("unary stream to tritonserver ended: %s", exc)
        finally:
            self._lost(call)

    def _lost(self, call: grpc.aio.StreamStreamCall) -> None:
        """``call`` is gone: everyone waiting on it fails; the next inference opens a new stream."""
        if self._call is call:
            self._call = None
            call.cancel()
            self._fail_all()

    def _fail_all(self) -> None:
        for answer in self._waiting.values():
            if not answer.done():
                answer.set_exception(EngineError("unavailable", "the stream to tritonserver failed; retry"))


class UnaryError(Exception):
    """A model's error answer to a unary inference (its message; a stream carries no status code)."""
